"""FeatCal in bfloat16 against float32 on the offline zoos, by accuracy (a benchmark, not a test).

    python benchmarks/precision_accuracy.py [--presets vision text] [--n 32]

Per preset, one `featcal compare` (params and log: benchmarks/out/precision_accuracy/; report:
reports/precision-<preset>-compare/) of Task Arithmetic 0.3 alone and + FeatCal at the paper's
defaults (α 0.25, ρ 2.2, λ 0.05, n = 32) with `featcal.precision` float32 and bfloat16, on the
test split, evaluated in float32 (`evaluation.precision`). Prints per task the accuracy of each
and the difference, the means, and the mean last-block drift after calibration of each (from the
variants' featcal.json).

Then (`--evaluation bfloat16`, the default) the same compare again on the same results folder
(merges and calibrations reused) with every evaluation forward in bfloat16 (run name
precision-<preset>-eval-bfloat16): per row (experts, TA, both FeatCals) the accuracy evaluated
in bfloat16 against float32, and each compare's wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from zoo_results import run_compare

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "precision_accuracy"
PRECISIONS = ("float32", "bfloat16")


def compare(preset: str, n: int, evaluation: str = "float32") -> tuple[dict, Path]:
    """({variant: compare row}, results folder), the compare.json under "__compare__"."""
    tag = f"precision-{preset}" + ("" if evaluation == "float32" else f"-eval-{evaluation}")
    variants = [{"name": "ta", "set": ["repair.method=none"]}]
    variants += [
        {"name": f"ta.featcal.{p}", "set": ["repair.method=featcal", f"featcal.precision={p}"]}
        for p in PRECISIONS
    ]
    params = {
        "run": {"name": tag, "results_dir": f"data/results/precision-{preset}", "seed": 0},
        "zoo": {
            "preset": preset,
            "dir": f"data/zoo/{preset}",
            "seed": 0,
            "evaluation_split": "test",
        },
        "merge": {"method": "task_arithmetic", "hyperparameters": {"scale": 0.3}},
        "featcal": {
            "alpha": 0.25,
            "rho": 2.2,
            "lam": 0.05,
            "num_per_task": n,
            "batch_size": 32,
            "heads": False,
        },
        "evaluation": {"precision": evaluation},
        "compare": {"variants": variants},
    }
    report = run_compare(tag, params, OUT)
    rows = {row["name"]: row for row in report["variants"]}
    rows["__compare__"] = report
    return rows, ROOT / "data" / "results" / f"precision-{preset}"


def evaluation_table(exact: dict, fast: dict) -> None:
    """Per task and row, accuracy evaluated in float32 and in bfloat16 (same models)."""
    names = ["expert", *[name for name in exact if name != "__compare__"]]

    def accuracy(rows: dict, name: str, task: str) -> float:
        if name == "expert":
            return 100 * rows["__compare__"]["evaluation"][task]["expert"]["accuracy"]
        return rows[name]["tasks"][task]["accuracy"]

    print("\n| task | " + " | ".join(f"{n} fp32 → bf16" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    tasks = list(exact["ta"]["tasks"])
    moved = {name: [] for name in names}
    for task in tasks:
        cells = []
        for name in names:
            a, b = accuracy(exact, name, task), accuracy(fast, name, task)
            moved[name].append(b - a)
            cells.append(f"{a:.2f} → {b:.2f} ({b - a:+.2f})")
        print(f"| {task} | " + " | ".join(cells) + " |")
    means = [sum(v) / len(v) for v in moved.values()]
    print("| mean Δ | " + " | ".join(f"{m:+.2f}" for m in means) + " |")


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
    parser.add_argument(
        "--evaluation",
        nargs="*",
        default=["bfloat16"],
        help="evaluation precisions to compare with float32's (none: skip)",
    )
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:
        started = time.perf_counter()
        rows, results = compare(preset, args.n)
        seconds = {"float32": time.perf_counter() - started}
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
        print(
            f"\nmean last-block drift after calibration: float32 {drift['float32']:.4g}, "
            f"bfloat16 {drift['bfloat16']:.4g} ({change:+.2f} %)"
        )
        for evaluation in args.evaluation:
            started = time.perf_counter()
            fast, _ = compare(preset, args.n, evaluation)
            seconds[evaluation] = time.perf_counter() - started
            print(f"\n{preset} zoo: test accuracy (%) evaluated in float32 → {evaluation}")
            evaluation_table(rows, fast)
        print(
            "\ncompare wall seconds by evaluation precision (the first also merges and "
            "calibrates unless reused): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
        )


if __name__ == "__main__":
    main()
