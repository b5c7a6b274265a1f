"""Prefect task for the merge step: a thin wrapper over featcal_core.merging.run.

The merged checkpoint is reused when its `merge.json` names the same method, hyperparameters,
weight file size limit and input weight files (by sha256) as this run would (the key is content,
not paths) and every file still matches the digest recorded when it was written; otherwise it is
merged again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from prefect import task

from featcal_core.io.adapters import expert_weight_paths
from featcal_core.io.checkpoint import sha256_file
from featcal_core.io.outputs import verify_output
from featcal_core.io.shard_size import parse_shard_size
from featcal_core.merging import get
from featcal_core.merging.run import RECORD_NAME, merge_checkpoints

log = logging.getLogger(__name__)


def _fingerprint(
    base: Path, experts: dict[str, Path], method: str, hp: dict, max_shard_size: int | str | None
) -> dict:
    def files(directory: Path, role: str) -> dict[str, str]:
        return {p.name: sha256_file(p) for p in expert_weight_paths(directory, role)}

    return {
        "method": method,
        "hyperparameters": get(method).check(hp),
        "max_shard_size": parse_shard_size(max_shard_size, "run.max_shard_size"),
        "base": files(base, "base model"),
        "experts": {t: files(p, f"expert {t!r}") for t, p in experts.items()},
    }


def _recorded(out: Path) -> dict | None:
    try:
        record = json.loads((out / RECORD_NAME).read_text())
        return {
            "method": record["method"],
            "hyperparameters": record["hyperparameters"],
            "max_shard_size": record.get("max_shard_size"),
            "base": record["inputs"]["base"]["sha256"],
            "experts": {t: e["sha256"] for t, e in record["inputs"]["experts"].items()},
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None


@task(name="merge")
def merge_task(
    base: str,
    experts: dict[str, str],
    out: str,
    method: str,
    hyperparameters: dict,
    max_shard_size: int | str | None = None,
) -> dict:
    """Merge (or reuse an identical earlier merge at `out`); returns the merge record."""
    out_path = Path(out)
    expert_paths = {t: Path(p) for t, p in experts.items()}
    wanted = _fingerprint(Path(base), expert_paths, method, hyperparameters, max_shard_size)
    if _recorded(out_path) == wanted:
        wrong = verify_output(out_path)  # reused only when its files match their digests
        if wrong is None:
            log.info("merge: %s already holds this merge; reused (verified)", out_path)
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
    )
