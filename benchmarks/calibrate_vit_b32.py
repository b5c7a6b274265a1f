"""Speed and memory of `featcal calibrate` at ViT-B/32 geometry on CPU (a benchmark, not a test).

For each expert count T (default 2, 4, 8): a synthetic pool with `CLIPVisionConfig()` defaults
(ViT-B/32: 12 blocks, width 768, MLP 3072, 224 px, patch 32: 50 tokens), random base, experts =
base + N(0, δ²) deltas, Task Arithmetic merge (s = 0.3), 32 random images per task, all saved as
HF directories; then `featcal calibrate` runs in its own process on CPU. Prints per T: wall time,
peak RSS, the seconds per phase (from the record: read, forward, statistics, solve), the counted
FLOPs per phase (benchmarks/flops.py), the machine's measured bf16 / fp32 / fp64 GEMM rates and
the fraction of the floor achieved (floor = counted FLOPs at the measured rates). With several
precisions (default float32 then bfloat16, each T run in both back to back) it prints each one's
wall time as a fraction of the float32 run's.

    .venv/bin/python benchmarks/calibrate_vit_b32.py [--experts 2 4 8]
        [--precision float32 bfloat16] [--dtype float32|bfloat16] [--layers L] [--work DIR]
        [--device cpu|cuda] [--library]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import library_calibrate
import torch
from flops import counted_flops, floor_seconds, gemm_rate

from featcal_core.data.synthetic import build_pool

D, F, SEQ, BLOCKS = 768, 3072, 50, 12
PHASES = ("read", "forward", "statistics", "solve")


def run_one(num_experts: int, work: Path, args) -> list[dict]:
    root = work / f"pool_{num_experts}"
    tasks = tuple(f"task{i}" for i in range(num_experts))
    started = time.perf_counter()
    config = {"num_hidden_layers": args.layers} if args.layers else {}
    dtype = getattr(torch, args.dtype)
    pool = build_pool(
        root, "clip", config, tasks, dtype=dtype, delta=args.delta, rows=args.images, seed=0
    )
    built = time.perf_counter() - started
    rows = [_calibrate(pool, num_experts, work, args, p, built) for p in args.precision]
    shutil.rmtree(root)
    return rows


def _calibrate(pool, num_experts: int, work: Path, args, precision: str, built: float) -> dict:
    out = work / f"out_{num_experts}"
    cmd = [
        sys.executable,
        "-m",
        "featcal_cli.main",
        *pool.cli_args(out),
        "--device",
        args.device,
        "--num-per-task",
        str(args.images),
        "--precision",
        precision,
        "--overwrite",
        "--no-progress",
    ]
    if args.library:  # featcal_core.calibrate in its own process (no Prefect needed)
        cmd = library_calibrate.command(
            {
                "base": str(pool.base),
                "merged": str(pool.merged),
                "out": str(out),
                "experts": {t: str(p) for t, p in pool.experts.items()},
                "calib": {t: str(p) for t, p in pool.calib.items()},
                "profile": args.profile,
                "torch_profile": args.torch_profile,
                "trace": str(args.trace / f"trace_{num_experts}_{precision}.json")
                if args.trace
                else None,
                "options": {
                    "num_per_task": args.images,
                    "device": args.device,
                    "precision": precision,
                },
            }
        )
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - started
    record = json.loads((out / "featcal.json").read_text())
    shutil.rmtree(out)
    phases = {p: sum(b.get("phases", {}).get(p, 0.0) for b in record["blocks"]) for p in PHASES}
    return {
        "experts": num_experts,
        "build_s": round(built, 1),
        "process_wall_s": round(wall, 1),
        "calibrate_wall_s": record["wall_seconds"],
        "block_s_total": round(sum(b["seconds"] for b in record["blocks"]), 1),
        "phases": phases,
        "peak_rss_mb": round(record["peak_rss_bytes"] / 2**20),
        "peak_device_mb": round(record.get("peak_device_bytes", 0) / 2**20),
        "precision": record["hyperparameters"].get("precision", "float64"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--images", type=int, default=32, help="calibration images per task")
    parser.add_argument("--delta", type=float, default=0.002, help="std of the expert deltas")
    parser.add_argument(
        "--precision",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float64", "float32", "bfloat16", "auto"],
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the checkpoints' dtype (default float32)",
    )
    parser.add_argument("--layers", type=int, default=None, help="blocks (default: 12)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    parser.add_argument(
        "--library",
        action="store_true",
        help="run featcal_core.calibrate instead of the featcal command (no Prefect needed)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda: where the calibration and the GEMM rates run",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="with --library: print the N top functions of a cProfile of each calibration",
    )
    parser.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        metavar="N",
        help="with --library: run each calibration under torch.profiler and print its N top "
        "operators (by host time; by device time on a GPU)",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --torch-profile: write each calibration's Chrome trace into DIR",
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":  # the float32 path runs its matmuls in TF32 there (the floor's rate)
        torch.backends.cuda.matmul.allow_tf32 = True
    rates = {
        name: gemm_rate(dtype, device=args.device)
        for name, dtype in (
            ("bfloat16", torch.bfloat16),
            ("float32", torch.float32),
            ("float64", torch.float64),
        )
    }
    rows = [row for n in args.experts for row in run_one(n, work, args)]
    shown = ", ".join(f"{name} {rate / 1e9:.0f}" for name, rate in rates.items())
    where = (
        f"{torch.get_num_threads()} threads"
        if args.device == "cpu"
        else f"{args.device}, float32 as TF32"
    )
    print(f"\nGEMM rates on this machine ({where}), GFLOP/s: {shown}")
    print(
        "\n| experts | precision | featcal wall (s) | vs float32 | process wall (s) | read / "
        "forward / statistics / solve (s) | peak RSS (MiB) | peak device (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    reference = {r["experts"]: r["calibrate_wall_s"] for r in rows if r["precision"] == "float32"}
    for r in rows:
        split = " / ".join(f"{r['phases'][p]:.1f}" for p in PHASES)
        ratio = (
            f"×{r['calibrate_wall_s'] / reference[r['experts']]:.2f}"
            if r["experts"] in reference
            else "—"
        )
        print(
            f"| {r['experts']} | {r['precision']} | {r['calibrate_wall_s']:.1f} | {ratio} "
            f"| {r['process_wall_s']:.1f} | {split} | {r['peak_rss_mb']} | {r['peak_device_mb']} |"
        )
    print(
        "\n| experts | precision | counted TFLOP forward / statistics / solve | floor (s) at the "
        "measured rates | floor / featcal wall |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        flops = counted_flops(D, F, SEQ, args.layers or BLOCKS, r["experts"], args.images)
        floor = floor_seconds(flops, rates, r["precision"])
        counted = " / ".join(f"{flops[p] / 1e12:.2f}" for p in ("forward", "statistics", "solve"))
        total = sum(floor.values())
        print(
            f"| {r['experts']} | {r['precision']} | {counted} | {total:.1f} "
            f"| {100 * total / r['calibrate_wall_s']:.0f} % |"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
