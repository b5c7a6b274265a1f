"""Seeded, deterministic CPU training of the checkpoints of a model zoo.

- `pretrain_vision_base`: a randomly initialised `CLIPVisionModel` pretrained without task labels
  (self-supervised rotation prediction on the train splits only).
- `finetune_vision_expert`: the base plus a Linear head on `pooler_output`, fine-tuned on one
  task; saved as a plain `CLIPVisionModel` + image processor + `classifier.*` (linear_head).
- `finetune_text_expert`: a `BertModel` directory fine-tuned as `BertForSequenceClassification`.

Datasets are `datasets.DatasetDict`s with "train", "validation" (and "test", never read here)
splits, an `image` (PIL, any mode and size) or `text` column and a ClassLabel `label` column. The
same seed gives bitwise-identical checkpoints on the same CPU build and thread count. Every output
directory is written under a temporary sibling name and renamed into place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.linear_head import save_linear_head
from featcal_core.io.outputs import check_replaceable, guarded_directory

logger = logging.getLogger(__name__)

_SPLITS_FIX = "pass a DatasetDict with 'train', 'validation' and 'test' splits"
_ENCODE_CHUNK = 1024  # images or texts preprocessed at a time
_EVAL_BATCH = 256
_WARMUP = 0.1  # fraction of the steps with a linear learning-rate warmup


# ------------------------------------------------------------------------------- configuration


def vision_config(
    image_size: int = 32,
    patch_size: int = 4,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 512,
):
    """A small `CLIPVisionConfig`: (image_size / patch_size)^2 + 1 tokens of width hidden_size."""
    from transformers import CLIPVisionConfig

    if image_size % patch_size:
        raise FeatCalError(
            f"vision_config: image_size {image_size} is not a multiple of patch_size "
            f"{patch_size}; pick sizes that divide"
        )
    if hidden_size % heads:
        raise FeatCalError(
            f"vision_config: hidden_size {hidden_size} is not a multiple of heads {heads}; pick "
            "sizes that divide"
        )
    return CLIPVisionConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        num_channels=3,
    )


def image_processor(image_size: int = 32):
    """A `CLIPImageProcessor`: RGB, shortest edge resized to image_size (bicubic), centre crop
    image_size x image_size, pixels scaled to [0, 1] then normalised with mean = std = 0.5
    (pixel_values in [-1, 1])."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": image_size},
        do_center_crop=True,
        crop_size={"height": image_size, "width": image_size},
        do_rescale=True,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_convert_rgb=True,
    )


# ------------------------------------------------------------------------------- training entry points


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
    _check_out(out_dir, overwrite)
    _check_run(steps, batch_size, lr)
    if not isinstance(datasets, Mapping) or not datasets:
        raise FeatCalError(
            "pretrain_vision_base: datasets must be a non-empty dict of name → DatasetDict; "
            "pass at least one dataset"
        )
    for name, dataset in datasets.items():
        for split in ("train", "validation"):
            _split(dataset, split, ("image",), f"dataset {name!r}")
    config = vision_config() if config is None else config
    processor = image_processor(config.image_size)
    started = time.perf_counter()
    with _threads(threads), torch.random.fork_rng(devices=[]):
        store = _PixelStore(processor)
        train = {
            n: store.encode(d["train"], f"dataset {n!r}", "train") for n, d in datasets.items()
        }
        pooled = torch.cat(list(train.values()))
        validation = {
            name: store.encode(
                _head(dataset["validation"], max_eval_images), f"dataset {name!r}", "validation"
            )
            for name, dataset in datasets.items()
        }
        logger.info(
            "%s: rotation pretraining on %d train images of %s, %d steps of %d",
            out_dir.name, len(pooled), sorted(datasets), steps, batch_size,
        )  # fmt: skip
        torch.manual_seed(seed)
        model = CLIPVisionModel(config).train()
        rotation_head = nn.Linear(config.hidden_size, 4)
        parameters = [*model.parameters(), *rotation_head.parameters()]
        generator = torch.Generator().manual_seed(seed)
        batches = _batches(len(pooled), batch_size, generator)

        def step_loss(_: int) -> torch.Tensor:
            index = next(batches)
            rotations = torch.randint(0, 4, (len(index),), generator=generator)
            pixels = _rotate(store.pixels(pooled[index]), rotations)
            return F.cross_entropy(
                rotation_head(model(pixel_values=pixels).pooler_output), rotations
            )

        losses = _train(step_loss, parameters, steps, lr, weight_decay, out_dir.name, progress)
        model.eval()
        accuracy = {
            name: _rotation_accuracy(model, rotation_head, store, pixels)
            for name, pixels in validation.items()
        }
        with guarded_directory(out_dir, overwrite=overwrite, flag="out_dir") as tmp:
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
    stats = {
        "train_loss": _tail_mean(losses),
        "rotation_accuracy": accuracy,
        "rotation_accuracy_mean": sum(accuracy.values()) / len(accuracy),
        "train_images": {name: len(pixels) for name, pixels in train.items()},
        "steps": steps,
        "seconds": time.perf_counter() - started,
    }
    logger.info("%s: pretrained %s", out_dir.name, stats)
    return stats


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
    progress: bool = True,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Fine-tune the `CLIPVisionModel` in base_dir with a fresh Linear head on `pooler_output`.

    Everything trains (AdamW, 10% linear warmup then cosine decay) on dataset["train"]
    (`image`, ClassLabel `label`); augment: random translations of up to 1/8 of the image side.
    Saves the tower (save_pretrained), the base's image processor and the head (save_linear_head,
    labels = the ClassLabel names) into out_dir. Returns {"validation_accuracy",
    "validation_loss", "train_loss" (mean of the last 10% of steps), "num_classes", "steps",
    "seconds" (wall)}; the test split is never read.
    """
    from transformers import CLIPVisionModel

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    _check_out(out_dir, overwrite)
    _check_run(steps, batch_size, lr)
    what = f"dataset for {out_dir.name}"
    names = _class_names(dataset, ("image", "label"), what)
    processor = _base_processor(base_dir)
    started = time.perf_counter()
    with _threads(threads), torch.random.fork_rng(devices=[]):
        store = _PixelStore(processor)
        train_x, val_x = (store.encode(dataset[s], what, s) for s in ("train", "validation"))
        train_y, val_y = (_labels(dataset[s], len(names), what, s) for s in ("train", "validation"))
        model = _load(CLIPVisionModel, base_dir, "vision base")
        logger.info(
            "%s: fine-tuning on %d train images, %d classes, %d steps of %d",
            out_dir.name, len(train_x), len(names), steps, batch_size,
        )  # fmt: skip
        torch.manual_seed(seed)
        head = nn.Linear(model.config.hidden_size, len(names))
        model.train()
        parameters = [*model.parameters(), *head.parameters()]
        generator = torch.Generator().manual_seed(seed)
        batches = _batches(len(train_x), batch_size, generator)

        def step_loss(_: int) -> torch.Tensor:
            index = next(batches)
            pixels = store.pixels(train_x[index])
            if augment:
                pixels = _translate(pixels, max(1, pixels.shape[-1] // 8), generator)
            return F.cross_entropy(head(model(pixel_values=pixels).pooler_output), train_y[index])

        losses = _train(step_loss, parameters, steps, lr, weight_decay, out_dir.name, progress)
        model.eval()

        def logits(index: torch.Tensor) -> torch.Tensor:
            return head(model(pixel_values=store.pixels(val_x[index])).pooler_output)

        val_accuracy, val_loss = _evaluate(logits, val_y)
        with guarded_directory(out_dir, overwrite=overwrite, flag="out_dir") as tmp:
            model.save_pretrained(tmp)
            processor.save_pretrained(tmp)
            save_linear_head(tmp, head.weight, head.bias, names)
    stats = {
        "validation_accuracy": val_accuracy,
        "validation_loss": val_loss,
        "train_loss": _tail_mean(losses),
        "num_classes": len(names),
        "steps": steps,
        "seconds": time.perf_counter() - started,
    }
    logger.info("%s: fine-tuned %s", out_dir.name, stats)
    return stats


def finetune_text_expert(
    base_dir: str | Path,
    dataset: Any,
    out_dir: str | Path,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 5e-5,
    weight_decay: float = 0.01,
    max_length: int = 64,
    seed: int = 0,
    progress: bool = True,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Fine-tune the `BertModel` in base_dir (with its tokenizer files) as a
    `BertForSequenceClassification` on dataset["train"] (`text`, ClassLabel `label`).

    Texts are truncated to max_length tokens; batches are padded to their longest text. A pooler
    missing from the base is newly initialised. AdamW, 10% linear warmup then linear decay.
    Saves the model (save_pretrained, id2label = the ClassLabel names) and the tokenizer into
    out_dir. Returns {"validation_accuracy", "validation_loss", "train_loss" (mean of the last
    10% of steps), "num_classes", "steps", "seconds" (wall)}; the test split is never read.
    """
    from transformers import AutoConfig, AutoTokenizer, BertForSequenceClassification

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    _check_out(out_dir, overwrite)
    _check_run(steps, batch_size, lr)
    if max_length < 2:
        raise FeatCalError(f"finetune_text_expert: max_length {max_length} < 2; pass e.g. 64")
    what = f"dataset for {out_dir.name}"
    names = _class_names(dataset, ("text", "label"), what)
    config = _load(AutoConfig, base_dir, "text base")
    if config.model_type != "bert":
        raise FeatCalError(
            f"{base_dir / 'config.json'}: model_type {config.model_type!r}, expected 'bert'; pass "
            "a BertModel directory (e.g. all-MiniLM-L6-v2)"
        )
    tokenizer = _load(AutoTokenizer, base_dir, "text base tokenizer")
    started = time.perf_counter()
    with _threads(threads), torch.random.fork_rng(devices=[]):
        train_x, val_x = (
            _tokenize(tokenizer, dataset[s], max_length, what, s) for s in ("train", "validation")
        )
        train_y, val_y = (_labels(dataset[s], len(names), what, s) for s in ("train", "validation"))
        torch.manual_seed(seed)
        model = _load(
            BertForSequenceClassification,
            base_dir,
            "text base",
            num_labels=len(names),
            id2label=dict(enumerate(names)),
            label2id={name: i for i, name in enumerate(names)},
        )
        logger.info(
            "%s: fine-tuning on %d train texts, %d classes, %d steps of %d",
            out_dir.name, len(train_y), len(names), steps, batch_size,
        )  # fmt: skip
        torch.manual_seed(seed)  # dropout masks
        model.train()
        generator = torch.Generator().manual_seed(seed)
        batches = _batches(len(train_y), batch_size, generator)

        def step_loss(_: int) -> torch.Tensor:
            index = next(batches)
            return F.cross_entropy(model(**train_x.batch(index)).logits, train_y[index])

        losses = _train(
            step_loss, list(model.parameters()), steps, lr, weight_decay, out_dir.name, progress,
            cosine=False,
        )  # fmt: skip
        model.eval()
        val_accuracy, val_loss = _evaluate(lambda index: model(**val_x.batch(index)).logits, val_y)
        with guarded_directory(out_dir, overwrite=overwrite, flag="out_dir") as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    stats = {
        "validation_accuracy": val_accuracy,
        "validation_loss": val_loss,
        "train_loss": _tail_mean(losses),
        "num_classes": len(names),
        "steps": steps,
        "seconds": time.perf_counter() - started,
    }
    logger.info("%s: fine-tuned %s", out_dir.name, stats)
    return stats


# ------------------------------------------------------------------------------- shared helpers


def _batches(count: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless index batches (batch_size,) over range(count): a fresh seeded permutation per epoch,
    the incomplete last batch of an epoch dropped (a single batch of `count` when count <
    batch_size)."""
    size = min(batch_size, count)
    while True:
        order = torch.randperm(count, generator=generator)
        for start in range(0, count - size + 1, size):
            yield order[start : start + size]


def _train(
    step_loss,
    parameters: Sequence[torch.Tensor],
    steps: int,
    lr: float,
    weight_decay: float,
    desc: str,
    progress: bool,
    *,
    cosine: bool = True,
) -> list[float]:
    """`steps` AdamW steps on step_loss(step) with 10% linear warmup then cosine (or linear)
    decay to 0 and gradient-norm clipping at 1; returns the loss of every step."""
    from tqdm.auto import tqdm

    decay = [p for p in parameters if p.ndim >= 2]
    no_decay = [p for p in parameters if p.ndim < 2]  # biases, norms, class/position vectors
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
    )
    warmup = max(1, int(_WARMUP * steps))

    def scale(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * done)) if cosine else 1 - done

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, scale)
    losses: list[float] = []
    with tqdm(total=steps, desc=desc, disable=not progress, unit="step") as bar:
        for step in range(steps):
            loss = step_loss(step)
            if not torch.isfinite(loss):
                raise FeatCalError(
                    f"{desc}: the training loss became {loss.item()} at step {step}; lower lr "
                    f"(now {lr})"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(parameters, 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            bar.update()
            if step % 10 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


@torch.no_grad()
def _evaluate(logits_of, labels: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of logits_of(index batch) (B, C) against labels (N,)."""
    correct, loss = 0, 0.0
    for start in range(0, len(labels), _EVAL_BATCH):
        index = torch.arange(start, min(start + _EVAL_BATCH, len(labels)))
        logits = logits_of(index).float()
        correct += int((logits.argmax(-1) == labels[index]).sum())
        loss += float(F.cross_entropy(logits, labels[index], reduction="sum"))
    return correct / len(labels), loss / len(labels)


@torch.no_grad()
def _rotation_accuracy(model, head: nn.Module, store: _PixelStore, stored: torch.Tensor) -> float:
    correct = 0
    for start in range(0, len(stored), _EVAL_BATCH):
        pixels = store.pixels(stored[start : start + _EVAL_BATCH])
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


def _translate(pixels: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """pixels (B, C, H, W) each shifted by up to ±shift pixels (edge-replicated borders)."""
    height, width = pixels.shape[-2:]
    padded = F.pad(pixels, (shift, shift, shift, shift), mode="replicate")
    offsets = torch.randint(0, 2 * shift + 1, (len(pixels), 2), generator=generator).tolist()
    return torch.stack(
        [padded[i, :, y : y + height, x : x + width] for i, (y, x) in enumerate(offsets)]
    )


class _PixelStore:
    """Images preprocessed once by an image processor and kept compactly.

    A processor that rescales and normalises (CLIPImageProcessor) is run without those two steps:
    its resized, centre-cropped images (B, 3, S, S) are kept as uint8 (float32 if not integral)
    and `pixels` applies rescale + normalise per batch, equal to the processor's own output up to
    float rounding. Any other processor's pixel_values are kept as float32 and used as they are.
    """

    def __init__(self, processor: Any):
        self.processor = processor
        self.deferred = all(
            getattr(processor, name, None) not in (None, False)
            for name in ("do_rescale", "do_normalize", "rescale_factor", "image_mean", "image_std")
        )
        if self.deferred:
            self.scale = float(processor.rescale_factor)
            self.mean = torch.tensor(processor.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
            self.std = torch.tensor(processor.image_std, dtype=torch.float32).view(1, -1, 1, 1)

    def encode(self, split: Any, what: str, name: str) -> torch.Tensor:
        """The stored form (B, 3, S, S) of the `image` column of split."""
        chunks = []
        for start in range(0, len(split), _ENCODE_CHUNK):
            images = split[start : start + _ENCODE_CHUNK]["image"]
            if any(image is None for image in images):
                raise FeatCalError(
                    f"{what}: split {name!r} has empty entries in column 'image'; drop them with "
                    "dataset.filter(lambda row: row['image'] is not None)"
                )
            try:
                if self.deferred:
                    raw = self.processor(
                        images=images, do_rescale=False, do_normalize=False, return_tensors="pt"
                    )["pixel_values"]
                    integral = raw.dtype == torch.uint8 or bool(
                        (raw == raw.round()).all() and raw.min() >= 0 and raw.max() <= 255
                    )
                    chunks.append(raw.to(torch.uint8) if integral else raw.float())
                else:
                    raw = self.processor(images=images, return_tensors="pt")["pixel_values"]
                    chunks.append(raw.float())
            except (TypeError, ValueError, OSError) as exc:
                raise FeatCalError(
                    f"{what}: split {name!r} column 'image' could not be preprocessed ({exc}); "
                    "store PIL images (datasets.Image feature)"
                ) from exc
        dtype = torch.uint8 if all(c.dtype == torch.uint8 for c in chunks) else torch.float32
        return torch.cat([chunk.to(dtype) for chunk in chunks])

    def pixels(self, stored: torch.Tensor) -> torch.Tensor:
        """pixel_values (B, 3, S, S) float32 of stored images."""
        if not self.deferred:
            return stored.float()
        return (stored.float() * self.scale - self.mean) / self.std


@dataclass
class _Tokens:
    """Token ids and attention mask (N, max_length), right-padded."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows in index, cut to their longest text."""
        mask = self.attention_mask[index]
        length = max(1, int(mask.sum(1).max()))
        out = {"input_ids": self.input_ids[index, :length], "attention_mask": mask[:, :length]}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids[index, :length]
        return out


def _tokenize(tokenizer: Any, split: Any, max_length: int, what: str, name: str) -> _Tokens:
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(split), _ENCODE_CHUNK):
        texts = split[start : start + _ENCODE_CHUNK]["text"]
        if not all(isinstance(text, str) for text in texts):
            raise FeatCalError(
                f"{what}: split {name!r} column 'text' holds non-string entries; store strings "
                "(drop or fill the missing ones)"
            )
        encoded = tokenizer(
            texts, truncation=True, max_length=max_length, padding="max_length",
            return_tensors="pt",
        )  # fmt: skip
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            if key in encoded:
                parts.setdefault(key, []).append(encoded[key])
    joined = {key: torch.cat(value) for key, value in parts.items()}
    return _Tokens(joined["input_ids"], joined["attention_mask"], joined.get("token_type_ids"))


def _split(dataset: Any, split: str, columns: Sequence[str], what: str) -> Any:
    """dataset[split], checked to exist, be non-empty and have `columns`."""
    if not isinstance(dataset, Mapping):
        raise FeatCalError(f"{what}: got a {type(dataset).__name__}; {_SPLITS_FIX}")
    if split not in dataset:
        raise FeatCalError(f"{what}: no {split!r} split (has {sorted(dataset)}); {_SPLITS_FIX}")
    part = dataset[split]
    for column in columns:
        if column not in part.column_names:
            raise FeatCalError(
                f"{what}: split {split!r} has no {column!r} column (has {part.column_names}); "
                f"rename yours with dataset.rename_column(old_name, {column!r})"
            )
    if len(part) == 0:
        raise FeatCalError(f"{what}: split {split!r} is empty; give it at least one example")
    return part


def _class_names(dataset: Any, columns: Sequence[str], what: str) -> list[str]:
    """The ClassLabel names of the label column, after checking the train/validation splits."""
    from datasets import ClassLabel

    names = None
    for split in ("train", "validation"):
        feature = _split(dataset, split, columns, what).features["label"]
        if not isinstance(feature, ClassLabel):
            raise FeatCalError(
                f"{what}: split {split!r} column 'label' is a {type(feature).__name__}, not a "
                "ClassLabel; cast it with dataset.cast_column('label', ClassLabel(names=[...]))"
            )
        if names is not None and list(feature.names) != names:
            raise FeatCalError(
                f"{what}: splits 'train' and 'validation' have different class names; cast both "
                "to the same ClassLabel"
            )
        names = list(feature.names)
    if len(names) < 2:
        raise FeatCalError(
            f"{what}: ClassLabel has {len(names)} class(es); a task needs at least 2"
        )
    return names


def _labels(split: Any, num_classes: int, what: str, name: str) -> torch.Tensor:
    labels = torch.tensor(list(split["label"]), dtype=torch.long)
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        raise FeatCalError(
            f"{what}: split {name!r} column 'label' has {int(bad.sum())} value(s) outside "
            f"0..{num_classes - 1} (e.g. {int(labels[bad][0])}); drop unlabeled rows"
        )
    return labels


def _base_processor(base_dir: Path) -> Any:
    from transformers import AutoConfig, AutoImageProcessor

    if (base_dir / "preprocessor_config.json").is_file():
        return _load(AutoImageProcessor, base_dir, "vision base image processor")
    config = _load(AutoConfig, base_dir, "vision base")
    size = getattr(config, "image_size", None) or config.vision_config.image_size
    logger.warning("%s has no preprocessor_config.json; using image_processor(%d)", base_dir, size)
    return image_processor(size)


def _load(cls: Any, directory: Path, role: str, **kwargs: Any) -> Any:
    if not directory.is_dir():
        raise FeatCalError(
            f"{role} {directory} is not a directory; pass a checkpoint saved with save_pretrained"
        )
    try:
        return cls.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FeatCalError(
            f"{role} {directory} could not be loaded with {cls.__name__}.from_pretrained "
            f"({first}); pass a checkpoint saved with save_pretrained"
        ) from exc


def _head(split: Any, limit: int | None) -> Any:
    return split if limit is None or len(split) <= limit else split.select(range(limit))


def _tail_mean(losses: list[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def _check_out(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not overwrite:
        raise FeatCalError(
            f"out_dir {out_dir} already exists; pass overwrite=True to replace it (left untouched)"
        )
    check_replaceable(out_dir, "out_dir")  # only a folder featcal wrote is replaced


def _check_run(steps: int, batch_size: int, lr: float) -> None:
    if int(steps) < 1 or int(batch_size) < 1:
        raise FeatCalError(
            f"steps {steps} and batch_size {batch_size} must both be at least 1; pass positive "
            "integers"
        )
    if not (math.isfinite(lr) and lr > 0):
        raise FeatCalError(f"lr {lr} is not a positive number; pass e.g. 5e-4")


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    """torch.set_num_threads(threads) for the duration (untouched when threads is None)."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        yield
    finally:
        torch.set_num_threads(previous)
