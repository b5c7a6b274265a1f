"""Pretraining the zoo's vision base without task labels: self-supervised rotation prediction.

`pretrain_vision_base` trains a randomly initialised `CLIPVisionModel` to predict the 0/90/180/270
degree rotation of images drawn from the pooled train splits only, and saves it with its image
processor. Seeded and deterministic; the output directory is written under a temporary sibling
name and renamed into place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import guarded_directory
from featcal_core.zoo.training_inputs import check_out_dir, check_run, checked_split, first_rows
from featcal_core.zoo.training_loop import (
    EVAL_BATCH,
    index_batches,
    tail_mean,
    torch_threads,
    train_steps,
)
from featcal_core.zoo.vision_model import PixelStore, image_processor, vision_config

logger = logging.getLogger(__name__)


def pretrain_vision_base(
    datasets: Mapping[str, Any],
    out_dir: str | Path,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    seed: int = 0,
    config: Any = None,
    max_eval_images: int | None = 2000,
    progress: bool = True,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Pretrain a random `CLIPVisionModel` by rotation prediction and save it to out_dir.

    Each step draws batch_size images uniformly from the pooled train splits of `datasets`
    (name → DatasetDict with an `image` column; labels are never read), rotates each by a random
    0/90/180/270 degrees and predicts the rotation from `pooler_output` with a throwaway Linear
    head. config: a CLIPVisionConfig (default `vision_config()`). Validation splits (the first
    max_eval_images of each, all four rotations) only measure the rotation accuracy.

    Returns {"train_loss": mean loss of the last 10% of steps, "rotation_accuracy": {name: acc},
    "rotation_accuracy_mean", "train_images": {name: count}, "steps", "seconds" (wall)}.
    """
    from transformers import CLIPVisionModel

    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    check_run(steps, batch_size, lr)
    if not isinstance(datasets, Mapping) or not datasets:
        raise FeatCalError(
            "pretrain_vision_base: datasets must be a non-empty dict of name → DatasetDict; "
            "pass at least one dataset"
        )
    for name, dataset in datasets.items():
        for split in ("train", "validation"):
            checked_split(dataset, split, ("image",), f"dataset {name!r}")
    config = vision_config() if config is None else config
    processor = image_processor(config.image_size)
    started = time.perf_counter()
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        store = PixelStore(processor)
        train = {
            n: store.encode(d["train"], f"dataset {n!r}", "train") for n, d in datasets.items()
        }
        pooled = torch.cat(list(train.values()))
        validation = {
            name: store.encode(
                first_rows(dataset["validation"], max_eval_images),
                f"dataset {name!r}",
                "validation",
            )
            for name, dataset in datasets.items()
        }
        logger.info(
            "%s: rotation pretraining on %d train images of %s, %d steps of %d",
            out_dir.name,
            len(pooled),
            sorted(datasets),
            steps,
            batch_size,
        )
        torch.manual_seed(seed)
        model = CLIPVisionModel(config).train()
        rotation_head = nn.Linear(config.hidden_size, 4)
        parameters = [*model.parameters(), *rotation_head.parameters()]
        generator = torch.Generator().manual_seed(seed)
        batches = index_batches(len(pooled), batch_size, generator)

        def step_loss(_: int) -> torch.Tensor:
            index = next(batches)
            rotations = torch.randint(0, 4, (len(index),), generator=generator)
            pixels = _rotate(store.pixels(pooled[index]), rotations)
            return F.cross_entropy(
                rotation_head(model(pixel_values=pixels).pooler_output), rotations
            )

        losses = train_steps(step_loss, parameters, steps, lr, weight_decay, out_dir.name, progress)
        model.eval()
        accuracy = {
            name: _rotation_accuracy(model, rotation_head, store, pixels)
            for name, pixels in validation.items()
        }
        with guarded_directory(out_dir, overwrite=overwrite, flag="out_dir") as tmp:
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
    stats = {
        "train_loss": tail_mean(losses),
        "rotation_accuracy": accuracy,
        "rotation_accuracy_mean": sum(accuracy.values()) / len(accuracy),
        "train_images": {name: len(pixels) for name, pixels in train.items()},
        "steps": steps,
        "seconds": time.perf_counter() - started,
    }
    logger.info("%s: pretrained %s", out_dir.name, stats)
    return stats


@torch.no_grad()
def _rotation_accuracy(model, head: nn.Module, store: PixelStore, stored: torch.Tensor) -> float:
    correct = 0
    for start in range(0, len(stored), EVAL_BATCH):
        pixels = store.pixels(stored[start : start + EVAL_BATCH])
        for k in range(4):
            rotations = torch.full((len(pixels),), k)
            logits = head(model(pixel_values=_rotate(pixels, rotations)).pooler_output)
            correct += int((logits.argmax(-1) == rotations).sum())
    return correct / (4 * len(stored))


def _rotate(pixels: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """pixels (B, C, S, S) with image i rotated by rotations[i] x 90 degrees (counterclockwise)."""
    out = pixels.clone()
    for k in range(1, 4):
        mask = rotations == k
        if mask.any():
            out[mask] = torch.rot90(pixels[mask], k, dims=(2, 3))
    return out
