"""SIGTERM ends any featcal command within about a second, cleanly, whatever it is doing.

A scheduler stopping the job, `timeout`, `kill`: the command ends with exit status 143 and one
line on stderr (`STOPPED`), no traceback, no temporary output left (`.featcal-tmp-` and
`.featcal-old-` names), no helper process left (its local Prefect server, Dask workers, flow-run
processes), the run lock released (by the kernel, with the process).

It is not done by raising an exception in the main thread, as Ctrl-C does: Python runs a signal
handler between any two bytecodes, so an exception raised there lands anywhere (in a garbage
collector callback, where it is printed and dropped and the run goes on; inside Prefect, which
reports a crash and replaces the handler with its own; inside a `finally` already cleaning up),
and a main thread busy in a long native call runs no handler at all. Instead:

- the Python handler (`_stop`, main thread) parks the main thread for good, so that nothing more
  of the command runs, and wakes
- a watcher thread, which also hears of the signal at once through `signal.set_wakeup_fd` (even
  while the main thread is busy in native code); it waits up to `REST_S` for the main thread to
  park, then SIGTERMs every process this one started (descendants; SIGKILL after `CHILDREN_S`),
  removes the temporary outputs this process created (`outputs.remove_own_temporaries`: an
  interrupted swap is rolled back), writes the line with one `write(2)` (no lock a parked thread
  may hold) and ends the process (`os._exit(143)`).

A child forked without exec (multiprocessing's fork) gets SIGTERM's default back and no wakeup
fd, so that its own SIGTERM never reaches this process's watcher.

A command that waits for work (`featcal serve` between runs: `stop_when_idle`) stopped while it
waits ends normally instead: its helper processes stopped as above, one INFO line (`IDLE_STOPPED`,
formatted as the console formats featcal's log lines) and exit status 0. Stopped while it works (a
scheduled run in progress), it ends as any command does (143 and `STOPPED`).

What is skipped: Python's exit handlers (Prefect and MLflow mark nothing: the MLflow run stays
RUNNING and the Prefect flow run Running; a SIGKILL leaves the same), unflushed stdout.
Finished outputs are never touched, and the next run reuses every step that finished.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

EXIT_STATUS = 128 + signal.SIGTERM
#: the one line a stopped command ends with
STOPPED = (
    "featcal: error: stopped by SIGTERM; its unfinished outputs were removed (run the same "
    "command again to resume)"
)
#: the INFO line of a waiting command stopped (`stop_when_idle`), and its logger
IDLE_STOPPED = "stopped"
IDLE_LOGGER = "featcal_cli.serve"
#: how long the watcher waits for the main thread to park before stopping anyway
REST_S = 0.5
#: how long the processes this one started have to exit after SIGTERM before SIGKILL
CHILDREN_S = 1.0

_current: _Stopper | None = None
#: while a command waits for work (`stop_when_idle`): whether it waits now
_idle: Callable[[], bool] | None = None


def _stop(signum: int, frame) -> None:
    """The SIGTERM handler while a command runs (main thread): wake the watcher, then park."""
    stopper = _current
    if stopper is None:  # not ours any more: end as SIGTERM's default does
        os._exit(EXIT_STATUS)
    stopper.wake()
    stopper.resting.set()
    time.sleep(REST_S + CHILDREN_S + 10)  # the watcher ends the process long before
    os._exit(EXIT_STATUS)


class _Stopper:
    """The watcher thread of one command and the pipe it hears signals on."""

    def __init__(self, remove_temporaries: Callable[[], object], marker: str):
        self.marker = marker  # the attribute of a handler that calls `_stop` (it parks)
        self.remove_temporaries = remove_temporaries
        self.resting = threading.Event()
        self.closed = False
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd needs it; a full pipe drops bytes
        self.thread = threading.Thread(target=self._watch, name="featcal-sigterm", daemon=True)
        self.thread.start()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full (already woken) or closed
            os.write(self.write_fd, bytes([signal.SIGTERM]))

    def close(self) -> None:
        """The command is over: the watcher thread ends, or, when a SIGTERM came first (the
        main thread was not parked: someone else's handler ran), ends the process as for any
        SIGTERM; this thread waits for that."""
        self.closed = True
        with contextlib.suppress(OSError):
            os.write(self.write_fd, b"\0")
        self.thread.join()
        os.close(self.write_fd)
        os.close(self.read_fd)

    def _watch(self) -> None:
        while True:  # the wakeup fd carries every handled signal's number; act on SIGTERM's
            try:
                data = os.read(self.read_fd, 512)
            except OSError:
                return
            if signal.SIGTERM in data:
                break
            if self.closed or not data:
                return
        idle = _waiting()  # before its helpers are stopped
        handler = signal.getsignal(signal.SIGTERM)
        if handler is _stop or getattr(handler, self.marker, False):  # else nothing parks it
            self.resting.wait(REST_S)
        children = descendants(os.getpid())
        _signal(children, signal.SIGTERM)
        deadline = time.monotonic() + CHILDREN_S
        while (alive := [pid for pid in children if _running(pid)]) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.02)
        _signal(alive, signal.SIGKILL)
        with contextlib.suppress(Exception):  # once the children are gone; the process ends now
            self.remove_temporaries()
        line = (_console_line(IDLE_LOGGER, IDLE_STOPPED) if idle else STOPPED).encode() + b"\n"
        if os.isatty(2):  # over a progress bar's partial line
            line = b"\r\x1b[K" + line
        elif _bars_open():  # below it
            line = b"\n" + line
        with contextlib.suppress(OSError):
            os.write(2, line)
        os._exit(0 if idle else EXIT_STATUS)


def _waiting() -> bool:
    """Whether the command waits for work now (`stop_when_idle`); False when it cannot tell."""
    try:
        return _idle is not None and bool(_idle())
    except Exception:
        return False


def _console_line(name: str, message: str) -> str:
    """`message` as the console prints an INFO record of logger `name` (the root's first
    handler's formatter), formatted without the logging module's locks (a parked main thread
    may hold one)."""
    record = logging.LogRecord(name, logging.INFO, __file__, 0, message, None, None)
    formatter = next((h.formatter for h in logging.getLogger().handlers if h.formatter), None)
    try:
        return formatter.format(record) if formatter is not None else message
    except Exception:
        return message


@contextlib.contextmanager
def stop_when_idle(idle: Callable[[], bool]) -> Iterator[None]:
    """For the `with` body of a command that waits for work (`featcal serve`): a SIGTERM while
    `idle()` is true (nothing in progress) ends the command as a normal stop: its helper
    processes stopped, one INFO line `IDLE_STOPPED`, exit status 0. `idle` runs on the watcher
    thread, before anything is stopped."""
    global _idle
    previous, _idle = _idle, idle
    try:
        yield
    finally:
        _idle = previous


def _forked_child() -> None:
    """In a child forked while a command runs: SIGTERM's default, the parent's pipe closed."""
    global _current
    stopper, _current = _current, None
    if stopper is None:
        return
    with contextlib.suppress(ValueError, OSError):  # ValueError: not forked from the main thread
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd in (stopper.read_fd, stopper.write_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)


def _bars_open() -> bool:
    """Whether a tqdm progress bar is showing (its line on stderr not ended)."""
    bars = getattr(sys.modules.get("tqdm.std"), "tqdm", None)
    try:
        return bool(len(getattr(bars, "_instances", ())))
    except Exception:  # whatever tqdm's state, the line is written
        return False


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, their children, ...), from Linux /proc; [] where
    there is none."""
    parents: dict[int, list[int]] = {}
    try:
        entries = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return []
    for name in entries:
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                ppid = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, exited but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


@contextlib.contextmanager
def sigterm_stops() -> Iterator[None]:
    """SIGTERM ends the process as the module docstring says, for the `with` body (a command).
    Main thread only (elsewhere: nothing changes); the previous handler and wakeup fd are
    restored after."""
    global _current
    if threading.current_thread() is not threading.main_thread() or _current is not None:
        yield
        return
    from featcal.flows.environment import STOPS_THE_PROCESS
    from featcal_core.io.outputs import remove_own_temporaries

    setattr(_stop, STOPS_THE_PROCESS, True)  # Prefect's flow engine keeps it (command_api)
    stopper = _Stopper(remove_own_temporaries, STOPS_THE_PROCESS)
    _current = stopper
    previous = signal.signal(signal.SIGTERM, _stop)
    previous_fd = signal.set_wakeup_fd(stopper.write_fd, warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous)
        _current = None
        stopper.close()
