"""Calibration sets: draw a seeded sample of a task's train data and save it for `featcal calibrate`.

    data = open_source(spec.calibration, key="tasks.mnist.calibration")
    record = draw_calibration_set(
        "mnist", spec.calibration, spec.evaluation, "data/results/calibration_sets/mnist",
        n=256, seed=0, modality="image",
    )

A source is a `featcal_core.data.source.DataSource` (or the run configuration's equivalent): a local `save_to_disk` directory (a Dataset, or a
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

Held out by content: besides refusing a calibration source that names the evaluation source
(`same_data`), drawing hashes every drawn row's input and every row of the task's evaluation
source (`featcal_core.data.calibration_data.input_digest`: decoded RGB pixels + size, or the exact
string; the evaluation rows are streamed, only their digests are kept) and refuses any calibration
row that is also an evaluation row, however the data was copied or renamed. `evaluation_check`
records what was checked: the evaluation source, column, `rows_checked`, `rows_digest` (sha256 of
the evaluation row digests in row order), `calibration_rows_digest` (the same over the drawn rows)
and `overlap` (0); it is null when no evaluation source is given. Null or undecodable inputs (and
null `target` texts) in the drawn rows or the evaluation rows are refused with one line naming the
source, the row and the column.

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
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from featcal_core.data.calibration_data import (
    CONTENT_DIGEST,
    SOURCE_ROW,
    TARGET,
    checked_input,
    input_digest,
)
from featcal_core.data.source import DataSource, as_data_source
from featcal_core.errors import FeatCalError
from featcal_core.provenance.records import SET_RECORD
from featcal_core.io.outputs import guarded_directory

if TYPE_CHECKING:
    import datasets

__all__ = [
    "CANONICAL_COLUMNS",
    "RECORD_NAME",
    "draw_calibration_set",
    "open_source",
    "same_data",
    "sample_rows",
]

log = logging.getLogger(__name__)

RECORD_NAME = SET_RECORD
#: modality -> the column name featcal_core.data.calibration_data expects
CANONICAL_COLUMNS = {"image": "image", "text": "text"}
LABEL = "label"
#: rows per batch when streaming the evaluation source for the content check
EVALUATION_BATCH = 256


# ------------------------------------------------------------------------------------- sources


def _as_source(source: Any) -> DataSource:
    return as_data_source(source)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def open_source(
    source: DataSource | Mapping[str, Any],
    *,
    key: str = "data source",
    trust_remote_code: bool = False,
) -> datasets.Dataset:
    """The rows of one source as a `datasets.Dataset` (memory-mapped for local directories).

    `key` is the params key the source comes from (e.g. "tasks.mnist.calibration"); every
    error is one FeatCalError line that names it and says what to fix. An empty split is refused.
    """
    return _open(_as_source(source), key, trust_remote_code)[0]


def _open(
    source: DataSource, key: str, trust_remote_code: bool
) -> tuple[datasets.Dataset, str | None]:
    """(rows, the split they are: the configured one, or the only split of a local DatasetDict)."""
    if source.kind == "hub":
        data, split = _open_hub(source, key, trust_remote_code), source.split
    else:
        data, split = _open_local(source, key)
    if len(data) == 0:
        raise FeatCalError(f"{key}: {source.describe()} has no rows; point it at a non-empty split")
    return data, split


def _open_hub(source: DataSource, key: str, trust_remote_code: bool) -> datasets.Dataset:
    import datasets

    try:
        data = datasets.load_dataset(
            source.hub, source.config, split=source.split, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise FeatCalError(
            f"{key}: cannot load Hub dataset {source.describe()} ({type(exc).__name__}: "
            f"{_one_line(exc)}); check {key}.hub, .config and .split, and the network or the "
            "Hugging Face cache (HF_DATASETS_OFFLINE)"
        ) from exc
    if not isinstance(data, datasets.Dataset):
        raise FeatCalError(
            f"{key}: Hub dataset {source.describe()} gave a {type(data).__name__}, not one split; "
            f"set {key}.split to a single split name"
        )
    return data


def _open_local(source: DataSource, key: str) -> tuple[datasets.Dataset, str | None]:
    import datasets

    path = Path(os.path.expanduser(source.path))
    split = source.split
    if not path.exists():
        raise FeatCalError(
            f"{key}.path: {path} does not exist; pass a datasets save_to_disk directory "
            "(or fetch it first, e.g. dvc pull)"
        )
    target = path
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():  # a DatasetDict: each split is a Dataset directory below it
        try:
            splits = [str(s) for s in json.loads(dict_file.read_text())["splits"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FeatCalError(
                f"{key}.path: {dict_file} is unreadable ({_one_line(exc)}); re-save the dataset"
            ) from exc
        if source.split is None:
            if len(splits) != 1:
                raise FeatCalError(
                    f"{key}.split: {path} is a DatasetDict with splits {splits}; "
                    f"set {key}.split to one of them"
                )
            split = splits[0]
        elif source.split in splits:
            split = source.split
        else:
            raise FeatCalError(
                f"{key}.split: {path} has no split {source.split!r} (available: {splits}); "
                f"set {key}.split to one of them"
            )
        target = path / split
    elif not (path / "state.json").is_file():
        raise FeatCalError(
            f"{key}.path: {path} is not a datasets save_to_disk directory (no state.json or "
            "dataset_dict.json); save the data with Dataset.save_to_disk"
        )
    state = _state(target)
    if state is not None and state.get("_data_files") == []:
        # save_to_disk of an empty split writes no data file; load_from_disk then fails
        raise FeatCalError(f"{key}: {source.describe()} has no rows; point it at a non-empty split")
    try:
        data = datasets.load_from_disk(str(target))
    except Exception as exc:
        raise FeatCalError(
            f"{key}.path: cannot load {target} ({type(exc).__name__}: {_one_line(exc)}); "
            "re-save it with Dataset.save_to_disk"
        ) from exc
    if not isinstance(data, datasets.Dataset):
        raise FeatCalError(
            f"{key}.path: {target} holds a {type(data).__name__}, not one split; "
            f"set {key}.split or point {key}.path at a Dataset directory"
        )
    if target == path and source.split is not None:
        saved = state.get("_split") if state else None
        if saved is not None and str(saved) != source.split:
            raise FeatCalError(
                f"{key}.split: {path} is a single Dataset saved as split {saved!r}, not "
                f"{source.split!r}; fix {key}.split or remove it"
            )
        split = source.split
    elif target == path:
        split = None if state is None or state.get("_split") is None else str(state["_split"])
    return data, split


def _state(directory: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((directory / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _local_identity(source: DataSource) -> tuple[str, str | None]:
    """(resolved directory, split); the split is None for a plain Dataset directory."""
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
        return (first.hub.lower(), first.config, first.split) == (
            second.hub.lower(),
            second.config,
            second.split,
        )
    return _local_identity(first) == _local_identity(second)


# ------------------------------------------------------------------------------------ sampling


def sample_rows(total: int, n: int, seed: int) -> list[int]:
    """`n` distinct row ids of `total`, sorted (numpy default_rng(seed)); all rows when n >= total.

    The same draw as featcal_core.data.calibration_data.load_calibration_set.
    """
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
    configured = _input_column(data, source, key, modality, configured)
    available = data.column_names
    label_named = label_override or source.label_column
    label = label_named or LABEL
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


def _input_column(
    data: datasets.Dataset, source: DataSource, key: str, modality: str, configured: str
) -> str:
    """`configured`, checked: a column of `data` holding images (datasets.Image) or strings."""
    import datasets

    available = data.column_names
    field = f"{modality}_column"
    if configured not in available:
        raise FeatCalError(
            f"{key}.{field}: no column {configured!r} in {source.describe()} "
            f"(available: {available}); set {key}.{field} to the column with the {modality}s"
        )
    feature = data.features[configured]
    if modality == "image":
        ok = isinstance(feature, datasets.Image)
    else:
        ok = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    if not ok:
        raise FeatCalError(
            f"{key}.{field}: column {configured!r} of {source.describe()} holds {feature}, not "
            f"{'images (datasets.Image)' if modality == 'image' else 'strings'}; "
            f"set {key}.{field} to the column with the {modality}s"
        )
    return configured


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
) -> dict[str, Any]:
    """Sample `n` rows of the task's calibration source and save them at `out_dir`.

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
    source = _as_source(calibration_source)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise FeatCalError(
            f"featcal.num_per_task: the calibration set of task {task!r} needs at least 1 row "
            f"(got {n!r}); set featcal.num_per_task >= 1"
        )
    evaluation = None if evaluation_source is None else _as_source(evaluation_source)
    if evaluation is not None:
        if same_data(source, evaluation):
            raise FeatCalError(
                f"{key}: calibration and evaluation use the same data ({source.describe()}; "
                f"tasks.{task}.evaluation is {evaluation.describe()}); calibration must come from "
                "train data (e.g. split: train) so evaluation stays held out"
            )
    out_dir = Path(out_dir)
    if source.kind == "local":
        _check_no_overlap(Path(os.path.expanduser(source.path)), out_dir, key)

    data, split = _open(source, key, trust_remote_code)
    input_override = image_column if modality == "image" else text_column
    column, label = _resolve_columns(data, source, key, modality, input_override, label_column)
    total = len(data)
    ids = sample_rows(total, n, seed)

    kept = [column] + ([label] if label else [])
    names = [CANONICAL_COLUMNS[modality]] + ([LABEL] if label else [])
    target = modality == "text" and TARGET in data.column_names and TARGET not in kept
    if target:  # encoder-decoder decoders are teacher-forced on it (featcal_core.data.calibration_data)
        kept.append(TARGET)
        names.append(TARGET)
    rows = data.select_columns(kept).with_format("arrow")
    # gather in memory: `select` on a memory-mapped dataset may write cache files beside the source
    table = rows[:] if len(ids) == total else rows[ids]
    table = table.select(kept)
    digests = _drawn_digests(table, column, TARGET if target else None, ids, source, key, modality)
    table = table.rename_columns(names)
    check = None
    if evaluation is not None:
        check = _check_held_out(
            task, source, evaluation, digests, ids, modality, column, trust_remote_code
        )
    table = table.append_column(SOURCE_ROW, _int64_array(ids))
    features = datasets.Features(
        {new: data.features[old] for old, new in zip(kept, names, strict=True)}
        | {SOURCE_ROW: datasets.Value("int64")}
    )
    description = {
        "task": task,
        "source": source.describe(),
        "source_identity": list(source.identity()),
        "split": split,
        "modality": modality,
        "columns": {"input": column, "label": label} | ({"target": TARGET} if target else {}),
        "seed": seed,
        "n_requested": n,
        "rows_available": total,
        "n_rows": len(ids),
        "row_ids": ids,
    }
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


def _drawn_digests(
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


def _check_held_out(
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
    data, split = _open(evaluation, key, trust_remote_code)
    field = f"{modality}_column"
    column = getattr(evaluation, field)
    if column is None:  # as evaluation reads it; else the calibration source's column name
        column = CANONICAL_COLUMNS[modality]
        if column not in data.column_names and calibration_column in data.column_names:
            column = calibration_column
    column = _input_column(data, evaluation, key, modality, column)
    where = f"{key}: {evaluation.describe()}"
    fix = f"drop or repair that row of the evaluation data (e.g. Dataset.filter) or fix {key}"
    first_row: dict[bytes, int] = {}  # evaluation row digest -> its first row number
    rows_digest = hashlib.sha256()
    row = 0
    batches = data.select_columns([column]).with_format("arrow").iter(EVALUATION_BATCH)
    for batch in batches:
        for cell in batch.column(column).to_pylist():
            value = checked_input(
                cell, modality, where=where, row=f"row {row}", column=column, fix=fix
            )
            digest = input_digest(value, modality)
            rows_digest.update(digest)
            first_row.setdefault(digest, row)
            row += 1
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
