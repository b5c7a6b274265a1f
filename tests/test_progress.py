"""The run's one progress display (flows/progress.py): the steps, and the calibration's block
counter beside them, numbered from 0; nothing when the output is not a terminal."""

from __future__ import annotations

import io

from featcal.flows.progress import block_done, run_progress


def test_the_display_shows_each_step_and_the_blocks():
    out = io.StringIO()
    with run_progress(["merge", "calibrate"], file=out, enabled=True) as display:
        with display.step("merge"):
            pass
        with display.step("calibrate"):
            block_done(0, 4)
            block_done(3, 4)
    text = out.getvalue()
    assert "merge" in text and "calibrate" in text
    assert "block 3 (4 of 4) done" in text and "1/2" in text
    block_done(1, 4)  # outside a run: nothing to report to, no error


def test_no_display_off_a_terminal():
    out = io.StringIO()  # not a terminal
    with run_progress(["merge"], file=out) as display:
        with display.step("merge"):
            block_done(0, 1)
    assert out.getvalue() == ""
