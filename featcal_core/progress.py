"""Progress of one stage (a training, an evaluation, a merge, the blocks of a calibration): a tqdm
bar when its stream (stderr by default) is a terminal; otherwise at most one INFO line on the
`featcal_core.progress` logger per 10 % done (at most 10 lines a stage, none with `enabled`
False), never a carriage return in a log file, a pipe or CI.

    for batch in stage_progress(batches, desc="evaluate merged", unit="batch", enabled=progress_on):
        ...
    with stage_progress(total=steps, desc="base", unit="step") as bar:
        bar.update()
        bar.set_postfix(loss="0.4182")
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: a line each time this share of the stage (in %) is done, off a terminal
STEP_PERCENT = 10


class LoggedProgress(Generic[T]):
    """tqdm's interface as the stages use it (iteration, `update`, `set_postfix`,
    `set_postfix_str`, `close`, `with`), reported as log lines: one when the share done reaches
    each multiple of STEP_PERCENT (several multiples crossed by one update: one line). Without a
    total (an iterable of unknown length), one line when the stage closes."""

    def __init__(
        self,
        iterable: Iterable[T] | None,
        total: int | None,
        desc: str,
        unit: str,
        enabled: bool,
    ) -> None:
        self.iterable = iterable
        self.total = total
        self.desc = desc
        self.unit = unit
        self.enabled = enabled
        self.n = 0
        self.postfix = ""
        self.started = time.monotonic()
        self.reported = 0  # the last multiple of STEP_PERCENT logged
        self.closed = False

    def __iter__(self) -> Iterator[T]:
        if self.iterable is None:
            raise TypeError("this progress has no iterable; call update() instead")
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def __enter__(self) -> LoggedProgress[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """`n` more units done."""
        self.n += n
        if not self.enabled or not self.total:
            return
        reached = min(100, 100 * self.n // self.total) // STEP_PERCENT * STEP_PERCENT
        if reached > self.reported:
            self.reported = reached
            self._line(f"{reached} %")

    def set_postfix(self, **values: Any) -> None:
        """What the next line shows after the count (e.g. loss=0.4182)."""
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def close(self) -> None:
        """The stage ends; without a total, its one line (the count done)."""
        if self.closed:
            return
        self.closed = True
        if self.enabled and not self.total and self.n:
            self._line("done")

    def _line(self, share: str) -> None:
        count = f"{self.n} of {self.total}" if self.total else f"{self.n}"
        extra = f", {self.postfix}" if self.postfix else ""
        seconds = time.monotonic() - self.started
        log.info("%s: %s (%s %s%s; %.0f s)", self.desc, share, count, self.unit, extra, seconds)


def on_terminal(file: IO[str] | None = None) -> bool:
    """Whether `file` (None: stderr, where tqdm writes) is a terminal."""
    stream = sys.stderr if file is None else file
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def stage_progress(
    iterable: Iterable[T] | None = None,
    *,
    total: int | None = None,
    desc: str,
    unit: str = "it",
    enabled: bool = True,
    file: IO[str] | None = None,
    leave: bool = True,
) -> Any:
    """The progress of one stage: a tqdm bar on `file` (None: stderr) when it is a terminal,
    else a LoggedProgress (log lines every STEP_PERCENT %); `enabled` False: neither. `total`:
    the units of the stage (default: len(iterable), where it has one)."""
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if enabled and on_terminal(file):
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, leave=leave)
    return LoggedProgress(iterable, total, desc, unit, enabled)
