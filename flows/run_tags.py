"""What names a run's inputs in MLflow tags, for `featcal run` and the single steps alike: the
params digest, the lineage tags of the lock file (references, commits, file digests), and the
params a flow run was called with. This
module does not import Prefect or MLflow."""

from __future__ import annotations

import hashlib
from pathlib import Path

from featcal_core.params import Params, dump, load_params


def params_digest(params: Params) -> str:
    """sha256 of the full configuration (defaults filled in, as `featcal_core.params.dump`)."""
    return hashlib.sha256(dump(params).encode()).hexdigest()


def flow_params(parameters: dict) -> Params:
    """The validated params of a flow call (`featcal_run`, `featcal_compare`, a variant's
    subflow): the `params` its caller validated, or (a deployment's scheduled run) the params
    file and overrides read now."""
    given = parameters.get("params")
    if isinstance(given, Params):
        return given
    return load_params(parameters["params_path"], parameters.get("overrides") or [])


def files_digest(files: dict[str, str]) -> str:
    """One sha256 over a {file: sha256} mapping."""
    text = "\n".join(f"{name} {digest}" for name, digest in sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def checkpoint_digest(directory: Path) -> str:
    """One sha256 over a checkpoint's weight files (and index)."""
    from featcal_core.io.checkpoint import Checkpoint, sha256_file

    paths = Checkpoint(directory, "checkpoint").weight_paths()
    return files_digest({p.name: sha256_file(p) for p in paths})


def lineage_tags(lock: dict) -> dict[str, str | None]:
    """MLflow tags naming exactly which models a run used: references, commits, file digests."""
    tags: dict[str, str | None] = {"lock_digest": lock.get("lock_digest")}
    entries = {"base": lock["base"], **{f"expert.{t}": e for t, e in lock["experts"].items()}}
    for role, entry in entries.items():
        tags[f"{role}.reference"] = entry["reference"]
        tags[f"{role}.commit"] = entry.get("commit") or "local"
        tags[f"{role}.sha256"] = files_digest(entry["files"])
    return tags
