"""The report's accuracy table: its rows (one per task, then the average, every number from
`figures.summary_figures`), per-block mean drift, and how numbers are shown (percent with one
decimal; a missing value as DASH, left out of averages)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from featcal_core.report.figures import (
    Figure,
    Figures,
    gap_closed,
    headline_metrics,
    summary_figures,
)

__all__ = [
    "DASH",
    "MODEL_ORDER",
    "above_expert",
    "evaluated_precision",
    "evaluated_rows",
    "evaluation_cut",
    "harness_metrics",
    "cut_rows",
    "table_caption",
    "gap_closed",
    "headline",
]

#: models of the evaluation table, in display order
MODEL_ORDER = ("base", "expert", "merged", "calibrated")


#: shown for a missing value
DASH = "—"


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


def _rows(
    evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]], figures: Figures | None = None
) -> list[_Row]:
    """One row per task, then the average row (absent when there are no tasks): every number
    from `summary_figures` (the per-task ratios and the averages)."""
    figures = figures if figures is not None else summary_figures(evaluation)
    rows = []
    for task in figures.tasks:
        values = figures.per_task.get(task, {})
        accuracy = {m: (values.get(m) or {}).get("accuracy") for m in MODEL_ORDER}
        normalized = {m: (values.get(m) or {}).get("normalized") for m in ("merged", "calibrated")}
        rows.append(
            _Row(task, accuracy, normalized, (values.get("calibrated") or {}).get("gap_closed"))
        )
    if not rows:
        return rows

    def value(found: Mapping[str, Figure], m: str) -> float | None:
        return found[m].value if m in found else None

    rows.append(
        _Row(
            "average",
            {m: value(figures.accuracy, m) for m in MODEL_ORDER},
            {m: value(figures.normalized, m) for m in ("merged", "calibrated")},
            value(figures.gap_closed, "calibrated"),
        )
    )
    return rows


def headline(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """metrics.json (a DVC metric): `headline_metrics` of the table's `summary_figures`."""
    return headline_metrics(summary_figures(evaluation))


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
    for task, models in summary_figures(evaluation).per_task.items():
        for model, values in models.items():
            value = values.get("normalized")
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


def harness_metrics(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str | None:
    """What lm-evaluation-harness scored (evaluation.json's `evaluator`, `metric`, `examples`,
    `task_rows`, `num_fewshot`), e.g. "lm-eval 0.4.13: arc_easy acc_norm (0-shot, 100 of 2376
    rows), gsm8k exact_match (strict-match) (5-shot, 1319 rows); the accuracy columns hold each
    task's metric"; None when no row was scored by it."""
    evaluators, parts = set(), []
    for task, models in evaluation.items():
        rows = [r for r in (models or {}).values() if isinstance(r, Mapping) and r.get("evaluator")]
        if not rows:
            continue
        evaluators.add(str(rows[0]["evaluator"]))
        first = rows[0]
        scored, total = first.get("examples"), first.get("task_rows")
        count = f"{scored} of {total} rows" if scored != total else f"{total} rows"
        shots = first.get("num_fewshot")
        detail = f"{shots}-shot, {count}" if isinstance(shots, int) else count
        parts.append(f"{task} {first.get('metric')} ({detail})")
    if not parts:
        return None
    return (
        f"scored by {'/'.join(sorted(evaluators))}: {', '.join(parts)}; the accuracy columns "
        "hold each task's metric"
    )


def _table_figures(figures: Figures) -> dict[str, Figure]:
    """The accuracy table's average row as figures: {column: figure}."""
    found = {m: figures.accuracy[m] for m in MODEL_ORDER if m in figures.accuracy}
    found.update(
        {
            f"normalized ({m})": figures.normalized[m]
            for m in ("merged", "calibrated")
            if m in figures.normalized
        }
    )
    if "calibrated" in figures.gap_closed:
        found["gap closed"] = figures.gap_closed["calibrated"]
    return found


def _average_notes(figures: Figures) -> list[str]:
    """Columns whose average covers only some of the tasks: which, and why the others are left
    out ("base: averaged over 1 of 3 tasks; left out: svhn, x, not evaluated")."""
    return [
        f"{column}: averaged {figure.over()}"
        for column, figure in _table_figures(figures).items()
        if 0 < figure.used < figure.of
    ]


def _summary(figures: Figures, calibration_present: bool) -> str:
    if not figures.tasks:
        return "The evaluation table is empty: no task was evaluated."
    tasks = len(figures.tasks)
    mean = {m: f.value for m, f in figures.accuracy.items()}
    parts = [
        f"{m} {_pct(mean[m])} %"
        for m in ("expert", "merged", "calibrated")
        if mean.get(m) is not None
    ]
    text = f"Average accuracy over {tasks} task{'s' if tasks != 1 else ''}: " + ", ".join(parts)
    if mean.get("base") is not None:
        text += f" (base {_pct(mean['base'])} %)"
    text += ". "
    gap = figures.gap_closed.get("calibrated")
    if mean.get("calibrated") is None:
        text += "No calibrated model was evaluated" + (
            "." if calibration_present else " (FeatCal was not run)."
        )
    elif gap is None or gap.value is None:
        why = gap.undefined if gap is not None else "no expert or merged model was evaluated"
        text += f"There is no gap to close ({why})."
    else:
        text += (
            f"Calibration closed {_gap_text(gap.value)} % of the merged→expert gap ({gap.over()})."
        )
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
