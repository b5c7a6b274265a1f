"""`featcal params export`: a params file (any name, any subset of sections) with its --set
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
        "action", choices=("export",), help="export: write the full params file DVC reads"
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
        "model folder the params name)",
    )


def run(args: argparse.Namespace) -> int:
    from featcal_core.io.outputs import write_file
    from featcal_core.params import dump, load_params
    from featcal_core.params.export import model_folder_holding

    params = load_params(args.params, args.set)
    text = dump(params)
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    found = model_folder_holding(out, params)
    if found is not None:
        folder, named = found
        raise FeatCalError(
            f"--out {out} lies inside the model folder {folder}, which the params name as "
            f"{named}; featcal never writes into a model's folder, --overwrite included; choose "
            "another --out (left untouched)"
        )
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
        "export a params file (with --set overrides) as the full params.yaml that "
        "DVC's stages read",
        add_arguments,
        run,
    ),
)
