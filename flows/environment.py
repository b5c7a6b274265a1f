"""Offline, quiet, project-local defaults for Prefect; call before importing prefect.

Without PREFECT_API_URL each process starts Prefect's temporary local server backed by SQLite in
PREFECT_HOME (here: `.prefect/` in the project, git-ignored). Values already set are kept.
featcal's own loggers (`featcal`, `featcal_core`) also send their records to the Prefect API while
a flow or task run is active, so the steps' and blocks' lines show in the Prefect UI beside the
run (at the level the CLI set: INFO for the step and block lines by default, everything with -v).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from featcal_core.errors import FeatCalError


def project_root() -> Path:
    """The user's project folder: the working directory (never the installed package's folder).
    `.prefect/` (Prefect's home) and `mlruns/` (the MLflow store) go there by default."""
    return Path.cwd().resolve()


DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "featcal,featcal_core",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}


def configure(prefect_home: str | Path | None = None) -> None:
    """Set Prefect's environment defaults (not overriding what the user set)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackForBadInput) for f in logger.filters):
            logger.addFilter(_NoTracebackForBadInput())
    home = prefect_home or project_root() / ".prefect"
    os.environ.setdefault("PREFECT_HOME", str(home))
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)


class _NoTracebackForBadInput(logging.Filter):
    """Prefect logs a failed flow or task run with its traceback; for bad input (FeatCalError,
    whose one line the CLI prints) the record keeps its message and loses the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], FeatCalError):
            record.exc_info, record.exc_text = None, None
        return True
