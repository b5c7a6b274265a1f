"""Measuring a child process tree: wall time, summed RSS sampled while it runs, rusage and storage
reads (/proc/<pid>/io), optionally SIGKILLing it mid-way; and evicting inputs from the page cache.

Stdlib and psutil only: Linux carries the parent's RSS across fork+exec into the child, so the
measuring parent imports neither torch nor featcal.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

log = logging.getLogger("calibrate_llm_memory")

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


@dataclass
class Step:
    label: str
    returncode: int = 0
    wall_s: float = 0.0
    peak_tree_rss: int = 0  # max over samples of the summed RSS of the process tree
    ru_maxrss: int = 0  # wait4 rusage of the child (includes waited descendants)
    vmhwm: int | None = None  # the process's own peak (build.json, merge.json, featcal.json)
    read_bytes: int = 0  # from storage, summed over the tree
    read_chars: int = 0  # through read() and friends, summed over the tree
    write_chars: int = 0
    inblock_bytes: int = 0  # ru_inblock × 512 from wait4 (storage reads, cross-check)
    killed: bool = False
    samples: int = 0

    @property
    def peak_rss(self) -> int:
        return max(self.peak_tree_rss, self.vmhwm or 0)


def _sample(root: psutil.Process, io: dict[int, tuple[int, int, int]]) -> int:
    """Summed RSS of root and its descendants; updates io (pid → last io counters)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        procs = [root]
    rss = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                counters = proc.io_counters()
        except psutil.Error:
            continue
        io[proc.pid] = (counters.read_bytes, counters.read_chars, counters.write_chars)
    return rss


def measure(
    label: str,
    cmd: list[str],
    env: dict[str, str],
    log_dir: Path,
    poll: float,
    kill_when: Callable[[], bool] | None = None,
) -> Step:
    """Run cmd in its own session, sampling its process tree every `poll` s until it exits (or
    SIGKILL its process group once kill_when() is true)."""
    step = Step(label)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{label.replace(' ', '_')}.log"
    log.info("%s: %s", label, " ".join(cmd))
    io: dict[int, tuple[int, int, int]] = {}
    with open(log_path, "w") as log_file:
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        root = psutil.Process(proc.pid)
        while True:
            exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            # one more sample either way: an exited child is a zombie until reaped, its io readable
            step.peak_tree_rss = max(step.peak_tree_rss, _sample(root, io))
            step.samples += 1
            if exited is not None:
                break
            if kill_when is not None and not step.killed and kill_when():
                os.killpg(proc.pid, signal.SIGKILL)
                step.killed = True
            time.sleep(poll)
        _, status, usage = os.wait4(proc.pid, 0)
        step.wall_s = time.perf_counter() - started
        proc.returncode = step.returncode = os.waitstatus_to_exitcode(status)
    if step.killed:
        try:  # the rest of the group (e.g. a Prefect server subprocess)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    step.ru_maxrss = usage.ru_maxrss * 1024
    step.inblock_bytes = usage.ru_inblock * 512
    step.read_bytes = sum(v[0] for v in io.values())
    step.read_chars = sum(v[1] for v in io.values())
    step.write_chars = sum(v[2] for v in io.values())
    if step.returncode != 0 and not step.killed:
        tail = log_path.read_text()[-4000:]
        raise SystemExit(f"{label} failed with exit status {step.returncode}:\n{tail}")
    log.info("%s: %.1f s, peak RSS %.0f MiB", label, step.wall_s, step.peak_tree_rss / MIB)
    return step


def evict(paths: list[Path]) -> None:
    """Drop these files (directories: every file below) from the page cache (needs no root)."""
    for path in paths:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
