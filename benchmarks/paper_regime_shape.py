"""Does the tower's shape hold FeatCal back in the paper's regime? The vision-paper zoo with a
deeper or wider base: FeatCal alone at the paper's defaults against Task Arithmetic 0.3.

    python benchmarks/paper_regime_shape.py [--layers 8] [--width 128] [--pretrain-steps 400]
                                            [--drop TASK ...]

Builds (or reuses) the `vision-paper` preset with a base of `--layers` blocks of width `--width`
(MLP 4x the width, one attention head per 32 channels; the preset is 4 blocks of width 128, whose
zoo data/zoo/vision-paper is used as it is) in data/zoo/vision-paper-<L>l (width 128) or
data/zoo/vision-paper-<L>l-<W>w, then runs `featcal compare` on it with three variants:
Task Arithmetic 0.3 alone, + FeatCal at the paper's defaults (α 0.25, ρ 2.2, λ 0.05, n 32), and
+ FeatCal with α 1 (the teacher that undoes upstream drift too). Test split for the paper's
defaults; the α 1 row is an ablation, not a choice. `--drop` leaves tasks out of the merge (and of
the table), to see how much one task's interference costs the others. Prints each expert's validation accuracy
with the base's head, ‖τ‖/‖θ₀‖, and the compare table (params and logs: benchmarks/out/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument(
        "--drop",
        nargs="*",
        default=[],
        metavar="TASK",
        help="leave these tasks' experts out of the merge (task interference)",
    )
    args = parser.parse_args()
    if args.width % 32:
        parser.error(f"--width {args.width}: pick a multiple of 32 (one attention head per 32)")
    sys.path.insert(0, str(ROOT))
    from featcal_core.zoo.build import PRESETS, build_zoo, zoo_models_and_tasks

    preset = PRESETS["vision-paper"]
    if (args.layers, args.width, args.pretrain_steps) == (4, 128, preset.pretrain_steps):
        name, spec = preset.name, preset  # the preset itself (its zoo is reused when built)
    else:
        name = f"vision-paper-{args.layers}l" + ("" if args.width == 128 else f"-{args.width}w")
        tower = {"layers": args.layers}
        if args.width != 128:  # the 128-wide zoos keep their fingerprint (and their cached build)
            tower.update(
                hidden_size=args.width, intermediate=4 * args.width, heads=args.width // 32
            )
        spec = dataclasses.replace(
            preset,
            name=name,
            pretrain_steps=args.pretrain_steps,
            extra={**preset.extra, "pretrain": {"tower": tower}},
        )
    out = ROOT / "data" / "zoo" / name
    started = time.perf_counter()
    manifest = build_zoo(spec, out, progress=False)
    built = time.perf_counter() - started
    print(
        f"zoo {name}: {manifest['seconds']:.0f} s to build ({built:.0f} s this call); base "
        f"rotation accuracy {manifest['base'].get('rotation_accuracy_mean', float('nan')):.3f}"
    )
    for task, entry in manifest["experts"].items():
        print(
            f"  {task:14s} base + head {100 * entry['probe_validation_accuracy']:5.1f} %  expert "
            f"{100 * entry['validation_accuracy']:5.1f} %  |tau|/|theta0| "
            f"{100 * entry['task_vector_ratio']:.2f} %"
        )
    models, tasks = zoo_models_and_tasks(manifest, out, "test")
    unknown = sorted(set(args.drop) - set(tasks))
    if unknown:
        parser.error(f"--drop {unknown}: not tasks of the zoo (it has {sorted(tasks)})")
    for task in args.drop:
        del tasks[task], models["experts"][task]
    if args.drop:
        name += "-without-" + "-".join(sorted(args.drop))
    ta = ["merge.method=task_arithmetic", "merge.hyperparameters={scale: 0.3}"]
    params = {
        "run": {"name": f"{name}-shape", "results_dir": f"data/results/{name}-shape", "seed": 0},
        "models": models,
        "tasks": tasks,
        "merge": {"method": "task_arithmetic", "hyperparameters": {"scale": 0.3}},
        "featcal": {"alpha": 0.25, "rho": 2.2, "lam": 0.05, "num_per_task": 32, "heads": False},
        "tracking": {"enabled": False},
        "compare": {
            "variants": [
                {"name": "ta", "set": [*ta, "repair.method=none"]},
                {"name": "ta.featcal", "set": [*ta, "repair.method=featcal"]},
                {
                    "name": "ta.featcal-alpha1",
                    "set": [*ta, "repair.method=featcal", "featcal.alpha=1.0"],
                },
            ]
        },
    }
    folder = ROOT / "benchmarks" / "out" / "paper_regime_shape"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "featcal_cli.main", "compare", "--params", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    (folder / f"{name}.log").write_text(done.stderr)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    report = ROOT / "reports" / f"{name}-shape-compare" / "compare.json"
    record = json.loads(report.read_text())
    print(f"featcal compare: {time.perf_counter() - started:.0f} s ({report})")
    for variant in record["variants"]:
        mean = variant["mean"]
        gap = mean.get("gap_closed")
        print(
            f"  {variant['name']:18s} mean accuracy {mean['accuracy']:5.1f} %  gap closed "
            + ("—" if gap is None else f"{gap:.1f} %")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
