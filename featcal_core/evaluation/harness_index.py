"""The names lm-evaluation-harness knows (tasks, groups and tags of its own registry), remembered
per lm-eval installation, so that `featcal check` can tell a misspelt task in a second.

lm-eval builds its registry by parsing every YAML it ships (about 14,000 files: 15–30 s on a
laptop core) each time a `TaskManager` is made. The names it finds depend only on those files, so
they are kept in `<featcal cache>/lm-eval-tasks/<key>.json`, the key a sha256 of lm-eval's version
and of every file under its `tasks/` folder (relative path, size, mtime in ns; walking them takes
a tenth of a second). An edited, added or removed task file, or another lm-eval, gives another key
and the registry is read again. The featcal cache is the folder of the digest store
(`featcal_core.io.digests.store_path`; `FEATCAL_DIGEST_CACHE=off` turns both off); a cache that
cannot be read or written only costs the registry's build.

A task of the user's own (`evaluation.harness.include_path`) is indexed from its folder each
time: a few files, read in milliseconds.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from featcal_core.io import digests

log = logging.getLogger(__name__)

__all__ = ["known_names", "registry_key", "registry_names", "task_manager"]


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None, defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def _folder(include_path: str | None) -> str | None:
    return str(Path(include_path).expanduser().resolve()) if include_path else None


def task_manager(tasks: Sequence[str], include_path: str | None):
    """lm-eval's `TaskManager` for `tasks`: the include_path folder's alone when it holds every
    task, else lm-eval's registry and the folder's. One per process and folder."""
    folder = _folder(include_path)
    if folder is not None:
        own = _task_manager(folder, False)
        if all(name in own.all_tasks for name in tasks):
            return own
    return _task_manager(folder, True)


def known_names(tasks: Sequence[str], include_path: str | None) -> frozenset[str]:
    """The names lm-eval would resolve among `tasks`' candidates: the include_path folder's,
    and, unless that folder holds every task, the registry's (remembered, `registry_names`)."""
    folder = _folder(include_path)
    own = frozenset(_task_manager(folder, False).all_tasks) if folder else frozenset()
    if all(name in own for name in tasks):
        return own
    return own | registry_names()


def _tasks_folder() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("lm_eval")
    return Path(spec.origin).parent / "tasks"


def registry_key(folder: Path | None = None) -> str:
    """sha256 of lm-eval's version and of every file under its task folder (relative path, size,
    mtime_ns), hex."""
    folder = _tasks_folder() if folder is None else folder
    entries = []
    for directory, subdirectories, files in os.walk(folder):
        subdirectories.sort()
        for name in sorted(files):
            path = os.path.join(directory, name)
            stat = os.stat(path)
            entries.append(f"{os.path.relpath(path, folder)}\0{stat.st_size}\0{stat.st_mtime_ns}")
    digest = hashlib.sha256(importlib.metadata.version("lm_eval").encode())
    digest.update("\n".join(entries).encode())
    return digest.hexdigest()


def _index_file(key: str) -> Path | None:
    store = digests.store_path()
    return None if store is None else store.parent / "lm-eval-tasks" / f"{key}.json"


def _read(path: Path, key: str) -> frozenset[str] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    names = record.get("names")
    if not isinstance(names, list):
        return None
    if not all(isinstance(name, str) for name in names):
        return None
    return frozenset(names)


def _write(path: Path, key: str, names: frozenset[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".lm-eval-tasks-")
        try:
            with os.fdopen(handle, "w") as stream:
                json.dump({"key": key, "names": sorted(names)}, stream)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        log.debug("lm-eval task index %s not written (%s)", path, exc)


def registry_names() -> frozenset[str]:
    """Every task, group and tag name of lm-eval's own registry (not the user's folders)."""
    key = registry_key()
    path = _index_file(key)
    if path is not None:
        names = _read(path, key)
        if names is not None:
            return names
    log.info("indexing lm-eval's task registry (once per lm-eval installation)")
    names = frozenset(_task_manager(None, True).all_tasks)
    if path is not None:
        _write(path, key, names)
    return names
