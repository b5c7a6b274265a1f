"""Prefect task for the merge step: a thin wrapper over featcal_core.merging.run.

The merged checkpoint is reused when its `merge.json` names the same method, hyperparameters,
weight file size limit, input weight files (by sha256) and origins (a Hub model's id, revision and
commit; a local folder as local) as this run would (the key is content and origin, not paths:
the record and the merged model's card name them) and every file still matches the digest
recorded when it was written; otherwise it is merged again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task

from featcal_core.io.adapters import expert_weight_paths
from featcal_core.io.checkpoint import sha256_file
from featcal_core.io.outputs import verify_output
from featcal_core.io.shard_size import parse_shard_size
from featcal_core.log_detail import DETAIL
from featcal_core.merging import get
from featcal_core.merging.run import RECORD_NAME, merge_checkpoints

log = logging.getLogger(__name__)

#: what identifies an input's origin in the reuse key (its path does not)
_ORIGIN_KEYS = ("kind", "repo_id", "revision", "commit")


def _origin(source: Mapping[str, Any] | None) -> dict[str, Any]:
    """An input's origin as the key compares it: a Hub model's kind, repo_id, revision and
    commit; anything else is local."""
    if source is None or source.get("kind") != "hub":
        return {"kind": "local"}
    return {key: source.get(key) for key in _ORIGIN_KEYS}


def _fingerprint(
    base: Path,
    experts: dict[str, Path],
    method: str,
    hp: dict,
    max_shard_size: int | str | None,
    base_source: Mapping[str, Any] | None = None,
    expert_sources: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict:
    def files(directory: Path, role: str) -> dict[str, str]:
        return {p.name: sha256_file(p) for p in expert_weight_paths(directory, role)}

    sources = expert_sources or {}
    return {
        "method": method,
        "hyperparameters": get(method).check(hp),
        "max_shard_size": parse_shard_size(max_shard_size, "run.max_shard_size"),
        "base": files(base, "base model"),
        "experts": {t: files(p, f"expert {t!r}") for t, p in experts.items()},
        "origins": {
            "base": _origin(base_source),
            "experts": {t: _origin(sources.get(t)) for t in experts},
        },
    }


def _recorded(out: Path) -> dict | None:
    try:
        record = json.loads((out / RECORD_NAME).read_text())
        inputs = record["inputs"]
        return {
            "method": record["method"],
            "hyperparameters": record["hyperparameters"],
            "max_shard_size": record.get("max_shard_size"),
            "base": inputs["base"]["sha256"],
            "experts": {t: e["sha256"] for t, e in inputs["experts"].items()},
            "origins": {
                "base": _origin(inputs["base"]),
                "experts": {t: _origin(e) for t, e in inputs["experts"].items()},
            },
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@task(name="merge")
def merge_task(
    base: str,
    experts: dict[str, str],
    out: str,
    method: str,
    hyperparameters: dict,
    max_shard_size: int | str | None = None,
    base_source: dict | None = None,
    expert_sources: dict[str, dict] | None = None,
) -> dict:
    """Merge (or reuse an identical earlier merge at `out`); returns the merge record.
    base_source, expert_sources: where the folders came from (`ResolvedModel.source()` of the
    lock's models), recorded in merge.json and the merged model's card."""
    out_path = Path(out)
    expert_paths = {t: Path(p) for t, p in experts.items()}
    wanted = _fingerprint(
        Path(base),
        expert_paths,
        method,
        hyperparameters,
        max_shard_size,
        base_source,
        expert_sources,
    )
    if _recorded(out_path) == wanted:
        wrong = verify_output(out_path)  # reused only when its files match their digests
        if wrong is None:
            log.info(
                "merge: %s already holds this merge; reused (verified)", out_path, extra=DETAIL
            )
            return json.loads((out_path / RECORD_NAME).read_text())
        log.warning("merge: %s does not verify (%s); merging again", out_path, wrong)
    return merge_checkpoints(
        base,
        experts,
        out,
        method,
        hyperparameters,
        overwrite=True,
        progress=False,  # the run shows its own progress (flows/progress.py)
        max_shard_size=max_shard_size,
        base_source=base_source,
        expert_sources=expert_sources,
    )
