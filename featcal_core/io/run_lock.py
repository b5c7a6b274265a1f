"""The one run lock: exclusive use of a results folder for a whole run.

`featcal run`, each pipeline step (the DVC stages) and `featcal calibrate --results-dir` hold it
from before their first write to their end. A second run on the same folder stops at once with
one line naming the holder (pid, host, start time). The lock is an `flock` on
`<folder>/.featcal.lock`: the kernel releases it when the holder dies, so a stale lock (a killed
run) is taken over by the next run with no clean-up. Re-entrant within one process (a run's steps
take it again).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from featcal_core.errors import FeatCalError
from featcal_core.io.write_errors import oserror

LOCK_NAME = ".featcal.lock"
_held: dict[Path, tuple[int, int]] = {}  # lock path -> (depth, open file descriptor)


def holder(folder: str | Path) -> dict | None:
    """What the lock file says of its last holder ({"pid", "host", "started"}), or None."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as handle:
            data = json.loads(handle.read() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _failed(exc: OSError, path: Path) -> FeatCalError:
    """One line for a lock file that cannot be opened or written: a symlink (refused, never
    followed), or the guarded writer's line for a full, read-only or forbidden place."""
    if exc.errno == errno.ELOOP:
        return FeatCalError(
            f"the run lock {path} is a symlink; featcal never writes through one; remove the "
            "link (its target is left untouched) and run again"
        )
    return oserror(exc, path, "run lock")


@contextlib.contextmanager
def run_lock(folder: str | Path, what: str = "featcal run") -> Iterator[None]:
    """Hold the run lock of `folder` (created if missing) for the `with` body."""
    folder = Path(folder).resolve()
    path = folder / LOCK_NAME
    if path in _held:
        depth, handle = _held[path]
        _held[path] = (depth + 1, handle)
        try:
            yield
        finally:
            depth, handle = _held[path]
            _held[path] = (depth - 1, handle)
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # never through a symlink (O_NOFOLLOW): the lock's JSON must not land in a user's file
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _failed(exc, path) from exc
    if os.fstat(fd).st_nlink > 1:  # a hard link: the same bytes are a file elsewhere too
        os.close(fd)
        raise FeatCalError(
            f"the run lock {path} is a hard link to another file; featcal never writes into "
            "a file that has other names; remove it (the other names keep their file) and run "
            "again"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        info = holder(folder) or {}
        started = info.get("started")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
        raise FeatCalError(
            f"{folder} is in use by another featcal run ({info.get('what', '?')}: pid "
            f"{info.get('pid', '?')} on {info.get('host', '?')}, since {since}; lock {path}); "
            "wait for it to finish or use another results folder"
        ) from None
    try:
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "what": what,
        }
        try:  # unbuffered: a full disk fails here, once, not again when the lock is released
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError as exc:
            raise _failed(exc, path) from exc
        _held[path] = (1, fd)
        yield
    finally:
        _held.pop(path, None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
