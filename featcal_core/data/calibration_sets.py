"""Calibration sets: draw a seeded sample of a task's train data and save it for `featcal calibrate`.

    data = open_source(spec.calibration, key="tasks.mnist.calibration")
    record = draw_calibration_set(
        "mnist", spec.calibration, spec.evaluation, "data/results/calibration_sets/mnist",
        n=256, seed=0, modality="image",
    )

A source is a `featcal_core.data.source.DataSource` (or the run configuration's equivalent),
opened by featcal_core.data.source_rows: a local `save_to_disk` directory (a Dataset, or a
DatasetDict plus `split`) or a Hub dataset (`datasets.load_dataset(hub, config, split=split)`).

The written set is a `save_to_disk` directory that `featcal_core.data.calibration_data` reads:

* the input column under its canonical name, `image` or `text` (renamed from the configured
  `image_column` / `text_column`);
* `label`, when the source has a label column (renamed from `label_column`), kept for later
  analysis only: calibration never reads it;
* `target`, when a text source has a `target` column: the teacher-forced decoder input of
  encoder-decoder models (T5);
* `source_row` (int64): the row number of each example in the source split;
* `calibration_set.json` (RECORD_NAME): task, source, split, rows requested and available, seed,
  the chosen row ids, `evaluation_check` (below) and `digest`.

Held out by source and by content (featcal_core.data.calibration_hygiene): a calibration source
that names the evaluation source is refused, and so is any drawn row whose content is also a row
of the task's evaluation source, however the data was copied or renamed. `evaluation_check`
records what was checked; it is null when no evaluation source is given. Null or undecodable
inputs (and null `target` texts) in the drawn rows or the evaluation rows are refused with one line
naming the source, the row and the column.

Sampling: `numpy.random.default_rng(seed).choice(len, n, replace=False)`, sorted; when n is at
least the number of rows, every row in order.

Determinism: the dataset files are built from the selected Arrow rows with a fixed fingerprint
(derived from the source identity, columns and row ids), so the same source, seed and n give
byte-identical files (for the same `datasets`/`pyarrow` versions). `digest` is
`sha256_tree` of those files, computed before `calibration_set.json` is added, and the record holds
no time stamps or absolute paths: rebuilding an unchanged set leaves the directory's content, and
therefore the downstream calibration cache keys, unchanged.

Writing is atomic (`guarded_directory`): a failure leaves no output and keeps an earlier set; an
existing set at `out_dir` is always replaced (a pipeline step rebuilds its own output), but only by
renaming the complete new directory into place.

Nothing is written next to the source: rows are gathered in memory (`n` rows), never through
`datasets` cache files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from featcal_core.data.calibration_data import SOURCE_ROW, TARGET
from featcal_core.data.calibration_hygiene import check_held_out, drawn_digests, same_data
from featcal_core.data.source import DataSource, as_data_source
from featcal_core.data.source_rows import (
    CANONICAL_COLUMNS,
    dataset_commit,
    input_column,
    open_rows,
)
from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import guarded_directory
from featcal_core.provenance.records import SET_RECORD

if TYPE_CHECKING:
    import datasets

__all__ = [
    "RECORD_NAME",
    "draw_calibration_set",
    "sample_rows",
]

log = logging.getLogger(__name__)

RECORD_NAME = SET_RECORD
LABEL = "label"


# ------------------------------------------------------------------------------------ sampling


def sample_rows(total: int, n: int, seed: int, exclude: Sequence[int] = ()) -> list[int]:
    """`n` distinct row ids of `total`, sorted (numpy default_rng(seed)); all rows when n >= total.
    Rows in `exclude` are never drawn (a held-out set beside a calibration set): the draw is then
    from the remaining rows, in order.

    The same draw as featcal_core.data.calibration_data.load_calibration_set.
    """
    if exclude:
        excluded = set(exclude)
        rest = [i for i in range(total) if i not in excluded]
        return [rest[i] for i in sample_rows(len(rest), n, seed)]
    if n >= total:
        return list(range(total))
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(total, size=n, replace=False))


def _resolve_columns(
    data: datasets.Dataset,
    source: DataSource,
    key: str,
    modality: str,
    input_override: str | None,
    label_override: str | None,
) -> tuple[str, str | None]:
    """(input column, label column or None), checked against the data's columns and features."""
    field = f"{modality}_column"
    configured = input_override or getattr(source, field) or CANONICAL_COLUMNS[modality]
    configured = input_column(data, source, key, modality, configured)
    available = data.column_names
    label_named = label_override or source.label_column
    label: str | None = label_named or LABEL
    if label not in available:
        if label_named is not None:
            raise FeatCalError(
                f"{key}.label_column: no column {label!r} in {source.describe()} "
                f"(available: {available}); fix {key}.label_column or remove it"
            )
        label = None  # no labels: fine, calibration does not use them
    if label == configured:
        label = None
    return configured, label


# --------------------------------------------------------------------------------------- drawing


def draw_calibration_set(
    task: str,
    calibration_source: DataSource | Mapping[str, Any],
    evaluation_source: DataSource | Mapping[str, Any] | None,
    out_dir: str | Path,
    n: int,
    seed: int,
    modality: str,
    *,
    image_column: str | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    trust_remote_code: bool = False,
    exclude: Sequence[int] = (),
    count_key: str = "featcal.num_per_task",
) -> dict[str, Any]:
    """Sample `n` rows of the task's calibration source and save them at `out_dir`.

    `exclude`: row ids never drawn (a held-out set: the calibration set's `row_ids`); none left
    is an error. Fewer rows than `n` (the source, less `exclude`, is smaller) is not: the set
    holds every row there is, the record says so (`n_requested`, `n_rows`) and a WARNING names
    the task, `count_key` (the setting that asked for `n`: featcal.num_per_task, or
    select.holdout_per_task for a held-out set) and both counts.
    Column overrides take precedence over the source's `image_column` / `text_column` /
    `label_column`. Returns the record written to `out_dir/calibration_set.json`, plus `path`.
    Refuses (FeatCalError, nothing written): calibration data that is the evaluation data (by
    source identity, or any drawn row whose content is also an evaluation row), n < 1, a missing
    directory, split or column, an empty source, a null or undecodable input in the drawn rows or
    the evaluation rows, and an `out_dir` that overlaps the source directory.
    """
    import datasets

    from featcal_core.io.checkpoint import sha256_tree  # (imports torch; only needed here)

    if modality not in CANONICAL_COLUMNS:
        raise ValueError(f"modality must be one of {sorted(CANONICAL_COLUMNS)}, got {modality!r}")
    key = f"tasks.{task}.calibration"
    source = as_data_source(calibration_source)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise FeatCalError(
            f"featcal.num_per_task: the calibration set of task {task!r} needs at least 1 row "
            f"(got {n!r}); set featcal.num_per_task >= 1"
        )
    evaluation = None if evaluation_source is None else as_data_source(evaluation_source)
    if evaluation is not None:
        if same_data(source, evaluation):
            raise FeatCalError(
                f"{key}: calibration and evaluation use the same data ({source.describe()}; "
                f"tasks.{task}.evaluation is {evaluation.describe()}); calibration must come from "
                "train data (e.g. split: train) so evaluation stays held out"
            )
    out_dir = Path(out_dir)
    if source.kind == "local":
        assert source.path is not None  # a local source (as_data_source checks it)
        _check_no_overlap(Path(os.path.expanduser(source.path)), out_dir, key)

    data, split = open_rows(source, key, trust_remote_code)
    input_override = image_column if modality == "image" else text_column
    column, label = _resolve_columns(data, source, key, modality, input_override, label_column)
    total = len(data)
    ids = sample_rows(total, n, seed, exclude)
    if not ids:
        raise FeatCalError(
            f"{key}: all {total} rows of {source.describe()} are in the calibration set, so none "
            "is left to hold out; lower featcal.num_per_task or use a larger calibration source"
        )
    if len(ids) < n:
        left = (
            f"only {len(ids)} of its {total} rows are left besides the calibration set"
            if exclude
            else f"it has only {total} rows"
        )
        log.warning(
            "task %r: %s is %d but %s (%s), so the set holds %d rows, not %d",
            task,
            count_key,
            n,
            left,
            source.describe(),
            len(ids),
            n,
        )

    kept = [column] + ([label] if label else [])
    names = [CANONICAL_COLUMNS[modality]] + ([LABEL] if label else [])
    target = modality == "text" and TARGET in data.column_names and TARGET not in kept
    # encoder-decoder decoders are teacher-forced on it (featcal_core.data.calibration_data)
    if target:
        kept.append(TARGET)
        names.append(TARGET)
    rows = data.select_columns(kept).with_format("arrow")
    # gather in memory: `select` on a memory-mapped dataset may write cache files beside the source
    table = rows[:] if len(ids) == total else rows[ids]
    table = table.select(kept)
    digests = drawn_digests(table, column, TARGET if target else None, ids, source, key, modality)
    table = table.rename_columns(names)
    check = None
    if evaluation is not None:
        check = check_held_out(
            task, source, evaluation, digests, ids, modality, column, trust_remote_code
        )
    table = table.append_column(SOURCE_ROW, _int64_array(ids))
    features = datasets.Features(
        {new: data.features[old] for old, new in zip(kept, names, strict=True)}
        | {SOURCE_ROW: datasets.Value("int64")}
    )
    description: dict[str, Any] = {
        "task": task,
        "source": source.describe(),
        "source_identity": list(source.identity()),
        "source_commit": dataset_commit(source),  # Hub only; None where unknown
        "split": split,
        "modality": modality,
        "columns": {"input": column, "label": label} | ({"target": TARGET} if target else {}),
        "seed": seed,
        "n_requested": n,
        "rows_available": total,
        "n_rows": len(ids),
        "row_ids": ids,
    } | ({"excluded_rows": len(set(exclude))} if exclude else {})
    fingerprint = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]
    sample = datasets.Dataset(
        datasets.table.InMemoryTable(table),
        info=datasets.DatasetInfo(features=features),
        fingerprint=fingerprint,
    )

    with guarded_directory(out_dir, overwrite=True, flag=key) as tmp:
        sample.save_to_disk(str(tmp))
        record = dict(description, evaluation_check=check, digest=sha256_tree(tmp))
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log.info(
        "calibration set %s: %d of %d rows of %s (seed %d, column %r) -> %s (sha256 %s)",
        task,
        len(ids),
        total,
        source.describe(),
        seed,
        column,
        out_dir,
        record["digest"][:12],
    )
    return dict(record, path=str(out_dir))


def _int64_array(ids: list[int]):
    import pyarrow as pa

    return pa.array(ids, type=pa.int64())


def _check_no_overlap(source_dir: Path, out_dir: Path, key: str) -> None:
    src = Path(os.path.realpath(source_dir))
    out = Path(os.path.realpath(out_dir))
    if src == out or src in out.parents or out in src.parents:
        raise FeatCalError(
            f"{key}.path: the calibration set would be written at {out_dir}, which overlaps the "
            f"source {source_dir}; write calibration sets to another directory"
        )
