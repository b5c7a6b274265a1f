"""Calibration sets: `datasets` directories written with `save_to_disk`, sampled with a seed.

Also the row checks shared with featcal_core.data.calibration_hygiene: `checked_input` turns one
stored input (a `datasets.Image` cell or a string) into what calibration reads, or raises one
FeatCalError line for a null or undecodable row; `input_digest` is the content digest that decides
whether two rows are the same example (see CONTENT_DIGEST).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from featcal_core.errors import FeatCalError
from featcal_core.io.saved_datasets import check_saved_dataset

log = logging.getLogger(__name__)

COLUMNS = {"image": "image", "text": "text"}
#: optional column of text sets: the teacher-forced decoder input of encoder-decoder models (T5)
TARGET = "target"
#: the column draw_calibration_set writes: each row's row number in its source split
SOURCE_ROW = "source_row"
#: how `input_digest` identifies a row's content, per modality (recorded with the digests)
CONTENT_DIGEST = {
    "image": "sha256 of b'image', width, height and the decoded RGB pixels (uint8, H x W x 3)",
    "text": "sha256 of b'text' and the exact UTF-8 string",
}


@dataclass
class CalibrationSet:
    task: str
    path: Path
    rows: list[Any]  # PIL images or strings, in the order of `indices`
    indices: list[int]  # row numbers in the saved dataset
    total_rows: int
    targets: list[str] | None = None  # the `target` column (text sets that have one): decoder input

    def describe(self) -> dict:
        """How a record names this set: {"path"; "sha256" over the saved folder; "rows" in
        it; "indices": the rows drawn}."""
        from featcal_core.io.checkpoint import sha256_tree

        return {
            "path": str(self.path.resolve()),
            "sha256": sha256_tree(self.path),
            "rows": self.total_rows,
            "indices": self.indices,
        }


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
    check_saved_dataset(path, f"--calib {task}={path}")
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
        if len(data) < num_per_task and not _drawn_short(path, num_per_task, len(data)):
            log.warning(
                "task %r: num_per_task is %d but the calibration set %s holds only %d "
                "rows; all %d are used (the record's calibration inputs list them)",
                task,
                num_per_task,
                path,
                len(data),
                len(data),
            )
    chosen = data.select(indices)
    where = f"--calib {task}={path}"
    source_rows = chosen[SOURCE_ROW] if SOURCE_ROW in data.column_names else None

    def row_name(i: int) -> str:
        if source_rows is None:
            return f"row {indices[i]}"
        return f"row {indices[i]} (source row {source_rows[i]})"

    fix = "drop or repair that row (e.g. Dataset.filter) and save the set again, or redraw it"
    if isinstance(data.features[column], datasets.Image):  # decode here: one clear error per row
        cells = chosen.with_format("arrow")[column].to_pylist()
    else:
        cells = list(chosen[column])
    rows = [
        checked_input(cell, modality, where=where, row=row_name(i), column=column, fix=fix)
        for i, cell in enumerate(cells)
    ]
    targets = None
    if modality == "text" and TARGET in data.column_names:
        targets = [
            checked_input(t, "text", where=where, row=row_name(i), column=TARGET, fix=fix)
            for i, t in enumerate(chosen[TARGET])
        ]
    return CalibrationSet(task, path, rows, indices, len(data), targets)


def _drawn_short(path: Path, num_per_task: int, rows: int) -> bool:
    """True when the set's own record says it was drawn for `num_per_task` rows and holds
    `rows`: its draw warned already (featcal_core.data.calibration_sets), once per task."""
    from featcal_core.provenance.records import SET_RECORD

    try:
        record = json.loads((path / SET_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("n_requested") == num_per_task
        and record.get("n_rows") == rows
    )


def checked_input(value: Any, modality: str, *, where: str, row: str, column: str, fix: str) -> Any:
    """One stored input as calibration reads it: a PIL image (from a `datasets.Image` cell, a dict
    with `bytes`/`path`, or an already decoded image) or a str. A null, undecodable or wrongly
    typed value raises one FeatCalError line: `where`, `row`, `column`, then `fix`."""
    problem = None
    if modality == "text":
        if isinstance(value, str):
            return value
        problem = "no text (null)" if value is None else f"a {type(value).__name__}, not a string"
    elif value is None or (
        isinstance(value, dict) and value.get("bytes") is None and value.get("path") is None
    ):
        problem = "no image (null)"
    elif isinstance(value, dict):
        import datasets

        try:
            return datasets.Image().decode_example(value)
        except Exception as exc:
            detail = re.sub(r"<[^>]*>", "the stored bytes", " ".join(str(exc).split()))
            problem = f"an undecodable image ({type(exc).__name__}: {detail})"
    else:
        return value  # already decoded (a PIL image, or an array of pixels)
    raise FeatCalError(f"{where}: {row}, column {column!r} holds {problem}; {fix}")


def input_digest(value: Any, modality: str) -> bytes:
    """Content digest (32 bytes) of one checked input (`checked_input`'s result): for images the
    decoded RGB pixels and size, so the same picture stored in two datasets (any encoding, mode L
    or RGB) matches; for text the exact string. See CONTENT_DIGEST."""
    digest = hashlib.sha256()
    if modality == "text":
        digest.update(b"text\0")
        digest.update(value.encode("utf-8"))
        return digest.digest()
    from PIL import Image

    image = value if isinstance(value, Image.Image) else Image.fromarray(np.asarray(value))
    rgb = image.convert("RGB")
    digest.update(b"image\0%d\0%d\0" % rgb.size)
    digest.update(rgb.tobytes())
    return digest.digest()


def _saved_without_rows(path: Path) -> bool:
    """`save_to_disk` of an empty dataset writes no data file, and loading it then fails."""
    state = path / "state.json"
    if not state.is_file():
        return False
    try:
        return json.loads(state.read_text()).get("_data_files") == []
    except (OSError, json.JSONDecodeError):
        return False
