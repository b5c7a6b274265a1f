"""Run one pipeline step (the DVC stages' commands, and `featcal merge|calibrate --params`) from
params.yaml, inside the pipeline's session: checked outputs and the run lock."""

from __future__ import annotations

import argparse
import logging


def run_step(step: str, args: argparse.Namespace):
    """Run `featcal.flows.steps.Steps.<step>` for `args.params` / `args.set` and return its result;
    params are validated before any heavy work."""
    from featcal.flows.steps import Steps
    from featcal_core.params import load_params

    steps = Steps(load_params(args.params, args.set))
    if step == "calibrate":
        from featcal.flows.environment import configure

        configure()
    with steps.session(f"featcal {args.command}"):
        if step == "calibrate":
            steps.check_heads()
        result = getattr(steps, step)()
    logging.getLogger("featcal").info("%s: done (%s)", step, steps.paths["root"])
    return result
