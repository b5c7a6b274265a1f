"""Speed and memory of `featcal calibrate` at ViT-B/32 geometry on CPU (a benchmark, not a test).

For each expert count T (default 2, 4, 8): a synthetic pool with `CLIPVisionConfig()` defaults
(ViT-B/32: 12 blocks, width 768, 224 px, patch 32), random base, experts = base + N(0, δ²) deltas,
Task Arithmetic merge (s = 0.3), 32 random images per task, all saved as HF directories; then
`featcal calibrate` runs in its own process on CPU. Prints wall time and peak RSS per T.

    .venv/bin/python benchmarks/calibrate_vit_b32.py [--experts 2 4 8] [--work DIR]
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

from featcal_core.data.synthetic import build_pool


def run_one(num_experts: int, work: Path, images: int, delta: float) -> dict:
    root = work / f"pool_{num_experts}"
    tasks = tuple(f"task{i}" for i in range(num_experts))
    started = time.perf_counter()
    pool = build_pool(root, "clip", {}, tasks, delta=delta, rows=images, seed=0)
    built = time.perf_counter() - started
    out = work / f"out_{num_experts}"
    cmd = [sys.executable, "-m", "featcal_cli.main", *pool.cli_args(out), "--device", "cpu"]
    cmd += ["--num-per-task", str(images), "--overwrite"]
    started = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - started
    record = json.loads((out / "featcal.json").read_text())
    shutil.rmtree(root)
    shutil.rmtree(out)
    return {
        "experts": num_experts,
        "build_s": round(built, 1),
        "process_wall_s": round(wall, 1),
        "calibrate_wall_s": record["wall_seconds"],
        "block_s_total": round(sum(b["seconds"] for b in record["blocks"]), 1),
        "peak_rss_mb": round(record["peak_rss_bytes"] / 2**20),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--images", type=int, default=32, help="calibration images per task")
    parser.add_argument("--delta", type=float, default=0.002, help="std of the expert deltas")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = [run_one(n, work, args.images, args.delta) for n in args.experts]
    print(
        "\n| experts | featcal wall (s) | process wall (s) | sum of block times (s) | peak RSS (MiB) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['experts']} | {r['calibrate_wall_s']:.1f} | {r['process_wall_s']:.1f} "
            f"| {r['block_s_total']:.1f} | {r['peak_rss_mb']} |"
        )
    for a, b in zip(rows, rows[1:], strict=False):
        per = (b["peak_rss_mb"] - a["peak_rss_mb"]) / (b["experts"] - a["experts"])
        print(f"peak RSS growth {a['experts']}→{b['experts']} experts: {per:.1f} MiB per expert")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
