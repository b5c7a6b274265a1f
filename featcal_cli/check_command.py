"""`featcal check --params FILE`: every model and dataset of a params file, checked before anything
is downloaded (featcal_core.preflight): one line per problem with its fix, exit status 2 when
there is any. "no problems found" only when every item was checked; otherwise the headline
counts the items not checked and why (offline, unreachable, not read), and `--strict` makes each
of them a problem. `featcal run` runs the same check first."""

from __future__ import annotations

import argparse
from collections import Counter

from featcal_cli.arguments import Command, params_arguments
from featcal_cli.preflight_report import preflight


def _arguments(parser: argparse.ArgumentParser) -> None:
    params_arguments(parser)
    parser.add_argument(
        "--strict",
        action="store_true",
        help="count every item that could not be checked (offline, unreachable, not read) as a "
        "problem: exit 2 unless everything was checked",
    )


def _run(args: argparse.Namespace) -> int:
    from featcal_core.params import load_params

    params = load_params(args.params, args.set)
    unchecked: list[tuple[str, str]] = []
    status = preflight(params, args.params, strict=args.strict, unchecked=unchecked)
    if status == 0:
        tasks = 0 if params.tasks is None else len(params.tasks)
        scope = "zoo" if params.zoo else f"{tasks} tasks"
        if unchecked:
            why = ", ".join(f"{n} {w}" for w, n in sorted(Counter(w for _, w in unchecked).items()))
            print(
                f"{args.params}: no problems found in what was checked ({scope}); "
                f"{len(unchecked)} item{'s' if len(unchecked) != 1 else ''} not checked ({why}): "
                "see the notes, or run with --strict to count them as problems"
            )
        else:
            print(f"{args.params}: no problems found ({scope})")
    return status


COMMANDS = (
    Command(
        "check",
        "check the models and datasets of a params file before any download",
        _arguments,
        _run,
    ),
)
