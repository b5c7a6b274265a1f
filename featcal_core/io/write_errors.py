"""A failed write (disk full, read-only, no permission) as one line: `oserror`."""

from __future__ import annotations

import errno
from pathlib import Path

from featcal_core.errors import FeatCalError


def oserror(exc: OSError, target: Path, flag: str) -> FeatCalError:
    """The one line for a failed write of `target`: what failed and what is needed."""
    needs: dict[int | None, str] = {  # errno is None for an OSError without one
        errno.ENOSPC: "free space on that filesystem",
        errno.EDQUOT: "free space on that filesystem (quota)",
        errno.EROFS: "the filesystem is read-only; choose a writable place",
        errno.EACCES: "you lack permission there; choose a place you can write",
        errno.EPERM: "you lack permission there; choose a place you can write",
    }
    need = needs.get(exc.errno, "check the path")
    what = exc.strerror or str(exc)
    return FeatCalError(f"cannot write {flag} {target}: {what}; {need} (left as it was)")
