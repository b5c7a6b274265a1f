"""Where calibration time goes: cProfile of `featcal_core.calibrate` on a short ViT-B/32-width
pool (a benchmark aid, not a test).

    .venv/bin/python benchmarks/profile_calibration.py [--blocks 3] [--experts 8] [--work DIR]

Prints the seconds per block, the split per phase (read, forward, statistics, solve: recorded by
the block runner) and the functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import tempfile
from pathlib import Path

from featcal_core import calibrate
from featcal_core.data.synthetic import build_pool
from featcal_core.memory import peak_rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument(
        "--precision", choices=["float32", "float64", "bfloat16"], default="float32"
    )
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="featcal-profile-"))
    tasks = tuple(f"task{i}" for i in range(args.experts))
    config = {"num_hidden_layers": args.blocks}
    pool = build_pool(work / "pool", "clip", config, tasks, delta=0.002, rows=args.images)
    profile = cProfile.Profile()
    profile.enable()
    record = calibrate(
        pool.base,
        pool.merged,
        pool.experts,
        pool.calib,
        work / "out",
        num_per_task=args.images,
        precision=args.precision,
        progress=False,
    )
    profile.disable()
    print("seconds per block:", [b["seconds"] for b in record["blocks"]])
    phases: dict[str, float] = {}
    for block in record["blocks"]:
        for phase, seconds in block["phases"].items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    total = sum(phases.values())
    print(
        "seconds per phase:",
        ", ".join(f"{p} {s:.1f} ({100 * s / total:.0f} %)" for p, s in sorted(phases.items())),
    )
    print(f"wall {record['wall_seconds']:.1f} s, peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
