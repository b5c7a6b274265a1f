"""The small SQLite stores featcal keeps under the user's cache folder (file digests, evaluation
rows): where one lives and a connection to it. A store that cannot be opened is None, and its
users then work without it: a store only ever saves work, it never decides a result. A store
another process keeps locked for longer than BUSY_TIMEOUT is skipped for the rest of the process,
with one warning (`failed`).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

#: values of a store's variable that turn it off
OFF = ("", "off", "0", "false")
#: seconds a statement waits for another process's lock on a store before the store is skipped
BUSY_TIMEOUT = 2.0
#: stores found locked by another process: skipped for the rest of this process
_BUSY: set[Path] = set()
#: SQLite's primary result codes of a lock held elsewhere (SQLITE_BUSY, SQLITE_LOCKED)
_LOCK_CODES = (5, 6)


def store_path(variable: str, filename: str) -> Path | None:
    """`$variable` (a file path; `off` disables the store: None), else
    `$XDG_CACHE_HOME/featcal/<filename>` (default `~/.cache/featcal/`)."""
    setting = os.environ.get(variable)
    if setting is not None:
        return None if setting.strip().lower() in OFF else Path(setting)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "featcal" / filename


def connect(path: Path | None, schema: str) -> sqlite3.Connection | None:
    """A connection to the store at `path` with `schema` created (None: disabled or unusable;
    concurrent processes share it through SQLite's own locking)."""
    if path is None or path in _BUSY:
        return None
    connection = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(path, timeout=BUSY_TIMEOUT)
        connection.execute(schema)
        return connection
    except (OSError, sqlite3.Error) as exc:
        if connection is not None:
            connection.close()
        failed(path, exc, "opened")
        return None


def _busy(exc: BaseException) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return (code & 0xFF) in _LOCK_CODES
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


def failed(path: Path | None, exc: BaseException, action: str) -> None:
    """Note that the store at `path` could not be `action` ("read", "written", "opened"): a
    store locked by another process is skipped from now on, with one warning; anything else
    costs this one use."""
    if path is not None and _busy(exc):
        if path not in _BUSY:
            _BUSY.add(path)
            log.warning(
                "store %s is busy (locked by another process for over %g s); working without "
                "it in this process",
                path,
                BUSY_TIMEOUT,
            )
        return
    log.debug("store %s not %s (%s): working without it", path, action, exc)
