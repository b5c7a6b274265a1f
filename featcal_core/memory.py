"""Process memory figures for the calibration record."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from pathlib import Path


def peak_rss_bytes() -> int:
    """Peak resident set size of this process's own address space so far.

    Linux: VmHWM from /proc/self/status. (`ru_maxrss` is not used there: it survives execve, so a
    process started by a big parent reports the parent's peak.) Elsewhere: ru_maxrss.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Restart this process's peak-RSS count from the current resident set (Linux: writes 5 to
    /proc/self/clear_refs, which resets VmHWM), so `peak_rss_bytes` afterwards is the peak of
    what runs next. Returns False where that is not possible (the peak then stays the process's
    high-water mark)."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        return False
    return True


_M_MMAP_THRESHOLD = -3


def tune_allocator(mmap_threshold: int = 4 << 20) -> bool:
    """Serve allocations of at least `mmap_threshold` bytes with mmap (glibc only).

    Calibration allocates and frees many tensors of tens of MB per block; with glibc's default,
    dynamic threshold those come from the heap, which fragments and keeps the resident set high
    (measured: about 200 MB more peak RSS at ViT-B/32 size, for a few percent of speed). Process-wide;
    the `featcal` command calls it at start. Returns True when applied.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        return ctypes.CDLL(name).mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    except (OSError, AttributeError):
        return False
