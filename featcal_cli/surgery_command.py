"""`featcal surgery`: train Representation Surgery modules for a merged model (a repair baseline).

Takes the merged model and, per task, its expert (with its classification head) and calibration
set; writes OUT/<task>/surgery.{safetensors,json}, one module per task on the feature its head
reads, plus OUT/surgery.json.
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
        cmd, merged="merged model directory (its tower is read)",
        expert="expert with its classification head (classifier.safetensors or a "
        "*ForSequenceClassification model)",
        out="output folder (one subfolder per task)",
    )  # fmt: skip
    cmd.add_argument("--base", default=None,
                     help="base model directory: the tokenizer of experts saved without one")  # fmt: skip
    cmd.add_argument("--rank", type=integer(), default=defaults.SURGERY_RANK,
                     help="rank r of each module (default: %(default)s, the paper's)")  # fmt: skip
    cmd.add_argument("--steps", type=integer(), default=defaults.SURGERY_STEPS,
                     help="Adam steps per task (default: %(default)s, FusionBench's)")  # fmt: skip
    cmd.add_argument("--lr", type=number(), default=defaults.SURGERY_LR,
                     help="Adam learning rate (default: %(default)s, the paper's)")  # fmt: skip
    cmd.add_argument("--surgery-batch-size", type=integer(), default=defaults.SURGERY_BATCH,
                     help="calibration rows per Adam step (default: %(default)s)")  # fmt: skip
    repair_run_flags(cmd, SETTINGS)


def run(args: argparse.Namespace) -> int:
    from featcal_core.repair import train_surgery

    experts, calib, settings = repair_inputs(args, "surgery", SETTINGS)
    record = train_surgery(
        args.merged, experts, calib, args.out, rank=args.rank, steps=args.steps, lr=args.lr,
        batch_size=args.surgery_batch_size, settings=settings, seed=args.seed,
        tokenizer_dir=args.base, overwrite=args.overwrite, progress=not args.no_progress,
    )  # fmt: skip
    logging.getLogger("featcal").info(
        "surgery for %d tasks in %.1f s, peak RSS %.0f MB -> %s",
        len(record["tasks"]), record["wall_seconds"], record["peak_rss_bytes"] / 1e6, args.out,
    )  # fmt: skip
    return 0


COMMANDS = (
    Command("surgery", "train Representation Surgery modules for a merged model (baseline)",
            add_arguments, run),
)  # fmt: skip
