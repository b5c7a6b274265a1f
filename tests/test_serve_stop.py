"""What `featcal serve` tells the user: a trigger command that runs as printed (its first word an
executable, whatever the shell's PATH), and a stop while it waits for its next run that is a
normal end (one INFO line, exit 0) where a stop during work stays an error (143)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from featcal_cli.sigterm import EXIT_STATUS, IDLE_STOPPED, STOPPED

ROOT = Path(__file__).resolve().parents[1]


def _program(words: list[str]) -> str:
    """The command's program: its first word after the `NAME=value` assignments."""
    return next(w for w in words if not (w.partition("=")[0].isidentifier() and "=" in w))


@pytest.mark.parametrize("local", [True, False])
def test_the_trigger_command_names_an_executable(tmp_path, local):
    from featcal.flows.serve import trigger_command

    token = tmp_path / "featcal-api-token"
    command = (
        trigger_command("http://127.0.0.1:4242/api", token)
        if local
        else trigger_command(None, None)
    )
    words = shlex.split(command)
    program = Path(_program(words))
    assert program.is_absolute() and program.is_file() and os.access(program, os.X_OK), command
    assert words[words.index(str(program)) + 1 : words.index(str(program)) + 3] in (
        ["deployment", "run"],
        ["-m", "prefect"],
    )


#: a command in `sigterm_stops` that waits (idle or working, as its argument says) until stopped
_WAITING = """
import logging, sys, time
from featcal_cli.main import configure_logging
from featcal_cli.sigterm import sigterm_stops, stop_when_idle
configure_logging(0)
idle = sys.argv[1] == "idle"
with sigterm_stops(), stop_when_idle(lambda: idle):
    print("waiting", flush=True)
    time.sleep(60)
"""


def _stopped(state: str) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WAITING, state],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, err


def test_sigterm_while_idle_is_a_normal_stop():
    code, err = _stopped("idle")
    assert code == 0, err
    (line,) = err.strip().splitlines()
    assert line.endswith(f"INFO featcal_cli.serve: {IDLE_STOPPED}") and "error" not in line, err


def test_sigterm_while_working_stays_an_error():
    code, err = _stopped("working")
    assert code == EXIT_STATUS
    assert err.strip().splitlines()[-1] == STOPPED
