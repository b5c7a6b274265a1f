"""`featcal serve`: run the pipeline on a schedule (cron or interval) as a Prefect deployment.

Prefect's temporary per-process server never fires schedules, so when PREFECT_API_URL is unset this
starts a local `prefect server start` (SQLite in PREFECT_HOME) on a free loopback port, supervises
it (stopped when serving ends; on Linux also when `featcal serve` itself is killed, through the
parent-death signal) and points the deployment at it. With PREFECT_API_URL set, the
deployment is served against that server. Each scheduled run executes `featcal_scheduled_run`, the
same pipeline as `featcal run`, with the params file and overrides given here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from featcal_core.errors import FeatCalError
from flows.environment import configure

configure()  # before prefect is imported
from prefect import flow  # noqa: E402

log = logging.getLogger(__name__)

DEPLOYMENT = "featcal-scheduled"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1


def _parent_death_signal():
    """A function for Popen's preexec_fn that makes Linux send the child SIGTERM when this
    process dies, however it dies (SIGKILL included); None where prctl is unavailable. The libc
    function is looked up here, in the parent, so the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextmanager
def local_server(timeout_s: float = 180.0) -> Iterator[str]:
    """A supervised `prefect server start` on 127.0.0.1; yields its API URL."""
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
               "--port", str(port), "--no-ui", "--analytics-off"]  # fmt: skip
    server = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL,
                              preexec_fn=_parent_death_signal())  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(api_url):
            if server.poll() is not None:
                raise FeatCalError(
                    f"the local Prefect server exited with status {server.returncode}; "
                    "run `prefect server start` by hand to see why, or set PREFECT_API_URL"
                )
            if time.monotonic() > deadline:
                raise FeatCalError(f"the local Prefect server did not answer at {api_url}")
            time.sleep(0.5)
        log.info("local Prefect server at %s (pid %d)", api_url, server.pid)
        yield api_url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


@flow(name="featcal-scheduled-run")
def featcal_scheduled_run(params_path: str, overrides: list[str]) -> dict:
    """One scheduled pipeline run (the deployment's flow; `featcal run` runs as its subflow)."""
    from flows.pipeline import run_from_file

    return run_from_file(params_path, overrides)


def serve(
    params_path: str,
    overrides: list[str],
    *,
    cron: str | None = None,
    interval_s: float | None = None,
) -> None:
    """Serve the pipeline with a cron or interval schedule until interrupted."""
    if (cron is None) == (interval_s is None):
        raise FeatCalError("featcal serve needs exactly one of --cron EXPR or --interval SECONDS")
    from flows.params import load_params

    load_params(params_path, overrides)  # a bad params file fails now, not at the first run
    if os.environ.get("PREFECT_API_URL"):
        _serve(params_path, overrides, cron, interval_s)
        return
    with local_server() as api_url:
        os.environ["PREFECT_API_URL"] = api_url
        _serve(params_path, overrides, cron, interval_s)


def _serve(params_path, overrides, cron, interval_s) -> None:
    parameters = {"params_path": str(Path(params_path).resolve()), "overrides": list(overrides)}
    log.info("serving %s (%s) with %s", DEPLOYMENT, cron or f"every {interval_s} s", parameters)
    featcal_scheduled_run.serve(
        name=DEPLOYMENT,
        cron=cron,
        interval=interval_s,
        parameters=parameters,
        limit=1,  # one run at a time: runs share the results directory
        print_starting_message=True,
    )
