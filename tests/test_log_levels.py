"""The command line's log levels by level, not by a list of library names: featcal's own loggers
speak at their levels; every other logger (any library's, present or created later, whatever
level it sets on itself) only from WARNING unless -v (featcal_cli.main.LibraryThreshold on the
console handler, carried over to the handler that prints above the run's progress bar)."""

from __future__ import annotations

import io
import logging

from featcal.flows.progress import run_progress
from featcal_cli.main import LibraryThreshold, configure_logging, own_logger


def _console(level: int) -> tuple[logging.Handler, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(LibraryThreshold(level))
    return handler, stream


def _emitted(handler: logging.Handler, stream: io.StringIO, name: str, level: int) -> bool:
    stream.seek(0)
    stream.truncate()
    handler.handle(logging.LogRecord(name, level, __file__, 1, "message", None, None))
    return bool(stream.getvalue())


def test_libraries_pass_from_the_threshold_whatever_their_own_level():
    handler, stream = _console(logging.WARNING)
    logging.getLogger("some_library_of_later").setLevel(logging.DEBUG)  # a library's own level
    for name in ("httpx2", "httpx", "urllib3", "alembic", "some_library_of_later", "featcalx"):
        assert not own_logger(name)
        assert not _emitted(handler, stream, name, logging.INFO), name
        assert _emitted(handler, stream, name, logging.WARNING), name
    for name in ("featcal", "featcal.tasks.evaluate", "featcal_core.method", "featcal_cli.main"):
        assert own_logger(name) and _emitted(handler, stream, name, logging.INFO), name
    handler.filters[0].level = logging.INFO  # -v
    assert _emitted(handler, stream, "httpx2", logging.INFO)
    assert not _emitted(handler, stream, "httpx2", logging.DEBUG)


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
    configure_logging(1)
    assert logging.getLogger("httpx2").isEnabledFor(logging.INFO)
    assert not logging.getLogger("httpx2").isEnabledFor(logging.DEBUG)
    configure_logging(2)
    assert logging.getLogger("featcal").isEnabledFor(logging.DEBUG)
    configure_logging(0)
