"""Calibration sets: `datasets` directories written with `save_to_disk`, sampled with a seed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from featcal_core.errors import FeatCalError

COLUMNS = {"image": "image", "text": "text"}
#: optional column of text sets: the teacher-forced decoder input of encoder-decoder models (T5)
TARGET = "target"


@dataclass
class CalibrationSet:
    task: str
    path: Path
    rows: list[Any]  # PIL images or strings, in the order of `indices`
    indices: list[int]  # row numbers in the saved dataset
    total_rows: int
    targets: list[str] | None = None  # the `target` column (text sets that have one): decoder input


def load_calibration_set(
    task: str, path: str | Path, modality: str, num_per_task: int, seed: int
) -> CalibrationSet:
    """Load the set, check its column, and take a seeded sample of `num_per_task` rows."""
    import datasets  # local import: datasets is heavy and only needed here

    path = Path(path)
    if not path.exists():
        raise FeatCalError(
            f"--calib {task}={path}: directory does not exist; pass a datasets save_to_disk directory"
        )
    if _saved_without_rows(path):
        raise FeatCalError(f"--calib {task}={path}: the calibration set is empty; add rows")
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise FeatCalError(
            f"--calib {task}={path}: not a datasets save_to_disk directory ({exc})"
        ) from exc
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise FeatCalError(
                f"--calib {task}={path}: a DatasetDict without a 'train' split "
                f"(has {sorted(data)}); save the calibration split alone"
            )
        data = data["train"]
    column = COLUMNS[modality]
    if column not in data.column_names:
        raise FeatCalError(
            f"--calib {task}={path}: no {column!r} column (has {data.column_names}); "
            f"{modality} models need a {column!r} column"
        )
    if len(data) == 0:
        raise FeatCalError(f"--calib {task}={path}: the calibration set is empty; add rows")
    if num_per_task < 1:
        raise FeatCalError(f"--num-per-task must be at least 1 (got {num_per_task})")
    if len(data) > num_per_task:
        rng = np.random.default_rng(seed)
        indices = sorted(int(i) for i in rng.choice(len(data), size=num_per_task, replace=False))
    else:
        indices = list(range(len(data)))
    chosen = data.select(indices)
    targets = None
    if modality == "text" and TARGET in data.column_names:
        targets = [str(t) for t in chosen[TARGET]]
    return CalibrationSet(task, path, list(chosen[column]), indices, len(data), targets)


def _saved_without_rows(path: Path) -> bool:
    """`save_to_disk` of an empty dataset writes no data file, and loading it then fails."""
    state = path / "state.json"
    if not state.is_file():
        return False
    try:
        return json.loads(state.read_text()).get("_data_files") == []
    except (OSError, json.JSONDecodeError):
        return False
