"""Write a directory under a temporary name next to its target, then rename it into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from featcal_core.errors import FeatCalError


def check_output(out: Path, overwrite: bool, flag: str = "--out") -> None:
    if out.exists() and not overwrite:
        raise FeatCalError(
            f"{flag} {out} already exists; pass --overwrite to replace it (left untouched)"
        )


@contextmanager
def atomic_directory(out: str | Path, overwrite: bool, flag: str = "--out") -> Iterator[Path]:
    """Yield an empty temporary directory beside `out`; on success it replaces `out`.

    On any error the temporary directory is removed and an existing `out` is left as it was.
    """
    out = Path(out)
    check_output(out, overwrite, flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, backup / "old")
        os.replace(tmp, out)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(tmp, out)
