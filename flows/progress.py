"""One progress display for a pipeline run: a bar over the run's steps (its description the step
running now), with the calibration's block counter beside it, numbered from 0 as in the logs,
the record, the report and MLflow. Shown on a terminal only (tqdm's `disable=None`: nothing in a
pipe, a log file or CI); log lines print above it (`logging_redirect_tqdm`).

    with run_progress(["download-experts", "merge", "calibrate"]) as display:
        with display.step("merge"):
            ...
    block_done(index, total)   # from the calibration flow, wherever it runs in this process
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import IO

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

_current: RunProgress | None = None


class RunProgress:
    """The bar of one run; `enabled` None: only when the output is a terminal."""

    def __init__(
        self, steps: Sequence[str], *, file: IO[str] | None = None, enabled: bool | None = None
    ):
        disable = None if enabled is None else not enabled
        self.bar = tqdm(
            total=len(steps),
            desc="featcal run",
            unit="step",
            file=file,
            disable=disable,
            leave=False,
            dynamic_ncols=True,
        )

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Show `name` while the body runs, then count it done."""
        self.bar.set_description(name)
        self.bar.set_postfix_str("")
        yield
        self.bar.update(1)

    def block(self, index: int, total: int) -> None:
        """Block `index` (from 0) of `total` is done."""
        self.bar.set_postfix_str(f"block {index} ({index + 1} of {total}) done")

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def run_progress(
    steps: Sequence[str], *, file: IO[str] | None = None, enabled: bool | None = None
) -> Iterator[RunProgress]:
    """The run's display for the `with` body (the one `block_done` reports to)."""
    global _current
    display = RunProgress(steps, file=file, enabled=enabled)
    previous, _current = _current, display
    try:
        with _log_above_the_bar():
            yield display
    finally:
        _current = previous
        display.close()


@contextlib.contextmanager
def _log_above_the_bar() -> Iterator[None]:
    """tqdm's `logging_redirect_tqdm`, whose handler takes the root's console handler's place,
    with that handler's filters (the CLI's ConsoleThreshold: libraries' INFO lines stay out)."""
    root = logging.getLogger()
    before = list(root.handlers)
    with logging_redirect_tqdm():
        replaced = [handler for handler in before if handler not in root.handlers]
        for handler in root.handlers:
            if handler not in before:
                for source in replaced:
                    for kept in source.filters:
                        handler.addFilter(kept)
        yield


def block_done(index: int, total: int) -> None:
    """Tell this process's run display (if any) that block `index` of `total` is done."""
    if _current is not None:
        _current.block(index, total)
