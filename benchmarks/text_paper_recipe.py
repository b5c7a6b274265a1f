"""The `text-paper` zoo's recipe, chosen on validation data: which pooling its frozen heads read,
and the encoder's learning rate and steps.

    python benchmarks/text_paper_recipe.py pooling
    python benchmarks/text_paper_recipe.py recipe [--pooling mean] [--candidate LR STEPS ...]

`pooling`: the real all-MiniLM-L6-v2 base with a linear head fitted on its train features, read
through mean pooling (the model card's) and through [CLS] (the pooler), validation accuracy per
task. `recipe`: one expert per task for every (lr, steps) pair (`featcal_core.zoo.text_recipe`;
default: the preset's candidates, which its build trains the same way): the base with its head,
the expert and ‖τ‖/‖θ₀‖, and the pair the rule chooses. The tasks, data
(train cap, seed), batch size and max length are the preset's; only train and validation splits
are read. Tables print as markdown (percent); logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["pooling", "recipe"])
    parser.add_argument("--pooling", default=None, help="default: the preset's")
    parser.add_argument(
        "--candidate",
        nargs=2,
        action="append",
        metavar=("LR", "STEPS"),
        help="a (learning rate, steps) pair to try (repeat it); default: the preset's",
    )
    parser.add_argument("--tasks", nargs="*", default=None, help="default: the preset's")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from featcal_core.zoo.build import PRESETS, _load_task_data, _text_base, minilm_dir
    from featcal_core.zoo.text_recipe import (
        choose_recipe,
        compare_poolings,
        train_and_validation,
    )

    spec = PRESETS["text-paper"]
    expert = spec.extra.get("expert", {})
    tasks = args.tasks or list(spec.tasks)
    data = {
        task: train_and_validation(_load_task_data(task, spec.tasks[task], spec), task)
        for task in tasks
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="text-paper-recipe-") as work:
        base = _text_base(minilm_dir(), Path(work) / "base")
        if args.what == "pooling":
            accuracy = compare_poolings(
                base, data, max_length=spec.max_length, seed=spec.seed, threads=args.threads
            )
            print("| task | mean pooling | [CLS] (pooler) |\n|---|---|---|")
            for task, row in accuracy.items():
                print(f"| {task} | {100 * row['mean']:.1f} | {100 * row['cls']:.1f} |")
            for pooling in ("mean", "cls"):
                mean = sum(row[pooling] for row in accuracy.values()) / len(accuracy)
                print(f"mean {pooling}: {100 * mean:.2f}")
        else:
            pairs = args.candidate or spec.extra["recipe"]
            candidates = [(float(lr), int(steps)) for lr, steps in pairs]
            chosen, trials = choose_recipe(
                base,
                data,
                candidates,
                work_dir=Path(work) / "trials",
                pooling=args.pooling or expert.get("pooling", "mean"),
                batch_size=spec.batch_size,
                max_length=spec.max_length,
                seed=spec.seed,
                threads=args.threads,
            )
            print("| lr | steps | task | base + head | expert | gain | ‖τ‖/‖θ₀‖ |")
            print("|---|---|---|---|---|---|---|")
            for t in trials:
                print(
                    f"| {t.lr:g} | {t.steps} | {t.task} | {100 * t.probe_accuracy:.1f} | "
                    f"{100 * t.accuracy:.1f} | {100 * t.gain:+.1f} | "
                    f"{100 * t.task_vector_ratio:.2f} % |"
                )
            print(f"chosen: lr {chosen[0]:g}, steps {chosen[1]}")
    print(f"wall {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
