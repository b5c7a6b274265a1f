"""The labelled evaluation set: a `datasets.save_to_disk` directory (one split of it) and the
check of its label column against a head's classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from featcal_core.errors import FeatCalError
from featcal_core.io.saved_datasets import check_saved_dataset


def _load_split(dataset_dir: str | Path, split: str | None) -> Any:
    import datasets  # local import: heavy

    path = Path(dataset_dir)
    if not path.exists():
        raise FeatCalError(
            f"evaluation set {path} does not exist; pass a datasets save_to_disk directory"
        )
    check_saved_dataset(path, f"evaluation set {path}")
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise FeatCalError(
            f"evaluation set {path}: not a datasets save_to_disk directory ({exc})"
        ) from exc
    if isinstance(data, datasets.DatasetDict):
        if split is None:
            if len(data) == 1:
                return next(iter(data.values()))
            raise FeatCalError(
                f"evaluation set {path} has splits {sorted(data)}; pass split (e.g. 'test')"
            )
        if split not in data:
            raise FeatCalError(
                f"evaluation set {path} has no split {split!r} (has {sorted(data)}); pass one of them"
            )
        return data[split]
    if split is not None:
        raise FeatCalError(
            f"evaluation set {path} is a single dataset without splits, but split {split!r} was "
            "given; pass split=None or save a DatasetDict"
        )
    return data


def _check_labels(labels: list[Any], num_classes: int, where: str, column: str) -> torch.Tensor:
    try:
        values = torch.as_tensor(np.asarray(labels))
    except (TypeError, ValueError) as exc:
        raise FeatCalError(
            f"{where}: column {column!r} does not hold integer labels ({exc}); pass the label column"
        ) from exc
    if (
        values.ndim != 1
        or values.is_floating_point()
        or values.is_complex()
        or values.dtype == torch.bool
    ):
        raise FeatCalError(
            f"{where}: column {column!r} does not hold integer class ids (dtype {values.dtype}); "
            "pass the label column"
        )
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= num_classes:
        bad = low if low < 0 else high
        raise FeatCalError(
            f"{where}: label {bad} in column {column!r} is out of range for a head with "
            f"{num_classes} classes (0..{num_classes - 1}); check the label column, the class "
            "names or the expert"
        )
    return values.long()


# ------------------------------------------------------------------------------- evaluation
