"""`featcal demo`: the embedded default. Builds or reuses the offline zoo, runs the whole pipeline
on params.yaml and prints the per-task accuracy table; `--synthetic` calibrates a small random
pool instead and prints the per-block drift (plumbing only)."""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path

from featcal_cli.arguments import Command, integer, params_arguments
from featcal_core.errors import FeatCalError


def add_arguments(demo: argparse.ArgumentParser) -> None:
    params_arguments(demo)
    demo.add_argument(
        "--synthetic",
        action="store_true",
        help="instead: calibrate a small synthetic pool and print the per-block "
        "drift (plumbing only, no accuracy)",
    )
    demo.add_argument("--work", default="runs/demo", help="--synthetic: where the pool goes")
    demo.add_argument(
        "--tasks", type=integer(at_least=1), default=4, help="--synthetic: number of experts"
    )
    demo.add_argument("--rebuild", action="store_true", help="--synthetic: rebuild the pool")


def run(args: argparse.Namespace) -> int:
    if args.synthetic:
        return _synthetic(args)
    from featcal_core.params import load_params

    params = load_params(args.params, args.set)  # validated before any heavy work
    from featcal_cli.preflight_report import preflight

    if preflight(params, args.params, notes=False) != 0:  # as `featcal run` does
        return 2
    from featcal.flows.pipeline import run_pipeline
    from featcal.flows.summary import run_summary

    started = time.perf_counter()
    summary = run_pipeline(args.params, args.set, params)
    print(run_summary(summary))
    print(f"wall time:   {time.perf_counter() - started:.0f} s")
    return 0


def _synthetic(args: argparse.Namespace) -> int:
    from featcal_core import calibrate
    from featcal_core.data.synthetic import build_pool, load_pool

    work = Path(args.work)
    pool_dir = work / "pool"
    pool = None if args.rebuild else load_pool(pool_dir)
    if pool is None:
        logging.getLogger("featcal").info("building a synthetic pool in %s", pool_dir)
        if pool_dir.is_dir() and any(pool_dir.iterdir()) and not (pool_dir / "pool.json").is_file():
            raise FeatCalError(
                f"{pool_dir} exists and is not a synthetic pool (no pool.json); choose another "
                "--work (left untouched)"
            )
        shutil.rmtree(pool_dir, ignore_errors=True)
        config = dict(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            image_size=64,
            patch_size=16,
        )
        tasks = tuple(f"task{i}" for i in range(args.tasks))
        pool = build_pool(pool_dir, "clip", config, tasks, delta=0.01, rows=32, blocks_only=True)
    out = work / "calibrated"
    record = calibrate(pool.base, pool.merged, pool.experts, pool.calib, out, overwrite=True)
    print(f"\nFeatCal on a synthetic pool ({len(pool.experts)} experts, random weights and images)")
    print("feature drift per block, summed over tasks (last block: CLS token):\n")
    print("| block | drift before | drift after | change |")
    print("|---|---|---|---|")
    for block in record["blocks"]:
        before = sum(block["drift_before"].values())
        after = sum(block["drift_after"].values())
        print(
            f"| {block['index']} | {before:.5f} | {after:.5f} | {100 * (after / before - 1):+.1f} % |"
        )
    print(f"\ncalibrated model: {out}  (record: {out / 'featcal.json'})")
    print("accuracy needs real experts and data: see the README")
    return 0


COMMANDS = (
    Command(
        "demo",
        "the embedded default: build or reuse the offline zoo, run the whole pipeline on "
        "params.yaml and print the per-task accuracy table",
        add_arguments,
        run,
    ),
)
