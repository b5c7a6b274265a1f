"""Accuracy and cross-entropy of a model (base, expert, merged or calibrated) on a labelled set.

`evaluate(model_dir, head, dataset_dir, ...)` runs the model in eval mode without gradients over a
`datasets.save_to_disk` directory (`featcal_core.evaluation.dataset`) under a head
(`featcal_core.evaluation.head`) and returns {"accuracy", "loss", "examples"}; inputs are
preprocessed by the head. The tower runs in `precision` (float32, or bfloat16 under autocast:
featcal_core.precision.resolve_forwards); logits, losses and counts are float32. `normalized_accuracy` relates a model's
accuracy to its task's expert's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.dataset import _check_labels, _load_split
from featcal_core.evaluation.head import Head
from featcal_core.evaluation.input_batches import InputBatches
from featcal_core.precision import autocast

logger = logging.getLogger(__name__)

__all__ = ["evaluate", "evaluate_linears", "normalized_accuracy"]


def _device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise FeatCalError(f"device {device!r} is not a torch device (cpu, cuda, auto)") from exc


@torch.no_grad()
def evaluate(
    model_dir: str | Path,
    head: Head,
    dataset_dir: str | Path,
    split: str | None = None,
    *,
    batch_size: int = 64,
    max_examples: int | None = None,
    image_column: str | None = "image",
    text_column: str | None = "text",
    label_column: str | None = "label",
    device: str | torch.device = "cpu",
    progress: bool = True,
    precision: str = "float32",
) -> dict[str, float | int]:
    """Evaluate the tower in `model_dir` under `head` on a labelled `save_to_disk` set.
    split: the DatasetDict split (None: the only split, or a plain Dataset); max_examples: the
    first N rows only. Returns {"accuracy": fraction correct, "loss": mean cross-entropy,
    "examples": rows evaluated, "split_rows": rows the split holds}.
    """
    return evaluate_linears(
        model_dir,
        head,
        dataset_dir,
        split,
        {"head": None},
        batch_size=batch_size,
        max_examples=max_examples,
        image_column=image_column,
        text_column=text_column,
        label_column=label_column,
        device=device,
        progress=progress,
        precision=precision,
    )["head"]


@torch.no_grad()
def evaluate_linears(
    model_dir: str | Path,
    head: Head,
    dataset_dir: str | Path,
    split: str | None,
    linears: Mapping[str, tuple[torch.Tensor, torch.Tensor] | None],
    *,
    batch_size: int = 64,
    max_examples: int | None = None,
    image_column: str | None = "image",
    text_column: str | None = "text",
    label_column: str | None = "label",
    device: str | torch.device = "cpu",
    progress: bool = True,
    batches: InputBatches | None = None,
    precision: str = "float32",
) -> dict[str, dict[str, float | int]]:
    """`evaluate` under several final Linears that read the same features: one pass of the tower
    per batch, each Linear applied to its features. `linears` maps a name to (weight (classes,
    d), bias (classes)), or to None for `head`'s own Linear; {name: result} as `evaluate` gives
    (the same numbers as evaluating `head.with_linear(weight, bias)` alone). `batches`: the
    preprocessed batches shared with the other models evaluated on this set under heads with the
    same preprocessing (input_batches.py). `precision`: "float32", or "bfloat16" for the tower's
    forward under autocast (the Linears read its features in float32)."""
    from featcal_core.progress import stage_progress

    if not linears:
        raise FeatCalError("evaluate_linears needs at least one Linear to evaluate")
    if batch_size < 1:
        raise FeatCalError(f"batch_size must be at least 1 (got {batch_size})")
    if max_examples is not None and max_examples < 1:
        raise FeatCalError(f"max_examples must be at least 1 or None (got {max_examples})")
    where = f"evaluation set {dataset_dir}" + (f" (split {split})" if split else "")
    data = _load_split(dataset_dir, split)
    if head.modality == "image":
        input_column = image_column or "image"
    else:
        input_column = text_column or "text"
    label_column = label_column or "label"
    for column, role in ((input_column, f"{head.modality} input"), (label_column, "label")):
        if column not in data.column_names:
            raise FeatCalError(
                f"{where}: no {role} column {column!r} (has {data.column_names}); pass the "
                f"{role.split()[-1]} column name"
            )
    split_rows = len(data)
    if max_examples is not None and len(data) > max_examples:
        data = data.select(range(max_examples))
    if len(data) == 0:
        raise FeatCalError(f"{where} has no rows; evaluate on a non-empty set")
    labels = _check_labels(list(data[label_column]), head.num_classes, where, label_column)
    data = data.select_columns([input_column])

    target = _device(device)
    heads: dict[str, nn.Linear | None]
    if list(linears.values()) == [None]:  # the head's own classifier (an expert: its forward)
        features, heads = head.classifier(model_dir, target), {name: None for name in linears}
    else:  # the tower once, then each Linear on its features
        features, own = head.layers(model_dir, target)
        features.eval()
        heads = {
            name: own if pair is None else head.with_linear(*pair).linear_override_layer(target)
            for name, pair in linears.items()
        }
    total = len(data)
    correct = dict.fromkeys(heads, 0)
    loss_sum = dict.fromkeys(heads, 0.0)
    batches = batches if batches is not None else InputBatches(0)
    starts = range(0, total, batch_size)
    bar = stage_progress(
        starts, desc=f"evaluate {Path(model_dir).name}", unit="batch", enabled=progress
    )
    for start in bar:
        key = (str(dataset_dir), split, total, input_column, start, batch_size)

        def make(start: int = start) -> dict[str, torch.Tensor]:
            return head.preprocess(data[start : start + batch_size][input_column])

        prepared = batches.get(key, make)
        with autocast(precision, target):
            found = features(**{k: v.to(target) for k, v in prepared.items()}).float()
        batch_labels = labels[start : start + batch_size].to(target)
        for name, linear in heads.items():
            logits = found if linear is None else linear(found).float()
            loss_sum[name] += float(F.cross_entropy(logits, batch_labels, reduction="sum"))
            correct[name] += int((logits.argmax(dim=-1) == batch_labels).sum())
    results = {}
    for name in heads:
        results[name] = {
            "accuracy": correct[name] / total,
            "loss": loss_sum[name] / total,
            "examples": total,
            "split_rows": split_rows,
        }
        logger.info(
            "%s (%s) on %s: accuracy %.4f, loss %.4f over %d examples",
            model_dir,
            name,
            where,
            results[name]["accuracy"],
            results[name]["loss"],
            total,
        )
    return results


def normalized_accuracy(model_acc: float, expert_acc: float) -> float:
    """Accuracy relative to the task's expert: model_acc / expert_acc."""
    if not np.isfinite(model_acc) or not np.isfinite(expert_acc):
        raise FeatCalError(
            f"normalized accuracy needs finite accuracies (got {model_acc}, {expert_acc})"
        )
    if expert_acc <= 0:
        raise FeatCalError(
            f"normalized accuracy is undefined: the expert's accuracy is {expert_acc}; check the "
            "expert's evaluation (labels, head)"
        )
    return float(model_acc) / float(expert_acc)
