"""`featcal run` (the whole pipeline as one Prefect flow), `featcal serve` (on a schedule) and the
single pipeline steps (`download`, `calib-set`, `heads`, `evaluate`, `report`: the DVC stages),
all driven by params.yaml."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging

from featcal_cli.arguments import Command, number, params_arguments
from featcal_cli.step_runner import run_step


def _json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print the full result as JSON instead of the table"
    )


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    params_arguments(parser)
    _json_argument(parser)


def _run(args: argparse.Namespace) -> int:
    from featcal_core.params import load_params

    params = load_params(args.params, args.set)  # validated before any heavy work
    from featcal_cli.preflight_report import preflight

    if (
        preflight(params, args.params, notes=False) != 0
    ):  # every model and dataset, before any download
        return 2
    from featcal.flows.pipeline import run_pipeline
    from featcal.flows.summary import run_summary

    summary = run_pipeline(args.params, args.set, params)
    print(json.dumps(summary, indent=2) if args.json else run_summary(summary))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    result = run_step("evaluate", args)
    from featcal.flows.summary import accuracy_table
    from featcal_core.provenance.records import EVALUATION

    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"\n{accuracy_table(result)}\n\nfull record: {EVALUATION} in the results folder "
            "(run.results_dir); --json prints it"
        )
    return 0


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    params_arguments(parser)
    parser.add_argument("--cron", help='cron schedule, e.g. "0 3 * * *"')
    parser.add_argument("--interval", type=number(above=0), help="schedule every N seconds")
    parser.add_argument(
        "--ui",
        action="store_true",
        help="the local Prefect server also serves its web UI (URL printed)",
    )


def _serve(args: argparse.Namespace) -> int:
    """Serve until stopped. Stopped while no scheduled run is in progress (SIGTERM or Ctrl-C)
    is a normal end: one INFO line `stopped`, exit status 0 (featcal_cli.sigterm.stop_when_idle);
    SIGTERM during a run ends it as any command (143)."""
    from featcal.flows.serve import idle, serve
    from featcal_cli.sigterm import IDLE_LOGGER, IDLE_STOPPED, stop_when_idle

    with stop_when_idle(idle), contextlib.suppress(KeyboardInterrupt):
        serve(args.params, args.set, cron=args.cron, interval_s=args.interval, ui=args.ui)
    logging.getLogger(IDLE_LOGGER).info(IDLE_STOPPED)
    return 0


def _code_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default="data/code", help="folder for <stage>.sha256 (default: data/code)"
    )


def _code_digests(args: argparse.Namespace) -> int:
    from featcal.flows.code_digests import write_code_digests

    for stage, digest in write_code_digests(args.out).items():
        print(f"{stage:10s} {digest}")
    return 0


def _step(name: str, step: str, text: str) -> Command:
    def run(args: argparse.Namespace) -> int:
        run_step(step, args)
        return 0

    return Command(name, f"pipeline step: {text}", params_arguments, run)


COMMANDS = (
    Command("run", "run the whole pipeline (Prefect flow) from params.yaml", _run_arguments, _run),
    Command(
        "serve", "run the pipeline on a schedule (Prefect deployment)", _serve_arguments, _serve
    ),
    _step("download", "download", "resolve the models of params.yaml and write the lock file"),
    _step("calib-set", "calibration_sets", "draw the calibration sets of params.yaml"),
    _step("select", "select", "choose among select:'s candidates (held-out scores)"),
    _step("heads", "heads", "head calibration (refit each task's head; featcal.heads)"),
    Command(
        "evaluate",
        "pipeline step: evaluate base, experts, merged and calibrated models",
        _run_arguments,
        _evaluate,
    ),
    _step("report", "report", "write reports/<run>/report.md and report.html with plots"),
    Command(
        "code-digests",
        "write one sha256 per DVC stage of the code it runs (dvc.yaml's code dependencies)",
        _code_arguments,
        _code_digests,
    ),
)
