"""Run one pipeline step (the DVC stages' commands, and `featcal merge|calibrate --params`) from
params.yaml: validated params, the run lock, and an MLflow run like the step's in `featcal run`
(featcal.flows.single_step)."""

from __future__ import annotations

import argparse


def run_step(step: str, args: argparse.Namespace):
    """Run `featcal.flows.steps.Steps.<step>` for `args.params` / `args.set` and return its result;
    params are validated before any heavy work."""
    from featcal_core.params import load_params

    params = load_params(args.params, args.set)
    from featcal.flows.single_step import run_single_step

    return run_single_step(params, step, f"featcal {args.command}")
