"""A supervised local `prefect server start` (SQLite in its PREFECT_HOME) on a free loopback port.

Prefect's temporary per-process server never fires schedules and dies with its process, so
`featcal serve` (and the tests, to share one server between many flow processes) run this one
instead: stopped when the `with` block ends and, on Linux, also when the process that started it
dies however it dies (the parent-death signal). This module does not import Prefect itself.
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

log = logging.getLogger(__name__)


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


def wait_healthy(api_url: str, timeout_s: float, server: subprocess.Popen | None = None) -> None:
    """Wait until the Prefect API at `api_url` answers; FeatCalError after `timeout_s` seconds or
    as soon as `server` (the process serving it, when known) exits."""
    deadline = time.monotonic() + timeout_s
    while not _healthy(api_url):
        if server is not None and server.poll() is not None:
            raise FeatCalError(
                f"the local Prefect server exited with status {server.returncode}; "
                "run `prefect server start` by hand to see why, or set PREFECT_API_URL"
            )
        if time.monotonic() > deadline:
            raise FeatCalError(f"the local Prefect server did not answer at {api_url}")
        time.sleep(0.5)


def start_server(
    *, port: int | None = None, home: str | Path | None = None
) -> tuple[subprocess.Popen, str]:
    """Start `prefect server start` on 127.0.0.1 and return at once (not waiting for it to
    answer: see `wait_healthy`) with the process and its API URL; stop it with `stop_server`.

    port: None picks a free one. home: the server's PREFECT_HOME (its SQLite database); None keeps
    this process's. On Linux the server gets SIGTERM when the calling thread's process dies."""
    port = _free_port() if port is None else port
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
               "--port", str(port), "--no-ui", "--analytics-off"]  # fmt: skip
    env = None if home is None else {**os.environ, "PREFECT_HOME": str(home)}
    server = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env,
                              preexec_fn=_parent_death_signal())  # fmt: skip
    return server, f"http://127.0.0.1:{port}/api"


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group; SIGKILL it if it has not exited after 30 s."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


@contextmanager
def local_server(
    timeout_s: float = 180.0, *, port: int | None = None, home: str | Path | None = None
) -> Iterator[str]:
    """A supervised `start_server`; yields its API URL once it answers, stops it on exit."""
    server, api_url = start_server(port=port, home=home)
    try:
        wait_healthy(api_url, timeout_s, server)
        log.info("local Prefect server at %s (pid %d)", api_url, server.pid)
        yield api_url
    finally:
        stop_server(server)
