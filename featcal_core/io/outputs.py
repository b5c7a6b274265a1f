"""The one guarded writer: every file and directory featcal writes goes through this module.

Guarantees, each kept here (or in the `featcal_core/io` module named) and nowhere else:
- **Checked before any work** (`check_target`): an output is never `/`, the home directory, an
  input, the inside of an input, a folder that holds an input, or outside its declared root.
- **Only our own files are replaced**: a directory written here carries a marker, `MARKER`
  (`.featcal-output.json`: the tool, and each file's sha256). An existing output is replaced only
  when every file in it is listed in the marker of its nearest marked folder; anything else (a
  folder of the user's, a file the user added) stops the command with the path named.
- **Atomic**: a directory is written under a temporary name beside its target, then swapped in:
  exchanged with the old one in one step (Linux `renameat2`), or where that is not offered, the
  old one renamed aside first; the old one is removed only once the new one is in place. Files are
  renamed over their target.
- **Recognisable leftovers**: temporary names are `.<name>.featcal-tmp-<pid>-<random>` and
  `.<name>.featcal-old-<pid>-<random>`; `sweep` removes those of dead processes (an orphaned
  `-old-` whose target is missing is renamed back first) at the start of the next write of the
  same target.
- **Ownership by marker, never by name**: a results folder (`prepare_root`) is featcal's when its
  own marker says so (`"kind": "results"`); any other non-empty folder is refused whole, whatever
  its entries are called, except one restored by `dvc pull`, whose every entry must match what the
  DVC project's `dvc.lock` records for it (`featcal_core/io/restored.py`).
- **No writes through symlinks**: every write below a marked folder resolves its path and refuses
  one whose folder, resolved, leaves that marked folder (a symlinked subfolder pointing at the
  user's files).
- **Reuse only what verifies**: `verify_output` re-hashes a marked directory against its marker;
  `verify_file` a record against its folder's marker (both in `markers.py`, with the marker);
  `record_problems` every marked folder of a results folder (what `featcal lineage` checks). A
  folder the writer creates below a marked one is marked too, so every file written is listed.
- **OSError becomes one line**: a failed write (disk full, read-only, permission) raises
  FeatCalError naming the target and what is needed (`write_errors.oserror`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from featcal_core.errors import FeatCalError
from featcal_core.io import failpoints
from featcal_core.io.digests import sha256_file
from featcal_core.io.markers import MARKER, RESULTS, foreign_files, read_marker
from featcal_core.io.markers import verify_file as verify_file
from featcal_core.io.markers import verify_output as verify_output
from featcal_core.io.restored import restored_files
from featcal_core.io.run_lock import LOCK_NAME
from featcal_core.io.vocabulary import VOCAB_FILES
from featcal_core.io.write_errors import oserror

log = logging.getLogger(__name__)

TEMP_TAG = ".featcal-tmp-"
OLD_TAG = ".featcal-old-"


# ------------------------------------------------------------------------------ temporary names


#: every temporary name this process handed out (what `remove_own_temporaries` looks at)
_OWN: set[Path] = set()


def temp_path(target: Path, tag: str = TEMP_TAG) -> Path:
    """A fresh name beside `target`: `.<name><tag><pid>-<random>` (not created)."""
    target = Path(target)
    path = target.with_name(f".{target.name}{tag}{os.getpid()}-{secrets.token_hex(4)}")
    _OWN.add(Path(os.path.abspath(path)))
    return path


def _owner_alive(name: str, tag: str) -> bool:
    try:
        pid = int(name.rsplit(tag, 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    """Remove `path` (a folder with what it holds); a missing one is left alone (unlinking it on a
    read-only filesystem fails with EROFS, which would hide the write's own error)."""
    if not os.path.lexists(path):
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sweep(target: Path) -> list[Path]:
    """Remove the leftovers of dead processes beside `target`; returns what was removed.

    An `-old-` leftover whose target is missing (killed mid-swap) is renamed back to `target`.
    """
    target = Path(target)
    removed: list[Path] = []
    if not target.parent.is_dir():
        return removed
    for tag in (OLD_TAG, TEMP_TAG):
        for path in sorted(target.parent.glob(f".{glob.escape(target.name)}{tag}*")):
            if _owner_alive(path.name, tag):
                continue
            if tag == OLD_TAG and not target.exists() and not target.is_symlink():
                os.replace(path, target)  # the swap was cut between its two renames
                continue
            _remove(path)
            removed.append(path)
    return removed


def remove_own_temporaries() -> list[Path]:
    """Remove what this process's unfinished writes left (a stop that cannot unwind, e.g.
    featcal_cli's SIGTERM handling, which then exits at once): as `sweep` would after its death,
    an `-old-` whose target is missing is renamed back first. Returns what was removed."""
    removed: list[Path] = []
    for path in sorted(_OWN, key=lambda p: OLD_TAG not in p.name):  # the `-old-` ones first
        if not (path.exists() or path.is_symlink()):
            continue  # renamed into place, or removed by its writer
        if OLD_TAG in path.name:
            target = path.with_name(path.name[1:].rsplit(OLD_TAG, 1)[0])
            if not target.exists() and not target.is_symlink():
                os.replace(path, target)  # the swap was cut between its two renames
                continue
        _remove(path)
        removed.append(path)
    return removed


def sweep_tree(root: Path, depth: int = 3) -> list[Path]:
    """`sweep` every leftover of a dead process found in `root` down to `depth` levels."""
    removed: list[Path] = []
    root = Path(root)
    if not root.is_dir() or depth < 1:
        return removed
    targets = set()
    for path in root.iterdir():
        for tag in (TEMP_TAG, OLD_TAG):
            if tag in path.name and path.name.startswith("."):
                targets.add(root / path.name[1:].rsplit(tag, 1)[0])
    for target in sorted(targets):
        removed += sweep(target)
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.is_symlink():
            removed += sweep_tree(path, depth - 1)
    return removed


# ------------------------------------------------------------------------------- target checks


def check_target(
    out: str | Path,
    *,
    inputs: Iterable[str | Path | None] = (),
    root: str | Path | None = None,
    flag: str = "--out",
    may_hold_inputs: bool = False,
) -> Path:
    """`out` resolved, after checking it is a place this tool may write (see the module doc).

    inputs: files or folders the command reads (never written, never inside `out`, never holding
    `out`, unless `may_hold_inputs`: a folder featcal only adds a new subfolder to). root: the
    folder `out` must lie in (e.g. reports/). Raises FeatCalError naming `flag`.
    """
    path = Path(out).expanduser().resolve()
    fix = f"choose another {flag}"
    if path == Path(path.anchor):
        raise FeatCalError(f"{flag} {out} is the filesystem root; {fix}")
    home = Path.home().resolve()
    if path == home or path in home.parents:
        raise FeatCalError(f"{flag} {out} is your home folder or above it; {fix}")
    for item in inputs:
        if item is None:
            continue
        source = Path(item).expanduser().resolve()
        if path == source:
            raise FeatCalError(f"{flag} {out} is an input of this command ({item}); {fix}")
        if source in path.parents:
            raise FeatCalError(f"{flag} {out} lies inside the input {item}; {fix}")
        if path in source.parents and not may_hold_inputs:
            raise FeatCalError(
                f"{flag} {out} holds the input {item}; replacing it would delete that input; {fix}"
            )
    if root is not None:
        base = Path(root).expanduser().resolve()
        if path != base and base not in path.parents:
            raise FeatCalError(f"{flag} {out} is outside {root}; keep it under {root}")
    return path


def check_replaceable(out: Path, flag: str = "--out") -> None:
    """An existing `out` may be replaced: a directory holding only files this tool wrote."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise FeatCalError(
            f"{flag} {out} exists and is not a folder featcal wrote; move it away or choose "
            f"another {flag} (left untouched)"
        )
    if read_marker(out) is None:
        if not any(out.iterdir()):
            return
        raise FeatCalError(
            f"{flag} {out} exists and was not written by featcal (no {MARKER}); move it away "
            f"or choose another {flag} (left untouched)"
        )
    foreign = foreign_files(out) or _changed_small_files(out)
    if foreign:
        raise FeatCalError(
            f"{flag} {out} holds {foreign[0]}, which featcal did not write; move that file away "
            f"or choose another {flag} (left untouched)"
        )


#: the kinds of file a rerun replaces even when they no longer match their recorded sha256
#: (damaged weights, tensors, records and data shards are what a rerun heals)
HEALED_SUFFIXES = (".safetensors", ".json", ".arrow")


#: the files of a model folder featcal writes besides weights and records (tokenizer files, chat
#: template, model card): a replacement may drop them (another base has others)
MODEL_FILES = (*VOCAB_FILES, "chat_template.jinja", "README.md")


def _check_dropped(out: Path, new: Path, flag: str) -> None:
    """Refuse to replace the model folder `out` by `new` when `out` holds a file `new` does not,
    other than the kinds a rerun heals (`HEALED_SUFFIXES`) and featcal's model files
    (`MODEL_FILES`): a marker can be edited to list any file with its digest, so a user's own
    file is never deleted by the swap, whatever the marker says."""
    if not out.is_dir() or out.is_symlink():
        return
    for path in sorted(out.rglob("*")):
        if path.name in (MARKER, *MODEL_FILES) or path.suffix in HEALED_SUFFIXES:
            continue
        if not path.is_file():
            continue
        relative = path.relative_to(out)
        if not os.path.lexists(new / relative):
            raise FeatCalError(
                f"{flag} {out} holds {relative}, which the new output does not write; move that "
                f"file away or choose another {flag} (nothing was replaced)"
            )


def _changed_small_files(out: Path) -> list[Path]:
    """Files a marker lists but whose bytes are no longer those recorded, other than the kinds
    a rerun heals (`HEALED_SUFFIXES`): a user's file listed by an edited marker, or a file the
    user edited since, is never deleted by a replacement."""
    changed: list[Path] = []
    for folder in [out, *(d for d in sorted(out.rglob("*")) if d.is_dir())]:
        marker = read_marker(folder)
        for name, digest in sorted((marker or {}).get("files", {}).items()):
            path = folder / name
            if path.suffix in HEALED_SUFFIXES or not path.is_file() or path.is_symlink():
                continue
            if sha256_file(path) != digest:
                changed.append(path)
    return changed


def _absolute(path: Path) -> Path:
    """`path` made absolute without resolving its symlinks, but for the part up to its last
    `..`, which is resolved as the kernel does (a link followed by `..` leaves the link's
    target, not the folder the link is in)."""
    path = Path(path).expanduser()
    path = path if path.is_absolute() else Path.cwd() / path
    parts = path.parts
    if ".." in parts:
        last = len(parts) - 1 - parts[::-1].index("..")
        path = Path(os.path.realpath(Path(*parts[: last + 1]))).joinpath(*parts[last + 1 :])
    return Path(os.path.abspath(path))


def _owned(folder: Path) -> bool:
    """`folder` carries a marker, or is a temporary output featcal is writing
    (`.<name>.featcal-tmp-...`, marked when it is swapped in)."""
    if folder.name.startswith(".") and TEMP_TAG in folder.name and folder.is_dir():
        return True
    return read_marker(folder) is not None


def _owners(path: Path) -> list[Path]:
    """Every folder featcal owns at or above `path`, nearest first (lexically)."""
    folder = _absolute(path)
    return [candidate for candidate in (folder, *folder.parents) if _owned(candidate)]


def owner_of(path: str | Path) -> Path | None:
    """The nearest folder at or above `path` that featcal owns (a marked folder or a temporary
    output being written; lexically, symlinks not followed), or None."""
    owners = _owners(Path(path))
    return owners[0] if owners else None


def check_within_owner(target: str | Path, flag: str = "output") -> Path | None:
    """The nearest folder featcal owns that holds `target` (`owner_of`), after checking that
    `target`'s folder, resolved, lies inside the nearest root featcal prepared (a marker with a
    kind: a results folder), else the outermost featcal folder, resolved: a symlink below an output (a subfolder replaced by a link to the user's files) is refused, never written
    through. None when no featcal folder holds `target` (a new output of the user's choosing)."""
    target = _absolute(Path(target))
    owners = _owners(target.parent)
    if not owners:
        return None
    roots = [owner for owner in owners if (read_marker(owner) or {}).get("kind")]
    outer = roots[0] if roots else owners[-1]  # the prepared root (it may be a link the user set)
    existing = target.parent
    while not existing.exists() and existing != outer:
        existing = existing.parent
    resolved, root = existing.resolve(), outer.resolve()
    if resolved != root and root not in resolved.parents:
        link = next((p for p in (existing, *existing.parents) if p.is_symlink()), existing)
        raise FeatCalError(
            f"cannot write {flag} {target}: {link} is a symlink leading out of the featcal "
            f"folder {outer} (to {resolved}); featcal never writes through one; replace the link "
            "with a real folder or remove it (left untouched)"
        )
    return owners[0]


# ------------------------------------------------------------------------------------- writers


def _write_marker(directory: Path, files: dict[str, str], kind: str | None = None) -> None:
    """Write `directory`'s marker: {"tool", ["kind",] "files"}; `kind` names a root's role."""
    marker: dict = {"tool": "featcal"}
    if kind is not None:
        marker["kind"] = kind
    marker["files"] = dict(sorted(files.items()))
    tmp = temp_path(directory / MARKER)
    try:
        tmp.write_text(json.dumps(marker, indent=1) + "\n")
        os.replace(tmp, directory / MARKER)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written marker behind
        raise


def mark_directory(directory: Path) -> None:
    """Write the marker of `directory`: every file below it (but marked subfolders' files)."""
    directory = Path(directory)
    files: dict[str, str] = {}

    def visit(folder: Path, prefix: Path) -> None:
        for path in sorted(folder.iterdir()):
            if path.is_dir() and not path.is_symlink():
                if read_marker(path) is None:
                    visit(path, prefix / path.name)
            elif path.name != MARKER or folder != directory:
                files[str(prefix / path.name)] = sha256_file(path)

    visit(directory, Path())
    _write_marker(directory, files)


def check_output(
    out: str | Path,
    *,
    overwrite: bool,
    inputs: Iterable[str | Path | None] = (),
    root: str | Path | None = None,
    flag: str = "--out",
) -> Path:
    """Every check `guarded_directory` makes before writing, for commands to call before their
    work starts: `check_target`, an existing `out` needs `overwrite` and only this tool's files."""
    path = check_target(out, inputs=inputs, root=root, flag=flag)
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise FeatCalError(
            f"{flag} {out} already exists; pass --overwrite to replace it (left untouched)"
        )
    check_replaceable(out, flag)
    return path


@contextlib.contextmanager
def guarded_directory(
    out: str | Path,
    *,
    overwrite: bool,
    inputs: Iterable[str | Path | None] = (),
    root: str | Path | None = None,
    flag: str = "--out",
) -> Iterator[Path]:
    """Yield an empty temporary folder beside `out`; on success it becomes `out`, with a marker.

    Checked before the caller's work starts: `check_target`, an existing `out` needs `overwrite`
    and must hold only this tool's files. On any error the temporary folder is removed and an
    existing `out` is left as it was.
    """
    out, inputs = Path(out), list(inputs)
    check_output(out, overwrite=overwrite, inputs=inputs, root=root, flag=flag)
    check_within_owner(out, flag)
    sweep(out)
    tmp = temp_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:
        raise oserror(exc, out, flag) from exc
    try:
        yield tmp
        mark_directory(tmp)
        if any(item is not None for item in inputs):  # a model made from inputs
            _check_dropped(out, tmp, flag)
        failpoints.hit("commit", out.name)
        swap_in(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise oserror(exc, out, flag) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def scratch_directory(
    parent: str | Path, name: str, *, inputs: Iterable[str | Path | None] = (), flag: str
) -> Iterator[Path]:
    """A temporary folder `.<name>.featcal-tmp-...` in `parent` (created if missing) for
    the `with` body, removed after it; `parent` is checked as an output first (`check_target`:
    never an input or inside one) and what a killed run left there is swept."""
    parent = check_target(parent, inputs=inputs, flag=flag, may_hold_inputs=True)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        check_within_owner(parent / name, flag)
        sweep(parent / name)
        work = temp_path(parent / name)
        work.mkdir()
    except OSError as exc:
        raise oserror(exc, parent, flag) from exc
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`); False
    where the system or filesystem does not offer it (nothing changed then)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange):
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise OSError(code, os.strerror(code), str(second))
    return True


def swap_in(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`. An existing `out` is exchanged with `tmp` in one atomic step where
    the system allows (so `out` never goes missing), else renamed aside first; the old one is
    removed once the new one is in place."""
    if out.exists() or out.is_symlink():
        if exchange(tmp, out):
            _remove(tmp)  # now the old output, under a temporary name
            return
        old = temp_path(out, OLD_TAG)
        os.replace(out, old)
        os.replace(tmp, out)
        _remove(old)
    else:
        os.replace(tmp, out)


@contextlib.contextmanager
def atomic_file(path: str | Path, flag: str = "output file") -> Iterator[Path]:
    """Yield a temporary path beside `path` for the caller to write (any writer: safetensors,
    `save_to_disk`, plain bytes); on success it is renamed onto `path`.

    When the folder carries a marker, an existing file must be one the marker lists (else
    FeatCalError: it is the user's), and the marker is updated with the new file's sha256. A
    folder created here below a marked featcal folder (e.g. a results folder's `heads/`) is
    created marked, so every file written into it is listed too. On any error the temporary file
    is removed and `path` is left as it was.
    """
    path = Path(path)
    # below a featcal folder: never through a symlink leading out of it (outside one, the path is
    # the library caller's own choice; every command writes below a root it checked and marked)
    owner = check_within_owner(path, flag)
    marker = read_marker(path.parent) if path.parent.is_dir() else None
    if marker is not None and path.exists() and path.name not in marker["files"]:
        raise FeatCalError(
            f"{path} exists and was not written by featcal; move it away (left untouched)"
        )
    tmp = temp_path(path)
    try:
        if not path.parent.exists() and owner is not None and read_marker(owner) is not None:
            try:
                path.parent.mkdir(parents=True)
            except FileExistsError:
                pass  # created meanwhile by another writer, which marks it
            else:
                _write_marker(path.parent, {})
            marker = read_marker(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        if tmp.is_file():
            os.chmod(tmp, 0o644)
        failpoints.hit("commit", path.name)
        if tmp.is_dir():
            swap_in(tmp, path)
        else:
            os.replace(tmp, path)
        if marker is not None and path.is_file():
            marker = read_marker(path.parent) or marker
            files = dict(marker["files"], **{path.name: sha256_file(path)})
            _write_marker(path.parent, files, marker.get("kind"))
    except OSError as exc:
        with contextlib.suppress(OSError):  # the write's error is the one to report
            _remove(tmp)
        raise oserror(exc, path, flag) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            _remove(tmp)
        raise


def write_file(path: str | Path, data: str | bytes, flag: str = "output file") -> Path:
    """Write `data` to `path` through `atomic_file` (fsync'd before the rename)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_file(path, flag) as tmp, open(tmp, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    return Path(path)


def write_json(path: str | Path, data: object, flag: str = "output file") -> Path:
    """`write_file` of `data` as indented JSON (UTF-8, trailing newline)."""
    return write_file(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n", flag)


def _empty_tree(path: Path) -> bool:
    """`path` is a folder holding only folders, none of which holds a file or a link (nothing
    in it can be lost: a folder emptied by its owner is not a folder of the user's)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        return all(_empty_tree(entry) for entry in path.iterdir())
    except OSError:  # unreadable: not known to be empty
        return False


def _leftover(name: str) -> bool:
    """A name featcal leaves in a folder it writes: the run lock, a temporary or an old output."""
    return name == LOCK_NAME or (name.startswith(".") and (TEMP_TAG in name or OLD_TAG in name))


def _scope(folder: Path) -> tuple[list[Path], list[Path]]:
    """(the files in `folder`'s scope: in it and in its unmarked subfolders, the marker, the run
    lock and temporaries left out; the marked subfolders found there, not entered)."""
    files: list[Path] = []
    marked: list[Path] = []

    def visit(current: Path) -> None:
        for entry in sorted(current.iterdir()):
            if _leftover(entry.name) or (current == folder and entry.name == MARKER):
                continue
            if not entry.is_dir() or entry.is_symlink():
                files.append(entry)
            elif read_marker(entry) is not None:
                marked.append(entry)
            else:
                visit(entry)

    visit(folder)
    return files, marked


def record_problems(
    root: str | Path,
    *,
    skip: Iterable[str | Path] = (),
    digest: Callable[[Path], str | None] = sha256_file,
) -> list[tuple[Path, str, Path, str]]:
    """Every file the markers of `root` and of the marked folders below it list that is missing
    or changed, and every file in a marked folder below `root` that its marker does not list:
    (file, "missing" | "changed" | "unlisted", the marker, one line naming it). The writer lists each file
    it writes (`atomic_file`, `guarded_directory`), so this covers all a run wrote. Left out: the
    folders in `skip` (verified otherwise), results folders of their own below `root` (a marker
    with a kind: the calibration flow's resume cache, whose states verify by their manifests),
    and files in `root`'s own scope that its marker does not list (the run lock; folders of
    earlier versions)."""
    skipped = {os.path.abspath(path) for path in skip}
    problems: list[tuple[Path, str, Path, str]] = []

    def check(folder: Path, unlisted: bool) -> None:
        marker = read_marker(folder)
        if marker is None:
            return
        files, marked = _scope(folder)
        listed, place = marker["files"], folder / MARKER
        for name, expected in sorted(listed.items()):
            path = folder / name
            if not path.is_file():
                problems.append((path, "missing", place, f"{path} is missing ({place} lists it)"))
            elif digest(path) != expected:
                changed = f"{path} changed since featcal wrote it (sha256 differs from {place})"
                problems.append((path, "changed", place, changed))
        for path in files if unlisted else ():
            if path.relative_to(folder).as_posix() not in listed:
                foreign = f"{path} was not written by featcal ({place} does not list it)"
                problems.append((path, "unlisted", place, foreign))
        for sub in marked:
            if os.path.abspath(sub) not in skipped and not (read_marker(sub) or {}).get("kind"):
                check(sub, True)

    check(Path(root), False)
    return problems


def check_root(
    root: str | Path,
    *,
    inputs: Iterable[str | Path | None] = (),
    kind: str = RESULTS,
    flag: str = "run.results_dir",
) -> dict[str, str] | None:
    """Every check `prepare_root` makes, writing nothing (commands call it before any work).

    `root` may be missing or empty, a folder whose marker names `kind` (or, for results, a folder
    of an earlier featcal: a marker without a kind beside its run lock), or a results folder
    restored by `dvc pull` whose every entry matches the DVC project's `dvc.lock`. Anything else is
    refused whole, whatever its entries are called. Returns the files to list when adopting a
    restored folder ({name: sha256}), else None.
    """
    path = check_target(root, flag=flag)  # never the filesystem root, never the home folder
    adopted = _owned_root(path, root, kind, flag)  # whose folder it is, before what it holds
    check_target(root, inputs=inputs, flag=flag)
    return adopted


def _owned_root(path: Path, root: str | Path, kind: str, flag: str) -> dict[str, str] | None:
    """`check_root`'s ownership check of the resolved `path`: None when it is missing, empty or
    featcal's own `kind`; the files to list for a restored folder; else FeatCalError."""
    if path.exists() and not path.is_dir():
        raise FeatCalError(f"{flag} {root} is a file, not a folder; choose another {flag}")
    if not path.is_dir():
        return None
    marker = read_marker(path)
    if marker is not None:
        if marker.get("kind") == kind:
            return None
        if marker.get("kind") is None and kind == RESULTS and (path / LOCK_NAME).is_file():
            return None  # a results folder of featcal before root markers had a kind
        what = marker.get("kind") or "a model or data folder"
        raise FeatCalError(
            f"{flag} {root} is a folder featcal wrote as {what}, not as {kind}; choose a new or "
            f"empty folder for {flag} (left untouched)"
        )
    entries = sorted(e for e in path.iterdir() if not (_leftover(e.name) or _empty_tree(e)))
    if not entries:
        return None
    if kind == RESULTS:
        return restored_files(path, entries, flag)
    raise FeatCalError(
        f"{flag} {root} is a folder featcal did not create (it holds {entries[0]}); choose a new "
        f"or empty folder for {flag} (left untouched)"
    )


def prepare_root(
    root: str | Path,
    *,
    inputs: Iterable[str | Path | None] = (),
    kind: str = RESULTS,
    flag: str = "run.results_dir",
) -> Path:
    """Create or adopt an output root after `check_root` and mark it as `kind`. Returns it."""
    adopted = check_root(root, inputs=inputs, kind=kind, flag=flag)
    path = Path(root).expanduser().resolve()
    created = [p for p in (path, *path.parents) if not p.exists()]  # the deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
        marker = read_marker(path)
        if marker is None:
            _write_marker(path, adopted or {}, kind)
            if adopted:
                log.info(
                    "%s %s: adopted as restored by `dvc pull` (%d record(s) match dvc.lock)",
                    flag,
                    path,
                    len(adopted),
                )
        elif marker.get("kind") is None:
            _upgrade_root(path, marker, kind)
    except OSError as exc:
        for folder in created:  # what this call created goes again (a full disk, say)
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise oserror(exc, path, flag) from exc
    return path


#: what an earlier featcal wrote into a results folder's unmarked plots/
PLOT_FILES = ("accuracy.csv", "drift.csv")


def _upgrade_root(path: Path, marker: dict, kind: str) -> None:
    """A results folder of an earlier featcal: its marker gains its kind, and its `plots/` (then
    written file by file into an unmarked folder, now a marked output) gets a marker of its own
    when it holds plain files only."""
    plots = path / "plots"
    if plots.is_dir() and not plots.is_symlink() and read_marker(plots) is None:
        entries = list(plots.iterdir())
        if all(p.name in PLOT_FILES and p.is_file() and not p.is_symlink() for p in entries):
            mark_directory(plots)  # anything else there: the report refuses and names it
    _write_marker(path, marker["files"], kind)
