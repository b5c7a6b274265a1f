"""`featcal` console entry point. Bad input ends with one line on stderr and exit status 2.

Every subcommand is a `featcal_cli.arguments.Command` declared in the `COMMANDS` of one command
module; this module only assembles the parser from them and dispatches.
"""

from __future__ import annotations

import argparse
import logging
import sys

from featcal_cli import (
    calibrate_command,
    demo_command,
    lineage_command,
    merge_command,
    open_clip_command,
    pipeline_commands,
    zoo_command,
)
from featcal_cli.arguments import Command
from featcal_core.errors import FeatCalError
from featcal_core.memory import tune_allocator

EXIT_BAD_INPUT = 2

#: the command modules, in the order `featcal --help` lists their commands
MODULES = (
    demo_command,
    pipeline_commands,
    merge_command,
    calibrate_command,
    lineage_command,
    open_clip_command,
    zoo_command,
)


def commands() -> dict[str, Command]:
    """Every subcommand by name (a name declared twice is a programming error)."""
    table: dict[str, Command] = {}
    for module in MODULES:
        for command in module.COMMANDS:
            if command.name in table:
                raise RuntimeError(f"featcal {command.name} is declared twice")
            table[command.name] = command
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="featcal", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands().values():
        command.add_arguments(
            sub.add_parser(command.name, help=command.help, description=command.help)
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "urllib3", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tune_allocator()
    try:
        return commands()[args.command].run(args)
    except FeatCalError as exc:
        print(f"featcal: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # one line naming the path, never a traceback
        where = f" {exc.filename}" if exc.filename else ""
        print(f"featcal: error:{where}: {exc.strerror or exc}; check that path (space, "
              "permissions, a read-only filesystem)", file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
