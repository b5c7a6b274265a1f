"""The report's figures: the accuracy table's rows (one per task, then the average), the share
of the merged→expert gap closed, per-block mean drift, and how numbers are shown (percent with one
decimal; a missing value as DASH, left out of averages)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DASH",
    "MODEL_ORDER",
    "above_expert",
    "evaluated_precision",
    "evaluated_rows",
    "evaluation_cut",
    "cut_rows",
    "table_caption",
    "gap_closed",
    "headline",
]

#: models of the evaluation table, in display order
MODEL_ORDER = ("base", "expert", "merged", "calibrated")


#: shown for a missing value
DASH = "—"
#: |expert − merged| at or below this is "no gap" (guards against a float-noise denominator)
_GAP_EPS = 1e-12


_COLUMNS = (
    "task",
    "base",
    "expert",
    "merged",
    "calibrated",
    "normalized (merged)",
    "normalized (calibrated)",
    "gap closed",
)


def gap_closed(
    merged: float | None, calibrated: float | None, expert: float | None
) -> float | None:
    """Share of the merged→expert accuracy gap that calibration closed, in percent.

    (calibrated − merged) / (expert − merged) × 100: 0 when calibration changed nothing, 100 when
    it reached the expert, negative when it made things worse, above 100 when it beat the expert.
    None (shown "—") when a value is missing or non-finite, or when the merged model already
    matches or beats the expert (no gap to close: a ratio there would read as "600 %").
    """
    if merged is None or calibrated is None or expert is None:
        return None
    if not all(math.isfinite(v) for v in (merged, calibrated, expert)):
        return None
    gap = expert - merged
    if gap <= _GAP_EPS:
        return None
    return (calibrated - merged) / gap * 100.0


def _number(value: Any) -> float | None:
    """A finite float, else None (missing, NaN, inf, not a number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _mean(values: Sequence[float | None]) -> tuple[float | None, int]:
    present = [v for v in values if v is not None]
    return (sum(present) / len(present) if present else None), len(present)


@dataclass
class _Row:
    label: str
    accuracy: dict[str, float | None]  # model → accuracy (fraction)
    normalized: dict[str, float | None]  # "merged" / "calibrated" → normalized (fraction)
    gap: float | None  # percent
    counts: dict[str, int] = field(default_factory=dict)  # average row: tasks behind each column


def _rows(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[_Row]:
    """One row per task, then the average row (absent when there are no tasks)."""
    rows = []
    for task, models in evaluation.items():
        models = models or {}
        accuracy = {m: _number((models.get(m) or {}).get("accuracy")) for m in MODEL_ORDER}
        normalized = {
            m: _number((models.get(m) or {}).get("normalized")) for m in ("merged", "calibrated")
        }
        gap = gap_closed(accuracy["merged"], accuracy["calibrated"], accuracy["expert"])
        rows.append(_Row(str(task), accuracy, normalized, gap))
    if not rows:
        return rows
    accuracy, normalized, counts = {}, {}, {}
    for m in MODEL_ORDER:
        accuracy[m], counts[m] = _mean([r.accuracy[m] for r in rows])
    for m in ("merged", "calibrated"):
        normalized[m], counts[f"normalized ({m})"] = _mean([r.normalized[m] for r in rows])
    gap = gap_closed(accuracy["merged"], accuracy["calibrated"], accuracy["expert"])
    rows.append(_Row("average", accuracy, normalized, gap, counts))
    return rows


def headline(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The report's average row as flat numbers (metrics.json, a DVC metric): `tasks` (count),
    `accuracy_mean/<model>` and `normalized_mean/<merged|calibrated>` (fractions, means over the
    tasks that have the value), `gap_closed_mean` (percent of the average merged→expert gap,
    null where there is none) and `examples_min` (the fewest rows any task was evaluated on:
    fewer than a split holds when evaluation.max_examples_per_task cut it). Keys of models not
    evaluated are left out."""
    rows = _rows(evaluation)
    out: dict[str, Any] = {"tasks": max(len(rows) - 1, 0)}
    if rows:
        average = rows[-1]
        out.update({f"accuracy_mean/{m}": v for m, v in average.accuracy.items() if v is not None})
        out.update(
            {f"normalized_mean/{m}": v for m, v in average.normalized.items() if v is not None}
        )
        out["gap_closed_mean"] = average.gap
    examples = [
        r["examples"]
        for models in evaluation.values()
        for r in (models or {}).values()
        if isinstance(r, Mapping) and isinstance(r.get("examples"), int)
    ]
    if examples:
        out["examples_min"] = min(examples)
    return out


def _pct(value: float | None) -> str:
    if value is None:
        return DASH
    text = f"{value * 100:.1f}"
    return "0.0" if text == "-0.0" else text


def _gap_text(value: float | None) -> str:
    return _pct(None if value is None else value / 100)


def _cells(row: _Row) -> list[str]:
    return [
        row.label,
        *(_pct(row.accuracy[m]) for m in MODEL_ORDER),
        _pct(row.normalized["merged"]),
        _pct(row.normalized["calibrated"]),
        _gap_text(row.gap),
    ]


def evaluated_rows(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str | None:
    """How many rows of each task's evaluation split the table's numbers are on (evaluation.json's
    `examples`; fewer than the split holds when evaluation.max_examples_per_task cuts it): "200
    rows per task", or "mnist 200, digits 150 rows"; None when no row records it."""
    counts = {}
    for task, models in evaluation.items():
        found = sorted(
            {
                int(r["examples"])
                for r in (models or {}).values()
                if isinstance(r, Mapping) and isinstance(r.get("examples"), int)
            }
        )
        if found:
            counts[str(task)] = "/".join(map(str, found))
    if not counts:
        return None
    if len(set(counts.values())) == 1:
        return f"{next(iter(counts.values()))} rows per task"
    return ", ".join(f"{task} {count}" for task, count in counts.items()) + " rows"


def evaluation_cut(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str | None:
    """The tasks whose evaluation used fewer rows than their split holds (evaluation.json's
    `examples` below `split_rows`: evaluation.max_examples_per_task cut it), as "mnist 200 of
    10000, svhn 200 of 26032 rows"; None when every task ran on its whole split (or no row
    records the split's size)."""
    cut = {}
    for task, models in evaluation.items():
        for r in (models or {}).values():
            if (
                isinstance(r, Mapping)
                and isinstance(r.get("examples"), int)
                and isinstance(r.get("split_rows"), int)
                and r["examples"] < r["split_rows"]
            ):
                cut[str(task)] = f"{r['examples']} of {r['split_rows']}"
                break
    return ", ".join(f"{task} {text}" for task, text in cut.items()) + " rows" if cut else None


def cut_rows(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str | None:
    """What a per-task table's numbers are on when evaluation was cut short ("the first rows of
    each evaluation split only (evaluation cut short: mnist 100 of 10000 rows)"), else None."""
    cut = evaluation_cut(evaluation)
    return (
        None
        if cut is None
        else (f"the first rows of each evaluation split only (evaluation cut short: {cut})")
    )


def table_caption(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """The report's per-task table caption: units, and `cut_rows` when evaluation was cut."""
    caption = "Accuracy, normalized accuracy (÷ the expert's) and gap closed, in percent"
    return f"{caption}, on {cut}." if (cut := cut_rows(evaluation)) else f"{caption}."


def above_expert(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """ "task (model) 108.3 %" for each normalized accuracy above 100 % (a model beating the task's
    expert), which lifts the normalized average where raw accuracy may not move."""
    found = []
    for task, models in evaluation.items():
        for model, r in (models or {}).items():
            value = _number(r.get("normalized")) if isinstance(r, Mapping) else None
            if value is not None and value > 1.0 and model != "expert":
                found.append(f"{task} ({model}) {_pct(value)} %")
    return found


def evaluated_precision(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str | None:
    """The dtype(s) the evaluation forwards ran in (evaluation.json's `precision`), e.g.
    "bfloat16"; None when no row records it."""
    found = sorted(
        {
            str(r["precision"])
            for models in evaluation.values()
            for r in (models or {}).values()
            if isinstance(r, Mapping) and r.get("precision")
        }
    )
    return "/".join(found) or None


def _average_notes(rows: list[_Row]) -> list[str]:
    """Columns whose average covers only some of the tasks (those that have the value)."""
    if not rows:
        return []
    average, tasks = rows[-1], len(rows) - 1
    return [
        f"{column}: averaged over the {count} of {tasks} tasks that have it"
        for column, count in average.counts.items()
        if 0 < count < tasks
    ]


def _summary(rows: list[_Row], calibration_present: bool) -> str:
    if not rows:
        return "The evaluation table is empty: no task was evaluated."
    average, tasks = rows[-1], len(rows) - 1
    parts = [
        f"{m} {_pct(average.accuracy[m])} %"
        for m in ("expert", "merged", "calibrated")
        if average.accuracy[m] is not None
    ]
    text = f"Average accuracy over {tasks} task{'s' if tasks != 1 else ''}: " + ", ".join(parts)
    if average.accuracy["base"] is not None:
        text += f" (base {_pct(average.accuracy['base'])} %)"
    text += ". "
    if average.accuracy["calibrated"] is None:
        text += "No calibrated model was evaluated" + (
            "." if calibration_present else " (FeatCal was not run)."
        )
    elif average.gap is None:
        text += "On average the merged model matches the expert: there is no gap to close."
    else:
        text += f"Calibration closed {_gap_text(average.gap)} % of the merged→expert gap."
    return text


def _block_means(
    calibration: Mapping[str, Any],
) -> list[tuple[int, float | None, float | None, bool]]:
    """(index, mean drift before, mean drift after, restored) per block, in record order."""
    out = []
    for position, block in enumerate(calibration.get("blocks") or []):
        index = block.get("index", position)
        before = _mean([_number(v) for v in (block.get("drift_before") or {}).values()])[0]
        after = _mean([_number(v) for v in (block.get("drift_after") or {}).values()])[0]
        out.append((index, before, after, bool(block.get("restored"))))
    return out
