"""Time per block of FeatCal on a Llama of TinyLlama's geometry, through `featcal_core` alone
(a benchmark, not a test; for a machine without the pipeline's packages, e.g. the device tool's
GPU image, which has no Prefect for the `featcal` command).

It builds the pool of `calibrate_llm_memory.py` (benchmarks/llm_pool.py: random bf16 base, seeded
low-rank expert deltas, 16 word sequences of about 128 tokens per task) with --layers blocks,
merges it with Task Arithmetic (`featcal_core.merging.run.merge_checkpoints`), then runs
`featcal_core.calibrate` on --device once per --precision, each in its own process (so each
process's peak device memory is its own). Prints per precision: blocks, mean seconds per block
and its phases (read / forward / statistics / solve), the record's wall time, peak device memory
and peak RSS, and each precision's time per block against the first.

    python3 benchmarks/llm_block_time.py --device cuda --layers 4 [--precision float32 bfloat16]
    python3 benchmarks/llm_block_time.py --hidden 128 --intermediate 256 --layers 2 --heads 4 \\
        --kv-heads 2 --vocab 512 --shard-mb 0.2            # a small smoke run on the CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import library_calibrate
from llm_pool import add_pool_arguments, build, resolve_geometry

PHASES = ("read", "forward", "statistics", "solve")
MIB = 2**20


def _merge(pool: Path, tasks: list[str], merged: Path, scale: float) -> float:
    from featcal_core.merging.run import merge_checkpoints

    started = time.perf_counter()
    experts = {t: pool / f"expert_{t}" for t in tasks}
    merge_checkpoints(
        pool / "base",
        experts,
        merged,
        "task_arithmetic",
        {"scale": scale},
        overwrite=True,
        progress=False,
    )
    return time.perf_counter() - started


def _calibrate(pool: Path, tasks: list[str], merged: Path, out: Path, args, precision: str):
    spec = {
        "base": str(pool / "base"),
        "merged": str(merged),
        "out": str(out),
        "experts": {t: str(pool / f"expert_{t}") for t in tasks},
        "calib": {t: str(pool / f"calib_{t}") for t in tasks},
        "options": {
            "num_per_task": args.rows,
            "max_length": args.tokens,
            "device": args.device,
            "precision": precision,
        },
    }
    started = time.perf_counter()
    subprocess.run(library_calibrate.command(spec), check=True)
    wall = time.perf_counter() - started
    record = json.loads((out / "featcal.json").read_text())
    shutil.rmtree(out)
    blocks = record["blocks"]
    ran = record["hyperparameters"]
    return {
        "precision": precision,
        "ran": f"{ran.get('precision')} ({ran.get('precision_reason')}), products "
        f"{ran.get('products_precision')}",
        "blocks": len(blocks),
        "per_block": sum(b["seconds"] for b in blocks) / len(blocks),
        "phases": {
            p: sum(b.get("phases", {}).get(p, 0.0) for b in blocks) / len(blocks) for p in PHASES
        },
        "record_wall": record["wall_seconds"],
        "process_wall": wall,
        "peak_device_mib": record.get("peak_device_bytes", 0) / MIB,
        "peak_rss_mib": record["peak_rss_bytes"] / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pool_arguments(parser, layers=4)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--precision", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = parser.parse_args()
    resolve_geometry(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-llm-blocks-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        build(args, work / "pool")
        built = time.perf_counter() - started
        tasks = json.loads((work / "pool" / "build.json").read_text())["tasks"]
        merged_s = _merge(work / "pool", tasks, work / "merged", args.scale)
        rows = [
            _calibrate(work / "pool", tasks, work / "merged", work / "out", args, p)
            for p in args.precision
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nLlama: hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
        f"{args.heads} heads, {args.kv_heads} kv heads, vocab {args.vocab}; {args.experts} "
        f"experts, {args.rows} sequences of <= {args.tokens} tokens per task; device "
        f"{args.device}; pool built in {built:.1f} s, merged in {merged_s:.1f} s"
    )
    print(
        "\n| precision | blocks | s per block | read / forward / statistics / solve (s per "
        "block) | record wall (s) | process wall (s) | peak device (MiB) | peak RSS (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        split = " / ".join(f"{r['phases'][p]:.2f}" for p in PHASES)
        print(
            f"| {r['precision']} | {r['blocks']} | {r['per_block']:.2f} | {split} "
            f"| {r['record_wall']:.1f} | {r['process_wall']:.1f} | {r['peak_device_mib']:.0f} "
            f"| {r['peak_rss_mib']:.0f} |"
        )
    for r in rows:
        print(f"{r['precision']} ran: {r['ran']}")
    for r in rows[1:]:
        print(
            f"time per block, {r['precision']} / {rows[0]['precision']}: "
            f"{r['per_block'] / rows[0]['per_block']:.2f}"
        )


if __name__ == "__main__":
    main()
