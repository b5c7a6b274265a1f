"""Publish a local checkpoint into a Hugging Face cache folder, as if downloaded from the Hub.

The offline zoo writes its base and experts this way so that the pipeline's download step resolves
them through exactly the code path of real Hub references (`snapshot_download(repo_id,
cache_dir=..., local_files_only=True)`), with a commit hash recorded in the lock file:

    <cache>/models--<owner>--<name>/refs/main          the commit (40 hex digits)
    <cache>/models--<owner>--<name>/snapshots/<commit>/ the files (plain copies, no symlinks)

The commit is a sha1 over the files' relative paths and sha256 digests, so the same files always
give the same commit and any change gives a new one.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import sha256_file
from featcal_core.io.outputs import atomic_file, sweep, write_file

__all__ = ["content_commit", "publish", "repo_folder"]


def repo_folder(cache_dir: str | Path, repo_id: str) -> Path:
    """`<cache>/models--owner--name` for `owner/name`."""
    owner, sep, name = repo_id.partition("/")
    if not sep or not owner or not name or "/" in name:
        raise FeatCalError(
            f"{repo_id!r} is not a Hub id owner/name; pick a name like featcal-zoo/x"
        )
    return Path(cache_dir) / f"models--{owner}--{name}"


def _files(source: Path) -> list[Path]:
    return sorted(p for p in source.rglob("*") if p.is_file())


def content_commit(source: str | Path) -> str:
    """sha1 (40 hex) over the relative paths and sha256 digests of every file below `source`."""
    source = Path(source)
    digest = hashlib.sha1(b"featcal-zoo-commit-v1\0")
    for path in _files(source):
        digest.update(path.relative_to(source).as_posix().encode() + b"\0")
        digest.update(bytes.fromhex(sha256_file(path)))
    return digest.hexdigest()


def publish(source: str | Path, cache_dir: str | Path, repo_id: str) -> str:
    """Copy the checkpoint folder `source` into the cache as `repo_id` at branch main.

    Returns the commit. Re-publishing identical files is a no-op; the snapshot is written to a
    temporary folder and renamed, and refs/main is replaced atomically, so a reader never sees a
    half-written snapshot.
    """
    source = Path(source)
    if not (source / "config.json").is_file():
        raise FeatCalError(f"{source} has no config.json; publish a save_pretrained directory")
    commit = content_commit(source)
    repo = repo_folder(cache_dir, repo_id)
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        sweep(snapshot)  # what a killed publish left
        with atomic_file(snapshot, "Hub cache snapshot") as tmp:
            for path in _files(source):
                target = tmp / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    write_file(repo / "refs" / "main", commit, "Hub cache ref")
    return commit
