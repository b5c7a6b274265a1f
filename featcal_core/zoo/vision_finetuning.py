"""Fine-tuning a zoo vision expert: the base `CLIPVisionModel` plus a Linear head on one task.

`finetune_vision_expert` saves a plain `CLIPVisionModel` + image processor + `classifier.*`
(linear_head). Seeded and deterministic; the test split is never read; the output directory is
written under a temporary sibling name and renamed into place.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from featcal_core.evaluation.linear_head import save_linear_head
from featcal_core.io.outputs import guarded_directory
from featcal_core.zoo.training_inputs import (
    check_out_dir,
    check_run,
    class_names,
    label_tensor,
    load_pretrained,
)
from featcal_core.zoo.training_loop import (
    evaluate,
    fit_linear_probe,
    index_batches,
    tail_mean,
    task_vector_ratio,
    torch_threads,
    train_steps,
)
from featcal_core.zoo.vision_model import PixelStore, base_processor

logger = logging.getLogger(__name__)


def finetune_vision_expert(
    base_dir: str | Path,
    dataset: Any,
    out_dir: str | Path,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 5e-4,
    weight_decay: float = 0.01,
    seed: int = 0,
    augment: bool = False,
    head: str = "train",
    probe_steps: int = 300,
    progress: bool = True,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Fine-tune the `CLIPVisionModel` in base_dir with a Linear head on `pooler_output`.

    head "train": a fresh head and the tower train together (AdamW, 10% linear warmup then cosine
    decay) on dataset["train"] (`image`, ClassLabel `label`). head "probe" (task arithmetic's
    CLIP recipe, where the text tower's zero-shot head stays fixed): the head is first fitted on
    the frozen base's features (`probe_steps` full-batch AdamW steps), then frozen while the tower
    alone trains. augment: random translations of up to 1/8 of the image side. Saves the tower
    (save_pretrained), the base's image processor and the head (save_linear_head, labels = the
    ClassLabel names) into out_dir. Returns {"validation_accuracy", "validation_loss",
    "train_loss" (mean of the last 10% of steps), "num_classes", "steps", "seconds" (wall),
    "task_vector_ratio" (‖θ − θ₀‖ / ‖θ₀‖ over the tower's floating tensors)}, with head "probe"
    also "probe_validation_accuracy" (the base with the fitted head); the test split is never
    read.
    """
    from transformers import CLIPVisionModel

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    check_out_dir(out_dir, overwrite)
    check_run(steps, batch_size, lr)
    what = f"dataset for {out_dir.name}"
    names = class_names(dataset, ("image", "label"), what)
    processor = base_processor(base_dir)
    started = time.perf_counter()
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        store = PixelStore(processor)
        train_x, val_x = (store.encode(dataset[s], what, s) for s in ("train", "validation"))
        train_y, val_y = (
            label_tensor(dataset[s], len(names), what, s) for s in ("train", "validation")
        )
        model = load_pretrained(CLIPVisionModel, base_dir, "vision base")
        logger.info(
            "%s: fine-tuning on %d train images, %d classes, %d steps of %d",
            out_dir.name,
            len(train_x),
            len(names),
            steps,
            batch_size,
        )
        torch.manual_seed(seed)
        initial = {
            k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()
        }
        probe_accuracy = None
        if head == "probe":
            linear = _linear_probe(model, store, train_x, train_y, len(names), probe_steps, seed)
            probe_accuracy, _ = evaluate(
                lambda index: linear(model(pixel_values=store.pixels(val_x[index])).pooler_output),
                val_y,
            )
            linear.requires_grad_(False)
            trained = list(model.parameters())
        elif head == "train":
            linear = nn.Linear(model.config.hidden_size, len(names))
            trained = [*model.parameters(), *linear.parameters()]
        else:
            raise ValueError(f"head must be 'train' or 'probe' (got {head!r})")
        model.train()
        parameters = trained
        generator = torch.Generator().manual_seed(seed)
        batches = index_batches(len(train_x), batch_size, generator)

        def step_loss(_: int) -> torch.Tensor:
            index = next(batches)
            pixels = store.pixels(train_x[index])
            if augment:
                pixels = _translate(pixels, max(1, pixels.shape[-1] // 8), generator)
            return F.cross_entropy(linear(model(pixel_values=pixels).pooler_output), train_y[index])

        losses = train_steps(step_loss, parameters, steps, lr, weight_decay, out_dir.name, progress)
        model.eval()

        def logits(index: torch.Tensor) -> torch.Tensor:
            return linear(model(pixel_values=store.pixels(val_x[index])).pooler_output)

        val_accuracy, val_loss = evaluate(logits, val_y)
        with guarded_directory(out_dir, overwrite=overwrite, flag="out_dir") as tmp:
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
            save_linear_head(tmp, linear.weight, linear.bias, names)
        ratio = task_vector_ratio(initial, model.state_dict())
    stats = {
        "validation_accuracy": val_accuracy,
        "validation_loss": val_loss,
        "train_loss": tail_mean(losses),
        "num_classes": len(names),
        "steps": steps,
        "seconds": time.perf_counter() - started,
        "task_vector_ratio": ratio,
    }
    if probe_accuracy is not None:
        stats["probe_validation_accuracy"] = probe_accuracy
    logger.info("%s: fine-tuned %s", out_dir.name, stats)
    return stats


@torch.no_grad()
def _features(model: Any, store: PixelStore, stored: torch.Tensor) -> torch.Tensor:
    """pooler_output (N, hidden) of the frozen model for stored images (N, 3, S, S)."""
    model.eval()
    return torch.cat(
        [
            model(pixel_values=store.pixels(stored[i : i + 256])).pooler_output
            for i in range(0, len(stored), 256)
        ]
    )


def _linear_probe(
    model: Any,
    store: PixelStore,
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    num_classes: int,
    steps: int,
    seed: int,
) -> nn.Linear:
    """A Linear head fitted on the frozen model's train features: `steps` full-batch AdamW steps
    (lr 1e-2, weight decay 1e-4) on the cross-entropy; features standardised only through the
    head's own weights (the model's output is what the head will see)."""
    return fit_linear_probe(_features(model, store, train_x), train_y, num_classes, steps, seed)


def _translate(pixels: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """pixels (B, C, H, W) each shifted by up to ±shift pixels (edge-replicated borders)."""
    height, width = pixels.shape[-2:]
    padded = F.pad(pixels, (shift, shift, shift, shift), mode="replicate")
    offsets = torch.randint(0, 2 * shift + 1, (len(pixels), 2), generator=generator).tolist()
    return torch.stack(
        [padded[i, :, y : y + height, x : x + width] for i, (y, x) in enumerate(offsets)]
    )
