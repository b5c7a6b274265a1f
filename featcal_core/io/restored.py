"""Adopting a results folder restored by `dvc pull`: ownership proven by `dvc.lock`, not by names.

A colleague's clone gets a results folder from DVC (the cached outs: calibration sets, merged and
calibrated checkpoints) and from git (the uncached outs: the lock, `selection.json`,
`evaluation.json`, the plots), without the root marker that says featcal wrote it. Such a folder
is adopted only when **every** entry in it is one of:

- a file that the DVC project's `dvc.lock` records as an output of one of featcal's own stages
  (a stage whose command runs `featcal`), with the same md5;
- a folder that `dvc.lock` records as such an output, every file of which a featcal marker inside
  it lists with its sha256 (`markers.verify_output` on each marked folder: the calibration sets,
  the checkpoints, the plots), or whose own marker says it is a results folder (the calibration
  flow's `calibration/`, checked when it is used).

DVC's own `.gitignore` there (each line naming one of those outputs) is left as it is. Anything
else (a folder of the user's whose entries happen to be called `plots` or `calibration`)
is refused whole, naming the first entry that is not accounted for: the outputs of the user's own
stages are the user's files, whatever the folder is called. A folder that looks restored but has
no `dvc.lock` above it (copied out of the project) is refused with the ways to adopt it. Reads YAML
only; never imports DVC.
"""

from __future__ import annotations

import hashlib
import os
import shlex
from pathlib import Path

import yaml

from featcal_core.errors import FeatCalError
from featcal_core.io import markers
from featcal_core.io.digests import sha256_file

LOCK_FILE = "dvc.lock"
#: the files a featcal results folder holds at its root (git-tracked records beside DVC's outs)
RECORD_NAMES = ("models.lock.json", "evaluation.json", "metrics.json", "selection.json")


def find_dvc_lock(folder: Path) -> Path | None:
    """The `dvc.lock` of the DVC project holding `folder`: the nearest one above it, not looking
    past the project's root (the folder holding `.dvc/` or `.git/`)."""
    for candidate in (folder, *folder.parents):
        if (candidate / LOCK_FILE).is_file():
            return candidate / LOCK_FILE
        if (candidate / ".dvc").is_dir() or (candidate / ".git").exists():
            return None
    return None


def featcal_command(cmd: object) -> bool:
    """A stage command (a string or a list of them, as `dvc.lock` stores it) every part of which
    (split at `&&`, `||` and `;`) runs `featcal`, `python -m featcal_cli…` or a shell built-in
    that writes nothing of its own (`mkdir -p`, `true`)."""
    commands = cmd if isinstance(cmd, list) else [cmd]
    if not commands or not all(isinstance(c, str) for c in commands):
        return False
    found = False
    for command in map(str, commands):
        text = command.replace("&&", ";").replace("||", ";")
        for part in text.split(";"):
            try:
                words = shlex.split(part)
            except ValueError:
                return False
            if not words:
                continue
            program = Path(words[0]).name
            if program == "featcal" or (
                program.startswith("python") and words[1:3] == ["-m", "featcal_cli.main"]
            ):
                found = True
            elif program not in ("mkdir", "true"):
                return False
    return found


def recorded_outs(lock_file: Path) -> dict[Path, str]:
    """{absolute output path: md5} of the outs of featcal's own stages in `lock_file` (stages
    whose command runs featcal: `featcal_command`; a folder's md5 ends in `.dir`); {} when the file
    is not a readable lock. The outs of the user's own stages are not featcal's to adopt."""
    try:
        data = yaml.safe_load(lock_file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    stages = data.get("stages") if isinstance(data, dict) else None
    outs: dict[Path, str] = {}
    for stage in (stages or {}).values():
        if not isinstance(stage, dict) or not featcal_command(stage.get("cmd")):
            continue
        for out in stage.get("outs") or []:
            if isinstance(out, dict) and isinstance(out.get("path"), str):
                path = Path(os.path.abspath(lock_file.parent / out["path"]))
                outs[path] = str(out.get("md5") or "")
    return outs


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _marked_tree_problem(folder: Path) -> str | None:
    """None when every file below `folder` is listed, with its sha256, by a featcal marker inside
    it; else what is wrong."""
    marker = markers.read_marker(folder)
    if marker is not None and marker.get("kind") == markers.RESULTS:
        return None  # a results folder of its own (the calibration flow's): checked when used
    if marker is not None:
        return markers.verify_output(folder)
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            return f"{entry} is not inside a folder featcal marked"
        wrong = _marked_tree_problem(entry)
        if wrong is not None:
            return wrong
    return None


def _dvc_gitignore(path: Path, outs: dict[Path, str]) -> bool:
    """`path` is the `.gitignore` DVC writes beside its cached outs: each line `/<name>` names a
    DVC output in that folder (comments and blank lines aside)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    names = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return all(
        name.startswith("/") and Path(os.path.abspath(path.parent / name[1:])) in outs
        for name in names
    )


def restored_files(root: Path, entries: list[Path], flag: str) -> dict[str, str]:
    """{file name: sha256} of the files directly in `root` when every entry of it (`entries`, the
    run lock and temporaries left out) is a DVC output `dvc.lock` records as it is; FeatCalError
    naming the first entry that is not."""
    lock_file = find_dvc_lock(root.parent)
    if lock_file is None and any(e.name in RECORD_NAMES for e in entries):
        raise FeatCalError(
            f"{flag} {root} is a folder featcal did not create: no dvc.lock lies above it to "
            "prove its files are featcal's; if `dvc pull` restored it, use it inside the DVC "
            "project that restored it (where its dvc.lock is) or restore it there again (`git "
            f"clone` + `dvc pull`); else choose a new or empty folder for {flag} (left untouched)"
        )
    outs = recorded_outs(lock_file) if lock_file is not None else {}
    where = (
        f"{lock_file} does not record it as an output of featcal's own stages"
        if lock_file
        else "no dvc.lock above it"
    )
    files: dict[str, str] = {}
    for entry in entries:
        md5 = outs.get(Path(os.path.abspath(entry)))
        problem = None
        if entry.name == ".gitignore" and _dvc_gitignore(entry, outs):
            continue  # DVC's own: it keeps the cached outs out of git (left as it is)
        if md5 is None:
            problem = f"it holds {entry}, which no featcal marker lists and {where}"
        elif entry.is_dir() and not entry.is_symlink():
            wrong = _marked_tree_problem(entry)  # a folder is featcal's by its markers
            if wrong is not None:
                problem = f"it holds {entry}, restored by DVC but not as featcal wrote it ({wrong})"
        elif not entry.is_file() or _md5(entry) != md5:  # a file: by content (a cache link too)
            problem = f"it holds {entry}, which differs from what {lock_file} records"
        else:
            files[entry.name] = sha256_file(entry)
        if problem is not None:
            raise FeatCalError(
                f"{flag} {root} is a folder featcal did not create ({problem}); choose a new or "
                f"empty folder for {flag} (left untouched)"
            )
    return files
