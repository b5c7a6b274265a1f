"""How much the tasks' inputs overlap inside the base model, block by block: FeatCal fits one
weight to every task's target on that task's own inputs, so tasks whose inputs span the same
directions compete for them, and tasks whose inputs live apart can each be matched.

    python benchmarks/task_overlap.py data/results/text-paper-compare
    python benchmarks/task_overlap.py data/results/vision-paper-compare --rows 32

Reads a results folder of `featcal run`/`featcal compare` (its models.lock.json: the base; its
calibration_sets/: each task's rows, the first `--rows` of them), runs the base on each task's
rows, and for every block input (and the last block's output) takes each task's token statistics
over real tokens (padding left out): the uncentered second moment C_t = E[x xᵀ] (what FeatCal's
solve sums) and the covariance Σ_t = C_t − μ_t μ_tᵀ. Prints per block the mean over task pairs of
the Frobenius cosine ⟨A, B⟩ / (‖A‖ ‖B‖) of the C's and of the Σ's (1: the same directions with
the same energy), and the least and most similar pair of Σ's; then each task's class balance in
the rows read (from the calibration set's label column, which FeatCal never reads).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tokens(base: Path, rows, modality: str, column: str):
    """[(hidden states per layer (L+1, tokens, width) of real tokens)] for the rows, batch 16."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(base).eval()
    if modality == "text":
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(base)
    else:
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(base)
    layers = []
    with torch.no_grad():
        for start in range(0, len(rows), 16):
            batch = rows[start : start + 16][column]
            if modality == "text":
                inputs = tokenizer(
                    batch, padding=True, truncation=True, max_length=128, return_tensors="pt"
                )
                mask = inputs["attention_mask"].bool()
            else:
                images = [image.convert("RGB") for image in batch]
                inputs = processor(images=images, return_tensors="pt")
                mask = None
            out = model(**inputs, output_hidden_states=True)
            states = torch.stack(out.hidden_states)  # (L+1, batch, tokens, width)
            if mask is None:
                mask = torch.ones(states.shape[1:3], dtype=torch.bool)
            layers.append(states[:, mask].double())
    return torch.cat(layers, dim=1)


def _cosine(a, b) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--rows", type=int, default=32, help="rows per task (FeatCal's n)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import datasets

    lock = json.loads((args.results / "models.lock.json").read_text())
    base = Path(lock["base"]["path"])
    moments, balance = {}, {}
    for task_dir in sorted((args.results / "calibration_sets").iterdir()):
        record = json.loads((task_dir / "calibration_set.json").read_text())
        rows = datasets.load_from_disk(str(task_dir)).select(range(args.rows))
        states = _tokens(base, rows, record["modality"], record["columns"]["input"])
        second = states.transpose(1, 2) @ states / states.shape[1]  # (L+1, width, width)
        mean = states.mean(dim=1)
        moments[record["task"]] = (second, second - mean[:, :, None] * mean[:, None, :])
        label = record["columns"].get("label")
        if label is not None:
            counts: dict = {}
            for value in rows[label]:
                counts[value] = counts.get(value, 0) + 1
            balance[record["task"]] = dict(sorted(counts.items()))
    tasks = list(moments)
    pairs = list(itertools.combinations(tasks, 2))
    depth = next(iter(moments.values()))[0].shape[0]
    print(f"{len(tasks)} tasks, {args.rows} rows each, base {lock['base']['reference']}")
    print("| block input | mean cos C | mean cos Σ | least similar Σ | most similar Σ |")
    print("|---|---|---|---|---|")
    for layer in range(depth):
        cos_c = [_cosine(moments[a][0][layer], moments[b][0][layer]) for a, b in pairs]
        cos_s = {(a, b): _cosine(moments[a][1][layer], moments[b][1][layer]) for a, b in pairs}
        low = min(cos_s, key=cos_s.__getitem__)
        high = max(cos_s, key=cos_s.__getitem__)
        name = f"{layer}" if layer < depth - 1 else f"{layer} (output)"
        print(
            f"| {name} | {sum(cos_c) / len(cos_c):.3f} | {sum(cos_s.values()) / len(cos_s):.3f} | "
            f"{low[0]}/{low[1]} {cos_s[low]:.3f} | {high[0]}/{high[1]} {cos_s[high]:.3f} |"
        )
    if balance:
        print("\nclass counts in the rows read:")
        for task, counts in balance.items():
            print(f"- {task}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
