"""The summary figures of an evaluation table, defined once.

Every surface that shows a summary figure takes it from `summary_figures`: the table a run prints
(`featcal run`, `featcal demo`, `featcal evaluate`), report.md and report.html, metrics.json and
metrics_per_task.json (`headline_metrics`, `per_task_metrics`), the MLflow run, the model card and
`featcal compare`. Each shows the same value under the same label (`LABELS`).

    figures = summary_figures(evaluation)             # evaluation.json's {task: {row: {...}}}
    figures.normalized["calibrated"].value            # 0.871 (a fraction)
    headline_lines(figures)                           # the labelled lines every surface shows
    headline_metrics(figures)                         # metrics.json / MLflow: flat numbers

Definitions, over the tasks of the table, for each evaluated row (base, merged, calibrated, ...):

- **accuracy, average**: the mean of the row's accuracy over the tasks it was evaluated on.
- **normalized accuracy, average** (the paper's normalized accuracy): the mean over tasks of the
  row's accuracy ÷ the task expert's accuracy. A task whose expert scores 0 has no ratio and is
  left out, as is a task without the row; the figure is over the remaining tasks and says so
  ("over 7 of 8 tasks; left out: svhn, the expert scores 0").
- **gap closed, average**: (mean row − mean merged) / (mean expert − mean merged) × 100, in
  percent, over the tasks that have the row, the merged model and an expert scoring above 0 (a
  task whose expert scores 0 is left out as above): the share of the summed merged→expert gap
  that the row closes, which weighs each task's gap closed by the size of its gap, so a task whose
  gap is tiny does not swing the figure as it would a plain mean of per-task percentages. When
  the merged model matches or beats the experts on average there is no gap: the figure is None
  ("—", with the reason). Not for the expert, the merged model and the base.

A figure no task defines is None, shown "—": never NaN. Per task, `task_normalized` and
`gap_closed` give the ratios the per-task tables show (None where undefined: an expert at 0, no
gap on that task).

Units: accuracy and normalized accuracy as fractions (shown in percent), gap closed in percent;
shown with one decimal.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "LABELS",
    "Figure",
    "Figures",
    "gap_closed",
    "headline_lines",
    "headline_metrics",
    "per_task_metrics",
    "summary_figures",
    "task_normalized",
]

#: evaluation rows in display order; any other row follows in the order it first appears
ROW_ORDER = ("base", "expert", "merged", "calibrated", "merged_heads", "calibrated_heads")
#: the label of each figure, the same on every surface
LABELS = {
    "accuracy": "accuracy, average",
    "normalized": "normalized accuracy, average",
    "gap_closed": "gap closed, average",
}
#: the metric name of each figure (metrics.json, MLflow): `<name>/<row>`, and `<name>_tasks/<row>`
#: the number of tasks it is over
METRIC_NAMES = {
    "accuracy": "accuracy_mean",
    "normalized": "normalized_mean",
    "gap_closed": "gap_closed_mean",
}
#: rows without a gap closed besides the reference: the expert (the far end of the gap) and
#: the base (the pretrained model, not a merge)
_NO_GAP_ROWS = ("expert", "base")
#: |expert − merged| at or below this is "no gap" (guards against a float-noise denominator)
_GAP_EPS = 1e-12
_EXPERT_AT_ZERO = "the expert scores 0"
_NOT_EVALUATED = "not evaluated"


def _number(value: Any) -> float | None:
    """A finite float, else None (missing, NaN, inf, not a number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def task_normalized(accuracy: float | None, expert: float | None) -> float | None:
    """A row's normalized accuracy on one task: accuracy ÷ the expert's (a fraction); None when a
    value is missing or non-finite, or the expert scores 0 (no reference to divide by)."""
    accuracy, expert = _number(accuracy), _number(expert)
    if accuracy is None or expert is None or expert <= 0:
        return None
    return accuracy / expert


def gap_closed(
    merged: float | None, calibrated: float | None, expert: float | None
) -> float | None:
    """Share of the merged→expert accuracy gap that a model closed on one task, in percent.

    (calibrated − merged) / (expert − merged) × 100: 0 when calibration changed nothing, 100 when
    it reached the expert, negative when it made things worse, above 100 when it beat the expert.
    None (shown "—") when a value is missing or non-finite, or when the merged model already
    matches or beats the expert (no gap to close: a ratio there would read as "600 %").
    """
    merged, calibrated, expert = _number(merged), _number(calibrated), _number(expert)
    if merged is None or calibrated is None or expert is None:
        return None
    gap = expert - merged
    if gap <= _GAP_EPS:
        return None
    return (calibrated - merged) / gap * 100.0


@dataclass(frozen=True)
class Figure:
    """One summary figure of one row: its value (None when undefined), the number of tasks it is
    over (`used`) of the table's (`of`), the tasks left out with why, and why it is None."""

    value: float | None
    used: int
    of: int
    left_out: tuple[tuple[str, str], ...] = ()
    undefined: str | None = None

    def over(self) -> str:
        """ "over 2 tasks", or "over 7 of 8 tasks; left out: svhn, the expert scores 0"."""
        tasks = f"task{'s' if self.of != 1 else ''}"
        if self.used == self.of:
            return f"over {self.of} {tasks}"
        reasons: dict[str, list[str]] = {}
        for task, why in self.left_out:
            reasons.setdefault(why, []).append(task)
        left_out = "; ".join(f"{', '.join(names)}, {why}" for why, names in reasons.items())
        return f"over {self.used} of {self.of} {tasks}; left out: {left_out}"


@dataclass(frozen=True)
class Figures:
    """The summary figures of one evaluation table (see the module doc)."""

    tasks: tuple[str, ...]
    rows: tuple[str, ...]  # every evaluated row, display order
    reference: str  # the row gap closed is measured from ("merged")
    accuracy: dict[str, Figure] = field(default_factory=dict)
    normalized: dict[str, Figure] = field(default_factory=dict)  # every row but the expert
    gap_closed: dict[str, Figure] = field(default_factory=dict)  # not expert, reference, base
    #: {task: {row: {"accuracy", "normalized", "gap_closed"}}}: the per-task values, undefined
    #: ones left out
    per_task: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    examples_min: int | None = None  # the fewest rows any task was evaluated on

    def of(self, name: str) -> dict[str, Figure]:
        """The figures named "accuracy", "normalized" or "gap_closed", by row."""
        return {"accuracy": self.accuracy, "normalized": self.normalized}.get(name, self.gap_closed)


def _accuracy(models: Mapping[str, Any], row: str) -> float | None:
    result = models.get(row)
    return _number(result.get("accuracy")) if isinstance(result, Mapping) else None


def _mean_figure(values: Mapping[str, float | None], why: Mapping[str, str]) -> Figure:
    """The mean of the defined values, with the tasks left out (`why[task]`, else not evaluated)."""
    present = [v for v in values.values() if v is not None]
    left_out = tuple(
        (task, why.get(task, _NOT_EVALUATED)) for task, v in values.items() if v is None
    )
    return Figure(
        value=sum(present) / len(present) if present else None,
        used=len(present),
        of=len(values),
        left_out=left_out,
        undefined=None if present else "no task has it",
    )


def _gap_figure(
    accuracy: Mapping[str, Mapping[str, float | None]], row: str, reference: str
) -> Figure:
    """Gap closed of the mean accuracies over the tasks with the row, the reference and an expert
    scoring above 0."""
    used: list[tuple[float, float, float]] = []  # (reference, row, expert) per task
    left_out = []
    for task, acc in accuracy.items():
        expert, merged, value = acc.get("expert"), acc.get(reference), acc.get(row)
        if expert is not None and expert <= 0:
            left_out.append((task, _EXPERT_AT_ZERO))
        elif expert is None or merged is None or value is None:
            left_out.append((task, _NOT_EVALUATED))
        else:
            used.append((merged, value, expert))
    undefined = None
    if not used:
        value, undefined = None, "no task has it"
    else:
        means = [sum(values) / len(used) for values in zip(*used, strict=True)]
        value = gap_closed(*means)
        if value is None:
            undefined = f"no gap: {reference} matches or beats the experts on average"
    return Figure(value, len(used), len(accuracy), tuple(left_out), undefined)


def summary_figures(
    evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]],
    reference: str = "merged",
    gap_rows: Sequence[str] | None = None,
) -> Figures:
    """The summary figures of an evaluation table ({task: {row: {"accuracy", ...}}},
    evaluation.json): the definitions are in the module doc. `reference`: the row gap closed is
    measured from (`featcal compare` names its reference merge's row); `gap_rows`: the rows with
    a gap closed (default: every row but the expert, the reference and the base; `featcal
    compare` names every variant's, its reference's included, whose gap closed is then 0)."""
    tasks = tuple(str(t) for t in evaluation)
    names: list[str] = []
    for models in evaluation.values():
        names += [str(m) for m in (models or {}) if str(m) not in names]
    rows = tuple([m for m in ROW_ORDER if m in names] + [m for m in names if m not in ROW_ORDER])
    if gap_rows is None:
        gap_rows = [row for row in rows if row not in (*_NO_GAP_ROWS, reference)]
    accuracy = {
        str(task): {row: _accuracy(models or {}, row) for row in rows}
        for task, models in evaluation.items()
    }
    at_zero = {
        task: _EXPERT_AT_ZERO
        for task, acc in accuracy.items()
        if (expert := acc.get("expert")) is not None and expert <= 0
    }
    per_task: dict[str, dict[str, dict[str, float]]] = {}
    for task, acc in accuracy.items():
        per_task[task] = {}
        for row in rows:
            values = {
                "accuracy": acc[row],
                "normalized": task_normalized(acc[row], acc.get("expert")),
                "gap_closed": gap_closed(acc.get(reference), acc[row], acc.get("expert"))
                if row in gap_rows
                else None,
            }
            defined = {k: v for k, v in values.items() if v is not None}
            if defined:
                per_task[task][row] = defined
    figures: dict[str, dict[str, Figure]] = {"accuracy": {}, "normalized": {}, "gap_closed": {}}
    for row in rows:
        figures["accuracy"][row] = _mean_figure({t: a[row] for t, a in accuracy.items()}, {})
        if row != "expert" and "expert" in rows:
            normalized = {t: (per_task[t].get(row) or {}).get("normalized") for t in tasks}
            figures["normalized"][row] = _mean_figure(normalized, at_zero)
        if row in gap_rows and {"expert", reference} <= set(rows):
            figures["gap_closed"][row] = _gap_figure(accuracy, row, reference)
    examples = [
        r["examples"]
        for models in evaluation.values()
        for r in (models or {}).values()
        if isinstance(r, Mapping) and isinstance(r.get("examples"), int)
    ]
    return Figures(
        tasks=tasks,
        rows=rows,
        reference=reference,
        accuracy=figures["accuracy"],
        normalized=figures["normalized"],
        gap_closed=figures["gap_closed"],
        per_task=per_task,
        examples_min=min(examples) if examples else None,
    )


def headline_metrics(figures: Figures) -> dict[str, float | int]:
    """The headline as flat numbers (metrics.json, the DVC metric; the MLflow run's metrics):
    `tasks` (how many), for each figure and row `<metric>/<row>` (`accuracy_mean`,
    `normalized_mean`: fractions; `gap_closed_mean`: percent) and `<metric>_tasks/<row>` (the
    tasks it is over), and `examples_min` (the fewest rows any task was evaluated on: fewer than a
    split holds when evaluation.max_examples_per_task cut it). An undefined figure has its
    `_tasks` count and no value: numbers only, never NaN."""
    out: dict[str, float | int] = {"tasks": len(figures.tasks)}
    for name, metric in METRIC_NAMES.items():
        for row, figure in figures.of(name).items():
            if figure.value is not None:
                out[f"{metric}/{row}"] = figure.value
            out[f"{metric}_tasks/{row}"] = figure.used
    if figures.examples_min is not None:
        out["examples_min"] = figures.examples_min
    return out


def per_task_metrics(figures: Figures) -> dict[str, dict[str, dict[str, float]]]:
    """metrics_per_task.json: {task: {row: {"accuracy", "normalized", "gap_closed"}}}, numbers
    only (fractions; gap closed in percent); an undefined value is left out."""
    return {
        task: {row: dict(v) for row, v in rows.items()} for task, rows in figures.per_task.items()
    }


def _pct(value: float | None, scale: float) -> str:
    if value is None:
        return "—"
    text = f"{value * scale:.1f}"
    return "0.0" if text == "-0.0" else text


def figure_text(figure: Figure, name: str) -> str:
    """A figure's value in percent with one decimal ("—" when undefined)."""
    return _pct(figure.value, 1.0 if name == "gap_closed" else 100.0)


def headline_lines(figures: Figures, names: Sequence[str] = tuple(LABELS)) -> list[str]:
    """The headline as text, one line per figure with every row's value and the tasks it is over:
    "normalized accuracy, average (over 7 of 8 tasks; left out: svhn, the expert scores 0):
    merged 61.3 %, calibrated 87.1 %"; when the rows are over different tasks, each says its own
    ("accuracy, average: base 30.0 % (over 1 of 3 tasks; left out: ...), expert 85.0 % (over 3
    tasks)"). The same lines on every surface."""
    lines = []
    for name in names:
        found = figures.of(name)
        if not found:
            continue
        shared = len({(f.used, f.left_out) for f in found.values()}) == 1
        parts = []
        for row, figure in found.items():
            text = f"{row} {figure_text(figure, name)}"
            if figure.value is not None:
                text += " %"
            elif figure.undefined:
                text += f" ({figure.undefined})"
            parts.append(text if shared else f"{text} ({figure.over()})")
        label = LABELS[name]
        if shared:
            label += f" ({next(iter(found.values())).over()})"
        lines.append(f"{label}: " + ", ".join(parts))
    return lines
