"""The four text tasks of `lm_token_weighting.py`: loading them from the offline text zoo, cutting
texts to MAX_TEXT_TOKENS tokens, and the seeded (capped) validation and test rows."""

from __future__ import annotations

import numpy as np
from lm_settings import DATA, MAX_TEXT_TOKENS, TASKS


def load_tasks() -> dict[str, dict]:
    """task → {"words": label words, split → (texts, labels)} from the offline text zoo."""
    import datasets

    tasks = {}
    for task in TASKS:
        data = datasets.load_from_disk(str(DATA / task))
        names = data["train"].features["label"].names
        entry = {"words": [str(n).lower() for n in names]}
        for split in ("train", "validation", "test"):
            entry[split] = (
                [str(t) for t in data[split]["text"]],
                [int(x) for x in data[split]["label"]],
            )
        tasks[task] = entry
    return tasks


def clip_texts(tokenizer, texts: list[str]) -> list[str]:
    """Each text cut after its first MAX_TEXT_TOKENS tokens (by the tokenizer's offsets)."""
    out = []
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    for text, offsets in zip(texts, encoded["offset_mapping"], strict=True):
        out.append(
            text if len(offsets) <= MAX_TEXT_TOKENS else text[: offsets[MAX_TEXT_TOKENS - 1][1]]
        )
    return out


def subset(texts: list[str], labels: list[int], limit: int, seed: int) -> tuple[list, list]:
    """At most `limit` rows (0 = all; else a seeded sample), ordered by text length."""
    rows = list(range(len(texts)))
    if 0 < limit < len(texts):
        rows = [
            int(i) for i in np.random.default_rng(seed).choice(len(texts), limit, replace=False)
        ]
    rows.sort(key=lambda i: (len(texts[i]), i))  # by length: less padding (accuracy is a mean)
    return [texts[i] for i in rows], [labels[i] for i in rows]


def clip_all(tokenizer, tasks: dict) -> None:
    for task in TASKS:
        for split in ("train", "validation", "test"):
            texts, labels = tasks[task][split]
            tasks[task][split] = (clip_texts(tokenizer, texts), labels)


def eval_rows(tasks: dict, args) -> dict:
    rows = {}
    for index, task in enumerate(TASKS):
        for split, limit in (("validation", args.max_val), ("test", args.max_test)):
            texts, labels = tasks[task][split]
            rows[task, split] = subset(texts, labels, limit, args.seed + 100 + index)
    return rows
