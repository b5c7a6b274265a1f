"""Calibration hygiene: calibration rows are never evaluation rows, by source or by content.

Besides refusing a calibration source that names the evaluation source (`same_data`), drawing a
calibration set (featcal_core.data.calibration_sets) hashes every drawn row's input
(`drawn_digests`) and every row of the task's evaluation source
(`featcal_core.data.calibration_data.input_digest`: decoded RGB pixels + size, or the exact string;
the evaluation rows are streamed EVALUATION_BATCH at a time, only their digests are kept) and
refuses any calibration row that is also an evaluation row, however the data was copied or renamed
(`check_held_out`). `check_held_out` returns the record's `evaluation_check`: the evaluation
source, column, `rows_checked`, `rows_digest` (sha256 of the evaluation row digests in row order),
`calibration_rows_digest` (the same over the drawn rows) and `overlap` (0). Null or undecodable
inputs (and null `target` texts) in the drawn rows or the evaluation rows are refused with one line
naming the source, the row and the column.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from typing import Any

from tqdm import tqdm

from featcal_core.data.calibration_data import CONTENT_DIGEST, checked_input, input_digest
from featcal_core.data.source import DataSource
from featcal_core.data.source_rows import CANONICAL_COLUMNS, input_column, open_rows
from featcal_core.errors import FeatCalError

__all__ = ["EVALUATION_BATCH", "check_held_out", "drawn_digests", "same_data"]

log = logging.getLogger(__name__)

#: rows per batch when streaming the evaluation source for the content check
EVALUATION_BATCH = 256


def _local_identity(source: DataSource) -> tuple[str, str | None]:
    """(resolved directory, split); the split is None for a plain Dataset directory."""
    assert source.path is not None  # a local source (as_data_source checks it)
    path = os.path.realpath(os.path.expanduser(source.path))
    if not os.path.isfile(os.path.join(path, "dataset_dict.json")):
        return path, None  # one Dataset: every split name means the same rows
    return path, source.split


def same_data(first: DataSource, second: DataSource) -> bool:
    """True when both sources name the same rows: the same Hub id, config and split, or the same
    resolved directory and split (any split of a plain Dataset directory is the same rows)."""
    if first.kind != second.kind:
        return False
    if first.kind == "hub":
        assert first.hub is not None and second.hub is not None  # what kind "hub" means
        return (first.hub.lower(), first.config, first.split) == (
            second.hub.lower(),
            second.config,
            second.split,
        )
    return _local_identity(first) == _local_identity(second)


def drawn_digests(
    table: Any,
    column: str,
    target: str | None,
    ids: list[int],
    source: DataSource,
    key: str,
    modality: str,
) -> list[bytes]:
    """Content digests (32 bytes each, in `ids` order) of the drawn rows' inputs (`table`: the
    drawn rows, pyarrow, source column names), after checking every input and `target` text is
    present and decodable."""
    where = f"{key}: {source.describe()}"
    fix = "drop or repair that row in the source (e.g. Dataset.filter) and draw again"
    digests = []
    for row, cell in zip(ids, table.column(column).to_pylist(), strict=True):
        value = checked_input(
            cell, modality, where=where, row=f"source row {row}", column=column, fix=fix
        )
        digests.append(input_digest(value, modality))
    if target is not None:
        for row, cell in zip(ids, table.column(target).to_pylist(), strict=True):
            checked_input(
                cell, "text", where=where, row=f"source row {row}", column=target, fix=fix
            )
    return digests


def check_held_out(
    task: str,
    source: DataSource,
    evaluation: DataSource,
    digests: list[bytes],
    ids: list[int],
    modality: str,
    calibration_column: str,
    trust_remote_code: bool,
) -> dict[str, Any]:
    """Refuse drawn rows whose content is also a row of the task's evaluation source; returns the
    record's `evaluation_check`. The evaluation rows are streamed (EVALUATION_BATCH rows at a
    time); only a map of each distinct row digest (32 bytes) to its first row number is kept."""
    key = f"tasks.{task}.evaluation"
    data, split = open_rows(evaluation, key, trust_remote_code)
    field = f"{modality}_column"
    column = getattr(evaluation, field)
    if column is None:  # as evaluation reads it; else the calibration source's column name
        column = CANONICAL_COLUMNS[modality]
        if column not in data.column_names and calibration_column in data.column_names:
            column = calibration_column
    column = input_column(data, evaluation, key, modality, column)
    where = f"{key}: {evaluation.describe()}"
    fix = f"drop or repair that row of the evaluation data (e.g. Dataset.filter) or fix {key}"
    first_row: dict[bytes, int] = {}  # evaluation row digest -> its first row number
    rows_digest = hashlib.sha256()
    row = 0
    batches = data.select_columns([column]).with_format("arrow").iter(EVALUATION_BATCH)
    bar = tqdm(
        total=len(data),
        desc=f"{task}: hash the evaluation rows",
        unit="row",
        disable=not sys.stderr.isatty(),
        leave=False,
    )
    for batch in batches:
        bar.update(batch.num_rows)
        for cell in batch.column(column).to_pylist():
            value = checked_input(
                cell, modality, where=where, row=f"row {row}", column=column, fix=fix
            )
            digest = input_digest(value, modality)
            rows_digest.update(digest)
            first_row.setdefault(digest, row)
            row += 1
    bar.close()
    shared = [(i, first_row[d]) for i, d in zip(ids, digests, strict=True) if d in first_row]
    if shared:
        examples = ", ".join(f"source row {i} = evaluation row {j}" for i, j in shared[:3])
        raise FeatCalError(
            f"tasks.{task}.calibration: {len(shared)} of the {len(ids)} calibration rows drawn "
            f"from {source.describe()} are also rows of the evaluation data ({key}: "
            f"{evaluation.describe()}; same {modality} content, e.g. {examples}); draw "
            "calibration data from train data (e.g. split: train) so evaluation stays held out"
        )
    log.info(
        "calibration set %s: none of its %d rows is among the %d evaluation rows of %s",
        task,
        len(ids),
        row,
        evaluation.describe(),
    )
    return {
        "source": evaluation.describe(),
        "source_identity": list(evaluation.identity()),
        "split": split,
        "column": column,
        "method": CONTENT_DIGEST[modality],
        "rows_checked": row,
        "rows_digest": rows_digest.hexdigest(),
        "calibration_rows_digest": hashlib.sha256(b"".join(digests)).hexdigest(),
        "overlap": 0,
    }
