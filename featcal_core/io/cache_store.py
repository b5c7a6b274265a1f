"""The small SQLite stores featcal keeps under the user's cache folder (file digests, evaluation
rows): where one lives and a connection to it. A store that cannot be opened is None, and its
users then work without it: a store only ever saves work, it never decides a result.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

#: values of a store's variable that turn it off
OFF = ("", "off", "0", "false")


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
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(path, timeout=10.0)
        connection.execute(schema)
        return connection
    except (OSError, sqlite3.Error) as exc:
        log.debug("store %s unavailable (%s): working without it", path, exc)
        return None
