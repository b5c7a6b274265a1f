"""`featcal adamerging`: learn Task Arithmetic coefficients per task and tower tensor by entropy
minimisation on unlabeled calibration inputs (layer-wise AdaMerging, a repair baseline).

Takes the base, the merged model (the template of every tensor AdaMerging does not learn) and,
per task, its expert (with its classification head) and calibration set; writes OUT as a
checkpoint in the merged model's layout plus OUT/adamerging.json (the coefficients, the entropy
curve, the inputs' digests).
"""

from __future__ import annotations

import argparse
import logging

from featcal_cli.arguments import (
    Command,
    integer,
    number,
    repair_arguments,
    repair_inputs,
    repair_run_flags,
)

SETTINGS = ["num_per_task", "batch_size", "device"]


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    from featcal_core.repair import defaults

    repair_arguments(
        cmd, merged="merged model directory (the template of the tensors not learnt)",
        expert="expert with its classification head (classifier.safetensors or a "
        "*ForSequenceClassification model)",
        out="output checkpoint folder",
    )  # fmt: skip
    cmd.add_argument("--base", required=True,
                     help="base model directory (task vectors are expert − base)")  # fmt: skip
    cmd.add_argument("--steps", type=integer(), default=defaults.ADAMERGING_STEPS,
                     help="Adam steps, all tasks per step (default: %(default)s, the paper's)")  # fmt: skip
    cmd.add_argument("--lr", type=number(), default=defaults.ADAMERGING_LR,
                     help="Adam learning rate (default: %(default)s, the paper's)")  # fmt: skip
    cmd.add_argument("--init", type=number(), default=defaults.ADAMERGING_INIT,
                     help="initial coefficient λ of every task and tensor (default: %(default)s, "
                     "the paper's)")  # fmt: skip
    cmd.add_argument("--adamerging-batch-size", type=integer(), default=defaults.ADAMERGING_BATCH,
                     help="calibration rows per task per Adam step (default: %(default)s)")  # fmt: skip
    repair_run_flags(cmd, SETTINGS)


def run(args: argparse.Namespace) -> int:
    from featcal_core.repair import adamerge_checkpoint

    experts, calib, settings = repair_inputs(args, "adamerging", SETTINGS)
    record = adamerge_checkpoint(
        args.base, args.merged, experts, calib, args.out, steps=args.steps, lr=args.lr,
        init=args.init, batch_size=args.adamerging_batch_size, settings=settings,
        seed=args.seed, tokenizer_dir=args.base, overwrite=args.overwrite,
        progress=not args.no_progress,
    )  # fmt: skip
    curve = record["entropy"]
    logging.getLogger("featcal").info(
        "adamerging for %d tasks: entropy %.4g -> %.4g in %.1f s, peak RSS %.0f MB -> %s",
        len(experts), curve["first"], curve["last"], record["wall_seconds"],
        record["peak_rss_bytes"] / 1e6, args.out,
    )  # fmt: skip
    return 0


COMMANDS = (
    Command("adamerging", "learn merge coefficients by entropy minimisation (AdaMerging baseline)",
            add_arguments, run),
)  # fmt: skip
