"""The resumable calibration flow: stems → one cached Prefect task per block → export.

A run killed while calibrating block k and started again with the same inputs restores blocks < k
from their persisted states (Prefect cache hits, or valid state directories) and computes the rest;
the final checkpoint is bitwise identical to an uninterrupted run's. The record (featcal.json) says
per block whether it was computed or restored.

The per-task statistics of a block run one task after another in the block's task (`runner:
local`), or as one Prefect task per task on a Dask cluster (`runner: dask`, prefect-dask: a local
cluster by default, a scheduler address for a real one; the results directory must be on a
filesystem every worker can reach). Both give the same checkpoint, bit for bit.

`featcal calibrate ... --results-dir DIR` runs it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

from featcal.flows.progress import block_done
from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import check_output, guarded_directory, prepare_root, sweep_tree
from featcal_core.io.run_lock import run_lock
from featcal_core.io.safetensors_io import read_header
from featcal_core.io.shard_size import parse_shard_size
from featcal_core.log_detail import DETAIL
from featcal_core.method.calibration import RECORD_NAME, calibration_inputs, check_tasks
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.settings import Settings
from featcal_core.method.state import BLOCK, digest_of, verify

log = logging.getLogger(__name__)


def make_spec(
    base: str | Path,
    merged: str | Path,
    experts: dict[str, str | Path],
    calib: dict[str, str | Path],
    results_dir: str | Path,
    params: FeatCalParams = FeatCalParams(),
    settings: Settings = Settings(),
    runner: str = "local",
    dask_address: str | None = None,
    dask_workers: int = 2,
    memory_budget: float | None = None,
    max_shard_size: int | str | None = None,
) -> dict:
    """A JSON-able description of one calibration (what the tasks receive). The runner settings
    change only where the per-task statistics run, and the memory budget (GiB; None: half the
    available RAM) only whether they are folded in memory or through files: never the result
    (neither is in any cache key); `max_shard_size` only how the calibrated model's weights are
    split into files (featcal_core.io.shards; None: its default)."""
    check_tasks(experts, calib)
    parse_shard_size(max_shard_size)
    if runner not in RUNNERS:
        raise FeatCalError(f"runner {runner!r} is not one of {', '.join(RUNNERS)}")
    if dask_address is not None and runner != "dask":
        raise FeatCalError("a Dask scheduler address is only used with runner dask")
    if dask_workers < 1:
        raise FeatCalError(f"dask workers must be at least 1 (got {dask_workers})")
    return {
        "base": str(Path(base).resolve()),
        "merged": str(Path(merged).resolve()),
        "experts": {t: str(Path(p).resolve()) for t, p in experts.items()},
        "calib": {t: str(Path(p).resolve()) for t, p in calib.items()},
        "results_dir": str(Path(results_dir).resolve()),
        "params": asdict(params),
        "settings": asdict(settings),
        "runner": {"kind": runner, "address": dask_address, "workers": dask_workers},
        "memory_budget_gib": memory_budget,
        "max_shard_size": max_shard_size,
    }


RUNNERS = ("local", "dask")


def task_runner(spec: dict):
    """A started-on-enter Prefect task runner for the per-task statistics, or None (local)."""
    runner = spec.get("runner") or {"kind": "local"}
    if runner["kind"] != "dask":
        return None
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise FeatCalError(
            "runner dask needs prefect-dask (pip install prefect-dask); or use runner local"
        ) from exc
    if runner.get("address"):
        return DaskTaskRunner(address=runner["address"])
    cluster = {
        "n_workers": runner.get("workers", 2),
        "threads_per_worker": 1,
        "processes": True,
        "dashboard_address": None,
    }
    return DaskTaskRunner(cluster_kwargs=cluster)


def _remove_partial_states(results_dir: Path) -> None:
    """Temporary state and work directories left by a killed run (only called while holding the
    lock)."""
    sweep_tree(results_dir / "states", depth=2)
    shutil.rmtree(results_dir / WORK, ignore_errors=True)


#: per-block folders of the distributed runner's per-task results (removed once the block is done)
WORK = "work"


def calibration_flow_fn(spec: dict, out: str, overwrite: bool = False) -> dict:
    """Body of the flow (see `calibration_flow`)."""
    from featcal.tasks.calibration import (
        block_task,
        inputs_digest,
        spec_calibration,
        state_dir,
        state_key,
        stems_task,
        task_statistics_task,
    )

    started = time.perf_counter()
    out_path = Path(out)
    inputs = calibration_inputs(spec["base"], spec["merged"], spec["experts"], spec["calib"])
    check_output(out_path, overwrite=overwrite, inputs=inputs)
    results = Path(spec["results_dir"]).resolve()
    if results == out_path.resolve() or out_path.resolve() in results.parents:
        raise FeatCalError(
            f"--results-dir {results} lies in --out {out_path}, which the calibrated model "
            "replaces; put the results folder elsewhere"
        )
    results_dir = prepare_root(results, inputs=inputs, flag="--results-dir")
    storage = results_dir / "prefect-results"
    with run_lock(results_dir, "featcal calibration"), ExitStack() as stack:
        storage.mkdir(parents=True, exist_ok=True)
        _remove_partial_states(results_dir)
        cal = spec_calibration(spec)  # validates everything before heavy work
        digest = inputs_digest(spec, code={"flows/calibration.py": Path(__file__)})
        runner = task_runner(spec)  # started when a block first needs it (not on a full restore)
        started_runner = []

        workers: dict[int, list[str]] = {}

        def distributed_statistics(key: str, index: int, previous: Path) -> str:
            """Every task's statistics of block `index` on the task runner → their folder."""
            if not started_runner:
                started_runner.append(stack.enter_context(runner))
            work = results_dir / WORK / key
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            futures = [
                runner.submit(
                    task_statistics_task,
                    parameters={
                        "spec": spec,
                        "index": index,
                        "task_name": name,
                        "previous": str(previous),
                        "work": str(work),
                    },
                )
                for name in cal.models.experts
            ]
            done = [future.result() for future in futures]  # raises the task's own error
            workers[index] = sorted({result["worker"] for result in done})
            return str(work)

        def run(task_fn, index: int, **kwargs) -> tuple[Path, bool]:
            key = state_key(kwargs["stage"], index, digest, kwargs.get("previous_digest", ""))
            # the state's place in *this* results directory, also for a cached result: that one
            # records the path it was computed at, elsewhere once the directory is moved or copied
            path = state_dir(results_dir, key)
            valid = verify(path) is not None
            try:
                if not valid and runner is not None and kwargs["stage"] == "block":
                    kwargs["work"] = distributed_statistics(key, index, Path(kwargs["previous"]))
                state = task_fn.with_options(refresh_cache=not valid, result_storage=storage)(
                    spec=spec, index=index, digest=digest, return_state=True, **kwargs
                )
                result = state.result()
            finally:  # the block's per-task results, also when it fails (a full disk)
                if runner is not None:
                    shutil.rmtree(results_dir / WORK / key, ignore_errors=True)
            return path, state.name == "Cached" or result["reused"]

        previous, _ = run(stems_task, -1, stage="stems")
        blocks, replaced = [], {}
        for index in range(cal.num_blocks):
            path, restored = run(
                block_task,
                index,
                stage="block",
                previous=str(previous),
                previous_digest=digest_of(previous),
            )
            manifest = verify(path)
            if manifest is None:
                raise FeatCalError(f"state {path} of block {index} failed verification; rerun")
            summary = dict(manifest["summary"], restored=restored)
            if index in workers:
                summary["statistics_workers"] = workers[index]
            blocks.append(summary)
            if restored:
                log.info(
                    "block %d (%d of %d): restored from %s",
                    index,
                    index + 1,
                    cal.num_blocks,
                    path,
                    extra=DETAIL,
                )
            block_done(index, cal.num_blocks)
            block_file = path / BLOCK
            replaced.update(dict.fromkeys(read_header(block_file)[0], block_file))
            previous = path
        with guarded_directory(out_path, overwrite=overwrite, inputs=inputs) as tmp:
            cal.export(replaced, tmp, spec.get("max_shard_size"))
            record = cal.record(blocks, started)
            record["results_dir"] = str(results_dir)
            record["inputs_digest"] = digest
            record["runner"] = spec.get("runner", {"kind": "local"})
            (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return record


def calibration_flow(spec: dict, out: str, overwrite: bool = False) -> dict:
    """Run the calibration as a Prefect flow (on a local server of this command's unless
    PREFECT_API_URL is set: `flows.environment.command_api`)."""
    from prefect import flow

    from featcal.flows.environment import command_api

    wrapped = flow(name="featcal-calibration", log_prints=False)(calibration_flow_fn)
    with command_api():
        return wrapped(spec, out, overwrite)
