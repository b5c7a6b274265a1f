"""`featcal run` (the whole pipeline as one Prefect flow), `featcal serve` (on a schedule) and the
single pipeline steps (`download`, `calib-set`, `heads`, `evaluate`, `report`: the DVC stages),
all driven by params.yaml."""

from __future__ import annotations

import argparse
import json

from featcal_cli.arguments import Command, params_arguments
from featcal_cli.step_runner import run_step


def _run(args: argparse.Namespace) -> int:
    from featcal_core.params import load_params

    params = load_params(args.params, args.set)  # validated before any heavy work
    from featcal.flows.pipeline import run_pipeline

    summary = run_pipeline(params)
    print(json.dumps(summary, indent=2))
    return 0


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    params_arguments(parser)
    parser.add_argument("--cron", help='cron schedule, e.g. "0 3 * * *"')
    parser.add_argument("--interval", type=float, help="schedule every N seconds")


def _serve(args: argparse.Namespace) -> int:
    from featcal.flows.serve import serve

    serve(args.params, args.set, cron=args.cron, interval_s=args.interval)
    return 0


def _step(name: str, step: str, text: str) -> Command:
    return Command(name, f"pipeline step: {text}", params_arguments,
                   lambda args: run_step(step, args))  # fmt: skip


COMMANDS = (
    Command(
        "run", "run the whole pipeline (Prefect flow) from params.yaml", params_arguments, _run
    ),
    Command(
        "serve", "run the pipeline on a schedule (Prefect deployment)", _serve_arguments, _serve
    ),
    _step("download", "download", "resolve the models of params.yaml and write the lock file"),
    _step("calib-set", "calibration_sets", "draw the calibration sets of params.yaml"),
    _step("heads", "heads", "head calibration (refit each task's head; featcal.heads)"),
    _step("evaluate", "evaluate", "evaluate base, experts, merged and calibrated models"),
    _step("report", "report", "write reports/<run>/report.md and report.html with plots"),
)
