"""The models lock file (models.lock.json): write it, read it back, verify its files.

    lock = write_lock("data/models.lock.json", base, experts, {"architecture": architecture})
    problems = verify_lock(read_lock("data/models.lock.json"))

The lock file records, for the base and every expert (featcal_core.provenance.resolved's
`ResolvedModel`), the reference, the resolved commit, the local directory and the sha256 of
config.json, the safetensors index and every weight shard (plus, for open_clip references only,
`open_clip_source`), and `lock_digest`: the sha256 of the lock's own content (canonical JSON
without `lock_digest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import sha256_file
from featcal_core.io.outputs import write_file
from featcal_core.provenance.hub import _one_line
from featcal_core.provenance.resolved import ResolvedModel

__all__ = [
    "LOCK_VERSION",
    "lock_digest",
    "models_from_lock",
    "read_lock",
    "verify_lock",
    "write_lock",
]

log = logging.getLogger(__name__)

LOCK_VERSION = 1
_LOCK_KEYS = ("version", "base", "experts", "lock_digest")


def _canonical(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def lock_digest(lock: Mapping[str, Any]) -> str:
    """sha256 of the lock's content without its `lock_digest` (canonical JSON: sorted keys)."""
    return hashlib.sha256(
        _canonical({k: v for k, v in lock.items() if k != "lock_digest"})
    ).hexdigest()


def write_lock(
    path: str | Path,
    base: ResolvedModel,
    experts: Mapping[str, ResolvedModel],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the lock file atomically (temporary file beside it, then os.replace); return it.

    extra: more top-level entries (JSON values, e.g. {"architecture": "hf-clip-vision"}); they
    may not reuse the keys version, base, experts, lock_digest.
    """
    path = Path(path)
    clash = sorted(set(extra or {}) & set(_LOCK_KEYS))
    if clash:
        raise FeatCalError(f"write_lock: extra may not set {', '.join(clash)}; rename those keys")
    lock: dict[str, Any] = {
        "version": LOCK_VERSION,
        "base": base.to_dict(),
        "experts": {task: model.to_dict() for task, model in experts.items()},
        **dict(extra or {}),
    }
    # the JSON round trip makes the digest the one read_lock will recompute
    lock = json.loads(json.dumps(lock, ensure_ascii=False))
    lock["lock_digest"] = lock_digest(lock)
    write_file(path, json.dumps(lock, indent=2, ensure_ascii=False) + "\n", "lock file")
    log.info("wrote %s (lock_digest %s)", path, lock["lock_digest"][:12])
    return lock


def read_lock(path: str | Path) -> dict[str, Any]:
    """The lock written by `write_lock`; a FeatCalError when missing, malformed or edited."""
    path = Path(path)
    if not path.is_file():
        raise FeatCalError(f"{path} does not exist; run the download-experts step first")
    try:
        lock = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeatCalError(
            f"{path} is not valid JSON ({_one_line(exc)}); delete it and re-run download-experts"
        ) from exc
    if not isinstance(lock, dict):
        raise FeatCalError(f"{path} is not a lock object; delete it and re-run download-experts")
    missing = [key for key in _LOCK_KEYS if key not in lock]
    if missing:
        raise FeatCalError(
            f"{path} lacks {', '.join(missing)}; it is not a models lock, re-run download-experts"
        )
    if lock["version"] != LOCK_VERSION:
        raise FeatCalError(
            f"{path} has lock version {lock['version']!r}, this code reads {LOCK_VERSION}; "
            "re-run download-experts"
        )
    if lock_digest(lock) != lock["lock_digest"]:
        raise FeatCalError(
            f"{path}: lock_digest does not match the content (the file was edited); "
            "re-run download-experts to rewrite it"
        )
    return lock


def models_from_lock(lock: Mapping[str, Any]) -> tuple[ResolvedModel, dict[str, ResolvedModel]]:
    """The base and the experts (task → model) recorded in a lock."""
    base = ResolvedModel.from_dict(lock["base"])
    experts = {task: ResolvedModel.from_dict(entry) for task, entry in lock["experts"].items()}
    return base, experts


def verify_lock(lock: Mapping[str, Any]) -> list[str]:
    """Problems with a lock: a stale lock_digest, locked files that are missing or changed.

    Relative local paths are taken from the working directory. An empty list: all files match.
    """
    problems = []
    if "lock_digest" in lock and lock_digest(lock) != lock["lock_digest"]:
        problems.append("lock_digest does not match the lock's content (the lock was edited)")
    base, experts = models_from_lock(lock)
    for model in [base, *experts.values()]:
        for name, expected in sorted(model.files.items()):
            file = model.path / name
            if not file.is_file():
                problems.append(f"{model.role} ({model.reference}): {file} is missing")
                continue
            actual = sha256_file(file)
            if actual != expected:
                problems.append(
                    f"{model.role} ({model.reference}): {file} has sha256 {actual[:12]}…, the lock "
                    f"has {expected[:12]}…"
                )
        problems += _source_problems(model)
    return problems


def _source_problems(model: ResolvedModel) -> list[str]:
    """Problems with an open_clip model's recorded source file and config."""
    source = model.open_clip_source
    if not source:
        return []
    checks = []
    if source.get("path") and source.get("file"):
        checks.append((Path(source["path"]) / source["file"], source.get("sha256")))
    if source.get("config"):
        checks.append((Path(source["config"]), source.get("config_sha256")))
    problems = []
    for file, expected in checks:
        if not expected:
            continue
        if not file.is_file():
            problems.append(f"{model.role} ({model.reference}): open_clip source {file} is missing")
            continue
        actual = sha256_file(file)
        if actual != expected:
            problems.append(
                f"{model.role} ({model.reference}): open_clip source {file} has sha256 "
                f"{actual[:12]}…, the lock has {expected[:12]}…"
            )
    return problems
