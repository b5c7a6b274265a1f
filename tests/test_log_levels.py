"""The command line's log levels by level, not by a list of library names: featcal's own loggers
record from INFO; the console shows their step and result lines (QUIET_INFO, detail lines
left out) and every other logger (any library's, present or created later, whatever level it
sets on itself) only from WARNING unless -v (featcal_cli.main.ConsoleThreshold on the console
handler, carried over to the handler that prints above the run's progress bar)."""

from __future__ import annotations

import io
import logging

from featcal.flows.progress import run_progress
from featcal.tasks.evaluate import _normalize  # Prefect configures logging before caplog's
from featcal_cli.main import ConsoleThreshold, configure_logging, own_logger
from featcal_core.log_detail import DETAIL, is_detail
from featcal_core.method.block import BlockResult
from featcal_core.method.calibration import log_block


def _console(level: int) -> tuple[logging.Handler, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ConsoleThreshold(level))
    return handler, stream


def _emitted(
    handler: logging.Handler, stream: io.StringIO, name: str, level: int, detail: bool = False
) -> bool:
    stream.seek(0)
    stream.truncate()
    record = logging.LogRecord(name, level, __file__, 1, "message", None, None)
    record.__dict__.update(DETAIL if detail else {})
    handler.handle(record)
    return bool(stream.getvalue())


def test_libraries_pass_from_the_threshold_whatever_their_own_level():
    handler, stream = _console(logging.WARNING)
    logging.getLogger("some_library_of_later").setLevel(logging.DEBUG)  # a library's own level
    for name in ("httpx2", "httpx", "urllib3", "alembic", "some_library_of_later", "featcalx"):
        assert not own_logger(name)
        assert not _emitted(handler, stream, name, logging.INFO), name
        assert _emitted(handler, stream, name, logging.WARNING), name
    for name in ("featcal", "featcal.tasks.evaluate", "featcal_cli.main", "featcal_core.progress"):
        assert own_logger(name) and _emitted(handler, stream, name, logging.INFO), name
        assert not _emitted(handler, stream, name, logging.INFO, detail=True), name
        assert _emitted(handler, stream, name, logging.WARNING, detail=True), name
    for name in ("featcal_core.method.calibration", "featcal_core.evaluation.accuracy"):
        assert own_logger(name) and not _emitted(handler, stream, name, logging.INFO), name
        assert _emitted(handler, stream, name, logging.WARNING), name
    handler.filters[0].level = logging.INFO  # -v
    assert _emitted(handler, stream, "httpx2", logging.INFO)
    assert not _emitted(handler, stream, "httpx2", logging.DEBUG)
    assert _emitted(handler, stream, "featcal.tasks.evaluate", logging.INFO, detail=True)
    assert _emitted(handler, stream, "featcal_core.method.calibration", logging.INFO)


def test_the_threshold_holds_above_the_progress_bar(monkeypatch):
    root = logging.getLogger()
    handler, stream = _console(logging.WARNING)
    monkeypatch.setattr(root, "handlers", [handler])  # restored after the test
    monkeypatch.setattr(root, "level", logging.INFO)
    noisy = logging.getLogger("a_library_with_its_own_level")
    monkeypatch.setattr(noisy, "level", logging.INFO)
    with run_progress(["merge"], enabled=False):
        assert root.handlers != [handler]  # tqdm's handler prints above the bar
        noisy.info("HTTP Request: GET http://127.0.0.1/")
        logging.getLogger("featcal").info("merged")
    assert root.handlers == [handler]
    assert "HTTP Request" not in stream.getvalue() and "merged" in stream.getvalue()


def test_quiet_root_level_and_own_loggers(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    configure_logging(0)
    assert not logging.getLogger("httpx2").isEnabledFor(logging.INFO)
    assert not logging.getLogger("a_library_imported_later").isEnabledFor(logging.INFO)
    assert logging.getLogger("featcal_cli.check_command").isEnabledFor(logging.INFO)
    assert logging.getLogger("featcal.flows.pipeline").isEnabledFor(logging.INFO)
    # recorded (for the Prefect UI) though the console leaves them out
    assert logging.getLogger("featcal_core.evaluation.accuracy").isEnabledFor(logging.INFO)
    assert not logging.getLogger("featcal_core.evaluation.accuracy").isEnabledFor(logging.DEBUG)
    configure_logging(1)
    assert logging.getLogger("httpx2").isEnabledFor(logging.INFO)
    assert not logging.getLogger("httpx2").isEnabledFor(logging.DEBUG)
    configure_logging(2)
    assert logging.getLogger("featcal").isEnabledFor(logging.DEBUG)
    configure_logging(0)


def test_per_block_and_per_task_lines_are_details(caplog):
    """The lines a run logs per block and per task (its candidates' scores, its accuracy row)
    are detail lines: the console shows them with -v; the report and the Prefect UI hold them
    at every verbosity."""
    caplog.set_level(logging.INFO)
    log_block(BlockResult(0, {}, {"alpha": 2.0}, {"alpha": 1.0}, 0.5), 4)
    row = {name: {"accuracy": 0.5} for name in ("expert", "merged", "calibrated")}
    _normalize("alpha", row)
    block, task = caplog.records[-2:]
    assert block.getMessage().startswith("block 0 (1 of 4)") and task.getMessage().startswith(
        "evaluate alpha"
    )
    quiet, verbose = ConsoleThreshold(logging.WARNING), ConsoleThreshold(logging.INFO)
    for record in (block, task):
        assert is_detail(record) and not quiet.filter(record) and verbose.filter(record)
