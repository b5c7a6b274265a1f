"""The resumable calibration flow: stems → one cached Prefect task per block → export.

A run killed while calibrating block k and started again with the same inputs restores blocks < k
from their persisted states (Prefect cache hits, or valid state directories) and computes the rest;
the final checkpoint is bitwise identical to an uninterrupted run's. The record (featcal.json) says
per block whether it was computed or restored.

`featcal calibrate ... --results-dir DIR` runs it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from featcal_core.atomic import atomic_directory, check_output
from featcal_core.block import FeatCalParams
from featcal_core.calibration import RECORD_NAME, Settings, check_tasks
from featcal_core.errors import FeatCalError
from featcal_core.safetensors_io import read_header
from featcal_core.state import BLOCK, digest_of, verify

log = logging.getLogger(__name__)


def make_spec(
    base: str | Path,
    merged: str | Path,
    experts: dict[str, str | Path],
    calib: dict[str, str | Path],
    results_dir: str | Path,
    params: FeatCalParams = FeatCalParams(),
    settings: Settings = Settings(),
) -> dict:
    """A JSON-able description of one calibration (what the tasks receive)."""
    check_tasks(experts, calib)
    return {
        "base": str(Path(base).resolve()),
        "merged": str(Path(merged).resolve()),
        "experts": {t: str(Path(p).resolve()) for t, p in experts.items()},
        "calib": {t: str(Path(p).resolve()) for t, p in calib.items()},
        "results_dir": str(Path(results_dir).resolve()),
        "params": asdict(params),
        "settings": asdict(settings),
    }


@contextmanager
def results_lock(results_dir: Path) -> Iterator[None]:
    """Exclusive use of a results directory; a second run fails at once with a clear message."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / ".featcal.lock"
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise FeatCalError(
            f"{results_dir} is in use by another featcal run (lock {path}); wait for it to finish "
            "or use another results directory"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _remove_partial_states(results_dir: Path) -> None:
    """Temporary state directories left by a killed run (only called while holding the lock)."""
    for partial in (results_dir / "states").glob(".*.tmp-*"):
        shutil.rmtree(partial, ignore_errors=True)


def calibration_flow_fn(spec: dict, out: str, overwrite: bool = False) -> dict:
    """Body of the flow (see `calibration_flow`)."""
    from tasks.calibration import block_task, inputs_digest, spec_calibration, state_key, stems_task

    started = time.perf_counter()
    out_path = Path(out)
    check_output(out_path, overwrite)
    results_dir = Path(spec["results_dir"])
    storage = results_dir / "prefect-results"
    storage.mkdir(parents=True, exist_ok=True)
    with results_lock(results_dir):
        _remove_partial_states(results_dir)
        cal = spec_calibration(spec)  # validates everything before heavy work
        digest = inputs_digest(spec)

        def run(task_fn, index: int, **kwargs) -> tuple[Path, bool]:
            key = state_key(kwargs["stage"], index, digest, kwargs.get("previous_digest", ""))
            valid = verify(results_dir / "states" / key) is not None
            state = task_fn.with_options(refresh_cache=not valid, result_storage=storage)(
                spec=spec, index=index, digest=digest, return_state=True, **kwargs
            )
            result = state.result()
            return Path(result["path"]), state.name == "Cached" or result["reused"]

        previous, _ = run(stems_task, -1, stage="stems")
        blocks, replaced = [], {}
        for index in range(cal.num_blocks):
            path, restored = run(
                block_task, index, stage="block", previous=str(previous),
                previous_digest=digest_of(previous),
            )  # fmt: skip
            manifest = verify(path)
            if manifest is None:
                raise FeatCalError(f"state {path} of block {index} failed verification; rerun")
            summary = dict(manifest["summary"], restored=restored)
            blocks.append(summary)
            if restored:
                log.info("block %d/%d: restored from %s", index + 1, cal.num_blocks, path)
            block_file = path / BLOCK
            replaced.update(dict.fromkeys(read_header(block_file)[0], block_file))
            previous = path
        with atomic_directory(out_path, overwrite) as tmp:
            cal.export(replaced, tmp)
            record = cal.record(blocks, started)
            record["results_dir"] = str(results_dir)
            record["inputs_digest"] = digest
            (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return record


def calibration_flow(spec: dict, out: str, overwrite: bool = False) -> dict:
    """Run the calibration as a Prefect flow (embedded server unless PREFECT_API_URL is set)."""
    from prefect import flow

    wrapped = flow(name="featcal-calibration", log_prints=False)(calibration_flow_fn)
    return wrapped(spec, out, overwrite)
