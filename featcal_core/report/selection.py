"""The select step's record (flows.selection, `selection.json`) as a table: one row per
candidate, best first, with its mean score, its per-task scores and its cost.

    headers, rows = selection_table(record)
    lines = selection_lines(record)   # the score, the winner and why
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["held_out_text", "selection_lines", "selection_table"]

_LABELS = {
    "agreement": "agreement with the experts (%)",
    "drift": "feature drift",
    "kl": "KL divergence from the experts' class probabilities (nats)",
    "validation": "validation accuracy (%)",
}


def _value(score: str, value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.4f}" if score in ("drift", "kl") else f"{value:.1f}"


def held_out_text(counts: Mapping[str, int], requested: int) -> str:
    """How many held-out inputs each task had: "128 held-out unlabeled inputs per task", or,
    where a task had fewer rows left than `requested` (select.holdout_per_task), each task's
    count: "held-out unlabeled inputs mnist 12, digits 128 (128 requested per task; fewer rows
    were left)"."""
    if all(count == requested for count in counts.values()):
        return f"{requested} held-out unlabeled inputs per task"
    listed = ", ".join(f"{task} {count}" for task, count in counts.items())
    return (
        f"held-out unlabeled inputs {listed} ({requested} requested per task; fewer rows were left)"
    )


def _held_out(record: Mapping[str, Any]) -> dict[str, int]:
    """{task: held-out inputs actually scored on}: the record's `held_out`; a record written
    before it was kept: the requested count for every task."""
    counts = record.get("held_out")
    if counts is None:
        tasks = record["candidates"][0]["tasks"] if record.get("candidates") else {}
        counts = dict.fromkeys(tasks, record["holdout_per_task"])
    return dict(counts)


def selection_lines(record: Mapping[str, Any]) -> list[str]:
    """What was chosen, on what (each task's actual held-out count where one fell short of the
    requested), and why (plain text lines)."""
    if record.get("winner") is None:
        return [record.get("why") or "no selection"]
    score = record["score"]
    where = (
        "each task's labelled validation split"
        if score == "validation"
        else f"{held_out_text(_held_out(record), record['holdout_per_task'])} (label-free)"
    )
    better = "higher" if record["higher_is_better"] else "lower"
    return [
        f"chosen: {record['winner']} ({'; '.join(record['set']) or 'no overrides'})",
        f"score: {_LABELS[score]} on {where}; {better} is better",
        f"why: {record['why']}",
    ]


def selection_table(record: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): rank, candidate (winner starred; "(not eligible)" where it may not win:
    per-task modules without select.allow_task_modules), merge, repair, mean score, one column
    per task, seconds (merge + repair)."""
    if record.get("winner") is None:
        return [], []
    score = record["score"]
    by_name = {c["name"]: c for c in record["candidates"]}
    tasks = list(next(iter(by_name.values()))["tasks"])
    counts = {} if score == "validation" else _held_out(record)
    short = {t: n for t, n in counts.items() if n != record["holdout_per_task"]}
    columns = [f"{t} (n={short[t]})" if t in short else t for t in tasks]
    headers = ["rank", "candidate", "merge", "repair", f"mean {score}", *columns, "seconds"]
    rows = []
    for rank, name in enumerate(record["ranking"], start=1):
        candidate = by_name[name]
        seconds = candidate["merge_seconds"] + candidate["repair_seconds"]
        rows.append(
            [
                str(rank),
                name
                + (" *" if name == record["winner"] else "")
                + (" (not eligible)" if candidate.get("eligible") is False else ""),
                candidate["merge"]["method"],
                candidate["repair"],
                _value(score, candidate["mean"]),
                *[_value(score, candidate["tasks"][t].get(score)) for t in tasks],
                f"{seconds:.1f}",
            ]
        )
    return headers, rows
