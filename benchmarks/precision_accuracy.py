"""FeatCal in bfloat16 against float32 on the offline zoos, by accuracy (a benchmark, not a test).

    python benchmarks/precision_accuracy.py [--presets vision text] [--n 32]

Per preset, one `featcal compare` (params and log: benchmarks/out/precision_accuracy/; report:
reports/precision-<preset>-compare/) of Task Arithmetic 0.3 alone and + FeatCal at the paper's
defaults (α 0.25, ρ 2.2, λ 0.05, n = 32) with `featcal.precision` float32 and bfloat16, on the
test split. Prints per task the accuracy of each and the difference, the means, and the mean
last-block drift after calibration of each (from the variants' featcal.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zoo_results import run_compare

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "precision_accuracy"
PRECISIONS = ("float32", "bfloat16")


def compare(preset: str, n: int) -> tuple[dict, Path]:
    tag = f"precision-{preset}"
    variants = [{"name": "ta", "set": ["repair.method=none"]}]
    variants += [{"name": f"ta.featcal.{p}", "set": ["repair.method=featcal",
                                                      f"featcal.precision={p}"]}
                 for p in PRECISIONS]  # fmt: skip
    params = {
        "run": {"name": tag, "results_dir": f"data/results/{tag}", "seed": 0},
        "zoo": {"preset": preset, "dir": f"data/zoo/{preset}", "seed": 0,
                "evaluation_split": "test"},
        "merge": {"method": "task_arithmetic", "hyperparameters": {"scale": 0.3}},
        "featcal": {"alpha": 0.25, "rho": 2.2, "lam": 0.05, "num_per_task": n, "batch_size": 32,
                    "heads": False},
        "compare": {"variants": variants},
    }  # fmt: skip
    report = run_compare(tag, params, OUT)
    return {row["name"]: row for row in report["variants"]}, ROOT / "data" / "results" / tag


def last_block_drift(results: Path, variant: str) -> float:
    """Mean over tasks of the last block's drift after calibration (the variant's record)."""
    (record,) = (results / "variants" / variant).rglob("featcal.json")
    data = json.loads(record.read_text())
    assert data["hyperparameters"]["precision"] == variant.rsplit(".", 1)[-1], record
    after = data["blocks"][-1]["drift_after"]
    return sum(after.values()) / len(after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["vision", "text"])
    parser.add_argument("--n", type=int, default=32)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:
        rows, results = compare(preset, args.n)
        f32, b16 = (rows[f"ta.featcal.{p}"] for p in PRECISIONS)
        print(f"\n{preset} zoo, n = {args.n}: test accuracy (%)\n")
        print("| task | TA 0.3 | + FeatCal float32 | + FeatCal bfloat16 | Δ (bf16 − fp32) |")
        print("|---|---|---|---|---|")
        for task in f32["tasks"]:
            a, b = f32["tasks"][task]["accuracy"], b16["tasks"][task]["accuracy"]
            ta = rows["ta"]["tasks"][task]["accuracy"]
            print(f"| {task} | {ta:.2f} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
        a, b = f32["mean"]["accuracy"], b16["mean"]["accuracy"]
        print(f"| mean | {rows['ta']['mean']['accuracy']:.2f} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
        drift = {p: last_block_drift(results, f"ta.featcal.{p}") for p in PRECISIONS}
        change = 100 * (drift["bfloat16"] / drift["float32"] - 1)
        print(f"\nmean last-block drift after calibration: float32 {drift['float32']:.4g}, "
              f"bfloat16 {drift['bfloat16']:.4g} ({change:+.2f} %)")  # fmt: skip


if __name__ == "__main__":
    main()
