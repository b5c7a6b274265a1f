"""The installed featcal's version, as records and model cards name it."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version


@cache
def featcal_version() -> str:
    """featcal's version from the installed distribution's metadata ("unknown" when featcal runs
    from sources that were never installed)."""
    try:
        return version("featcal")
    except PackageNotFoundError:
        return "unknown"
