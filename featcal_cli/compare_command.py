"""`featcal compare`: the variants of the params file's `compare:` section side by side (merge ×
repair × hyperparameters) in one Prefect flow; prints the comparison table and where it is."""

from __future__ import annotations

import argparse
import json

from featcal_cli.arguments import Command, params_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    params_arguments(parser)
    parser.add_argument(
        "--json", action="store_true", help="print the comparison as JSON instead of the table"
    )


def run(args: argparse.Namespace) -> int:
    from featcal_core.params import load_params

    params = load_params(args.params, args.set)  # validated before any heavy work
    from featcal_cli.preflight_report import preflight

    if preflight(params, args.params, notes=False) != 0:  # models and data, before any download
        return 2
    from featcal.flows.compare import run_compare
    from featcal.flows.summary import shown

    summary = run_compare(args.params, args.set, params)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "files"}, indent=2, default=str))
        return 0
    text = summary["files"]["compare.md"].read_text()
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = [line for line in lines[first:] if line.startswith("|") or not line]
    table = table[: table.index("")] if "" in table else table  # the variants × tasks table
    print("\n" + "\n".join(table))
    print(
        f"\ncomparison:  {shown(summary['report'])} (compare.json: every number; "
        "accuracy_vs_cost.png)"
    )
    if summary.get("mlflow_run_id"):
        print(f"MLflow run:  {summary['mlflow_run_id']} (one child run per variant)")
    return 0


COMMANDS = (
    Command(
        "compare",
        "run the variants of params.yaml's compare: section (merge × repair × hyperparameters) "
        "side by side, sharing the download, calibration sets and merges",
        add_arguments,
        run,
    ),
)
