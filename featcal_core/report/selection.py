"""The select step's record (flows.selection, `selection.json`) as a table: one row per
candidate, best first, with its mean score, its per-task scores and its cost.

    headers, rows = selection_table(record)
    lines = selection_lines(record)   # the score, the winner and why
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["selection_lines", "selection_table"]

_LABELS = {"agreement": "agreement with the experts (%)", "drift": "feature drift",
           "kl": "KL divergence from the experts' class probabilities (nats)",
           "validation": "validation accuracy (%)"}  # fmt: skip


def _value(score: str, value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.4f}" if score in ("drift", "kl") else f"{value:.1f}"


def selection_lines(record: Mapping[str, Any]) -> list[str]:
    """What was chosen, on what, and why (plain text lines)."""
    if record.get("winner") is None:
        return [record.get("why") or "no selection"]
    score = record["score"]
    where = ("each task's labelled validation split" if score == "validation" else
             f"{record['holdout_per_task']} held-out unlabeled inputs per task (label-free)")  # fmt: skip
    better = "higher" if record["higher_is_better"] else "lower"
    return [f"chosen: {record['winner']} ({'; '.join(record['set']) or 'no overrides'})",
            f"score: {_LABELS[score]} on {where}; {better} is better",
            f"why: {record['why']}"]  # fmt: skip


def selection_table(record: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): rank, candidate (winner starred), merge, repair, mean score, one column
    per task, seconds (merge + repair)."""
    if record.get("winner") is None:
        return [], []
    score = record["score"]
    by_name = {c["name"]: c for c in record["candidates"]}
    tasks = list(next(iter(by_name.values()))["tasks"])
    headers = ["rank", "candidate", "merge", "repair", f"mean {score}", *tasks, "seconds"]
    rows = []
    for rank, name in enumerate(record["ranking"], start=1):
        candidate = by_name[name]
        seconds = candidate["merge_seconds"] + candidate["repair_seconds"]
        rows.append([
            str(rank), name + (" *" if name == record["winner"] else ""),
            candidate["merge"]["method"], candidate["repair"], _value(score, candidate["mean"]),
            *[_value(score, candidate["tasks"][t].get(score)) for t in tasks], f"{seconds:.1f}",
        ])  # fmt: skip
    return headers, rows
