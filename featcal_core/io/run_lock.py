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
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from featcal_core.errors import FeatCalError

LOCK_NAME = ".featcal.lock"
_held: dict[Path, tuple[int, object]] = {}  # lock path -> (depth, open handle)


def holder(folder: str | Path) -> dict | None:
    """What the lock file says of its last holder ({"pid", "host", "started"}), or None."""
    try:
        data = json.loads((Path(folder) / LOCK_NAME).read_text() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        info = holder(folder) or {}
        started = info.get("started")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
        raise FeatCalError(
            f"{folder} is in use by another featcal run ({info.get('what', '?')}: pid "
            f"{info.get('pid', '?')} on {info.get('host', '?')}, since {since}; lock {path}); "
            "wait for it to finish or use another results folder"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "what": what}  # fmt: skip
        handle.write(json.dumps(record))
        handle.flush()
        _held[path] = (1, handle)
        yield
    finally:
        _held.pop(path, None)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
