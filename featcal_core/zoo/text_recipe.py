"""Choosing the `text-paper` zoo's recipe on validation data: the pooling its heads read and the
encoder's learning rate and steps.

    accuracy = compare_poolings(base_dir, data)            # {task: {"mean": acc, "cls": acc}}
    chosen, trials = choose_recipe(base_dir, data, [(2e-5, 60), (1e-4, 60)], work_dir=tmp)

Both read each task's train split (fitting) and validation split (scoring) only: every dataset
is cut to those two splits before anything else sees it (`train_and_validation`), so the test
split, kept for the final evaluation, plays no part in any choice. Accuracies are fractions.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.linear_head import pooled
from featcal_core.zoo.text_encoder_finetuning import (
    POOLING_FEATURES,
    finetune_text_encoder,
    fit_frozen_head,
)
from featcal_core.zoo.text_finetuning import tokenize_split
from featcal_core.zoo.training_inputs import class_names, label_tensor, load_pretrained
from featcal_core.zoo.training_loop import EVAL_BATCH, evaluate, fit_linear_probe, torch_threads

logger = logging.getLogger(__name__)

__all__ = ["Trial", "choose_recipe", "compare_poolings", "train_and_validation", "trial_dir"]


def train_and_validation(dataset: Any, what: str) -> Any:
    """The DatasetDict of `dataset`'s "train" and "validation" splits only (any other split,
    test included, is left behind unread)."""
    import datasets

    missing = [s for s in ("train", "validation") if s not in dataset]
    if missing:
        raise FeatCalError(
            f"{what}: no {missing[0]!r} split; pass a DatasetDict with train and validation splits"
        )
    return datasets.DatasetDict(train=dataset["train"], validation=dataset["validation"])


@torch.no_grad()
def compare_poolings(
    base_dir: str | Path,
    data: Mapping[str, Any],
    *,
    max_length: int = 48,
    probe_steps: int = 300,
    seed: int = 0,
    threads: int | None = None,
) -> dict[str, dict[str, float]]:
    """Validation accuracy of the frozen base under a linear head fitted on its train features,
    for each pooling ("mean": mean of last_hidden_state over the real tokens; "cls": the
    pooler_output), per task: {task: {pooling: accuracy}}. One base pass per split."""
    from transformers import AutoTokenizer, BertModel

    base_dir = Path(base_dir)
    tokenizer = load_pretrained(AutoTokenizer, base_dir, "text base tokenizer")
    out: dict[str, dict[str, float]] = {}
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = load_pretrained(BertModel, base_dir, "text base").eval()
        for task, dataset in data.items():
            what = f"task {task}"
            dataset = train_and_validation(dataset, what)
            names = class_names(dataset, ("text", "label"), what)
            features, labels = {}, {}
            for split in ("train", "validation"):
                tokens = tokenize_split(tokenizer, dataset[split], max_length, what, split)
                labels[split] = label_tensor(dataset[split], len(names), what, split)
                parts: dict[str, list[torch.Tensor]] = {p: [] for p in POOLING_FEATURES}
                for start in range(0, len(labels[split]), EVAL_BATCH):
                    index = torch.arange(start, min(start + EVAL_BATCH, len(labels[split])))
                    batch = tokens.batch(index)
                    output = model(**batch)
                    for pooling, kind in POOLING_FEATURES.items():
                        parts[pooling].append(pooled(output, batch["attention_mask"], kind))
                features[split] = {p: torch.cat(v) for p, v in parts.items()}
            out[task] = {}
            for pooling in POOLING_FEATURES:
                with torch.enable_grad():
                    linear = fit_linear_probe(
                        features["train"][pooling], labels["train"], len(names), probe_steps, seed
                    )
                scores = linear(features["validation"][pooling])
                accuracy, _ = evaluate(lambda index, s=scores: s[index], labels["validation"])
                out[task][pooling] = accuracy
            logger.info("task %s: base + head validation accuracy %s", task, out[task])
    return out


@dataclass(frozen=True)
class Trial:
    """One candidate (lr, steps) on one task: `finetune_text_encoder`'s stats (validation
    accuracy of the base with its frozen head and of the expert, fractions; ‖τ‖/‖θ₀‖; ...)."""

    lr: float
    steps: int
    task: str
    stats: Mapping[str, Any]

    @property
    def probe_accuracy(self) -> float:
        return float(self.stats["probe_validation_accuracy"])

    @property
    def accuracy(self) -> float:
        return float(self.stats["validation_accuracy"])

    @property
    def task_vector_ratio(self) -> float:
        return float(self.stats["task_vector_ratio"])

    @property
    def gain(self) -> float:
        return self.accuracy - self.probe_accuracy

    def row(self) -> dict[str, Any]:
        """The trial as plain JSON (the zoo manifest's record)."""
        return {"lr": self.lr, "steps": self.steps, "task": self.task, **self.stats}


def trial_dir(work_dir: str | Path, candidate: tuple[float, int], task: str) -> Path:
    """Where `choose_recipe` writes candidate (lr, steps)'s expert for `task`."""
    lr, steps = candidate
    return Path(work_dir) / f"lr{float(lr):g}-steps{int(steps)}" / task


def choose_recipe(
    base_dir: str | Path,
    data: Mapping[str, Any],
    candidates: Sequence[tuple[float, int]],
    *,
    work_dir: str | Path,
    keep: bool = False,
    pooling: str = "mean",
    batch_size: int = 32,
    max_length: int = 48,
    probe_steps: int = 300,
    min_gain: float = 0.01,
    max_ratio: float = 0.05,
    seed: int = 0,
    threads: int | None = None,
    progress: bool = False,
) -> tuple[tuple[float, int], list[Trial]]:
    """Fine-tune one expert per task and candidate (lr, steps) with `finetune_text_encoder` (the
    task's head fitted once on the base, `fit_frozen_head`; seeds as the zoo build gives them:
    seed·1000 + task index + 1) and choose: among the candidates under which every expert beats
    the base with its head by at least `min_gain` and moves at most `max_ratio` (‖τ‖/‖θ₀‖), the
    highest mean validation accuracy (ties: the smaller mean ratio); when none qualifies, the
    highest mean validation accuracy (with a warning). Experts are written to
    `trial_dir(work_dir, candidate, task)`; with keep=False they are removed. Returns
    ((lr, steps), every trial)."""
    if not candidates:
        raise FeatCalError("choose_recipe: no candidates; pass (lr, steps) pairs")
    candidates = [(float(lr), int(steps)) for lr, steps in candidates]
    trials: list[Trial] = []
    for index, (task, dataset) in enumerate(data.items()):
        split = train_and_validation(dataset, f"task {task}")
        task_seed = seed * 1000 + index + 1
        shape: dict[str, Any] = dict(
            max_length=max_length, pooling=pooling, probe_steps=probe_steps
        )
        head = fit_frozen_head(base_dir, split, seed=task_seed, threads=threads, **shape)
        for lr, steps in candidates:
            out = trial_dir(work_dir, (lr, steps), task)
            out.parent.mkdir(parents=True, exist_ok=True)
            stats = finetune_text_encoder(
                base_dir,
                split,
                out,
                steps=steps,
                batch_size=batch_size,
                lr=lr,
                head=head,
                seed=task_seed,
                progress=progress,
                threads=threads,
                overwrite=True,
                **shape,
            )
            if not keep:
                shutil.rmtree(out, ignore_errors=True)
            trials.append(Trial(lr, steps, task, stats))
            logger.info("recipe trial %s", trials[-1])

    def of(candidate: tuple[float, int]) -> list[Trial]:
        return [t for t in trials if (t.lr, t.steps) == (float(candidate[0]), int(candidate[1]))]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    def qualifies(candidate: tuple[float, int]) -> bool:
        return all(t.gain >= min_gain and t.task_vector_ratio <= max_ratio for t in of(candidate))

    def rank(candidate: tuple[float, int]) -> tuple[float, float]:
        rows = of(candidate)
        return (mean([t.accuracy for t in rows]), -mean([t.task_vector_ratio for t in rows]))

    pool = [c for c in candidates if qualifies(c)]
    if not pool:
        logger.warning(
            "no candidate lets every expert gain %.3f over the base with its head within a task "
            "vector of %.3f; taking the best mean validation accuracy",
            min_gain,
            max_ratio,
        )
        pool = list(candidates)
    lr, steps = max(pool, key=rank)
    return (float(lr), int(steps)), trials
