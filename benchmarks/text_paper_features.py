"""What the frozen heads of the `text-paper` zoo read: per task, on its validation split, the
mean-pooled features of the base, the expert and any other models (a merge, a calibrated tower),
under the task's frozen head.

    python benchmarks/text_paper_features.py NAME=DIR [NAME=DIR ...]
    # e.g. merged=data/results/text-paper-ablation/merges/<key>
    #      paper=data/results/text-paper-ablation/variants/paper/calibrated

Prints per task and model: accuracy under the head; accuracy with each feature vector rescaled to
the expert's mean feature norm (a head that ignores the norm, as CLIP's cosine zero-shot heads
do); the mean feature norm; the drift ‖f − f_expert‖ / ‖f_expert‖ and the cosine to the expert's
feature (means over the split). Texts are cut at 128 tokens, as the evaluation cuts them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def features(directory: Path, tokenizer, texts: list[str]):
    """The mean-pooled last hidden states (N, hidden) of the BertModel in `directory`."""
    import torch
    from transformers import BertModel

    from featcal_core.evaluation.linear_head import pooled

    model = BertModel.from_pretrained(directory).eval()
    parts = []
    with torch.no_grad():
        for start in range(0, len(texts), 64):
            batch = tokenizer(
                texts[start : start + 64],
                padding=True,
                truncation=True,
                max_length=128,
                return_tensors="pt",
            )
            parts.append(pooled(model(**batch), batch["attention_mask"], "mean_pooling"))
    return torch.cat(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="NAME=DIR")
    parser.add_argument("--zoo", default=str(ROOT / "data" / "zoo" / "text-paper"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import datasets
    import torch
    from huggingface_hub import snapshot_download
    from transformers import AutoTokenizer

    from featcal_core.evaluation.linear_head import load_linear_head

    zoo = Path(args.zoo)
    manifest = json.loads((zoo / "zoo.json").read_text())

    def snapshot(repo: str) -> Path:
        return Path(snapshot_download(repo, cache_dir=zoo / "hub", local_files_only=True))

    others = {"base": snapshot(manifest["base"]["repo_id"])}
    others.update({name: Path(path) for name, path in (a.split("=", 1) for a in args.models)})
    print("| task | model | accuracy | rescaled | norm | drift | cosine |")
    print("|---|---|---|---|---|---|---|")
    for task, entry in manifest["experts"].items():
        expert = snapshot(entry["repo_id"])
        head = load_linear_head(expert)
        tokenizer = AutoTokenizer.from_pretrained(expert)
        split = datasets.load_from_disk(str(zoo / "data" / task))["validation"]
        texts, labels = list(split["text"]), torch.tensor(list(split["label"]))

        found = {
            name: features(directory, tokenizer, texts)
            for name, directory in {"expert": expert, **others}.items()
        }
        reference = found["expert"]
        scale = reference.norm(dim=1).mean()
        for name, value in found.items():
            accuracy = (head.logits(value).argmax(-1) == labels).float().mean().item()
            rescaled = value / value.norm(dim=1, keepdim=True) * scale
            accuracy_rescaled = (head.logits(rescaled).argmax(-1) == labels).float().mean().item()
            drift = ((value - reference).norm(dim=1) / reference.norm(dim=1)).mean().item()
            cosine = torch.nn.functional.cosine_similarity(value, reference).mean().item()
            print(
                f"| {task} | {name} | {100 * accuracy:.1f} | {100 * accuracy_rescaled:.1f} | "
                f"{value.norm(dim=1).mean():.2f} | {drift:.3f} | {cosine:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
