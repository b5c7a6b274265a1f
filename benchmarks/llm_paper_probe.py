"""Does the real SmolLM2-135M-Instruct leave room for a repair? The LLM zoo's regime, measured on
validation data only: experts fully fine-tuned from the real base on the four LLM tasks
(featcal_core/zoo/llm_tasks.py), merged by Task Arithmetic, then calibrated with FeatCal.

Prints, per task, validation accuracy (two-word label continuation, featcal's own scoring) of the
base, each expert on its task, the merge and the merge + FeatCal, with the mean and the gap
closed, and the per-block drift before and after FeatCal.

    python benchmarks/llm_paper_probe.py --work /tmp/llm-probe --steps 60 --lr 3e-5

The work folder keeps the exported base and the experts (a rerun with the same recipe reuses
them; delete it to start over).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import datasets

from featcal_core import FeatCalParams, calibrate
from featcal_core.evaluation.language_model import label_continuation
from featcal_core.merging.run import merge_checkpoints
from featcal_core.zoo.llm_finetuning import clip_text, finetune_causal_expert, prompt
from featcal_core.zoo.llm_tasks import LLM_TASKS
from featcal_core.zoo.smollm2 import export_smollm2
from featcal_core.zoo.sources import load_source


def _accuracy(model: Path, base: Path, task, split) -> float:
    texts = [clip_text(t) for t in split["text"]]
    labels = [int(v) for v in split["label"]]
    scored = label_continuation(model, base, texts, labels, list(task.words), task.template)
    return 100 * scored["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=list(LLM_TASKS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--scale", type=float, default=0.4, help="Task Arithmetic's λ")
    parser.add_argument("--validation", type=int, default=200, help="rows per task")
    parser.add_argument("--calibration", type=int, default=64, help="FeatCal inputs per task")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    started = time.perf_counter()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    if not (base / "model.safetensors").is_file():
        export_smollm2(base)
    data = {
        name: load_source(LLM_TASKS[name].source, seed=0, max_train=2000) for name in args.tasks
    }
    valid = {
        name: d["validation"]
        .shuffle(seed=0)
        .select(range(min(args.validation, len(d["validation"]))))
        for name, d in data.items()
    }
    recipe = f"s{args.steps}-lr{args.lr:g}-b{args.batch_size}"
    experts = {}
    for index, name in enumerate(args.tasks):
        folder = work / f"expert-{name}-{recipe}"
        if not (folder / "model.safetensors").is_file():
            stats = finetune_causal_expert(
                base,
                data[name],
                folder,
                LLM_TASKS[name],
                steps=args.steps,
                lr=args.lr,
                batch_size=args.batch_size,
                seed=index + 1,
                progress=True,
            )
            (folder / "stats.json").write_text(json.dumps(stats))
        experts[name] = folder
    calib = {}
    for name in args.tasks:
        folder = work / f"calib-{name}"
        if not folder.is_dir():
            rows = data[name]["train"].shuffle(seed=1).select(range(args.calibration))
            texts = [prompt(LLM_TASKS[name], t) for t in rows["text"]]
            datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(folder))
        calib[name] = folder
    merged = work / f"ta{args.scale:g}-{recipe}"
    merge_checkpoints(
        base,
        experts,
        merged,
        "task_arithmetic",
        {"scale": args.scale},
        overwrite=True,
        progress=False,
    )
    calibrated = work / f"ta{args.scale:g}-featcal-{recipe}"
    record = calibrate(
        base,
        merged,
        experts,
        calib,
        calibrated,
        FeatCalParams(),
        num_per_task=args.calibration,
        overwrite=True,
        progress=False,
    )
    rows = {}
    for name in args.tasks:
        task, split = LLM_TASKS[name], valid[name]
        rows[name] = {
            "base": _accuracy(base, base, task, split),
            "expert": _accuracy(experts[name], base, task, split),
            "merged": _accuracy(merged, base, task, split),
            "featcal": _accuracy(calibrated, base, task, split),
        }
        print(name, {k: round(v, 1) for k, v in rows[name].items()}, flush=True)
    mean = {
        k: sum(r[k] for r in rows.values()) / len(rows)
        for k in ("base", "expert", "merged", "featcal")
    }
    gap = mean["expert"] - mean["merged"]
    closed = 100 * (mean["featcal"] - mean["merged"]) / gap if gap else float("nan")
    print(f"\nrecipe {recipe}, TA λ {args.scale}, {args.validation} validation rows per task")
    print("| task | base | expert | TA | TA + FeatCal |")
    print("|---|---|---|---|---|")
    for name, r in {**rows, "mean": mean}.items():
        print(
            f"| {name} | {r['base']:.1f} | {r['expert']:.1f} | {r['merged']:.1f} | {r['featcal']:.1f} |"
        )
    print(f"gap closed: {closed:.1f} %")
    drift = [
        (b["index"], sum(b["drift_before"].values()), sum(b["drift_after"].values()))
        for b in record["blocks"]
    ]
    print("drift per block (summed over tasks), before → after:")
    print(", ".join(f"{i}: {x:.3g}→{y:.3g}" for i, x, y in drift))
    print(f"seconds: {time.perf_counter() - started:.0f}")


if __name__ == "__main__":
    main()
