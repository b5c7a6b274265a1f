"""Named places where the fault-injection tests stop the process, to prove recovery.

`FEATCAL_FAILPOINT=<place>:<name>` SIGKILLs the process there, e.g. `commit:merged` (just before
the guarded writer renames the finished `merged` folder into place), `commit:state` (a block's
calibration state), `commit:evaluation.json`. `FEATCAL_FAILPOINT=<place>:<name>:wait=<file>`
instead pauses there until `<file>` exists (a barrier for the concurrency tests), after creating
`<file>.waiting` (so a test knows the process got there). Unset, `hit` costs one environment
lookup. Only tests set it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

ENV = "FEATCAL_FAILPOINT"


def hit(place: str, name: str) -> None:
    """Act when FEATCAL_FAILPOINT names `place:name` (see the module docstring)."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, action = wanted.partition(":wait=")
    if point != f"{place}:{name}":
        return
    if not action:
        os.kill(os.getpid(), signal.SIGKILL)
    with contextlib.suppress(OSError):
        Path(f"{action}.waiting").touch()
    deadline = time.monotonic() + 600
    while not Path(action).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
