"""Lineage for audits: what produced a checkpoint, checked against the files on disk, and a model
card that says it.

    result = trace("data/results/calibrated")   # a checkpoint, a results dir or a report dir
    print(format_trace(result))                 # `featcal lineage PATH`
    check(result)                               # FeatCalError when a recorded input changed
    write_model_card("data/results/calibrated", **model_card_fields(result))

`trace` follows the records the pipeline writes below its results directory:

    calibrated/featcal.json   → merged (its sha256), base, experts (sha256 of each weight file),
                                calibration sets (sha256_tree of each directory)
    merged/merge.json         → base, experts (sha256 of each weight file)
    models.lock.json          → base and experts: reference, revision, commit, sha256 of each file
                                (open_clip imports: also their source file and config)
    calibration_sets/<task>/calibration_set.json → source, seed, row ids, digest of the data files

plus the evaluation table (evaluation.json) and the provenance fields of a `provenance.json`
beside the traced path or in the results directory (git commit, MLflow run id, Prefect flow-run
id, DVC stage). Every recorded input is verified: each weight file must still have its recorded
sha256, each calibration set its recorded digest, the lock its lock_digest, and records that
name the same input must agree. Mismatches are collected as problems (one per file); `check`
turns the first into a one-line FeatCalError.

A report directory (featcal_core.report: reports/<run name>/, beside the results) is traced
through the results directory whose models.lock.json has the lock digest its report.md names (or
the results_dir of a provenance.json there; or the results directory it sits in).

A recorded absolute path that no longer exists (a moved results directory) is looked up at its
place in the results layout (merged/, calibration_sets/<task>/); relative local paths of the lock
are taken from the working directory, then from the folders above the results directory.

Pure library: no Prefect, MLflow or DVC imports; nothing is written by `trace`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import sha256_file
from featcal_core.io.outputs import MARKER, read_marker, verify_output
from featcal_core.provenance.records import (
    EVALUATION,
    FEATCAL_RECORD,
    LOCK,
    MERGE_RECORD,
    PROVENANCE,
    SET_RECORD,
)
from featcal_core.provenance.text import DASH, as_dict, metric_text, value_text

__all__ = [
    "PROVENANCE_FIELDS",
    "PROVENANCE_NAME",
    "check",
    "format_trace",
    "trace",
]

log = logging.getLogger(__name__)

#: the records' names (featcal_core.provenance.records)
LOCK_NAME = LOCK
EVALUATION_NAME = EVALUATION
#: optional run identifiers, beside the traced path or in the results directory
PROVENANCE_NAME = PROVENANCE
#: a report directory's markdown (featcal_core.report), and the lock digest line it holds
REPORT_NAME = "report.md"
_REPORT_LOCK = re.compile(r"lock digest: ([0-9a-f]{64})\b")

#: provenance fields and the keys they may be written under in provenance.json
PROVENANCE_FIELDS: dict[str, tuple[str, ...]] = {
    "git_commit": ("git_commit", "git.commit", "mlflow.source.git.commit"),
    "git_dirty": ("git_dirty", "git.dirty"),
    "mlflow_run_id": ("mlflow_run_id", "mlflow.run_id"),
    "prefect_flow_run_id": ("prefect_flow_run_id", "prefect.flow_run_id"),
    "dvc_stage": ("dvc_stage", "dvc.stage"),
}
#: provenance.json keys of a report directory that point at what it reports on
_POINTERS = ("checkpoint", "results_dir")

_KIND_LABELS = {
    "calibrated": "calibrated checkpoint",
    "merged": "merged checkpoint",
    "results": "results directory",
}
#: what the chain shows of a calibration set's own record
_SET_KEYS = (
    "task", "source", "split", "modality", "seed", "n_requested", "rows_available", "n_rows",
    "digest", "row_ids",
)  # fmt: skip
_RERUN = "restore the recorded input or rerun the pipeline (featcal run) so the records match"


# ------------------------------------------------------------------------------------ helpers


def _tree_digests(directory: Path, exclude: str) -> tuple[str, str]:
    """(featcal_core.io.checkpoint.sha256_tree of `directory`, the same without the top-level file
    `exclude` and the guarded writer's marker: what calibration_set.json's digest covers); every
    file is read once."""
    full, without = hashlib.sha256(), hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = str(path.relative_to(directory)).encode()
        content = bytes.fromhex(sha256_file(path))
        full.update(relative)
        full.update(content)
        if relative not in (exclude.encode(), MARKER.encode()):
            without.update(relative)
            without.update(content)
    return full.hexdigest(), without.hexdigest()


def _short(digest: Any) -> str:
    return f"{digest[:12]}…" if isinstance(digest, str) and digest else str(digest)


def _changed_after(directory: Path, reference: Path) -> list[str]:
    """Files below `directory` modified after `reference` was written (a hint, by mtime);
    empty when none or all are (a copy resets every time stamp)."""
    try:
        written = reference.stat().st_mtime_ns
        files = [p for p in directory.rglob("*") if p.is_file() and p != reference]
        newer = [p for p in files if p.stat().st_mtime_ns > written]
    except OSError:
        return []
    if not newer or len(newer) == len(files):
        return []
    return sorted(str(p.relative_to(directory)) for p in newer)


def _sha_map(entry: Any) -> dict[str, str]:
    """{file name: sha256} of a record's input entry (`sha256`, or the lock's `files`)."""
    data = as_dict(entry)
    files = data.get("sha256", data.get("files"))
    return {str(k): str(v) for k, v in as_dict(files).items()}


def _first_existing(candidates: list[Path]) -> Path | None:
    for candidate in candidates:
        if candidate.exists():
            return candidate
    return None


def _is_results_root(directory: Path) -> bool:
    return (
        (directory / LOCK_NAME).is_file()
        or (directory / "calibrated" / FEATCAL_RECORD).is_file()
        or (directory / "merged" / MERGE_RECORD).is_file()
    )


class _Tracer:
    """Collects the chain's problems (one per file) and hashes each file once."""

    def __init__(self) -> None:
        self.problems: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._index: dict[tuple[str, str], dict[str, Any]] = {}
        self._digests: dict[Path, str | None] = {}
        self.sets_checked = 0

    def problem(
        self, file: Path | str, kind: str, message: str, record: Path | str | None = None
    ) -> dict[str, Any]:
        """Add a problem, or name `record` in the existing one for the same file and kind."""
        key = (str(file), kind)
        if key in self._index:
            entry = self._index[key]
            if record is not None and str(record) not in entry["recorded_in"]:
                entry["recorded_in"].append(str(record))
            return entry
        entry = {
            "file": str(file),
            "kind": kind,
            "message": message,
            "recorded_in": [str(record)] if record is not None else [],
        }
        self._index[key] = entry
        self.problems.append(entry)
        return entry

    def digest(self, path: Path) -> str | None:
        key = path.absolute()
        if key not in self._digests:
            log.debug("hashing %s", path)
            self._digests[key] = sha256_file(path) if path.is_file() else None
        return self._digests[key]

    @property
    def files_checked(self) -> int:
        return len(self._digests)

    def read_json(self, path: Path, what: str) -> dict | None:
        """A record's content; a problem (not an exception) when it is unreadable."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            message = " ".join(str(exc).split())
            self.problem(
                path, "record", f"{path} ({what}) is not readable JSON ({message}); {_RERUN}"
            )
            return None
        if not isinstance(data, dict):
            self.problem(path, "record", f"{path} ({what}) is not a JSON object; {_RERUN}")
            return None
        return data

    def verify_files(self, directory: Path, files: Mapping[str, str], record: Path, key: str):
        """{name: {"sha256", "status"}} for recorded files below `directory`."""
        out: dict[str, dict[str, str]] = {}
        for name, expected in sorted(files.items()):
            path = directory / name
            actual = self.digest(path)
            if actual is None:
                status = "missing"
                self.problem(
                    path,
                    "missing",
                    f"{path} is missing; {record} ({key}) recorded it with sha256 "
                    f"{_short(expected)}; {_RERUN}",
                    record,
                )
            elif actual != expected:
                status = "changed"
                self.problem(
                    path,
                    "changed",
                    f"{path} has sha256 {_short(actual)}, {record} ({key}) recorded "
                    f"{_short(expected)}; {_RERUN}",
                    record,
                )
            else:
                status = "ok"
            out[name] = {"sha256": expected, "status": status}
        return out


# -------------------------------------------------------------------------------------- trace


def trace(path: str | Path) -> dict[str, Any]:
    """The chain of records that produced `path`, with every recorded input verified.

    `path`: a checkpoint directory (with featcal.json or merge.json), a results directory
    (models.lock.json, merged/, calibrated/), a report directory (inside one, pointed at by its
    provenance.json's results_dir, or found by the lock digest its report.md names), or one of
    those records. Returns {"path", "kind", "checkpoint", "chain", "problems", "notes", "verified"}:
    `chain` holds calibrated, merged, base, experts, lock, calibration_sets, evaluation and
    provenance (JSON-able); each problem is {"file", "kind", "message", "recorded_in"}, kind one
    of missing, changed, digest, inconsistent, lock, record. Raises FeatCalError only when `path`
    is none of these.
    """
    start = Path(path).expanduser()
    if start.is_file() and start.name in (
        FEATCAL_RECORD,
        MERGE_RECORD,
        LOCK_NAME,
        EVALUATION_NAME,
        PROVENANCE_NAME,
    ):
        start = start.parent
    if not start.is_dir():
        raise FeatCalError(
            f"{start} is not a directory; pass a checkpoint directory (with featcal.json or "
            "merge.json), a results directory or a report directory"
        )
    start = start.resolve()
    tracer = _Tracer()
    target, kind = _classify(start, tracer)
    checkpoint = target if kind in ("calibrated", "merged") else None

    featcal_path = merge_path = None
    if kind == "calibrated":
        featcal_path = target / FEATCAL_RECORD
    elif kind == "merged":
        merge_path = target / MERGE_RECORD
    featcal = tracer.read_json(featcal_path, "FeatCal record") if featcal_path else None
    root = _results_root(target, kind, featcal)
    if kind == "results":
        if (root / "calibrated" / FEATCAL_RECORD).is_file():
            featcal_path = root / "calibrated" / FEATCAL_RECORD
            featcal = tracer.read_json(featcal_path, "FeatCal record")
        elif (root / "merged" / MERGE_RECORD).is_file():
            merge_path = root / "merged" / MERGE_RECORD

    chain: dict[str, Any] = {
        "results_dir": str(root) if root is not None else None,
        "calibrated": None,
        "merged": None,
        "base": None,
        "experts": {},
        "lock": None,
        "calibration_sets": {},
        "evaluation": None,
        "provenance": {},
        "provenance_files": [],
    }
    sources: dict[str, list[tuple[Path, str, Path, dict[str, str]]]] = {}  # role → sources
    details: dict[str, dict[str, Any]] = {}  # role → reference, commit... (from the lock)
    tasks_by_record: list[tuple[Path, str, set[str]]] = []

    # calibrated → featcal.json
    merged_dir = None
    if featcal is not None:
        inputs = as_dict(featcal.get("inputs"))
        blocks = featcal.get("blocks") if isinstance(featcal.get("blocks"), list) else []
        chain["calibrated"] = {
            "path": str(featcal_path.parent),
            "record": str(featcal_path),
            "architecture": featcal.get("architecture"),
            "hyperparameters": as_dict(featcal.get("hyperparameters")),
            "blocks": len(blocks),
            "restored": sum(bool(as_dict(b).get("restored")) for b in blocks),
            "wall_seconds": featcal.get("wall_seconds"),
            "inputs_digest": featcal.get("inputs_digest"),
        }
        _add_source(sources, "base", featcal_path, "inputs.base", inputs.get("base"), root)
        experts = as_dict(inputs.get("experts"))
        for task, entry in experts.items():
            _add_source(
                sources, f"experts.{task}", featcal_path, f"inputs.experts.{task}", entry, root
            )
        tasks_by_record.append((featcal_path, "calibrated against", set(experts)))
        merged_entry = as_dict(inputs.get("merged"))
        merged_dir = (
            _locate(merged_entry.get("path"), root, "merged", MERGE_RECORD, tracer)
            if merged_entry
            else None
        )
        if merged_dir is not None:
            chain["merged"] = {
                "path": str(merged_dir),
                "record": None,
                "files": tracer.verify_files(
                    merged_dir, _sha_map(merged_entry), featcal_path, "inputs.merged"
                ),
            }
            if (merged_dir / MERGE_RECORD).is_file():
                merge_path = merged_dir / MERGE_RECORD
            else:
                tracer.notes.append(
                    f"{merged_dir} has no {MERGE_RECORD}: how it was merged is not recorded"
                )
        elif merged_entry:
            tracer.problem(
                merged_entry.get("path", "merged"),
                "missing",
                f"the merged model {merged_entry.get('path')} that {featcal_path} was calibrated "
                f"from is missing; {_RERUN}",
                featcal_path,
            )

    # merged → merge.json
    if merge_path is not None:
        merge = tracer.read_json(merge_path, "merge record")
        if merge is not None:
            entry = chain["merged"] or {"path": str(merge_path.parent), "files": {}}
            entry.update(
                record=str(merge_path),
                method=merge.get("method"),
                hyperparameters=as_dict(merge.get("hyperparameters")),
                tensors=merge.get("tensors"),
            )
            chain["merged"] = entry
            inputs = as_dict(merge.get("inputs"))
            _add_source(sources, "base", merge_path, "inputs.base", inputs.get("base"), root)
            experts = as_dict(inputs.get("experts"))
            for task, item in experts.items():
                _add_source(
                    sources, f"experts.{task}", merge_path, f"inputs.experts.{task}", item, root
                )
            tasks_by_record.append((merge_path, "merged", set(experts)))

    # the lock of the results directory
    lock_path = root / LOCK_NAME if root is not None else None
    if lock_path is not None and lock_path.is_file():
        lock = tracer.read_json(lock_path, "models lock")
        if lock is not None:
            chain["lock"] = _check_lock(lock, lock_path, tracer)
            for role, entry in [("base", lock.get("base"))] + [
                (f"experts.{task}", item) for task, item in as_dict(lock.get("experts")).items()
            ]:
                _add_source(sources, role, lock_path, role, entry, root)
                details[role] = {
                    key: as_dict(entry).get(key)
                    for key in ("reference", "kind", "repo_id", "revision", "commit")
                }
                source = as_dict(as_dict(entry).get("open_clip_source"))
                if source:  # the open_clip checkpoint the locked import was made from
                    details[role]["open_clip_source"] = _verify_open_clip_source(
                        role, source, lock_path, root, tracer
                    )
            tasks_by_record.append((lock_path, "locked", set(as_dict(lock.get("experts")).keys())))
    elif root is not None:
        tracer.notes.append(f"no {LOCK_NAME} in {root}: model references and commits unknown")

    # base and experts, verified at every recorded place
    for role, role_sources in sources.items():
        entry = _verify_model(role, role_sources, details.get(role, {}), tracer)
        if role == "base":
            chain["base"] = entry
        else:
            chain["experts"][role.split(".", 1)[1]] = entry
    _check_tasks(tasks_by_record, tracer)

    # calibration sets
    if featcal is not None:
        calibration = as_dict(as_dict(featcal.get("inputs")).get("calibration"))
        for task, entry in calibration.items():
            entry = as_dict(entry)
            directory = _locate(
                entry.get("path"), root, f"calibration_sets/{task}", SET_RECORD, tracer
            )
            chain["calibration_sets"][task] = _verify_set(
                task, directory, entry, featcal_path, tracer
            )
    elif kind == "results" and root is not None and (root / "calibration_sets").is_dir():
        for record in sorted((root / "calibration_sets").glob(f"*/{SET_RECORD}")):
            task = record.parent.name
            chain["calibration_sets"][task] = _verify_set(task, record.parent, {}, None, tracer)

    # every featcal-written folder in the chain still holds what it held when written
    for entry in (chain["calibrated"], chain["merged"]):  # (sets: their digests, above)
        directory = Path(entry["path"]) if isinstance(entry, dict) and entry.get("path") else None
        if directory is None or not directory.is_dir() or read_marker(directory) is None:
            continue
        wrong = verify_output(directory)
        if wrong is not None:
            tracer.problem(directory, "changed", f"{wrong}; {_RERUN}", directory / MARKER)

    # evaluation and provenance
    if root is not None and (root / EVALUATION_NAME).is_file():
        chain["evaluation"] = tracer.read_json(root / EVALUATION_NAME, "evaluation table")
    places = [start, target]
    if featcal_path is not None:
        places.append(featcal_path.parent)
    if root is not None:
        places.append(root)
    chain["provenance"], chain["provenance_files"] = _provenance(places, tracer)

    return {
        "path": str(start),
        "kind": kind,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "chain": chain,
        "problems": tracer.problems,
        "notes": tracer.notes,
        "verified": {
            "files": tracer.files_checked,
            "calibration_sets": tracer.sets_checked,
        },
    }


def _classify(start: Path, tracer: _Tracer) -> tuple[Path, str]:
    """(directory to trace, kind): a checkpoint, a results dir, or what a report dir points at."""
    if (start / FEATCAL_RECORD).is_file():
        return start, "calibrated"
    if (start / MERGE_RECORD).is_file():
        return start, "merged"
    if _is_results_root(start):
        return start, "results"
    # a report directory: provenance.json may point at what it reports on, else a folder above
    pointer = start / PROVENANCE_NAME
    if pointer.is_file():
        data = tracer.read_json(pointer, "provenance") or {}
        for key in _POINTERS:
            value = data.get(key)
            if isinstance(value, str) and value:
                target = (start / Path(value).expanduser()).resolve()
                if (target / FEATCAL_RECORD).is_file():
                    return target, "calibrated"
                if (target / MERGE_RECORD).is_file():
                    return target, "merged"
                if _is_results_root(target):
                    return target, "results"
    for parent in list(start.parents)[:3]:
        if _is_results_root(parent):
            return parent, "results"
    if (start / REPORT_NAME).is_file():
        found = _results_of_report(start / REPORT_NAME, tracer)
        if found is not None:
            return found, "results"
    raise FeatCalError(
        f"{start} holds no {FEATCAL_RECORD}, {MERGE_RECORD} or {LOCK_NAME} and is not inside a "
        "results directory; pass a checkpoint directory, a results directory or a report "
        "directory (or add a provenance.json with results_dir)"
    )


def _results_of_report(report: Path, tracer: _Tracer) -> Path | None:
    """The results directory whose models.lock.json has the lock digest report.md names, looked
    for up to two folders below the report's parent and the folder above that (the pipeline
    writes reports/<run name>/ and <results_dir>/ relative to the project root)."""
    try:
        match = _REPORT_LOCK.search(report.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    if match is None:
        return None
    digest = match.group(1)
    seen: set[Path] = set()
    for folder in list(report.parent.parents)[:2]:
        for pattern in (LOCK_NAME, f"*/{LOCK_NAME}", f"*/*/{LOCK_NAME}"):
            for lock in sorted(folder.glob(pattern)):
                if lock in seen:
                    continue
                seen.add(lock)
                try:
                    found = json.loads(lock.read_text(encoding="utf-8")).get("lock_digest")
                except (OSError, UnicodeDecodeError, ValueError, AttributeError):
                    continue
                if found == digest:
                    tracer.notes.append(
                        f"{report} names lock digest {_short(digest)}: results dir {lock.parent}"
                    )
                    return lock.parent.resolve()
    return None


def _results_root(target: Path, kind: str, featcal: dict | None) -> Path | None:
    """The results directory a traced directory belongs to (None: a checkpoint on its own)."""
    if kind == "results":
        return target
    candidates = [target.parent]
    recorded = (featcal or {}).get("results_dir")  # the flow's state dir: <root>/calibration
    if isinstance(recorded, str) and recorded:
        candidates += [Path(recorded).parent, Path(recorded)]
    for candidate in candidates:
        if _is_results_root(candidate):
            return candidate.resolve()
    return None


def _locate(
    recorded: Any, root: Path | None, subdir: str, marker: str, tracer: _Tracer
) -> Path | None:
    """A recorded directory, or its place in the results layout when it moved (None: neither)."""
    path = Path(recorded).expanduser() if isinstance(recorded, str) and recorded else None
    if path is not None and path.is_dir():
        return path
    if root is not None:
        fallback = root / subdir
        if fallback.is_dir() and (path is None or (fallback / marker).exists()):
            if path is not None:
                tracer.notes.append(f"{path} does not exist; using {fallback} of the results dir")
            return fallback
    return None


def _resolve_local(recorded: Any, root: Path | None) -> Path | None:
    """A lock path: absolute, else from the working directory, else from folders above root."""
    if not isinstance(recorded, str) or not recorded:
        return None
    path = Path(recorded).expanduser()
    if path.is_absolute():
        return path
    candidates = [Path.cwd() / path]
    if root is not None:
        candidates += [folder / path for folder in [root, *list(root.parents)[:3]]]
    return _first_existing(candidates) or candidates[0]


def _add_source(sources, role: str, record: Path, key: str, entry: Any, root: Path | None):
    data = as_dict(entry)
    if not data:
        return
    directory = _resolve_local(data.get("path"), root)
    if directory is None:
        return
    sources.setdefault(role, []).append((record, key, directory, _sha_map(data)))


def _verify_model(role: str, role_sources, detail: dict[str, Any], tracer: _Tracer) -> dict:
    """One base or expert entry of the chain: every record's files verified where it says."""
    first_dir = role_sources[0][2]
    files: dict[str, dict[str, str]] = {}
    recorded: dict[str, tuple[Path, str]] = {}  # name → (first record, its sha256)
    paths: list[str] = []
    for record, key, directory, sha in role_sources:
        statuses = tracer.verify_files(directory, sha, record, key)
        for name, status in statuses.items():
            files.setdefault(name, status)
        if str(directory.resolve()) not in paths:
            paths.append(str(directory.resolve()))
        for name, digest in sha.items():
            if name not in recorded:
                recorded[name] = (record, digest)
            elif recorded[name][1] != digest:
                other, expected = recorded[name]
                tracer.problem(
                    record,
                    "inconsistent",
                    f"{record} records sha256 {_short(digest)} for {role}'s {name}, {other} "
                    f"records {_short(expected)}: they describe different models; {_RERUN}",
                )
    entry = {
        "role": role,
        "path": str(first_dir),
        **{key: value for key, value in detail.items() if value is not None},
        "files": files,
        "recorded_in": list(dict.fromkeys(str(s[0]) for s in role_sources)),
    }
    if len(paths) > 1:
        entry["paths"] = paths
    return entry


def _verify_open_clip_source(
    role: str, source: dict, lock_path: Path, root: Path | None, tracer: _Tracer
) -> dict[str, Any]:
    """A lock's `open_clip_source` record with its weight file and config verified."""
    out = dict(source)
    key = f"{role}.open_clip_source"
    directory = _resolve_local(source.get("path"), root)
    if directory is not None and source.get("file") and source.get("sha256"):
        status = tracer.verify_files(directory, {source["file"]: source["sha256"]}, lock_path, key)
        out["status"] = status[source["file"]]["status"]
    config = _resolve_local(source.get("config"), root)
    if config is not None and source.get("config_sha256"):
        status = tracer.verify_files(
            config.parent, {config.name: source["config_sha256"]}, lock_path, f"{key}.config"
        )
        out["config_status"] = status[config.name]["status"]
    return out


def _check_tasks(tasks_by_record: list[tuple[Path, str, set[str]]], tracer: _Tracer) -> None:
    """The records of one chain name the same tasks."""
    if not tasks_by_record:
        return
    first, first_verb, first_tasks = tasks_by_record[0]
    for record, verb, tasks in tasks_by_record[1:]:
        if tasks != first_tasks:
            tracer.problem(
                record,
                "inconsistent",
                f"{record} {verb} experts {sorted(tasks)} but {first} {first_verb} "
                f"{sorted(first_tasks)}; the records come from different runs, rerun the "
                "pipeline (featcal run)",
            )


def _check_lock(lock: dict, lock_path: Path, tracer: _Tracer) -> dict[str, Any]:
    from featcal_core.provenance.resolve import (
        lock_digest,  # (imports huggingface_hub; only needed here)
    )

    recorded = lock.get("lock_digest")
    actual = lock_digest(lock)
    ok = recorded == actual
    if not ok:
        tracer.problem(
            lock_path,
            "lock",
            f"{lock_path}: lock_digest {_short(recorded)} does not match the content "
            f"({_short(actual)}; the lock was edited); rerun the pipeline (featcal run) to "
            "rewrite it",
        )
    return {
        "path": str(lock_path),
        "version": lock.get("version"),
        "architecture": lock.get("architecture"),
        "lock_digest": recorded,
        "lock_digest_ok": ok,
    }


def _verify_set(
    task: str,
    directory: Path | None,
    entry: dict[str, Any],
    featcal_path: Path | None,
    tracer: _Tracer,
) -> dict[str, Any]:
    """One calibration set: its own record's digest, and featcal.json's sha256_tree of it."""
    tracer.sets_checked += 1
    out: dict[str, Any] = {"path": str(directory) if directory else entry.get("path")}
    if featcal_path is not None:
        out["recorded_in"] = [str(featcal_path)]
    if directory is None or not directory.is_dir():
        where = f"{featcal_path} (inputs.calibration.{task})" if featcal_path else "the results"
        tracer.problem(
            out["path"],
            "missing",
            f"calibration set {task!r}: {out['path']} is missing; {where} recorded it; {_RERUN}",
            featcal_path,
        )
        out["status"] = "missing"
        return out
    status = "ok"
    reported: dict[str, Any] | None = None
    tree, data = _tree_digests(directory, exclude=SET_RECORD)
    record_path = directory / SET_RECORD
    record = tracer.read_json(record_path, "calibration set") if record_path.is_file() else None
    if record is not None:
        for key in _SET_KEYS:
            out[key] = record.get(key)
        out["recorded_in"] = [*out.get("recorded_in", []), str(record_path)]
        if data != record.get("digest"):
            status = "changed"
            reported = _set_problem(
                task, directory, record_path, data, record.get("digest"), tracer
            )
    if entry:
        out["rows"] = entry.get("rows")
        out["indices"] = entry.get("indices")
        out["tree_sha256"] = entry.get("sha256")
        if entry.get("sha256"):
            if tree != entry["sha256"] and reported is None:
                status = "changed"
                _set_problem(task, directory, featcal_path, tree, entry["sha256"], tracer)
            elif tree != entry["sha256"]:  # the same change, seen by featcal.json too
                reported["recorded_in"].append(str(featcal_path))
    out["status"] = status
    return out


def _set_problem(
    task: str, directory: Path, record: Path, actual: str, expected: Any, tracer: _Tracer
) -> dict[str, Any]:
    suspects = _changed_after(directory, record)
    hint = f" ({', '.join(suspects)} changed after the record was written)" if suspects else ""
    file = directory / suspects[0] if len(suspects) == 1 else directory
    return tracer.problem(
        file,
        "digest",
        f"calibration set {task!r}: {directory} has digest {_short(actual)}, {record} recorded "
        f"{_short(expected)}{hint}; {_RERUN}",
        record,
    )


def _provenance(places: list[Path], tracer: _Tracer) -> tuple[dict[str, Any], list[str]]:
    """Fields of the provenance.json files at `places`, the nearest first."""
    fields: dict[str, Any] = {}
    files: list[str] = []
    known = {alias for aliases in PROVENANCE_FIELDS.values() for alias in aliases}
    for place in dict.fromkeys(places):
        path = place / PROVENANCE_NAME
        if not path.is_file():
            continue
        data = tracer.read_json(path, "provenance")
        if data is None:
            continue
        files.append(str(path))
        for name, aliases in PROVENANCE_FIELDS.items():
            for alias in aliases:
                if alias in data and data[alias] is not None and name not in fields:
                    fields[name] = data[alias]
                    break
        for key, value in data.items():
            if key in known or key in fields or isinstance(value, (dict, list)):
                continue
            fields[key] = value
    return fields, files


# -------------------------------------------------------------------------------------- check


def check(path_or_trace: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """`trace(path)` (or an existing trace result); FeatCalError naming the first problem.

    The message is one line: the first mismatching file, what was recorded, that the pipeline
    should be rerun, and how many other problems there are.
    """
    if isinstance(path_or_trace, Mapping):
        result = dict(path_or_trace)
    else:
        result = trace(path_or_trace)
    problems = result.get("problems") or []
    if problems:
        first = problems[0]["message"]
        others = len(problems) - 1
        more = (
            f" ({others} other problem{'s' if others != 1 else ''}: featcal lineage "
            f"{result.get('path')} lists them)"
            if others
            else ""
        )
        raise FeatCalError(" ".join(f"{first}{more}".split()))
    return result


# --------------------------------------------------------------------------------- formatting


def _pairs(values: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={value_text(value)}" for key, value in values.items()) or DASH


def _row_ids(ids: Any, limit: int = 8) -> str:
    if not isinstance(ids, list):
        return DASH
    shown = ", ".join(str(i) for i in ids[:limit])
    return shown + (f", … ({len(ids)} in all)" if len(ids) > limit else "")


_STATUS = {"ok": "ok", "changed": "CHANGED", "missing": "MISSING"}


def format_trace(result: Mapping[str, Any]) -> str:
    """The trace as text, one fact a line (what `featcal lineage PATH` prints)."""
    chain = result.get("chain") or {}
    kind = result.get("kind")
    lines = [f"lineage of {result.get('path')} ({_KIND_LABELS.get(kind, kind)})"]
    if chain.get("results_dir"):
        lines.append(f"  results dir      {chain['results_dir']}")
    calibrated = chain.get("calibrated")
    if calibrated:
        lines.append(f"  calibrated       {calibrated['path']}")
        lines.append(f"    record         {calibrated['record']}")
        lines.append(
            f"    FeatCal        {calibrated.get('architecture') or DASH}, "
            f"{calibrated.get('blocks')} blocks ({calibrated.get('restored')} restored)"
        )
        lines.append(f"    settings       {_pairs(calibrated.get('hyperparameters') or {})}")
    merged = chain.get("merged")
    if merged:
        lines.append(f"  merged           {merged['path']}")
        if merged.get("record"):
            lines.append(f"    record         {merged['record']}")
            lines.append(
                f"    method         {merged.get('method') or DASH} "
                f"({_pairs(merged.get('hyperparameters') or {})})"
            )
        lines += _file_lines(merged.get("files") or {})
    models = [("base", chain.get("base"))] + [
        (f"expert {task}", entry) for task, entry in (chain.get("experts") or {}).items()
    ]
    for label, entry in models:
        if not entry:
            continue
        lines.append(f"  {label:<16} {entry.get('reference') or entry['path']}")
        facts = {key: entry.get(key) for key in ("kind", "revision", "commit") if entry.get(key)}
        if facts:
            lines.append(f"    {'':<14} {_pairs(facts)}")
        if entry.get("reference") and entry.get("reference") != entry["path"]:
            lines.append(f"    path           {entry['path']}")
        for other in entry.get("paths", [])[1:]:
            lines.append(f"    also recorded  {other}")
        lines += _file_lines(entry.get("files") or {})
        source = entry.get("open_clip_source")
        if source:
            lines.append(
                f"    imported from  {Path(source.get('path') or '') / (source.get('file') or '')}"
            )
            lines += _file_lines({"(open_clip source)": {"sha256": source.get("sha256"),
                                                         "status": source.get("status")}})  # fmt: skip
    lock = chain.get("lock")
    if lock:
        state = "ok" if lock.get("lock_digest_ok") else "EDITED"
        lines.append(f"  lock             {lock['path']}")
        lines.append(f"    lock_digest    {_short(lock.get('lock_digest'))} {state}")
    for task, entry in (chain.get("calibration_sets") or {}).items():
        lines.append(f"  calibration set  {task}: {entry.get('path')}")
        if "n_rows" in entry:
            lines.append(
                f"    rows           {entry.get('n_rows')} of {entry.get('rows_available')}, "
                f"seed {value_text(entry.get('seed'))}, split {value_text(entry.get('split'))}, from "
                f"{entry.get('source')}"
            )
            lines.append(f"    row ids        {_row_ids(entry.get('row_ids'))}")
        if entry.get("indices") is not None:
            lines.append(f"    calibrated on  {len(entry['indices'])} of {entry.get('rows')} rows")
        digest = entry.get("digest") or entry.get("tree_sha256")
        status = _STATUS.get(entry.get("status"), entry.get("status"))
        lines.append(f"    digest         {_short(digest)} {status}")
    evaluation = chain.get("evaluation")
    if isinstance(evaluation, Mapping) and evaluation:
        lines.append("  evaluation (accuracy)")
        for task, row in evaluation.items():
            if isinstance(row, Mapping):
                cells = ", ".join(
                    f"{model} {metric_text(as_dict(res).get('accuracy'))}"
                    for model, res in row.items()
                )
                lines.append(f"    {task:<14} {cells}")
    if chain.get("provenance"):
        lines.append(f"  provenance       {_pairs(chain['provenance'])}")
    for note in result.get("notes") or []:
        lines.append(f"  note: {note}")
    problems = result.get("problems") or []
    verified = result.get("verified") or {}
    if problems:
        lines.append(f"problems ({len(problems)}):")
        lines += [f"  - {p['message']}" for p in problems]
    else:
        lines.append(
            f"all recorded inputs verify ({verified.get('files', 0)} files, "
            f"{verified.get('calibration_sets', 0)} calibration sets)"
        )
    return "\n".join(lines)


def _file_lines(files: Mapping[str, Mapping[str, str]]) -> list[str]:
    return [
        f"    {_STATUS.get(info.get('status'), info.get('status')):<8} {name}  "
        f"sha256 {_short(info.get('sha256'))}"
        for name, info in files.items()
    ]
