"""Offline, quiet, project-local defaults for Prefect (`configure`: call before importing
prefect), and the Prefect API of a featcal command that runs flows (`command_api`).

Without PREFECT_API_URL a featcal command that runs flows starts its own local server, once,
at its first flow (`command_api`: the API alone, backed by SQLite in PREFECT_HOME, here
`.prefect/` in the project, git-ignored; stopped when the command ends, `command_scope`), in
place of the temporary server Prefect would start: this one requires the project's API token
(`prefect_server.api_auth_string`, as `featcal serve`'s server does) and dies with the command
however the command dies (`prefect_server.start_server`). Values already set are kept.

featcal's own loggers (RUN_LOGGERS) also send their records from INFO up to the Prefect API while
a flow or task run is active (PREFECT_LOGGING_EXTRA_LOGGERS), so every featcal line of the run
(its steps, stages, blocks, candidates and scores, at every console verbosity) shows in the
Prefect UI beside the run. They record from INFO in the featcal CLI (featcal_cli.main) and, from
`configure` (`log_detail.record_from_info`), in any process nobody set their level in: a
scheduled run's own process under `featcal serve`, a script; a Dask worker does the same when it
starts a task (tasks.calibration). Where Prefect's console handler is the console (such a process),
it prints from WARNING, as the CLI's quiet console does.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import warnings
from collections.abc import Iterator
from pathlib import Path

from featcal_core.errors import FeatCalError
from featcal_core.log_detail import REPORTED, RUN_LOGGERS, record_from_info

log = logging.getLogger(__name__)


def project_root() -> Path:
    """The user's project folder: the working directory (never the installed package's folder).
    `.prefect/` (Prefect's home) and `mlruns/` (the MLflow store) go there by default."""
    return Path.cwd().resolve()


DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_EXTRA_LOGGERS": ",".join(RUN_LOGGERS),
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    # Prefect's console handler (the console of a process Prefect configured: a scheduled run's)
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
}


def configure(prefect_home: str | Path | None = None) -> None:
    """Set Prefect's environment defaults (not overriding what the user set) and RUN_LOGGERS'
    level, where none is set, to INFO. Prefect's warning at import that it cannot create
    PREFECT_HOME is left out: where featcal needs that folder (its local server) it names it in
    one line (`prefect_server.check_home`)."""
    warnings.filterwarnings(
        "ignore", message="Failed to create the Prefect home directory", category=UserWarning
    )
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OneLineFailures) for f in logger.filters):
            logger.addFilter(_OneLineFailures())
    home = prefect_home or project_root() / ".prefect"
    os.environ.setdefault("PREFECT_HOME", str(home))
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    record_from_info()  # unset (no CLI here): INFO, so that the run's lines reach the API


#: a full or read-only disk: its traceback tells nothing more than its one line
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class _OneLineFailures(logging.Filter):
    """Prefect logs a failed flow or task run (or a result it could not write) with its
    traceback. Bad input (FeatCalError, whose one line the CLI prints) keeps its message and
    loses the traceback; so does a full or read-only disk (OSError), its error added to the
    message. A failure of the MLflow tracking store becomes one line without the traceback,
    marked REPORTED: the CLI prints it in its own line, and featcal's console leaves it out."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        if isinstance(exc, FeatCalError):
            record.exc_info, record.exc_text = None, None
        elif isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
            message = record.getMessage()
            if str(exc) not in message:
                record.msg, record.args = f"{message}: {exc}", None
            record.exc_info, record.exc_text = None, None
        else:
            from featcal.tracking.store import store_failure

            failure = store_failure(exc)
            if failure is not None:
                record.msg, record.args = "the MLflow tracking store failed (%s)", (failure,)
                record.exc_info, record.exc_text = None, None
                setattr(record, REPORTED, True)
        return True


#: the attribute by which a SIGTERM handler says it ends the process itself, at once and cleanly
#: (featcal_cli.sigterm's): Prefect's flow engine then leaves it in place (`command_api`)
STOPS_THE_PROCESS = "featcal_stops_the_process"


#: the local server `command_api` started, while a `command_scope` keeps it for the rest of the
#: command: (process, API URL, auth string)
_kept: tuple | None = None
_scopes = 0


@contextlib.contextmanager
def command_scope() -> Iterator[None]:
    """One command (featcal_cli runs each in one): a local server `command_api` starts in the
    body serves every later flow of the command too and is stopped when the body ends (without
    a scope, at the end of each `command_api`): `featcal select` runs one calibration flow per
    candidate."""
    global _scopes
    _scopes += 1
    try:
        yield
    finally:
        _scopes -= 1
        if _scopes == 0:
            _stop_kept()


def _stop_kept() -> None:
    global _kept
    from featcal.flows.prefect_server import stop_server

    kept, _kept = _kept, None
    if kept is not None:
        stop_server(kept[0])


def _local_api() -> tuple[str, str]:
    """The API URL and auth string of this command's local server, started now unless it runs
    (main thread: it dies with the thread that started it)."""
    global _kept
    from featcal.flows.prefect_server import (
        api_auth_string,
        start_lock,
        start_server,
        stop_server,
        wait_healthy,
    )

    if _kept is not None and _kept[0].poll() is None:
        return _kept[1], _kept[2]
    home = os.environ["PREFECT_HOME"]  # set by configure()
    auth = api_auth_string(home)
    with start_lock(home):  # one start-up at a time on one database (its migrations)
        server, api_url = start_server(home=home, auth=auth, temporary=True)
        try:
            wait_healthy(api_url, 180, server, home)
        except BaseException:
            stop_server(server)
            raise
    log.debug("local Prefect server at %s (pid %d, basic auth)", api_url, server.pid)
    _kept = (server, api_url, auth)
    return api_url, auth


@contextlib.contextmanager
def command_api() -> Iterator[None]:
    """Prefect's API for the `with` body of a command that runs flows (main thread; re-entrant).

    With PREFECT_API_URL set (in the environment or in Prefect's settings) that server is used.
    Otherwise this command's local server (`prefect_server.start_server(temporary=True)` on
    PREFECT_HOME, with the project's API token; started by the first `command_api` of the
    command, stopped at the end of its `command_scope`) serves the body: PREFECT_API_URL and
    PREFECT_API_AUTH_STRING point at it, in Prefect's settings for this process and in the
    environment for the processes it starts; Prefect's queued logs and events are sent before
    the body ends. While a SIGTERM handler that ends the process itself is installed
    (featcal_cli's), Prefect's flow engine does not swap in its own for the flow run (its
    handler raises inside whatever runs, and the run exits 0, 1 or 143 by chance)."""
    configure()
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    if os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value():
        with _keep_sigterm_handler():
            yield
        return
    api_url, auth = _local_api()
    names = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(PREFECT_API_URL=api_url, PREFECT_API_AUTH_STRING=auth)
    try:
        with (
            temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_API_AUTH_STRING: auth}),
            _keep_sigterm_handler(),
        ):
            try:
                yield
            finally:
                _send_queued()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if _scopes == 0:
            _stop_kept()


def _send_queued() -> None:
    """Send Prefect's queued logs and events now, while the server is still there (at
    interpreter exit it would be gone)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        try:
            service.drain_all(timeout=5)
        except Exception as exc:  # a log line lost is no reason to fail the run
            log.debug("could not send Prefect's queued %s: %s", service.__name__, exc)


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """While the body runs, Prefect's flow engine keeps a SIGTERM handler marked
    STOPS_THE_PROCESS instead of installing its own (`prefect.utilities.engine.capture_sigterm`,
    which turns SIGTERM into an exception raised wherever the process is). Anything else (no
    such handler, another Prefect version): unchanged."""
    if not getattr(signal.getsignal(signal.SIGTERM), STOPS_THE_PROCESS, False):
        yield
        return
    import prefect.flow_engine as engine

    original = getattr(engine, "capture_sigterm", None)
    if original is None:
        yield
        return
    engine.capture_sigterm = contextlib.nullcontext
    try:
        yield
    finally:
        engine.capture_sigterm = original
