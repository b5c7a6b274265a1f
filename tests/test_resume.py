"""The resumable calibration flow (real Prefect): SIGKILL during a block, then the same command
again restores the finished blocks and ends bitwise identical to an uninterrupted run;
content-based cache keys decide what is recomputed; the Dask runner gives the local checkpoint.

The SIGKILL and concurrency tests run on Prefect's embedded server (killed with the flow); the
others share one local `prefect server` (as a team would), which saves its start-up per run."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from featcal_core.data.synthetic import build_pool

RESUME_CLIP = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    image_size=32,
    patch_size=8,
)


def _command(zoo, out: Path, results: Path, *extra: str) -> list[str]:
    args = zoo.cli_args(out) + ["--results-dir", str(results), "--overwrite", *extra]
    return [sys.executable, "-m", "featcal_cli.main", *args]


def _env(home: Path, api_url: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    if api_url is not None:
        env["PREFECT_API_URL"] = api_url
    return env


def _record(out: Path) -> dict:
    return json.loads((out / "featcal.json").read_text())


def _committed(results: Path) -> int:
    """States renamed into place (a temporary `.<key>.featcal-tmp-…` folder holds its manifest
    before the rename, so it does not count: a kill then would lose that block)."""
    states = results / "states"
    return (
        sum(
            1
            for p in states.iterdir()
            if not p.name.startswith(".") and (p / "manifest.json").is_file()
        )
        if states.exists()
        else 0
    )


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return build_pool(root / "zoo", "clip", RESUME_CLIP, ("a", "b", "c"), rows=32)


@pytest.fixture(scope="module")
def reference(zoo, prefect_api, tmp_path_factory) -> Path:
    """An uninterrupted calibration with the local runner: the checkpoint the others must equal."""
    root = tmp_path_factory.mktemp("reference")
    out = root / "out"
    subprocess.run(
        _command(zoo, out, root / "results"),
        env=_env(root / "home", prefect_api),
        check=True,
        capture_output=True,
        timeout=600,
    )
    assert all(not b["restored"] for b in _record(out)["blocks"])
    return out


def test_sigkill_then_resume_is_bitwise_identical(zoo, tmp_path, reference, prefect_api):
    home = tmp_path / "prefect"

    results, out = tmp_path / "results", tmp_path / "out"
    proc = subprocess.Popen(
        _command(zoo, out, results),
        env=_env(home),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while _committed(results) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # stems + 3 blocks persisted: block 3 is now running
    os.killpg(proc.pid, signal.SIGKILL)  # the flow and its temporary Prefect server
    proc.wait()
    done = _committed(results) - 1  # blocks (not stems) that finished before the kill
    assert 3 <= done < RESUME_CLIP["num_hidden_layers"], "the kill must land mid-calibration"
    assert not out.exists()

    # the same command again (here against the tests' shared server: the temporary one died
    # with the flow, and the block states live in the results directory, not in a server)
    subprocess.run(
        _command(zoo, out, results),
        env=_env(home, prefect_api),
        check=True,
        capture_output=True,
        timeout=600,
    )
    blocks = _record(out)["blocks"]
    assert [b["restored"] for b in blocks] == [i < done for i in range(len(blocks))]
    assert (out / "model.safetensors").read_bytes() == (
        reference / "model.safetensors"
    ).read_bytes()
    assert not list((results / "states").glob(".*.tmp-*"))


def test_cache_keys_follow_content(zoo, tmp_path, prefect_api, reference):
    """Starts from a copy of the reference run's results directory, with the original moved
    away: a copied or moved directory restores on its own."""
    home, results = tmp_path / "prefect", tmp_path / "results"
    original = reference.parent / "results"
    shutil.copytree(original, results)
    moved = original.rename(original.with_name("results.moved"))

    def run(out: Path, *extra: str) -> list[bool]:
        subprocess.run(
            _command(zoo, out, results, *extra),
            env=_env(home, prefect_api),
            check=True,
            capture_output=True,
            timeout=600,
        )
        return [b["restored"] for b in _record(out)["blocks"]]

    def same_as_reference(out: Path) -> bool:
        return (out / "model.safetensors").read_bytes() == (
            reference / "model.safetensors"
        ).read_bytes()

    try:
        # a persisted block whose file no longer matches its manifest is recomputed, never used;
        # every other block is restored from the copy (for another output path)
        manifest = next(
            p
            for p in (results / "states").glob("*/manifest.json")
            if json.loads(p.read_text())["index"] == 2
        )
        block_file = manifest.parent / "block.safetensors"
        data = bytearray(block_file.read_bytes())
        data[-1] ^= 0xFF
        block_file.write_bytes(bytes(data))
        again = run(tmp_path / "two")
        assert again == [i != 2 for i in range(len(again))]  # same content: later ones restored
        assert same_as_reference(tmp_path / "two")
        assert not any(run(tmp_path / "three", "--alpha", "0.5"))  # α changed: all recomputed
    finally:
        moved.rename(original)


def test_two_runs_at_once_on_one_results_dir(zoo, tmp_path, reference):
    """Both start together: the second either waits its turn (the first finished) or stops at
    once with a clear message; neither corrupts the shared states, and every output is complete."""
    home, results = tmp_path / "prefect", tmp_path / "results"
    outs = [tmp_path / "out_a", tmp_path / "out_b"]
    procs = [
        subprocess.Popen(
            _command(zoo, out, results),
            env=_env(home),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for out in outs
    ]
    finished = [(p.wait(timeout=600), p.communicate()[1]) for p in procs]
    codes = [code for code, _ in finished]
    assert 0 in codes and set(codes) <= {0, 2}, finished
    for (code, stderr), out in zip(finished, outs, strict=True):
        if code == 2:
            assert "in use by another featcal run" in stderr.strip().splitlines()[-1]
            assert not out.exists()
        else:
            assert len(_record(out)["blocks"]) == RESUME_CLIP["num_hidden_layers"]
    from featcal_core.method.state import verify

    states = [p for p in (results / "states").iterdir() if not p.name.startswith(".")]
    assert states and all(verify(p) is not None for p in states)
    done = [out for (code, _), out in zip(finished, outs, strict=True) if code == 0]
    first = (reference / "model.safetensors").read_bytes()
    assert all((out / "model.safetensors").read_bytes() == first for out in done)


def test_dask_runner_gives_the_local_checkpoint(zoo, tmp_path, prefect_api, reference):
    """runner dask: every block's per-task statistics run as Prefect tasks on a local 2-worker
    Dask cluster (other processes); the checkpoint equals the local runner's, bit for bit."""
    home = tmp_path / "prefect"
    local, distributed = reference, tmp_path / "dask"
    started = datetime.datetime.now(datetime.timezone.utc)
    proc = subprocess.Popen(
        _command(
            zoo, distributed, tmp_path / "results_dask", "--runner", "dask", "--dask-workers", "2"
        ),
        env=_env(home, prefect_api),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    record = _record(distributed)
    assert record["runner"] == {"kind": "dask", "address": None, "workers": 2}
    workers = {w for b in record["blocks"] for w in b["statistics_workers"]}
    pids = {int(w.rsplit(":", 1)[1]) for w in workers}
    assert 1 <= len(pids) <= 2 and proc.pid not in pids  # worker processes, not the flow's
    assert all(not b["restored"] for b in record["blocks"])
    assert (distributed / "model.safetensors").read_bytes() == (
        local / "model.safetensors"
    ).read_bytes()
    # the workers' featcal lines reach the Prefect UI beside the run, as the flow's own do
    reported = {
        m.rsplit(" ", 1)[1]
        for m in _api_messages(prefect_api, started)
        if "statistics computed in process" in m
    }
    assert reported == workers, (reported, workers)
    assert not (tmp_path / "results_dask" / "work").exists() or not any(
        (tmp_path / "results_dask" / "work").iterdir()
    )


def _api_messages(api_url: str, since) -> list[str]:
    """The messages of every log line the Prefect API received since `since`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTimestamp
    from prefect.settings import PREFECT_API_URL, temporary_settings

    found: list[str] = []
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        with get_client(sync_client=True) as client:
            while True:  # by pages of the server's limit
                page = client.read_logs(
                    LogFilter(timestamp=LogFilterTimestamp(after_=since)), offset=len(found)
                )
                if not page:
                    return found
                found += [entry.message for entry in page]


def test_memory_budget_decides_where_statistics_go_not_the_result(
    zoo, tmp_path, prefect_api, reference
):
    """With room (the reference run: half the available RAM) each block's statistics are folded
    in memory; with `--memory-budget 0` every task's statistics go through files. Same bytes."""
    held = {b["statistics"]["held"] for b in _record(reference)["blocks"]}
    assert held == {"memory"}
    out = tmp_path / "out"
    subprocess.run(
        _command(zoo, out, tmp_path / "results", "--memory-budget", "0"),
        env=_env(tmp_path / "home", prefect_api),
        check=True,
        capture_output=True,
        timeout=600,
    )
    blocks = _record(out)["blocks"]
    assert {b["statistics"]["held"] for b in blocks} == {"files"}
    assert all(
        b["statistics"]["task_bytes"] > 0 and b["statistics"]["budget_bytes"] == 0 for b in blocks
    )
    assert (out / "model.safetensors").read_bytes() == (
        reference / "model.safetensors"
    ).read_bytes()
