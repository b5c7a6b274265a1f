"""Detail log lines: one per block, per candidate or per task of a run. featcal's console shows
them with -v (featcal_cli.main.ConsoleThreshold); the Prefect UI gets them beside the flow run
at every verbosity (flows.environment); the run's records and report hold the same numbers.

    log.info("block %d (%d of %d): mean drift %.6g -> %.6g", ..., extra=DETAIL)
"""

from __future__ import annotations

import logging

#: the `extra=` of a detail record: the attribute it sets on the record
DETAIL = {"featcal_detail": True}


def is_detail(record: logging.LogRecord) -> bool:
    """Whether `record` was logged as a detail line (`extra=DETAIL`)."""
    return bool(getattr(record, "featcal_detail", False))


#: the attribute set on a record of a failure that the featcal command reports in its own
#: one `featcal: error:` line (flows.environment): featcal's console leaves such a record out
REPORTED = "featcal_reported"


def is_reported(record: logging.LogRecord) -> bool:
    """Whether `record` tells of a failure the command reports in its own line (REPORTED)."""
    return bool(getattr(record, REPORTED, False))


#: featcal's loggers recorded beside a run (flows and tasks; the library)
RUN_LOGGERS = ("featcal", "featcal_core")


def record_from_info() -> None:
    """Give featcal's own loggers level INFO where nobody set one, so that a process nobody
    configured (a Dask worker, a scheduled run, a script) records their INFO and detail lines
    (which handlers then show: the Prefect API's beside a run)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
