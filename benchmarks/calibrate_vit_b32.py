"""Speed and memory of `featcal calibrate` at ViT-B/32 geometry on CPU (a benchmark, not a test).

For each expert count T (default 2, 4, 8): a synthetic pool with `CLIPVisionConfig()` defaults
(ViT-B/32: 12 blocks, width 768, MLP 3072, 224 px, patch 32: 50 tokens), random base, experts =
base + N(0, δ²) deltas, Task Arithmetic merge (s = 0.3), 32 random images per task, all saved as
HF directories; then `featcal calibrate` runs in its own process on CPU. Prints per T: wall time,
peak RSS, the seconds per phase (from the record: read, forward, statistics, solve), the counted
FLOPs per phase (benchmarks/flops.py), the machine's measured fp32 / fp64 GEMM rates and the
fraction of the floor achieved (floor = counted FLOPs at the measured rates).

    .venv/bin/python benchmarks/calibrate_vit_b32.py [--experts 2 4 8] [--precision float32]
        [--threads N] [--work DIR]
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

import torch
from flops import counted_flops, floor_seconds, gemm_rate

from featcal_core.data.synthetic import build_pool

D, F, SEQ, BLOCKS = 768, 3072, 50, 12
PHASES = ("read", "forward", "statistics", "solve")


def run_one(num_experts: int, work: Path, args) -> dict:
    root = work / f"pool_{num_experts}"
    tasks = tuple(f"task{i}" for i in range(num_experts))
    started = time.perf_counter()
    pool = build_pool(root, "clip", {}, tasks, delta=args.delta, rows=args.images, seed=0)
    built = time.perf_counter() - started
    out = work / f"out_{num_experts}"
    cmd = [sys.executable, "-m", "featcal_cli.main", *pool.cli_args(out), "--device", "cpu",
           "--num-per-task", str(args.images), "--precision", args.precision, "--overwrite",
           "--no-progress"]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - started
    record = json.loads((out / "featcal.json").read_text())
    shutil.rmtree(root)
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
        "precision": record["hyperparameters"].get("precision", "float64"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--images", type=int, default=32, help="calibration images per task")
    parser.add_argument("--delta", type=float, default=0.002, help="std of the expert deltas")
    parser.add_argument("--precision", choices=["float32", "float64"], default="float32")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rate32, rate64 = gemm_rate(torch.float32), gemm_rate(torch.float64)
    rows = [run_one(n, work, args) for n in args.experts]
    print(f"\nGEMM rate on this machine ({torch.get_num_threads()} threads): "
          f"fp32 {rate32 / 1e9:.0f} GFLOP/s, fp64 {rate64 / 1e9:.0f} GFLOP/s")  # fmt: skip
    print("\n| experts | precision | featcal wall (s) | process wall (s) | read / forward / "
          "statistics / solve (s) | peak RSS (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        split = " / ".join(f"{r['phases'][p]:.1f}" for p in PHASES)
        print(
            f"| {r['experts']} | {r['precision']} | {r['calibrate_wall_s']:.1f} "
            f"| {r['process_wall_s']:.1f} | {split} | {r['peak_rss_mb']} |"
        )
    print("\n| experts | counted TFLOP forward / statistics / solve | floor (s) at the measured "
          "rates | floor / featcal wall |")  # fmt: skip
    print("|---|---|---|---|")
    for r in rows:
        flops = counted_flops(D, F, SEQ, BLOCKS, r["experts"], args.images)
        floor = floor_seconds(flops, rate32, rate64, r["precision"])
        counted = " / ".join(f"{flops[p] / 1e12:.2f}" for p in ("forward", "statistics", "solve"))
        total = sum(floor.values())
        print(f"| {r['experts']} | {counted} | {total:.1f} "
              f"| {100 * total / r['calibrate_wall_s']:.0f} % |")  # fmt: skip
    for a, b in zip(rows, rows[1:], strict=False):
        per = (b["peak_rss_mb"] - a["peak_rss_mb"]) / (b["experts"] - a["experts"])
        print(f"peak RSS growth {a['experts']}→{b['experts']} experts: {per:.1f} MiB per expert")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
