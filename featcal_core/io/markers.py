"""The marker of every folder featcal writes, `MARKER` (`.featcal-output.json`: the tool, a
root's kind, and each file's sha256): reading it, and checking a folder or a file against it.

Ownership is by marker, never by name: a file is featcal's when the marker of its nearest marked
folder lists it; an output is reused only when it verifies (`verify_output`, `verify_file`).
"""

from __future__ import annotations

import json
from pathlib import Path

from featcal_core.io.digests import sha256_file

#: the marker file of every directory this tool writes
MARKER = ".featcal-output.json"
#: the `kind` of a results folder's root marker (`featcal run`, the steps, the calibration flow)
RESULTS = "results"


def read_marker(directory: Path) -> dict | None:
    """The marker of `directory` ({"tool", "files": {relative path: sha256}}), or None."""
    try:
        marker = json.loads((Path(directory) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("tool") != "featcal":
        return None
    if not isinstance(marker.get("files"), dict):
        return None
    return marker


def foreign_files(directory: Path) -> list[Path]:
    """Files under `directory` that no marker lists (the nearest marked folder above each file
    decides); all of them when `directory` itself has no marker."""
    directory = Path(directory)
    foreign: list[Path] = []

    def visit(folder: Path, marker: dict | None, prefix: Path) -> None:
        own = read_marker(folder)
        if own is not None:
            marker, prefix = own, Path()
        for path in sorted(folder.iterdir()):
            name = prefix / path.name
            if path.is_dir() and not path.is_symlink():
                visit(path, marker, name)
            elif path.name == MARKER and own is not None:
                continue
            elif marker is None or str(name) not in marker["files"]:
                foreign.append(path)

    visit(directory, None, Path())
    return foreign


def verify_output(directory: Path) -> str | None:
    """None when every file the marker lists exists with its sha256 and nothing else is there;
    otherwise one line saying what is wrong (a missing, changed or unlisted file)."""
    directory = Path(directory)
    if not directory.is_dir():
        return f"{directory} does not exist"
    marker = read_marker(directory)
    if marker is None:
        return f"{directory} has no {MARKER}"
    for name, digest in sorted(marker["files"].items()):
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if sha256_file(path) != digest:
            return f"{path} changed since it was written (sha256 differs)"
    foreign = foreign_files(directory)
    if foreign:
        return f"{foreign[0]} was not written by featcal"
    return None


def verify_file(path: str | Path) -> str | None:
    """None when `path` is a file its folder's marker lists with this sha256; otherwise one line
    saying what is wrong (missing, not written by featcal, changed since written)."""
    path = Path(path)
    if not path.is_file():
        return f"{path} is missing"
    marker = read_marker(path.parent)
    if marker is None or path.name not in marker["files"]:
        return f"{path} was not written by featcal (its folder's {MARKER} does not list it)"
    if sha256_file(path) != marker["files"][path.name]:  # through a DVC cache link too
        return f"{path} changed since featcal wrote it (sha256 differs from {MARKER})"
    return None
