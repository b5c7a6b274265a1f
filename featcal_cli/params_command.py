"""`featcal params`: the params files.

`featcal params list` lists the params files that ship with featcal (the paper's setting
paper-clip-vit-b32, the zoo and comparison settings: featcal_core.params.installed); every command
takes one by name (`--params paper-clip-vit-b32`) from any folder. `featcal params show NAME`
prints one as it is, comments included (`> my.yaml` starts a params file of one's own).

`featcal params export`: a params file (any name, any subset of sections) with its --set
overrides as the complete params.yaml that DVC's stages read (dvc.yaml names sections DVC looks
up in params.yaml; a section left to its defaults is missing from a short file, and `dvc repro`
stops with "Parameters ... are missing"). Every section is written, defaults filled in; the
file reads back to the same settings. Paths in it stay as written: they are relative to the
working directory the pipeline runs in, not to the params file.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from featcal_cli.arguments import Command, params_arguments
from featcal_core.errors import FeatCalError

log = logging.getLogger("featcal")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        choices=ACTIONS,
        help="list: the params files that ship with featcal; show NAME: print one; export: "
        "write the full params file DVC reads",
    )
    parser.add_argument(
        "name",
        nargs="?",
        help="show: the params file to print, a name from `featcal params list` or a path",
    )
    params_arguments(parser)
    parser.add_argument(
        "--out",
        default="params.yaml",
        help="where to write it (default: params.yaml, the file dvc.yaml's stages "
        "read); - prints it",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file whose settings differ (never a file inside a "
        "model, dataset or task folder the params name, nor inside a folder featcal wrote)",
    )


def run(args: argparse.Namespace) -> int:
    _refuse_flags_of_other_actions(args)
    if args.action == "list":
        return _list()
    if args.action == "show":
        return _show(args.name)
    return _export(args)


#: the actions, and the flags only export takes
ACTIONS = ("list", "show", "export")
EXPORT_FLAGS = {"params": "params.yaml", "set": [], "out": "params.yaml", "overwrite": False}


def _refuse_flags_of_other_actions(args: argparse.Namespace) -> None:
    """list takes nothing, show a NAME only, export its flags and no NAME: anything else would be
    silently ignored, so it is refused, naming it."""
    if args.action == "export":
        if args.name is not None:
            raise FeatCalError(
                f"featcal params export: {args.name!r} is not a flag; name the params file "
                f"with --params (e.g. --params {args.name})"
            )
        return
    given = [
        f"--{flag}" for flag, default in EXPORT_FLAGS.items() if getattr(args, flag) != default
    ]
    if given:
        raise FeatCalError(
            f"featcal params {args.action} does not take {', '.join(given)} (flags of "
            "`featcal params export`); drop them"
        )
    if args.action == "list" and args.name is not None:
        raise FeatCalError(f"featcal params list takes no name (got {args.name!r}); drop it")
    if args.action == "show" and args.name is None:
        raise FeatCalError(
            "featcal params show needs the params file to print: a name from `featcal params "
            "list` (e.g. featcal params show paper-clip-vit-b32) or a path"
        )


def _list() -> int:
    """One line per shipped params file: its name and the command that runs it."""
    from featcal_core.params.installed import installed_params, params_folder

    shipped = installed_params()
    if not shipped:
        raise FeatCalError("no params files are installed with this featcal; reinstall it")
    width = max(len(name) for name in shipped)
    for name, path in shipped.items():
        command = "compare" if _section(path, "compare") else "run"
        print(f"{name:<{width}}  featcal {command} --params {name}")
    log.info(
        "installed in %s; `featcal params show NAME` prints one (`> my.yaml` to start from it)",
        params_folder(),
    )
    return 0


def _section(path: Path, section: str) -> object:
    """The top-level `section` of the params file at `path` (None: missing, empty or unread)."""
    from featcal_core.params.base import load_yaml
    from featcal_core.params.loading import read_params_text

    try:
        data = load_yaml(read_params_text(path, str(path)))
    except Exception:  # a broken file still lists; `show` and the commands report it
        return None
    return data.get(section) if isinstance(data, dict) else None


def _show(name: str) -> int:
    """The params file `name` names (a shipped name or a path), as it is, comments included."""
    from featcal_core.params.installed import installed_hint, resolve_params
    from featcal_core.params.loading import read_params_text

    path = resolve_params(name)
    try:
        sys.stdout.write(read_params_text(path, f"featcal params show {name}"))
    except FileNotFoundError:
        raise FeatCalError(
            f"featcal params show {name}: no such params file; {installed_hint()}"
        ) from None
    except IsADirectoryError:
        raise FeatCalError(
            f"featcal params show {name}: is a directory; name a params file"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FeatCalError(f"featcal params show {name}: cannot be read ({exc})") from None
    return 0


def _export(args: argparse.Namespace) -> int:
    from featcal_core.io.outputs import write_file
    from featcal_core.params import dump, load_params
    from featcal_core.params.export import check_export_out

    params = load_params(args.params, args.set)
    text = dump(params)
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    check_export_out(out, params)
    if out.is_dir():
        raise FeatCalError(f"--out {out}: is a directory; name the file to write (params.yaml)")
    if out.exists() and not args.overwrite:
        if out.is_file() and _same_settings(out, text):
            log.info("%s already holds these settings; left as it is", out)
            return 0
        raise FeatCalError(
            f"--out {out} exists with other settings (left untouched); pass --overwrite to "
            "replace it, or another --out"
        )
    write_file(out, text, "--out")
    log.info(
        "wrote %s: every section of %s%s, defaults filled in",
        out,
        args.params,
        f" with {len(args.set)} override(s)" if args.set else "",
    )
    print(out)
    return 0


def _same_settings(path: Path, text: str) -> bool:
    """Whether the params file at `path` reads to the same settings as the exported `text`."""
    from featcal_core.params import dump, load_params

    try:
        return dump(load_params(path)) == text
    except FeatCalError:  # not a valid params file: not the same settings
        return False


COMMANDS = (
    Command(
        "params",
        "the params files: list those that ship with featcal, show one, or export one "
        "(with --set overrides) as the full params.yaml that DVC's stages read",
        add_arguments,
        run,
    ),
)
