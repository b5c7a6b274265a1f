"""Scoring in `lm_token_weighting.py`: label-continuation accuracy of model directories on the
capped splits (cached), and the binomial standard error of a task-averaged accuracy."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from lm_settings import TASKS, TEMPLATE

from featcal_core.evaluation.language_model import label_continuation


class Scorer:
    """Label-continuation accuracy of model directories on the (capped) splits, cached."""

    def __init__(self, tokenizer_dir: Path, tasks: dict, eval_rows: dict):
        self.tokenizer_dir = tokenizer_dir
        self.tasks = tasks
        self.rows = eval_rows  # (task, split) → (texts, labels)
        self.cache: dict[tuple[str, str, str], float] = {}

    def accuracy(self, model_dir: Path, task: str, split: str) -> float:
        key = (str(model_dir), task, split)
        if key not in self.cache:
            texts, labels = self.rows[task, split]
            result = label_continuation(
                model_dir,
                self.tokenizer_dir,
                texts,
                labels,
                self.tasks[task]["words"],
                template=TEMPLATE,
                batch_size=64,
            )
            self.cache[key] = result["accuracy"]
        return self.cache[key]

    def all_tasks(self, model_dir: Path, split: str) -> dict[str, float]:
        """task → accuracy, plus "avg"."""
        scores = {task: self.accuracy(model_dir, task, split) for task in TASKS}
        scores["avg"] = float(np.mean([scores[t] for t in TASKS]))
        return scores


def standard_error(scores: dict[str, float], counts: dict[str, int]) -> float:
    """Binomial standard error of the average over tasks of per-task accuracies."""
    variance = sum(scores[t] * (1 - scores[t]) / counts[t] for t in TASKS)
    return math.sqrt(variance) / len(TASKS)
