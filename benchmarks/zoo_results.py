"""Accuracy of FeatCal on the offline zoos: merged vs calibrated vs experts, for inputs-per-task
n ∈ {8, 32, 128} and merge methods {Task Arithmetic, TIES}, with and without FeatCal, with and
without head calibration. Every hyperparameter is chosen on the validation split (carved from
train); the test split is scored only for the chosen settings (and the paper's defaults).

    python benchmarks/zoo_results.py                       # both presets, the full grid
    python benchmarks/zoo_results.py --presets vision --n 32

Writes benchmarks/results/zoo_results.{csv,md} and accuracy_vs_n.png, and prints the table.
Selection, per (preset, merge method):
  - merge hyperparameters (TA scale, TIES scale): the best average validation accuracy;
  - per n, FeatCal (α, λ) from ALPHAS × LAMS with ρ = 2.2: best validation accuracy
    ("featcal (val-selected)"); the paper's defaults α = 0.25, λ = 0.05 are always shown too;
  - head calibration λ_h from HEAD_LAMS, on the merged model ("merged + heads") and on the
    selected calibrated model ("featcal + heads");
  - "best on validation" is whichever of these variants has the best validation accuracy.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from featcal_core import FeatCalParams, calibrate  # noqa: E402
from featcal_core.data.calibration_data import load_calibration_set  # noqa: E402
from featcal_core.evaluation.accuracy import evaluate  # noqa: E402
from featcal_core.evaluation.expert_head import ExpertHead  # noqa: E402
from featcal_core.merging.run import merge_checkpoints  # noqa: E402
from featcal_core.method.head_calibration import fit_linear_head, head_statistics  # noqa: E402
from featcal_core.report import gap_closed  # noqa: E402
from featcal_core.zoo.build import PRESETS, build_zoo  # noqa: E402

log = logging.getLogger("benchmark")

MERGE_GRID = {
    "task_arithmetic": [{"scale": s} for s in (0.3, 0.5, 0.8)],
    "ties": [{"scale": s, "top_k": 20} for s in (0.5, 1.0)],
}
PAPER = (0.25, 0.05)  # (α, λ), ρ = 2.2
ALPHAS = (0.25, 0.5, 1.0)
LAMS = (0.05, 0.5)
HEAD_LAMS = (0.001, 0.01, 0.1, 1.0)
SEED = 0


def snapshot(hub: Path, repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, cache_dir=hub, local_files_only=True))


class Bench:
    def __init__(self, preset: str, zoo_dir: Path, work: Path, batch_size: int):
        self.preset = preset
        self.manifest = build_zoo(PRESETS[preset], zoo_dir)
        hub = zoo_dir / "hub"
        self.base = snapshot(hub, self.manifest["base"]["repo_id"])
        self.experts = {t: snapshot(hub, e["repo_id"]) for t, e in self.manifest["experts"].items()}
        self.data = {t: zoo_dir / "data" / t for t in self.experts}
        self.heads = {t: ExpertHead(p) for t, p in self.experts.items()}
        self.work = work
        self.batch = batch_size
        self.max_val: int | None = None  # validation rows scored per task (None: all)
        self._cache: dict = {}

    def score(self, model: Path, split: str, heads: dict | None = None) -> dict[str, float]:
        """Accuracy per task of `model` on `split` (heads: task -> (weight, bias) overrides)."""
        out = {}
        for task, head in self.heads.items():
            if heads is not None:
                head = head.with_linear(*heads[task])
            cap = self.max_val if split == "validation" else None
            result = evaluate(model, head, self.data[task], split, batch_size=128,
                              max_examples=cap, progress=False)  # fmt: skip
            out[task] = result["accuracy"]
        return out

    def rows(self, task: str, n: int) -> list:
        key = (task, n)
        if key not in self._cache:
            modality = self.heads[task].modality
            self._cache[key] = load_calibration_set(task, self.data[task], modality, n, SEED).rows
        return self._cache[key]

    @torch.no_grad()
    def refit_heads(self, model: Path, n: int) -> dict[float, dict]:
        """{λ_h: {task: (weight, bias)}}: head calibration of `model` on n inputs per task."""
        fits: dict[float, dict] = {lam: {} for lam in HEAD_LAMS}
        for task, head in self.heads.items():
            stats, linear = head_statistics(
                head, self.experts[task], model, self.rows(task, n), batch_size=64
            )
            for lam in HEAD_LAMS:
                weight, bias = fit_linear_head(stats, linear.weight, linear.bias, lam)
                fits[lam][task] = (weight.float(), bias.float())
        return fits

    def calibrated(self, merged: Path, n: int, alpha: float, lam: float, tag: str) -> Path:
        out = self.work / f"cal_{tag}_n{n}_a{alpha}_l{lam}"
        if not (out / "featcal.json").is_file():
            calibrate(
                self.base, merged, self.experts, self.data, out,
                FeatCalParams(alpha=alpha, rho=2.2, lam=lam), num_per_task=n,
                batch_size=self.batch, seed=SEED, max_length=64, overwrite=True, progress=False,
            )  # fmt: skip
        return out


def mean(scores: dict[str, float]) -> float:
    return sum(scores.values()) / len(scores)


#: every FeatCal grid point's validation accuracy (written to zoo_grid.json: the sensitivity)
grid: list[dict] = []


def run_preset(
    preset: str, ns: list[int], methods: list[str], work: Path, max_val: int | None = None
) -> list[dict]:
    bench = Bench(preset, ROOT / "data" / "zoo" / preset, work / preset, batch_size=32)
    bench.max_val = max_val
    results = []
    expert = {s: {t: evaluate(p, bench.heads[t], bench.data[t], s, batch_size=128,
                              max_examples=max_val if s == "validation" else None,
                              progress=False)["accuracy"] for t, p in bench.experts.items()}
              for s in ("validation", "test")}  # fmt: skip
    log.info("%s experts: val %.4f test %.4f", preset, mean(expert["validation"]),
             mean(expert["test"]))  # fmt: skip

    def record(method, n, variant, settings, val, test):
        row = {
            "preset": preset, "method": method, "n": n, "variant": variant,
            "settings": json.dumps(settings, sort_keys=True),
            "val_acc": round(mean(val), 4), "test_acc": round(mean(test), 4),
            "expert_test_acc": round(mean(expert["test"]), 4),
        }  # fmt: skip
        results.append(row)
        log.info("%s", row)
        return row

    for method in methods:
        merged_val, best = {}, None
        for hp in MERGE_GRID[method]:
            tag = f"{method}_" + "_".join(f"{k}{v}" for k, v in sorted(hp.items()))
            out = bench.work / f"merged_{tag}"
            if not (out / "merge.json").is_file():
                merge_checkpoints(bench.base, bench.experts, out, method, hp, overwrite=True,
                                  progress=False)  # fmt: skip
            merged_val[tag] = bench.score(out, "validation")
            if best is None or mean(merged_val[tag]) > mean(merged_val[best[0]]):
                best = (tag, out, hp)
        tag, merged, hp = best
        merged_test = bench.score(merged, "test")
        base_row = record(method, 0, "merged", hp, merged_val[tag], merged_test)
        for n in ns:
            record(method, n, "merged", hp, merged_val[tag], merged_test)
            # head calibration alone (on the merged model)
            heads = bench.refit_heads(merged, n)
            head_val = {lam: bench.score(merged, "validation", h) for lam, h in heads.items()}
            lam_h = max(head_val, key=lambda k: mean(head_val[k]))
            record(method, n, "merged + heads", {**hp, "head_lam": lam_h}, head_val[lam_h],
                   bench.score(merged, "test", heads[lam_h]))  # fmt: skip
            # FeatCal: grid on validation
            val_scores = {}
            for alpha in ALPHAS:
                for lam in LAMS:
                    model = bench.calibrated(merged, n, alpha, lam, tag)
                    val_scores[(alpha, lam)] = (model, bench.score(model, "validation"))
                    grid.append({"preset": preset, "method": method, "n": n, "alpha": alpha,
                                 "lam": lam, "val_acc": round(mean(val_scores[(alpha, lam)][1]), 4),
                                 "val_per_task": val_scores[(alpha, lam)][1]})  # fmt: skip
            paper_model, paper_val = val_scores[PAPER]
            record(method, n, "featcal (paper defaults)", {**hp, "alpha": PAPER[0],
                   "lam": PAPER[1], "rho": 2.2}, paper_val, bench.score(paper_model, "test"))  # fmt: skip
            chosen = max(val_scores, key=lambda k: mean(val_scores[k][1]))
            model, val = val_scores[chosen]
            settings = {**hp, "alpha": chosen[0], "lam": chosen[1], "rho": 2.2}
            record(method, n, "featcal (val-selected)", settings, val, bench.score(model, "test"))
            heads = bench.refit_heads(model, n)
            head_val = {lam: bench.score(model, "validation", h) for lam, h in heads.items()}
            lam_h = max(head_val, key=lambda k: mean(head_val[k]))
            record(method, n, "featcal + heads", {**settings, "head_lam": lam_h},
                   head_val[lam_h], bench.score(model, "test", heads[lam_h]))  # fmt: skip
            candidates = [r for r in results if r["method"] == method and r["n"] == n
                          and r["variant"] != "merged"]  # fmt: skip
            winner = max(candidates, key=lambda r: r["val_acc"])
            results.append({**winner, "variant": f"best on validation ({winner['variant']})"})
        del base_row
    return results


def write(results: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = ["preset", "method", "n", "variant", "val_acc", "test_acc", "expert_test_acc",
              "gap_closed_pct", "settings"]  # fmt: skip
    merged = {(r["preset"], r["method"], r["n"]): r["test_acc"] for r in results
              if r["variant"] == "merged"}  # fmt: skip
    for r in results:
        gap = gap_closed(merged[(r["preset"], r["method"], r["n"])], r["test_acc"],
                         r["expert_test_acc"])  # fmt: skip
        r["gap_closed_pct"] = None if gap is None else round(gap, 1)
    rows = [r for r in results if r["n"] != 0]
    cells = {(r["preset"], r["method"], str(r["n"])) for r in rows}
    if (out / "zoo_results.csv").is_file():  # keep other (preset, method, n) rows of earlier runs
        with (out / "zoo_results.csv").open(newline="") as handle:
            kept = [r for r in csv.DictReader(handle)
                    if (r["preset"], r["method"], r["n"]) not in cells]  # fmt: skip
        for r in kept:
            r["n"] = int(r["n"])
            for key in ("val_acc", "test_acc", "expert_test_acc"):
                r[key] = float(r[key])
            r["gap_closed_pct"] = float(r["gap_closed_pct"]) if r["gap_closed_pct"] else None
        rows = sorted(kept + rows, key=lambda r: (r["preset"] != "vision", r["preset"],
                                                  r["method"], r["n"]))  # fmt: skip
    with (out / "zoo_results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: r[k] for k in fields} for r in rows)
    lines = ["| preset | merge | n | variant | val acc | test acc | expert test | gap closed | "
             "settings |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        gap = "—" if r["gap_closed_pct"] is None else f"{r['gap_closed_pct']:.1f} %"
        lines.append(
            f"| {r['preset']} | {r['method']} | {r['n']} | {r['variant']} | "
            f"{100 * r['val_acc']:.1f} | {100 * r['test_acc']:.1f} | "
            f"{100 * r['expert_test_acc']:.1f} | {gap} | `{r['settings']}` |"
        )
    (out / "zoo_results.md").write_text("\n".join(lines) + "\n")
    grid_cells = {(r["preset"], r["method"], r["n"]) for r in grid}
    grid_file = out / "zoo_grid.json"
    kept = [r for r in json.loads(grid_file.read_text())
            if (r["preset"], r["method"], r["n"]) not in grid_cells] if (
        grid_file.is_file()) else []  # fmt: skip
    grid_file.write_text(json.dumps(kept + grid, indent=1) + "\n")
    plot(rows, out / "accuracy_vs_n.png")
    print("\n".join(lines))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["preset"], r["method"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, (preset, method) in zip(axes[0], keys, strict=True):
        sub = [r for r in rows if r["preset"] == preset and r["method"] == method]
        for variant in ("merged", "merged + heads", "featcal (paper defaults)",
                        "featcal (val-selected)", "featcal + heads"):  # fmt: skip
            points = sorted((r["n"], r["test_acc"]) for r in sub if r["variant"] == variant)
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=variant)
        ax.axhline(sub[0]["expert_test_acc"], color="k", ls="--", lw=1, label="experts")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{preset} / {method}")
        ax.set_xlabel("calibration inputs per task (n)")
        ax.set_ylabel("average test accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["vision", "text"])
    parser.add_argument("--n", nargs="+", type=int, default=[8, 32, 128])
    parser.add_argument("--methods", nargs="+", default=["task_arithmetic", "ties"])
    parser.add_argument("--work", default=str(ROOT / "runs" / "benchmark"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--max-val", type=int, default=None,
                        help="score only the first N validation rows per task (speed; the "
                        "validation rows are a seeded random sample, so this is a subsample)")  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("featcal_core", "transformers", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    started = time.perf_counter()
    work = Path(args.work)
    results = []
    for preset in args.presets:
        results += run_preset(preset, args.n, args.methods, work, args.max_val)
        write(results, Path(args.out))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
