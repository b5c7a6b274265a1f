"""Prefect tasks for a resumable calibration: stems, one task per block, export.

Each stage persists a state directory (featcal_core.method.state) under `<results_dir>/states/<key>`,
where the key is built from content, never from paths: the digest of all inputs (weight files,
calibration sets, FeatCal hyperparameters and settings, code version) and, for block i, the digest
of block i-1's persisted state. A task whose key has a valid state is restored, not recomputed;
a state whose files no longer match its manifest is recomputed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import socket
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE, CachePolicy

from featcal_core.io.checkpoint import sha256_file, sha256_tree
from featcal_core.io.outputs import temp_path
from featcal_core.io.safetensors_io import save_tensors
from featcal_core.log_detail import DETAIL, record_from_info
from featcal_core.method.calibration import Calibration, block_summary, log_block
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.settings import Settings
from featcal_core.method.state import (
    BLOCK,
    STREAMS,
    commit_state,
    load_masks,
    new_state_dir,
    save_masks,
    streams_of,
    verify,
)
from featcal_core.method.streams import HiddenStreams, stream_file_name
from featcal_core.provenance.identity import core_sources, sources_digest

log = logging.getLogger(__name__)


def spec_calibration(spec: dict) -> Calibration:
    """The Calibration a spec describes (validated; cached per process)."""
    return _calibration(json.dumps(spec, sort_keys=True))


@functools.lru_cache(maxsize=2)
def _calibration(spec_json: str) -> Calibration:
    spec = json.loads(spec_json)
    return Calibration(
        spec["base"],
        spec["merged"],
        spec["experts"],
        spec["calib"],
        FeatCalParams(**spec["params"]),
        Settings(**spec["settings"]),
    )


def code_version(more: dict[str, Path] | None = None) -> str:
    """Digest of all code that shapes a state: featcal_core's sources, this module, and `more`
    ({project path: file}; the calibration flow adds its own module): a change invalidates every
    block. Files are named by their path in the project, never an absolute one."""
    files = {**core_sources(), "tasks/calibration.py": Path(__file__), **(more or {})}
    return sources_digest(files)


def inputs_digest(spec: dict, code: dict[str, Path] | None = None) -> str:
    """Digest of everything a calibration's result depends on except the blocks' own chain;
    `code`: more source files that shape the states (see `code_version`)."""
    cal = spec_calibration(spec)
    models = cal.models
    parts = {
        "weights": {
            role: {p.name: sha256_file(p) for p in ckpt.weight_paths()}
            for role, ckpt in [("base", models.base), ("merged", models.merged)]
            + [(f"expert:{t}", c) for t, c in models.experts.items()]
        },
        "calibration": {t: sha256_tree(Path(s.path)) for t, s in cal.sets.items()},
        "params": spec["params"],
        "settings": spec["settings"],
        "precision": cal.precision,  # what "auto" resolved to on this device
        "code": code_version(code),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def state_key(stage: str, index: int, digest: str, previous_digest: str = "") -> str:
    text = f"{stage}|{index}|{digest}|{previous_digest}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class StateCachePolicy(CachePolicy):
    """Prefect cache key = the state key (content only; no run id, no paths)."""

    def compute_key(self, task_ctx, inputs, flow_parameters, **kwargs) -> str:
        return state_key(
            inputs["stage"], inputs["index"], inputs["digest"], inputs.get("previous_digest", "")
        )


def state_dir(results_dir: str | Path, key: str) -> Path:
    return Path(results_dir) / "states" / key


@task(name="calibration-stems", cache_policy=StateCachePolicy(), persist_result=True)
def stems_task(spec: dict, stage: str, index: int, digest: str) -> dict:
    """Block-0 inputs of every task (each model's own stem) → state directory."""
    final = state_dir(spec["results_dir"], state_key(stage, index, digest))
    if verify(final) is not None:
        return {"path": str(final), "reused": True}
    cal = spec_calibration(spec)
    with new_state_dir(final) as tmp:
        masks = cal.stems(streams_of(tmp))
        save_masks(tmp, masks)
        commit_state(tmp, final, -1, {})
    return {"path": str(final), "reused": False}


def carry_forward(source: HiddenStreams, target: HiddenStreams) -> None:
    """Hard-link (or copy) into `target` every stream of `source` the block did not rewrite (an
    encoder-decoder's decoder stems and contexts), so each state holds all later blocks need."""
    for path in sorted(source.directory.glob("*.safetensors")):
        kept = target.directory / path.name
        if not kept.exists():
            try:
                os.link(path, kept)
            except OSError:
                shutil.copy2(path, kept)


def memory_budget_bytes(gib: float | None) -> int:
    """The statistics' memory budget in bytes: `gib` GiB, or (None) half of the RAM available
    now."""
    if gib is not None:
        return int(gib * 2**30)
    import psutil

    return int(psutil.virtual_memory().available // 2)


def statistics_file(work: str | Path, task_name: str) -> Path:
    """Where `task_statistics_task` leaves one task's statistics of a block."""
    return Path(work) / stream_file_name("statistics", task_name)


@task(
    name="block-task-statistics",
    cache_policy=NO_CACHE,
    persist_result=False,
    task_run_name="block-{index}-{task_name}",
)
def task_statistics_task(spec: dict, index: int, task_name: str, previous: str, work: str) -> dict:
    """One task's pass over block `index` (runs on the flow's task runner: a Dask worker with
    `runner: dask`). Reads the block inputs from the state `previous`, writes the expert's block
    output stream and the task's statistics into `work` (a folder every worker can reach).
    Returns {"path": the statistics file, "worker": "host:pid" of the process that ran it}."""
    record_from_info()  # a worker process: featcal's lines reach the Prefect UI as the flow's do
    worker = f"{socket.gethostname()}:{os.getpid()}"
    cal = spec_calibration(spec)
    source = Path(previous)
    stats = cal.task_statistics(
        index,
        task_name,
        streams_of(source),
        HiddenStreams(Path(work) / STREAMS),
        load_masks(source),
    )
    path = statistics_file(work, task_name)
    stats.save(path)
    log.info(
        "block %d, task %r: statistics computed in process %s",
        index,
        task_name,
        worker,
        extra=DETAIL,
    )
    return {"path": str(path), "worker": worker}


@task(
    name="calibrate-block",
    cache_policy=StateCachePolicy(),
    persist_result=True,
    task_run_name="block-{index}",
)
def block_task(
    spec: dict,
    stage: str,
    index: int,
    digest: str,
    previous: str,
    previous_digest: str,
    work: str | None = None,
) -> dict:
    """Calibrate block `index` from the state `previous` → its own state directory.

    work: a folder where `task_statistics_task` left every task's statistics and expert outputs
    (distributed runner); None computes them here. Not part of the cache key: both give the same
    state, bit for bit."""
    final = state_dir(spec["results_dir"], state_key(stage, index, digest, previous_digest))
    if verify(final) is not None:
        return {"path": str(final), "reused": True}
    cal = spec_calibration(spec)
    source = Path(previous)
    masks = load_masks(source)
    with new_state_dir(final) as tmp:
        target = streams_of(tmp)
        precomputed = None
        if work is not None:  # the experts' block outputs (and contexts), already computed there
            for done in sorted((Path(work) / STREAMS).glob("*.safetensors")):
                done.replace(target.directory / done.name)

            def precomputed(task_name: str) -> Path:  # folded group by group from the file
                return statistics_file(work, task_name)

        needed = cal.statistics_bytes(index)  # one task's statistics of this block, at most
        budget = memory_budget_bytes(spec.get("memory_budget_gib"))
        in_memory = precomputed is None and 2 * needed <= budget  # running sums + one task's
        scratch = None if in_memory else temp_path(final.parent / "statistics")
        try:
            if scratch is not None:
                scratch.mkdir(parents=True)
            result = cal.block(index, streams_of(source), target, masks, precomputed, scratch)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        carry_forward(streams_of(source), target)
        save_tensors(tmp / BLOCK, cal.checkpoint_keys(result))
        save_masks(tmp, masks)
        summary = block_summary(result)
        summary["statistics"] = {
            "held": "memory" if in_memory else "files",
            "task_bytes": needed,
            "budget_bytes": budget,
        }
        commit_state(tmp, final, index, summary)
    log_block(result, cal.num_blocks)
    return {"path": str(final), "reused": False}
