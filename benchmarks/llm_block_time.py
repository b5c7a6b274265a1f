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
import sys
import tempfile
import time
from pathlib import Path

from llm_pool import build

PHASES = ("read", "forward", "statistics", "solve")
MIB = 2**20

#: one calibration in its own process: argv[1] is the spec as JSON
CALIBRATE = """import json, logging, sys
from featcal_core import calibrate
logging.basicConfig(level=logging.WARNING)
spec = json.loads(sys.argv[1])
calibrate(spec["base"], spec["merged"], spec["experts"], spec["calib"], spec["out"],
          num_per_task=spec["rows"], max_length=spec["tokens"], device=spec["device"],
          precision=spec["precision"], overwrite=True, progress=False)
"""


def _merge(pool: Path, tasks: list[str], merged: Path, scale: float) -> float:
    from featcal_core.merging.run import merge_checkpoints

    started = time.perf_counter()
    experts = {t: pool / f"expert_{t}" for t in tasks}
    merge_checkpoints(pool / "base", experts, merged, "task_arithmetic", {"scale": scale},
                      overwrite=True, progress=False)  # fmt: skip
    return time.perf_counter() - started


def _calibrate(pool: Path, tasks: list[str], merged: Path, out: Path, args, precision: str):
    spec = {
        "base": str(pool / "base"), "merged": str(merged), "out": str(out),
        "experts": {t: str(pool / f"expert_{t}") for t in tasks},
        "calib": {t: str(pool / f"calib_{t}") for t in tasks},
        "rows": args.rows, "tokens": args.tokens, "device": args.device, "precision": precision,
    }  # fmt: skip
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", CALIBRATE, json.dumps(spec)], check=True)
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
        "phases": {p: sum(b.get("phases", {}).get(p, 0.0) for b in blocks) / len(blocks)
                   for p in PHASES},
        "record_wall": record["wall_seconds"],
        "process_wall": wall,
        "peak_device_mib": record.get("peak_device_bytes", 0) / MIB,
        "peak_rss_mib": record["peak_rss_bytes"] / MIB,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    geometry = parser.add_argument_group("model geometry (default: TinyLlama 1.1 B, 4 layers)")
    geometry.add_argument("--hidden", type=int, default=2048)
    geometry.add_argument("--intermediate", type=int, default=5632)
    geometry.add_argument("--layers", type=int, default=4)
    geometry.add_argument("--heads", type=int, default=32)
    geometry.add_argument("--kv-heads", type=int, default=4)
    geometry.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rank", type=int, default=16, help="rank of the expert deltas")
    parser.add_argument("--delta", type=float, default=0.002, help="std of the delta entries")
    parser.add_argument("--norm-delta", type=float, default=0.01, help="std of the norm noise")
    parser.add_argument("--shard-mb", type=float, default=500, help="max shard size (MB)")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="calibration sequences per task")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence (max)")
    parser.add_argument("--scale", type=float, default=0.3, help="Task Arithmetic scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--precision", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--work", type=Path, default=None, help="scratch directory")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-llm-blocks-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        build(args, work / "pool")
        built = time.perf_counter() - started
        tasks = json.loads((work / "pool" / "build.json").read_text())["tasks"]
        merged_s = _merge(work / "pool", tasks, work / "merged", args.scale)
        rows = [_calibrate(work / "pool", tasks, work / "merged", work / "out", args, p)
                for p in args.precision]  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nLlama: hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
          f"{args.heads} heads, {args.kv_heads} kv heads, vocab {args.vocab}; {args.experts} "
          f"experts, {args.rows} sequences of <= {args.tokens} tokens per task; device "
          f"{args.device}; pool built in {built:.1f} s, merged in {merged_s:.1f} s")  # fmt: skip
    print(
        "\n| precision | blocks | s per block | read / forward / statistics / solve (s per "
        "block) | record wall (s) | process wall (s) | peak device (MiB) | peak RSS (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        split = " / ".join(f"{r['phases'][p]:.2f}" for p in PHASES)
        print(f"| {r['precision']} | {r['blocks']} | {r['per_block']:.2f} | {split} "
              f"| {r['record_wall']:.1f} | {r['process_wall']:.1f} | {r['peak_device_mib']:.0f} "
              f"| {r['peak_rss_mib']:.0f} |")  # fmt: skip
    for r in rows:
        print(f"{r['precision']} ran: {r['ran']}")
    for r in rows[1:]:
        print(f"time per block, {r['precision']} / {rows[0]['precision']}: "
              f"{r['per_block'] / rows[0]['per_block']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
