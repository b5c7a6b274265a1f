"""`featcal serve`: run the pipeline on a schedule (cron or interval) as a Prefect deployment.

Prefect's temporary per-process server never fires schedules, so when PREFECT_API_URL is unset this
starts a local `prefect server start` (flows.prefect_server: SQLite in PREFECT_HOME, stopped when
serving ends or `featcal serve` is killed) and points the deployment at it. With PREFECT_API_URL
set, the deployment is served against that server (with the user's PREFECT_API_AUTH_STRING, if
any). The local server requires HTTP basic auth: its token is generated once and kept in
PREFECT_HOME (`flows.prefect_server.api_auth_string`, a user-only file); the server gets it as
PREFECT_SERVER_API_AUTH_STRING, this process and its flow runs as PREFECT_API_AUTH_STRING, so other
local users cannot start runs with their own params. Each scheduled run executes
`featcal.flows.pipeline.featcal_run`, the flow of `featcal run`, with the params file and
overrides given here. `ui=True` starts the local server with Prefect's web UI and logs its URL.

It logs a trigger command that runs as printed from any shell (`trigger_command`: the `prefect`
executable of this Python by its absolute path). Each scheduled run runs in a process of its own,
below this one; `idle` says whether one runs now (featcal_cli stops an idle `serve` normally on
SIGTERM). While serving, Prefect's runner keeps the SIGTERM handler featcal_cli installed (one
marked STOPS_THE_PROCESS) instead of installing its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from featcal.flows.environment import STOPS_THE_PROCESS, configure
from featcal.flows.prefect_server import (
    AUTH_USER,
    SERVER_OF,
    TOKEN_FILE,
    api_auth_string,
    local_server,
)
from featcal_core.errors import FeatCalError

configure()  # before prefect is imported
from prefect.settings import (  # noqa: E402
    PREFECT_API_AUTH_STRING,
    PREFECT_API_URL,
    temporary_settings,
)

log = logging.getLogger(__name__)

DEPLOYMENT = "featcal-scheduled"


def serve(
    params_path: str,
    overrides: list[str],
    *,
    cron: str | None = None,
    interval_s: float | None = None,
    ui: bool = False,
) -> None:
    """Serve the pipeline with a cron or interval schedule until interrupted; `ui`: the local
    server (when PREFECT_API_URL is unset) also serves Prefect's web UI."""
    if (cron is None) == (interval_s is None):
        raise FeatCalError("featcal serve needs exactly one of --cron EXPR or --interval SECONDS")
    from featcal_core.params import load_params

    load_params(params_path, overrides)  # a bad params file fails now, not at the first run
    if os.environ.get("PREFECT_API_URL"):
        log.info("start a run now, from any shell: %s", trigger_command(None, None))
        _serve(params_path, overrides, cron, interval_s)
        return
    auth = api_auth_string(os.environ["PREFECT_HOME"])  # set by configure()
    token_file = Path(os.environ["PREFECT_HOME"]) / TOKEN_FILE
    with local_server(auth=auth, ui=ui) as api_url:
        if ui:
            log.info(
                "Prefect UI: %s (log in with `%s:` followed by the token in %s)",
                api_url.removesuffix("/api"),
                AUTH_USER,
                token_file,
            )
        log.info("start a run now, from any shell: %s", trigger_command(api_url, token_file))
        # the environment for the flow-run processes; the settings for this process, whose
        # Prefect settings were read at import
        os.environ.update(PREFECT_API_URL=api_url, PREFECT_API_AUTH_STRING=auth)
        with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}):
            _serve(params_path, overrides, cron, interval_s)


def trigger_command(api_url: str | None, token_file: Path | None) -> str:
    """The shell command that starts a run of the served deployment now: Prefect's own, with the
    local server's URL and token (read from its file, never printed) in front."""
    from featcal.flows.pipeline import FLOW_NAME

    command = f"{prefect_executable()} deployment run '{FLOW_NAME}/{DEPLOYMENT}'"
    if api_url is None:  # a server the user configured: their PREFECT_API_URL and credentials
        return command
    return (
        f'PREFECT_API_URL={api_url} PREFECT_API_AUTH_STRING="{AUTH_USER}:$(cat '
        f"'{token_file}')\" {command}"
    )


def prefect_executable() -> str:
    """The shell words that run this Python's Prefect CLI from any shell (whatever its PATH): the
    `prefect` script beside the interpreter by its absolute path, else `python -m prefect`;
    shell-quoted."""
    script = Path(sys.executable).with_name("prefect")
    if script.is_file() and os.access(script, os.X_OK):
        return shlex.quote(str(script))
    return f"{shlex.quote(sys.executable)} -m prefect"


def idle() -> bool:
    """Whether no scheduled run is in progress: every process this one started is one of its
    local Prefect servers (their environment carries SERVER_OF=this pid) or multiprocessing's
    resource tracker; any other (a flow-run process) is a run."""
    import psutil

    me = str(os.getpid())
    for child in psutil.Process().children():
        try:
            if child.environ().get(SERVER_OF) == me:
                continue
            if "multiprocessing.resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue  # ended meanwhile
        return False
    return True


@contextlib.contextmanager
def _runner_keeps_sigterm_handler() -> Iterator[None]:
    """While the body runs, Prefect's runner (`Runner.start`, which installs its own SIGTERM
    handler: a graceful shutdown racing featcal_cli's) leaves a handler marked
    STOPS_THE_PROCESS in charge: its handler calls that one (and is marked so too). Anything
    else: unchanged."""
    kept = signal.getsignal(signal.SIGTERM)
    if not getattr(kept, STOPS_THE_PROCESS, False):
        yield
        return
    from prefect.runner import Runner

    original = Runner.handle_sigterm

    def handle_sigterm(self, *args, **kwargs) -> None:
        kept(*args)

    setattr(handle_sigterm, STOPS_THE_PROCESS, True)
    Runner.handle_sigterm = handle_sigterm  # type: ignore[method-assign]
    try:
        yield
    finally:
        Runner.handle_sigterm = original  # type: ignore[method-assign]


def _serve(params_path, overrides, cron, interval_s) -> None:
    parameters = {"params_path": str(Path(params_path).resolve()), "overrides": list(overrides)}
    log.info("serving %s (%s) with %s", DEPLOYMENT, cron or f"every {interval_s} s", parameters)
    from featcal.flows.pipeline import featcal_run

    with _runner_keeps_sigterm_handler():
        featcal_run.serve(
            name=DEPLOYMENT,
            cron=cron,
            interval=interval_s,
            parameters=parameters,
            limit=1,  # one run at a time: runs share the results directory
            # Prefect's message names a trigger command without the local server's URL and token
            # (run from another shell, it reaches no server); `serve` logs a working one
            print_starting_message=False,
        )
