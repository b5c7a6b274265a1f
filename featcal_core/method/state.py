"""Persisted calibration states, so a long calibration can resume where it stopped.

A state directory holds what block i+1 needs and what block i produced:

    streams/<kind>-<task>-<digest>.safetensors   both hidden-state streams of every task
    masks.safetensors                           token masks, one tensor per task
    block.safetensors                           block i's calibrated tensors (merged key names)
    manifest.json                               {"index", "summary", "files": {path: sha256}}

The stem state (index -1) has no block file. `verify` re-hashes every file: a state whose files no
longer match the manifest is never used. The digest of its files' hashes identifies the state's content
and feeds the next block's cache key.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeGuard

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io import failpoints
from featcal_core.io.checkpoint import sha256_file
from featcal_core.io.outputs import swap_in, temp_path
from featcal_core.io.safetensors_io import Reader, save_tensors
from featcal_core.io.write_errors import oserror
from featcal_core.method.streams import HiddenStreams

MANIFEST = "manifest.json"
MASKS = "masks.safetensors"
BLOCK = "block.safetensors"
STREAMS = "streams"


@contextmanager
def new_state_dir(final: Path) -> Iterator[Path]:
    """A fresh temporary directory beside the state `final` for the `with` body to fill and
    commit (`commit_state`); removed when the body fails, so a failed write (a full disk) leaves
    no half-written state behind. A full or read-only disk is one line naming `final`."""
    tmp = temp_path(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        raise oserror(exc, final, "calibration state") from exc
    try:
        yield tmp
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = exc if isinstance(exc, OSError) else exc.__cause__
        if isinstance(exc, OSError | FeatCalError) and _full_disk(cause):
            raise oserror(cause, final, "calibration state") from cause
        raise


def _full_disk(exc: BaseException | None) -> TypeGuard[OSError]:
    """Whether `exc` is a write refused for want of space or by a read-only filesystem."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def streams_of(directory: Path) -> HiddenStreams:
    return HiddenStreams(directory / STREAMS)


def save_masks(directory: Path, masks: dict[str, torch.Tensor]) -> None:
    save_tensors(directory / MASKS, {task: mask.contiguous() for task, mask in masks.items()})


def load_masks(directory: Path) -> dict[str, torch.Tensor]:
    with Reader(directory / MASKS) as reader:
        return {task: reader[task] for task in reader.entries}


def commit_state(tmp: Path, final: Path, index: int, summary: dict) -> str:
    """Write the manifest of `tmp`, rename it to `final` (replacing a stale one); returns the
    state's digest."""
    files = {
        str(p.relative_to(tmp)): sha256_file(p)
        for p in sorted(tmp.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"index": index, "summary": summary, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    failpoints.hit("commit", "state")
    swap_in(tmp, final)
    return digest_of(final)


def digest_of(directory: Path) -> str:
    """Content digest of a committed state: its index and its files' sha256 (not the timings)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    content = {"index": manifest["index"], "files": manifest["files"]}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def verify(directory: Path) -> dict | None:
    """The manifest when every listed file exists with its recorded sha256, else None."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        for name, digest in manifest["files"].items():
            if sha256_file(directory / name) != digest:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest
