"""File digests: `sha256_file`, remembered in the process and, through a small SQLite store of
sha256 by file identity, across processes.

Every pipeline step runs in a new process and checks the weight files it reads against their
recorded sha256 (reuse only what verifies). At LLM scale that is gigabytes read per step just to
hash. A file's digest is therefore kept, once computed, under its identity (device, inode, size,
mtime, ctime, all in ns): any write to the file, a rename over it or a metadata change moves its
ctime, which no user tool can set back, so a file that changed is always read again; a copy has
another inode and is read again too.

The store: `$FEATCAL_DIGEST_CACHE` (a file path; `off` disables it), else
`$XDG_CACHE_HOME/featcal/digests.sqlite` (default `~/.cache/featcal/`). Concurrent processes share
it through SQLite's own locking; any failure to read or write it only costs a re-hash (a store
another process keeps locked is skipped: featcal_core.io.cache_store).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

from featcal_core.io import cache_store

log = logging.getLogger(__name__)

#: smaller files are hashed again rather than looked up (records, configs: cheaper to read)
MIN_BYTES = 1 << 20
#: a file's identity: (device, inode, size, mtime_ns, ctime_ns)
Identity = tuple[int, int, int, int, int]

_SCHEMA = """CREATE TABLE IF NOT EXISTS digests (
    dev INTEGER, ino INTEGER, size INTEGER, mtime_ns INTEGER, ctime_ns INTEGER,
    sha256 TEXT NOT NULL, PRIMARY KEY (dev, ino))"""


def store_path() -> Path | None:
    """Where the store lives (None: disabled)."""
    return cache_store.store_path("FEATCAL_DIGEST_CACHE", "digests.sqlite")


def _connect() -> sqlite3.Connection | None:
    return cache_store.connect(store_path(), _SCHEMA)


def lookup(identity: Identity) -> str | None:
    """The recorded sha256 of the file with this identity, if one was recorded."""
    connection = _connect()
    if connection is None:
        return None
    try:
        with connection:
            row = connection.execute(
                "SELECT size, mtime_ns, ctime_ns, sha256 FROM digests WHERE dev = ? AND ino = ?",
                identity[:2],
            ).fetchone()
    except sqlite3.Error as exc:
        cache_store.failed(store_path(), exc, "read")
        return None
    finally:
        connection.close()
    if row is None or tuple(row[:3]) != identity[2:]:
        return None
    return row[3]


def record(identity: Identity, sha256: str) -> None:
    """Remember `sha256` for the file with this identity (replacing what its inode held)."""
    connection = _connect()
    if connection is None:
        return
    try:
        with connection:
            connection.execute(
                "INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?)", (*identity, sha256)
            )
    except sqlite3.Error as exc:
        cache_store.failed(store_path(), exc, "written")
    finally:
        connection.close()


#: digests of files this process has hashed, keyed by (device, inode, size, mtime, ctime): any
#: write or rename changes ctime, so a changed file is always read again
_DIGESTS: dict[Identity, str] = {}


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, remembered while the file is unchanged: in this process and,
    for files of at least `MIN_BYTES`, across processes (the store)."""
    with open(path, "rb") as handle:
        st = os.fstat(handle.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        cached = _DIGESTS.get(key)
        if cached is not None:
            return cached
        stored = st.st_size >= MIN_BYTES
        cached = lookup(key) if stored else None
        if cached is not None:
            _DIGESTS[key] = cached
            return cached
        digest = hashlib.sha256()
        while block := handle.read(chunk):
            digest.update(block)
    _DIGESTS[key] = digest.hexdigest()
    if stored:
        record(key, _DIGESTS[key])
    return _DIGESTS[key]


def hash_in_background(paths: list[Path]) -> Callable[[], None]:
    """Start hashing `paths` (`sha256_file`) in a daemon thread; returns a call that waits for
    it. Later `sha256_file` calls of those files read the remembered digests. A file the thread
    cannot read is left alone: the later call meets the same error and reports it."""

    def work() -> None:
        for path in paths:
            try:
                sha256_file(path)
            except OSError as exc:
                log.debug("background digest of %s skipped (%s)", path, exc)

    thread = threading.Thread(target=work, name="featcal-digests", daemon=True)
    thread.start()
    return thread.join
