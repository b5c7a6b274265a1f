"""Process memory: peak RSS, and glibc allocator settings that return freed blocks to the OS.

Calibration allocates and frees many tensors of tens of MB per block; glibc's default dynamic
mmap threshold then serves them from the heap, which fragments and keeps RSS high. A fixed
threshold makes every allocation above it an mmap that `free` hands straight back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_allocator(mmap_threshold: int = 1 << 20) -> bool:
    """Use mmap for allocations ≥ mmap_threshold bytes (glibc only); True when applied."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, mmap_threshold) == 1
    except (OSError, AttributeError):
        return False
    log.debug("glibc mmap threshold set to %d bytes: %s", mmap_threshold, ok)
    return ok


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
