"""A stage's progress (featcal_core.progress): a tqdm bar on a terminal only; elsewhere (a log
file, a pipe, CI) at most one log line per 10 % done and never a carriage return."""

from __future__ import annotations

import io
import logging

import torch

from featcal_core.progress import LoggedProgress, stage_progress
from featcal_core.zoo.training_loop import train_steps


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "featcal_core.progress"]


def test_off_a_terminal_a_line_per_ten_percent_and_no_carriage_return(caplog):
    caplog.set_level(logging.INFO, logger="featcal_core.progress")
    stream = io.StringIO()  # not a terminal
    with stage_progress(total=100, desc="train", unit="step", file=stream) as bar:
        assert isinstance(bar, LoggedProgress)
        for step in range(100):
            bar.update()
            bar.set_postfix(loss=f"{1 / (step + 1):.4f}")
    lines = _lines(caplog)
    assert 1 <= len(lines) <= 11, lines
    assert stream.getvalue() == ""  # nothing written where a bar would go, no "\r"
    assert lines[0].startswith("train: 10 % (10 of 100 step")
    assert lines[-1].startswith("train: 100 % (100 of 100 step, loss=0.0101")


def test_an_iterable_a_jump_past_several_steps_and_a_stage_turned_off(caplog):
    caplog.set_level(logging.INFO, logger="featcal_core.progress")
    assert list(stage_progress(range(7), desc="blocks", unit="block", file=io.StringIO())) == list(
        range(7)
    )
    assert len(_lines(caplog)) <= 7 and _lines(caplog)[-1].startswith("blocks: 100 % (7 of 7")
    caplog.clear()
    bar = stage_progress(total=10, desc="merge", unit="tensor", file=io.StringIO())
    bar.update(10)  # from 0 to 100 % at once: one line
    bar.close()
    (line,) = _lines(caplog)
    assert line.startswith("merge: 100 % (10 of 10 tensor")
    caplog.clear()
    quiet = stage_progress(total=10, desc="merge", unit="tensor", enabled=False)
    quiet.update(10)
    quiet.close()
    assert _lines(caplog) == []


def test_on_a_terminal_a_bar(caplog):
    caplog.set_level(logging.INFO, logger="featcal_core.progress")
    terminal = _Terminal()
    with stage_progress(total=5, desc="evaluate", unit="batch", file=terminal) as bar:
        bar.update(5)
    assert "evaluate" in terminal.getvalue() and "5/5" in terminal.getvalue()
    assert _lines(caplog) == []


def test_a_training_logs_its_progress_off_a_terminal(caplog, capsys):
    """The zoo's training loop, stderr captured (no terminal): its progress as log lines."""
    caplog.set_level(logging.INFO, logger="featcal_core.progress")
    weight = torch.nn.Parameter(torch.ones(2, 2))

    def step_loss(step: int) -> torch.Tensor:
        return (weight**2).sum()

    train_steps(step_loss, [weight], 100, 1e-2, 0.0, "probe", progress=True)
    assert "\r" not in capsys.readouterr().err
    lines = _lines(caplog)
    assert 1 <= len(lines) <= 11 and lines[-1].startswith("probe: 100 %"), lines
