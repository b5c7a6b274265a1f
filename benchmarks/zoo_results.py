"""Accuracy of FeatCal on the offline zoos, hyperparameters chosen on validation (featcal compare).

    python benchmarks/zoo_results.py                       # both presets, n 8 32 128, TA and TIES
    python benchmarks/zoo_results.py --presets vision --n 32 [--methods ties] [--max-val 300]

Per preset and n, two `featcal compare` runs (params and logs: benchmarks/out/zoo_results/;
results: data/results/zoo-results-<preset>-n<n>-{val,test}/; reports, with every grid point's
accuracy: reports/<that name>-compare/). On the validation split (carved from train): each
MERGE_GRID setting alone and + FeatCal for α ∈ ALPHAS × λ ∈ LAMS (ρ 2.2); per merge method the
best merge-only and the best FeatCal variant (mean accuracy) are chosen. On the test split: only
those and the paper's defaults (Task Arithmetic 0.3, alone and + FeatCal α 0.25, ρ 2.2, λ 0.05).
Writes benchmarks/results/zoo_results.{csv,md} (keeping other (preset, n, method) cells of earlier
runs) and accuracy_vs_n.png; prints the table. Accuracy: mean % over tasks; gap closed: compare's,
of the means, against Task Arithmetic 0.3 (every run's reference merge). Head calibration is no
longer part of this benchmark (`featcal compare` does not apply it).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import yaml

from featcal_core.io.outputs import write_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out" / "zoo_results"
log = logging.getLogger("zoo_results")

MERGE_GRID = {
    "task_arithmetic": [{"scale": s} for s in (0.3, 0.5, 0.8)],
    "ties": [{"scale": s, "top_k": 20} for s in (0.5, 1.0)],
}
ALPHAS, LAMS, RHO = (0.25, 0.5, 1.0), (0.05, 0.5), 2.2
PAPER_MERGE, PAPER_FEATCAL = ("task_arithmetic", {"scale": 0.3}), {"alpha": 0.25, "lam": 0.05}
SHORT = {"task_arithmetic": "ta", "ties": "ties"}
FIELDS = [
    "preset",
    "n",
    "method",
    "variant",
    "settings",
    "val_acc",
    "test_acc",
    "test_gap_closed",
    "expert_test_acc",
]


def variant(setting: tuple) -> dict:
    """A compare variant for (merge method, merge hyperparameters, FeatCal {α, λ} or None)."""
    method, merge, featcal = setting
    name = SHORT[method] + "".join(f"-{v}" for v in merge.values())
    hp = ", ".join(f"{k}: {v}" for k, v in merge.items())
    sets = [f"merge.method={method}", f"merge.hyperparameters={{{hp}}}", "repair.method=none"]
    if featcal is not None:
        name += f".featcal-a{featcal['alpha']}-l{featcal['lam']}"
        sets[-1:] = [
            "repair.method=featcal",
            f"featcal.alpha={featcal['alpha']}",
            f"featcal.lam={featcal['lam']}",
            f"featcal.rho={RHO}",
        ]
    return {"name": name, "set": sets}


def run_compare(tag: str, params: dict, out: Path) -> dict:
    """`featcal compare` on `params` (written to out/<tag>.yaml, its log to out/<tag>.log, run
    from the checkout's root; run.name must be `tag`); returns its compare.json."""
    path = write_file(out / f"{tag}.yaml", yaml.safe_dump(params, sort_keys=False))
    started = time.perf_counter()
    with (out / f"{tag}.log").open("w") as handle:
        done = subprocess.run(
            [sys.executable, "-m", "featcal_cli.main", "compare", "--params", str(path)],
            cwd=ROOT,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    if done.returncode != 0:
        tail = (out / f"{tag}.log").read_text().strip().splitlines()[-15:]
        raise SystemExit(f"featcal compare {tag} failed:\n" + "\n".join(tail))
    log.info(
        "%s: %d variants in %.0f s",
        tag,
        len(params["compare"]["variants"]),
        time.perf_counter() - started,
    )
    return json.loads((ROOT / "reports" / f"{tag}-compare" / "compare.json").read_text())


def compare(preset: str, n: int, split: str, settings: list, max_val: int | None):
    """`featcal compare` of `settings` on `split`: ({variant: compare's "mean"}, experts' mean)."""
    tag = f"zoo-results-{preset}-n{n}-{'val' if split == 'validation' else 'test'}"
    params = {
        "run": {"name": tag, "results_dir": f"data/results/{tag}", "seed": 0},
        "zoo": {
            "preset": preset,
            "dir": f"data/zoo/{preset}",
            "seed": 0,
            "evaluation_split": split,
        },
        "merge": {"method": PAPER_MERGE[0], "hyperparameters": PAPER_MERGE[1]},
        "featcal": {
            **PAPER_FEATCAL,
            "rho": RHO,
            "num_per_task": n,
            "batch_size": 32,
            "heads": False,
        },
        "evaluation": {"max_examples_per_task": max_val if split == "validation" else None},
        "compare": {"variants": [variant(s) for s in settings]},
    }
    report = run_compare(tag, params, OUT)
    experts = [models["expert"]["accuracy"] for models in report["evaluation"].values()]
    means = {
        v["name"]: {k: x if x is None else round(x, 2) for k, x in v["mean"].items()}
        for v in report["variants"]
    }
    return means, round(100 * sum(experts) / len(experts), 2)


def run_cell(preset: str, n: int, methods: list[str], quick: bool, max_val: int | None) -> list:
    featcals = [PAPER_FEATCAL] if quick else [{"alpha": a, "lam": x} for a in ALPHAS for x in LAMS]
    grid = [
        (m, hp, fc)
        for m in methods
        for hp in MERGE_GRID[m][: 1 if quick else None]
        for fc in (None, *featcals)
    ]
    val, _ = compare(preset, n, "validation", grid, max_val)
    chosen = []
    for method in methods:
        for kind, calibrated in (("merge only (val-selected)", 0), ("featcal (val-selected)", 1)):
            pool = [s for s in grid if s[0] == method and (s[2] is not None) == calibrated]
            chosen.append((kind, max(pool, key=lambda s: val[variant(s)["name"]]["accuracy"])))
    chosen += [
        ("paper defaults: merge only", (*PAPER_MERGE, None)),
        ("paper defaults: featcal", (*PAPER_MERGE, PAPER_FEATCAL)),
    ]
    unique = list({variant(s)["name"]: s for _, s in chosen}.values())
    test, expert = compare(preset, n, "test", unique, None)
    rows = []
    for kind, (method, hp, fc) in chosen:
        key = variant((method, hp, fc))["name"]
        settings = json.dumps({**hp, **({} if fc is None else {**fc, "rho": RHO})}, sort_keys=True)
        rows.append(
            {
                "preset": preset,
                "n": n,
                "method": method,
                "variant": kind,
                "settings": settings,
                "val_acc": val.get(key, {}).get("accuracy"),
                "test_acc": test[key]["accuracy"],
                "test_gap_closed": test[key]["gap_closed"],
                "expert_test_acc": expert,
            }
        )
    return rows


def cell(value, unit: str = "") -> str:
    return "—" if value in (None, "") else f"{float(value):.1f}{unit}"


def write(rows: list[dict], out: Path) -> None:
    done = {(r["preset"], str(r["n"]), r["method"]) for r in rows}
    if (out / "zoo_results.csv").is_file():  # keep the other cells of earlier runs
        with (out / "zoo_results.csv").open(newline="") as handle:
            old = [r for r in csv.DictReader(handle) if set(r) == set(FIELDS)]
        rows = [r for r in old if (r["preset"], r["n"], r["method"]) not in done] + rows
    rows = sorted(
        rows, key=lambda r: (r["preset"] != "vision", r["preset"], int(r["n"]), r["method"])
    )
    text = io.StringIO()
    (writer := csv.DictWriter(text, fieldnames=FIELDS, lineterminator="\n")).writeheader()
    writer.writerows(rows)
    write_file(out / "zoo_results.csv", text.getvalue())
    lines = [
        "| preset | n | merge | variant | settings | val acc | test acc | test gap closed "
        "(vs TA 0.3) | experts (test) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['preset']} | {r['n']} | {r['method']} | {r['variant']} | `{r['settings']}` | "
        f"{cell(r['val_acc'])} | {cell(r['test_acc'])} | {cell(r['test_gap_closed'], ' %')} | "
        f"{cell(r['expert_test_acc'])} |"
        for r in rows
    ]
    write_file(out / "zoo_results.md", "\n".join(lines) + "\n")
    plot(rows, out / "accuracy_vs_n.png")
    print("\n".join(lines))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    plt.switch_backend("Agg")
    keys = sorted({(r["preset"], r["method"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, (preset, method) in zip(axes[0], keys, strict=True):
        sub = [r for r in rows if (r["preset"], r["method"]) == (preset, method)]
        for kind in dict.fromkeys(r["variant"] for r in sub):
            points = sorted(
                (int(r["n"]), float(r["test_acc"])) for r in sub if r["variant"] == kind
            )
            ax.plot(*zip(*points, strict=True), marker="o", label=kind)
        ax.axhline(float(sub[0]["expert_test_acc"]), color="k", ls="--", lw=1, label="experts")
        ax.set(
            xscale="log",
            title=f"{preset} / {method}",
            xlabel="calibration inputs per task (n)",
            ylabel="mean test accuracy (%)",
        )
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["vision", "text"])
    parser.add_argument("--n", nargs="+", type=int, default=[8, 32, 128])
    parser.add_argument("--methods", nargs="+", default=list(MERGE_GRID), choices=list(MERGE_GRID))
    parser.add_argument(
        "--max-val",
        type=int,
        default=None,
        help="score only the first N validation rows per task (speed)",
    )
    parser.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # smoke: 1 × 1 grid
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    started = time.perf_counter()
    out = OUT if args.quick else ROOT / "benchmarks" / "results"  # a smoke run replaces nothing
    rows = []
    for preset in args.presets:
        for n in args.n:
            rows += run_cell(preset, n, args.methods, args.quick, args.max_val)
        write(rows, out)  # after each preset: a later failure keeps what was measured
    log.info("total %.0f s", time.perf_counter() - started)


if __name__ == "__main__":
    main()
