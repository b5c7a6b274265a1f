"""`featcal surgery`: train Representation Surgery modules for a merged model (a repair baseline).

Takes the merged model and, per task, its expert (with its classification head) and calibration
set; writes OUT/<task>/surgery.{safetensors,json}, one module per task on the feature its head
reads, plus OUT/surgery.json.
"""

from __future__ import annotations

import argparse
import logging

from featcal_cli.arguments import Command, pairs, setting_flags, task_path
from featcal_core.errors import FeatCalError

SETTINGS = ["num_per_task", "batch_size", "device"]


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    from featcal_core.params import FeatCalSettings, RunSettings
    from featcal_core.repair.surgery import (
        DEFAULT_LR,
        DEFAULT_RANK,
        DEFAULT_STEPS,
        DEFAULT_SURGERY_BATCH,
    )

    cmd.add_argument("--merged", required=True, help="merged model directory (its tower is read)")
    cmd.add_argument("--expert", action="append", type=task_path("--expert"), metavar="TASK=DIR",
                     help="expert with its classification head (classifier.safetensors or a "
                     "*ForSequenceClassification model)")  # fmt: skip
    cmd.add_argument("--calib", action="append", type=task_path("--calib"), metavar="TASK=DIR")
    cmd.add_argument("--out", required=True, help="output folder (one subfolder per task)")
    cmd.add_argument("--base", default=None,
                     help="base model directory: the tokenizer of experts saved without one")  # fmt: skip
    cmd.add_argument("--rank", type=int, default=DEFAULT_RANK,
                     help="rank r of each module (default: %(default)s, the paper's)")  # fmt: skip
    cmd.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                     help="Adam steps per task (default: %(default)s, FusionBench's)")  # fmt: skip
    cmd.add_argument("--lr", type=float, default=DEFAULT_LR,
                     help="Adam learning rate (default: %(default)s, the paper's)")  # fmt: skip
    cmd.add_argument("--surgery-batch-size", type=int, default=DEFAULT_SURGERY_BATCH,
                     help="calibration rows per Adam step (default: %(default)s)")  # fmt: skip
    setting_flags(cmd, FeatCalSettings, SETTINGS, "featcal")
    setting_flags(cmd, RunSettings, ["seed"], "run")
    cmd.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from featcal_core.method.settings import Settings
    from featcal_core.params import featcal_from_flags
    from featcal_core.repair import train_surgery

    featcal_from_flags({name: getattr(args, name) for name in SETTINGS})  # checks the values
    experts, calib = pairs("--expert", args.expert), pairs("--calib", args.calib)
    if not experts:
        raise FeatCalError(
            "featcal surgery needs at least one --expert TASK=DIR and --calib TASK=DIR"
        )
    settings = Settings(num_per_task=args.num_per_task, batch_size=args.batch_size,
                        seed=args.seed, device=args.device)  # fmt: skip
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
