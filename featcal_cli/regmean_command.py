"""`featcal regmean`: repair a merged model's block Linears with RegMean (a baseline beside FeatCal).

Takes the same inputs as `featcal calibrate` (base, merged, one expert and one calibration set per
task) and writes the merged checkpoint with RegMean's block Linears, plus regmean.json.
"""

from __future__ import annotations

import argparse
import logging

from featcal_cli.arguments import (
    Command,
    number,
    repair_arguments,
    repair_inputs,
    repair_run_flags,
)

SETTINGS = ["num_per_task", "batch_size", "device", "max_length", "pooling", "token_weighting",
            "precision"]  # fmt: skip


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    from featcal_core.repair import DEFAULT_ALPHA

    cmd.add_argument("--base", required=True, help="base model directory (with its preprocessor)")
    repair_arguments(
        cmd, merged="merged model directory (every tensor outside the block Linears is kept)",
        out="output directory (save_pretrained layout)",
    )  # fmt: skip
    cmd.add_argument("--alpha", type=number(), default=DEFAULT_ALPHA,
                     help="scale of the Grams' off-diagonal entries, in [0, 1] (1: plain "
                     "RegMean; default: %(default)s, FusionBench's for CLIP)")  # fmt: skip
    cmd.add_argument("--pooled-weights", action="store_true",
                     help="weigh tokens in the Grams as FeatCal does (0.01 for non-pooled tokens "
                     "in the last block) instead of 1 for every real token")  # fmt: skip
    repair_run_flags(cmd, SETTINGS, spill_dir=True)


def run(args: argparse.Namespace) -> int:
    from featcal_core.repair import regmean_checkpoint

    experts, calib, settings = repair_inputs(args, "regmean", SETTINGS)
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
