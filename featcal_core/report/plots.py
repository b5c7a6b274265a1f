"""The report's plots: accuracy per task (accuracy.png) and feature drift per block (drift.png).

What each plot draws is computed first, without matplotlib (`accuracy_series`, `drift_series`);
the plotting functions draw exactly that and return it. matplotlib (Agg canvas, no pyplot, so no
global backend is touched) is imported inside the plotting functions."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.report.figures import summary_figures
from featcal_core.report.tables import MODEL_ORDER, _mean, _number

__all__ = ["accuracy_series", "drift_series", "plot_accuracy", "plot_drift"]

#: evaluation rows in plot order: the accuracy table's models, then the head-calibration rows;
#: any other row follows in the order it first appears in the evaluation table
PLOT_ORDER = (*MODEL_ORDER, "merged_heads", "calibrated_heads")
_LABELS = {"merged_heads": "merged + heads", "calibrated_heads": "calibrated + heads"}
_COLORS = {
    "base": "#9e9e9e",
    "expert": "#4c72b0",
    "merged": "#dd8452",
    "calibrated": "#55a868",
    "merged_heads": "#f2b880",
    "calibrated_heads": "#2d6a3e",
}
#: colours of rows without one of their own, in turn
_OTHER_COLORS = ("#8172b3", "#937860", "#da8bc3", "#ccb974", "#64b5cd", "#c44e52", "#8c8c8c")


def _canvas(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _plain(label: str) -> str:
    """A label matplotlib shows verbatim (a '$' would start mathtext)."""
    return str(label).replace("$", r"\$")


def _color(name: str, others: list[str]) -> str:
    if name in _COLORS:
        return _COLORS[name]
    return _OTHER_COLORS[others.index(name) % len(_OTHER_COLORS)]


# ------------------------------------------------------------------------------------- accuracy


def accuracy_series(
    evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]],
) -> tuple[list[str], dict[str, list[float | None]]]:
    """What the accuracy plot draws: (groups, {row: accuracy per group}).

    groups: the tasks, then "average" (absent when there are no tasks). Rows: every evaluation
    row with at least one finite accuracy (base, expert, merged, calibrated, merged_heads,
    calibrated_heads, then any other row of the table in the order it first appears); a missing
    or non-finite accuracy is None. The average is over the tasks that have the row."""
    names: list[str] = []
    for models in evaluation.values():
        names += [str(m) for m in (models or {}) if str(m) not in names]
    names = [m for m in PLOT_ORDER if m in names] + [m for m in names if m not in PLOT_ORDER]
    groups = [str(task) for task in evaluation]
    averages = summary_figures(evaluation).accuracy  # the headline's "accuracy, average"
    series: dict[str, list[float | None]] = {}
    for name in names:
        values = [
            _number(((models or {}).get(name) or {}).get("accuracy"))
            for models in evaluation.values()
        ]
        if any(v is not None for v in values):
            series[name] = values + [averages[name].value]
    return (groups + ["average"] if groups else groups), series


def plot_accuracy(
    path: str | Path, evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]
) -> tuple[list[str], dict[str, list[float | None]]]:
    """Grouped bars of accuracy per task, one bar per evaluation row (`accuracy_series`: base
    when present, expert, merged, calibrated, the head-calibration rows and any other row), plus
    an "average" group; y from 0 to 1. Writes a PNG to `path`; returns what it drew."""
    groups, series = accuracy_series(evaluation)
    others = [m for m in series if m not in _COLORS]
    count = max(len(series), 1)
    figure = _canvas(min(max(6.0, 1.2 + 0.3 * len(groups) * count), 16.0), 4.5)
    ax = figure.add_subplot(1, 1, 1)
    width = 0.8 / count
    for k, (model, values) in enumerate(series.items()):
        points = [(g - 0.4 + width * (k + 0.5), v) for g, v in enumerate(values) if v is not None]
        ax.bar(
            [p[0] for p in points],
            [p[1] for p in points],
            width=width,
            label=_plain(_LABELS.get(model, model)),
            color=_color(model, others),
            edgecolor="white",
        )
    if len(groups) > 1:
        ax.axvline(len(groups) - 1.5, color="#999", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(groups)))
    rotate = len(groups) > 6 or any(len(g) > 10 for g in groups)
    ax.set_xticklabels(
        [_plain(g) for g in groups],
        rotation=30 if rotate else 0,
        ha="right" if rotate else "center",
    )
    ax.set_xlim(-0.6, max(len(groups), 1) - 0.4)
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel("accuracy")
    ax.set_title("Accuracy per task")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    figure.tight_layout()
    figure.savefig(path, format="png")
    return groups, series


# ---------------------------------------------------------------------------------------- drift


def drift_series(calibration: Mapping[str, Any]) -> dict[str, Any]:
    """What the drift plot draws, per block in record order: {"blocks": [index], "restored":
    [bool], "before": {task: [drift]}, "after": {task: [drift]}, "mean_before": [mean over
    tasks], "mean_after": [...]}; a missing or non-finite value is None (and left out of the
    mean). Tasks in the order they first appear."""
    blocks = [b if isinstance(b, Mapping) else {} for b in calibration.get("blocks") or []]
    out: dict[str, Any] = {
        "blocks": [b.get("index", position) for position, b in enumerate(blocks)],
        "restored": [bool(b.get("restored")) for b in blocks],
    }
    for when in ("before", "after"):
        drifts = [b.get(f"drift_{when}") or {} for b in blocks]
        tasks = list(dict.fromkeys(str(t) for d in drifts for t in d))
        per_task = {t: [_number(d.get(t)) for d in drifts] for t in tasks}
        out[when] = per_task
        out[f"mean_{when}"] = [_mean([_number(v) for v in d.values()])[0] for d in drifts]
    return out


def _y_scale(ax, values: list[float]) -> None:
    """Log y when the positive values span over 2 decades (symlog when some are zero)."""
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 100:
        if len(positive) == len(values):
            ax.set_yscale("log")
        elif all(v >= 0 for v in values):
            ax.set_yscale("symlog", linthresh=min(positive))


def plot_drift(path: str | Path, calibration: Mapping[str, Any]) -> dict[str, Any]:
    """Feature drift per block, before (left) and after (right) calibration: one thin line per
    task and the mean over tasks as a thick line; restored blocks get hollow markers on the mean
    and a shaded band. Log y when the positive values span over 2 decades (symlog when some are
    zero). Writes a PNG to `path`; returns what it drew (`drift_series`)."""
    from matplotlib import colormaps

    data = drift_series(calibration)
    blocks, restored = data["blocks"], data["restored"]
    tasks = list(dict.fromkeys([*data["before"], *data["after"]]))
    palette = colormaps["tab10" if len(tasks) <= 10 else "tab20"]
    colors = {t: palette(i % palette.N) for i, t in enumerate(tasks)}
    figure = _canvas(max(8.0, min(0.4 * len(blocks) + 6.0, 18.0)), 4.5)
    axes = figure.subplots(1, 2, sharey=True)
    values = [v for when in ("before", "after") for v in data[f"mean_{when}"] if v is not None]
    values += [
        v
        for when in ("before", "after")
        for line in data[when].values()
        for v in line
        if v is not None
    ]
    for ax, when, title in (
        (axes[0], "before", "before calibration"),
        (axes[1], "after", "after calibration"),
    ):
        for task, line in data[when].items():
            points = [(b, v) for b, v in zip(blocks, line, strict=True) if v is not None]
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=colors[task],
                linewidth=1,
                alpha=0.85,
                label=_plain(task),
            )
        means = data[f"mean_{when}"]
        mean = [(b, v) for b, v in zip(blocks, means, strict=True) if v is not None]
        ax.plot(
            [p[0] for p in mean],
            [p[1] for p in mean],
            color="black",
            linewidth=2.2,
            marker="o",
            markersize=4,
            label="mean over tasks",
        )
        hollow = [
            (b, v) for b, v, r in zip(blocks, means, restored, strict=True) if r and v is not None
        ]
        if hollow:
            ax.plot(
                [p[0] for p in hollow],
                [p[1] for p in hollow],
                linestyle="none",
                marker="o",
                markersize=8,
                markerfacecolor="white",
                markeredgecolor="black",
            )
        for n, index in enumerate(b for b, r in zip(blocks, restored, strict=True) if r):
            ax.axvspan(
                index - 0.5,
                index + 0.5,
                color="#bbbbbb",
                alpha=0.25,
                linewidth=0,
                label="restored (not recomputed)" if n == 0 else None,
            )
        _y_scale(ax, values)
        ax.set_xlabel("block index")
        ax.set_title(title)
        if blocks and len(blocks) <= 30:
            ax.set_xticks(blocks)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("feature drift")
    legend: dict[str, Any] = {}  # label -> handle, both panels (a task may be in one only)
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    if legend:
        axes[1].legend(
            list(legend.values()),
            list(legend),
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            frameon=False,
        )
    figure.suptitle("Feature drift per block (per task and mean over tasks)")
    figure.tight_layout()
    figure.savefig(path, format="png")
    return data
