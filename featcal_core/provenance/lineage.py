"""Lineage for audits: what produced a checkpoint, checked against the files on disk, and a model
card that says it.

    result = trace("data/results/calibrated")   # a checkpoint, a results dir or a report dir
    print(format_trace(result))                 # `featcal lineage PATH` (lineage_text)
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
name the same input must agree. Every file the run wrote below its results directory (records,
metrics.json, plots/, caches) is checked against the markers the guarded writer kept
(`outputs.record_problems`): a changed, missing or unlisted file is named. Mismatches are
collected as problems (one per file); `check` turns the first into a one-line FeatCalError.

A report directory (featcal_core.report: reports/<run name>/, beside the results) is traced
through the results directory whose models.lock.json has the lock digest its report.md names (or
the results_dir of a provenance.json there; or the results directory it sits in). A comparison
folder (`featcal compare`: reports/<run name>-compare/) is traced through the results_dir its
compare.json names, whose lock must have the lock_digest recorded beside it (else the results
directory found by that digest).

A recorded absolute path that no longer exists (a moved results directory) is looked up at its
place in the results layout (merged/, calibration_sets/<task>/); relative local paths of the lock
are taken from the working directory, then from the folders above the results directory.

The verification itself (hashing each file once, collecting the problems) is in
featcal_core.provenance.lineage_checks; the text `featcal lineage` prints, in
featcal_core.provenance.lineage_text.

Pure library: no Prefect, MLflow or DVC imports; nothing is written by `trace`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import MARKER, read_marker, record_problems, verify_output
from featcal_core.provenance.lineage_checks import (
    _RERUN,
    _check_lock,
    _check_tasks,
    _resolve_local,
    _sha_map,
    _short,
    _Tracer,
    _verify_model,
    _verify_open_clip_source,
    _verify_set,
)
from featcal_core.provenance.records import (
    EVALUATION,
    FEATCAL_RECORD,
    LOCK,
    MERGE_RECORD,
    PROVENANCE,
    SET_RECORD,
)
from featcal_core.provenance.text import as_dict

__all__ = [
    "PROVENANCE_FIELDS",
    "PROVENANCE_NAME",
    "check",
    "trace",
]

#: the records' names (featcal_core.provenance.records)
LOCK_NAME = LOCK
EVALUATION_NAME = EVALUATION
#: optional run identifiers, beside the traced path or in the results directory
PROVENANCE_NAME = PROVENANCE
#: a report directory's markdown (featcal_core.report), and the lock digest line it holds
REPORT_NAME = "report.md"
_REPORT_LOCK = re.compile(r"lock digest: ([0-9a-f]{64})\b")
#: a comparison folder's record (featcal_core.report.compare): results_dir and lock_digest
COMPARE_NAME = "compare.json"
_DIGEST = re.compile(r"[0-9a-f]{64}")

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


def _is_results_root(directory: Path) -> bool:
    return (
        (directory / LOCK_NAME).is_file()
        or (directory / "calibrated" / FEATCAL_RECORD).is_file()
        or (directory / "merged" / MERGE_RECORD).is_file()
    )


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
        assert root is not None  # a results directory is its own root (_results_root)
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
    # role → reference, commit... (from the lock; else from merge.json)
    details: dict[str, dict[str, Any]] = {}
    tasks_by_record: list[tuple[Path, str, set[str]]] = []

    # calibrated → featcal.json
    merged_dir = None
    if featcal is not None:
        assert featcal_path is not None  # featcal is read from featcal_path
        inputs = as_dict(featcal.get("inputs"))
        blocks = featcal.get("blocks")
        if not isinstance(blocks, list):
            blocks = []
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
            for role, item in [("base", inputs.get("base"))] + [
                (f"experts.{task}", item) for task, item in experts.items()
            ]:
                if as_dict(item).get("kind") == "hub":  # where it came from (Hub id, commit)
                    details[role] = {
                        key: as_dict(item).get(key)
                        for key in ("reference", "kind", "repo_id", "revision", "commit")
                    }
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

    # everything the run wrote into its results folder (records, metrics, plot data, caches), as
    # the markers the writer kept list it: a changed, missing or unlisted file is named; and the
    # traced folder itself (e.g. a report)
    if root is not None:
        verified = [
            entry["path"]
            for entry in (chain["calibrated"], chain["merged"], *chain["calibration_sets"].values())
            if isinstance(entry, dict) and entry.get("path")
        ]
        for path, what, marker, wrong in record_problems(root, skip=verified, digest=tracer.digest):
            kind = "missing" if what == "missing" else "changed"
            tracer.problem(path, kind, f"{wrong}; {_RECORD_RERUN}", marker)
    if start != target and read_marker(start) is not None:
        wrong = verify_output(start)
        if wrong is not None:
            tracer.problem(start, "changed", f"{wrong}; {_RECORD_RERUN}", start / MARKER)

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


#: what to do when one of the run's own records was edited
_RECORD_RERUN = "the record no longer says what the run wrote; rerun the step that writes it"


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
    if (start / COMPARE_NAME).is_file():  # a comparison: compare.json names its results
        found = _results_of_comparison(start / COMPARE_NAME, tracer)
        if found is not None:
            return found, "results"
    for parent in list(start.parents)[:3]:
        if _is_results_root(parent):
            return parent, "results"
    if (start / REPORT_NAME).is_file():
        found = _results_of_report(start / REPORT_NAME, tracer)
        if found is not None:
            return found, "results"
    wrong = verify_output(start) if read_marker(start) is not None else None
    if wrong is not None:  # a report folder whose pointer was edited away
        raise FeatCalError(f"{wrong}; {_RECORD_RERUN}")
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
    return _results_with_lock(match.group(1), report, tracer)


def _results_of_comparison(record: Path, tracer: _Tracer) -> Path | None:
    """The results directory a comparison (`featcal compare`'s compare.json) was made on: its
    `results_dir` (relative to the report folder), else the one whose lock has its
    `lock_digest`. A results_dir whose lock has another digest is a problem: its models changed
    since the comparison."""
    data = tracer.read_json(record, "comparison record") or {}
    digest = data.get("lock_digest")
    digest = digest if isinstance(digest, str) and _DIGEST.fullmatch(digest) else None
    value = data.get("results_dir")
    if isinstance(value, str) and value:
        target = (record.parent / Path(value).expanduser()).resolve()
        if _is_results_root(target):
            found = _lock_digest_of(target / LOCK_NAME)
            if digest is not None and found != digest:
                tracer.problem(
                    record,
                    "inconsistent",
                    f"{record} compared models of lock digest {_short(digest)}, but "
                    f"{target / LOCK_NAME} now has {_short(found or 'none')}: the results were "
                    "rerun since; run `featcal compare` again",
                    record,
                )
            tracer.notes.append(f"{record} names results dir {target}")
            return target
    return _results_with_lock(digest, record, tracer) if digest is not None else None


def _lock_digest_of(lock: Path) -> str | None:
    try:
        found = json.loads(lock.read_text(encoding="utf-8")).get("lock_digest")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def _results_with_lock(digest: str, report: Path, tracer: _Tracer) -> Path | None:
    """The results directory whose models.lock.json has lock digest `digest`, looked for up to
    two folders below the parent of `report`'s folder and the folder above that."""
    seen: set[Path] = set()
    for folder in list(report.parent.parents)[:2]:
        for pattern in (LOCK_NAME, f"*/{LOCK_NAME}", f"*/*/{LOCK_NAME}"):
            for lock in sorted(folder.glob(pattern)):
                if lock in seen:
                    continue
                seen.add(lock)
                if _lock_digest_of(lock) == digest:
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


def _add_source(sources, role: str, record: Path, key: str, entry: Any, root: Path | None):
    data = as_dict(entry)
    if not data:
        return
    directory = _resolve_local(data.get("path"), root)
    if directory is None:
        return
    sources.setdefault(role, []).append((record, key, directory, _sha_map(data)))


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
