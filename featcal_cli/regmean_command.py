"""`featcal regmean`: repair a merged model's block Linears with RegMean (a baseline beside FeatCal).

Takes the same inputs as `featcal calibrate` (base, merged, one expert and one calibration set per
task) and writes the merged checkpoint with RegMean's block Linears, plus regmean.json.
"""

from __future__ import annotations

import argparse
import logging

from featcal_cli.arguments import Command, pairs, setting_flags, task_path
from featcal_core.errors import FeatCalError

SETTINGS = ["num_per_task", "batch_size", "device", "max_length", "pooling", "token_weighting",
            "precision"]  # fmt: skip


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    from featcal_core.params import FeatCalSettings, RunSettings
    from featcal_core.repair import DEFAULT_ALPHA

    cmd.add_argument("--base", required=True, help="base model directory (with its preprocessor)")
    cmd.add_argument("--merged", required=True,
                     help="merged model directory (every tensor outside the block Linears is kept)")  # fmt: skip
    cmd.add_argument("--expert", action="append", type=task_path("--expert"), metavar="TASK=DIR")
    cmd.add_argument("--calib", action="append", type=task_path("--calib"), metavar="TASK=DIR")
    cmd.add_argument("--out", required=True, help="output directory (save_pretrained layout)")
    cmd.add_argument("--alpha", type=float, default=DEFAULT_ALPHA,
                     help="scale of the Grams' off-diagonal entries, in [0, 1] (1: plain "
                     "RegMean; default: %(default)s, FusionBench's for CLIP)")  # fmt: skip
    cmd.add_argument("--pooled-weights", action="store_true",
                     help="weigh tokens in the Grams as FeatCal does (0.01 for non-pooled tokens "
                     "in the last block) instead of 1 for every real token")  # fmt: skip
    setting_flags(cmd, FeatCalSettings, SETTINGS, "featcal")
    setting_flags(cmd, RunSettings, ["seed"], "run")
    cmd.add_argument("--spill-dir", default=None, help="keep hidden-state streams on disk here")
    cmd.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    cmd.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from featcal_core.method.settings import Settings
    from featcal_core.params import featcal_from_flags
    from featcal_core.repair import regmean_checkpoint

    featcal_from_flags({name: getattr(args, name) for name in SETTINGS})  # checks the values
    experts, calib = pairs("--expert", args.expert), pairs("--calib", args.calib)
    if not experts:
        raise FeatCalError(
            "featcal regmean needs at least one --expert TASK=DIR and --calib TASK=DIR"
        )
    settings = Settings(args.num_per_task, args.batch_size, args.seed, args.device,
                        args.max_length, args.pooling, args.token_weighting, args.precision)  # fmt: skip
    record = regmean_checkpoint(
        args.base, args.merged, experts, calib, args.out, alpha=args.alpha, settings=settings,
        pooled_weights=args.pooled_weights, spill_dir=args.spill_dir, overwrite=args.overwrite,
        progress=not args.no_progress,
    )  # fmt: skip
    logging.getLogger("featcal").info(
        "RegMean over %d blocks in %.1f s, peak RSS %.0f MB -> %s",
        len(record["blocks"]), record["wall_seconds"], record["peak_rss_bytes"] / 1e6, args.out,
    )  # fmt: skip
    return 0


COMMANDS = (
    Command("regmean", "repair a merged model's block Linears with RegMean (baseline)",
            add_arguments, run),
)  # fmt: skip
