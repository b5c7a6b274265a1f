"""`featcal check --params FILE`: every model and dataset of a params file, checked before anything
is downloaded (featcal_core.preflight): one line per problem with its fix, exit status 2 when
there is any. `featcal run` runs the same check first."""

from __future__ import annotations

import argparse

from featcal_cli.arguments import Command, params_arguments
from featcal_cli.preflight_report import preflight


def _run(args: argparse.Namespace) -> int:
    from featcal_core.params import load_params

    params = load_params(args.params, args.set)
    status = preflight(params, args.params)
    if status == 0:
        tasks = 0 if params.tasks is None else len(params.tasks)
        print(f"{args.params}: no problems found ({'zoo' if params.zoo else f'{tasks} tasks'})")
    return status


COMMANDS = (
    Command(
        "check",
        "check the models and datasets of a params file before any download",
        params_arguments,
        _run,
    ),
)
