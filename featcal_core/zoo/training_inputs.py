"""Checking what the zoo's trainers read and write: dataset splits, labels, checkpoints, out_dir.

Datasets are `datasets.DatasetDict`s with "train", "validation" (and "test", never read here)
splits, an `image` or `text` column and a ClassLabel `label` column. Every problem raises a
FeatCalError that names the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import check_replaceable

_SPLITS_FIX = "pass a DatasetDict with 'train', 'validation' and 'test' splits"
ENCODE_CHUNK = 1024  # images or texts preprocessed at a time


def checked_split(dataset: Any, split: str, columns: Sequence[str], what: str) -> Any:
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


def class_names(dataset: Any, columns: Sequence[str], what: str) -> list[str]:
    """The ClassLabel names of the label column, after checking the train/validation splits."""
    from datasets import ClassLabel

    names: list[str] | None = None
    for split in ("train", "validation"):
        feature = checked_split(dataset, split, columns, what).features["label"]
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
    assert names is not None  # set for both splits
    if len(names) < 2:
        raise FeatCalError(
            f"{what}: ClassLabel has {len(names)} class(es); a task needs at least 2"
        )
    return names


def label_tensor(split: Any, num_classes: int, what: str, name: str) -> torch.Tensor:
    labels = torch.tensor(list(split["label"]), dtype=torch.long)
    bad = (labels < 0) | (labels >= num_classes)
    if bad.any():
        raise FeatCalError(
            f"{what}: split {name!r} column 'label' has {int(bad.sum())} value(s) outside "
            f"0..{num_classes - 1} (e.g. {int(labels[bad][0])}); drop unlabeled rows"
        )
    return labels


def first_rows(split: Any, limit: int | None) -> Any:
    return split if limit is None or len(split) <= limit else split.select(range(limit))


def load_pretrained(cls: Any, directory: Path, role: str, **kwargs: Any) -> Any:
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


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not overwrite:
        raise FeatCalError(
            f"out_dir {out_dir} already exists; pass overwrite=True to replace it (left untouched)"
        )
    check_replaceable(out_dir, "out_dir")  # only a folder featcal wrote is replaced


def check_run(steps: int, batch_size: int, lr: float) -> None:
    if int(steps) < 1 or int(batch_size) < 1:
        raise FeatCalError(
            f"steps {steps} and batch_size {batch_size} must both be at least 1; pass positive "
            "integers"
        )
    if not (math.isfinite(lr) and lr > 0):
        raise FeatCalError(f"lr {lr} is not a positive number; pass e.g. 5e-4")
