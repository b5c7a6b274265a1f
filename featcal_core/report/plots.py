"""The report's plots: accuracy per task (accuracy.png) and feature drift per block (drift.png).

matplotlib (Agg canvas, no pyplot, so no global backend is touched) is imported inside the
plotting functions."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.report.tables import MODEL_ORDER, _block_means, _rows

__all__ = ["plot_accuracy", "plot_drift"]

_COLORS = {
    "base": "#9e9e9e",
    "expert": "#4c72b0",
    "merged": "#dd8452",
    "calibrated": "#55a868",
}


def _canvas(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _plain(label: str) -> str:
    """A label matplotlib shows verbatim (a '$' would start mathtext)."""
    return str(label).replace("$", r"\$")


def plot_accuracy(path: str | Path, evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]):
    """Grouped bars of accuracy per task (base when present, expert, merged, calibrated), plus an
    "average" group; y from 0 to 1. Writes a PNG to `path`."""
    rows = _rows(evaluation)
    models = [m for m in MODEL_ORDER if any(r.accuracy[m] is not None for r in rows)]
    groups = len(rows)
    figure = _canvas(min(max(6.0, 1.2 + 0.3 * groups * max(len(models), 1)), 16.0), 4.5)
    ax = figure.add_subplot(1, 1, 1)
    width = 0.8 / max(len(models), 1)
    for k, model in enumerate(models):
        xs, heights = [], []
        for g, row in enumerate(rows):
            if row.accuracy[model] is not None:
                xs.append(g - 0.4 + width * (k + 0.5))
                heights.append(row.accuracy[model])
        ax.bar(xs, heights, width=width, label=model, color=_COLORS[model], edgecolor="white")
    if groups > 1:
        ax.axvline(groups - 1.5, color="#999", linestyle=":", linewidth=1)
    ax.set_xticks(range(groups))
    rotate = groups > 6 or any(len(r.label) > 10 for r in rows)
    ax.set_xticklabels(
        [_plain(r.label) for r in rows],
        rotation=30 if rotate else 0,
        ha="right" if rotate else "center",
    )
    ax.set_xlim(-0.6, max(groups, 1) - 0.4)
    ax.set_ylim(0.0, 1.0)
    ax.set_ylabel("accuracy")
    ax.set_title("Accuracy per task")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if models:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    figure.tight_layout()
    figure.savefig(path, format="png")


def plot_drift(path: str | Path, calibration: Mapping[str, Any]) -> None:
    """Mean feature drift over tasks per block, before and after calibration; restored blocks
    get hollow markers and a shaded band. Log y when the positive values span over 2 decades
    (symlog when some are zero). Writes a PNG to `path`."""
    means = _block_means(calibration)
    figure = _canvas(max(6.0, min(0.25 * len(means) + 3.0, 16.0)), 4.5)
    ax = figure.add_subplot(1, 1, 1)
    for label, position, color, marker in (
        ("before calibration", 1, _COLORS["merged"], "o"),
        ("after calibration", 2, _COLORS["calibrated"], "s"),
    ):
        points = [(m[0], m[position]) for m in means if m[position] is not None]
        ax.plot(
            [p[0] for p in points], [p[1] for p in points],
            color=color, marker=marker, markersize=4, label=label,
        )  # fmt: skip
        hollow = [(m[0], m[position]) for m in means if m[3] and m[position] is not None]
        if hollow:
            ax.plot(
                [p[0] for p in hollow], [p[1] for p in hollow], linestyle="none",
                marker=marker, markersize=8, markerfacecolor="white", markeredgecolor=color,
            )  # fmt: skip
    restored = [m[0] for m in means if m[3]]
    for n, index in enumerate(restored):
        ax.axvspan(
            index - 0.5, index + 0.5, color="#bbbbbb", alpha=0.25, linewidth=0,
            label="restored (not recomputed)" if n == 0 else None,
        )  # fmt: skip
    values = [v for m in means for v in (m[1], m[2]) if v is not None]
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 100:
        if len(positive) == len(values):
            ax.set_yscale("log")
        elif all(v >= 0 for v in values):
            ax.set_yscale("symlog", linthresh=min(positive))
    ax.set_xlabel("block index")
    ax.set_ylabel("feature drift (mean over tasks)")
    ax.set_title("Feature drift per block")
    if means and len(means) <= 30:
        ax.set_xticks([m[0] for m in means])
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    figure.tight_layout()
    figure.savefig(path, format="png")
