"""Lineage checks: every input a record names, verified against the files on disk.

`_Tracer` hashes each file once and collects the problems (one per file and kind, naming every
record that recorded it); the checks below verify a base or expert at each place a record names
it, an open_clip import's source, a calibration set's digests, the lock's lock_digest, and that
the records of one chain name the same tasks. featcal_core.provenance.lineage.trace calls them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.io.checkpoint import sha256_file, tree_files
from featcal_core.io.outputs import MARKER
from featcal_core.provenance.records import SET_RECORD
from featcal_core.provenance.text import as_dict

log = logging.getLogger(__name__)

#: what the chain shows of a calibration set's own record
_SET_KEYS = (
    "task",
    "source",
    "split",
    "modality",
    "seed",
    "n_requested",
    "rows_available",
    "n_rows",
    "digest",
    "row_ids",
)
_RERUN = "restore the recorded input or rerun the pipeline (featcal run) so the records match"


# ------------------------------------------------------------------------------------ helpers


def _tree_digests(directory: Path, exclude: str) -> tuple[str, str]:
    """(featcal_core.io.checkpoint.sha256_tree of `directory`, the same without the top-level file
    `exclude` and the guarded writer's marker: what calibration_set.json's digest covers); every
    file is read once."""
    full, without = hashlib.sha256(), hashlib.sha256()
    for path in tree_files(directory):
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


# ------------------------------------------------------------------------------------- checks


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
    from featcal_core.provenance.lock import (
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
        if record.get("source_commit"):  # a Hub source: the dataset commit the rows came from
            out["source_commit"] = record["source_commit"]
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
            assert featcal_path is not None  # an entry of featcal.json comes with its path
            if tree != entry["sha256"] and reported is None:
                status = "changed"
                _set_problem(task, directory, featcal_path, tree, entry["sha256"], tracer)
            elif tree != entry["sha256"]:  # the same change, seen by featcal.json too
                assert reported is not None  # the branch above takes it when none is
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
