"""The run report: one directory with report.md, report.html and two plots.

    paths = write_report(
        "data/results/report", run_name="clip-vit-b32 8 tasks",
        evaluation=table,          # tasks/evaluate.py evaluate_models
        calibration=featcal_json,  # featcal_core/method/calibration.py record, or None (FeatCal disabled)
        merge=merge_json,          # featcal_core/merging/run.py record, or None
        lock=lock,                 # featcal_core/provenance/resolve.py lock file, or None
    )

The directory is written atomically (`guarded_directory`, overwrite=True): every file is written
under a temporary name beside it and only a complete report replaces the old one, so a failed
write leaves the previous report as it was. The directory belongs to the report: one that holds
anything but report files is refused rather than replaced.

Numbers are shown as given in the records; the only derived figures are averages over tasks
(per column), the mean drift over tasks of each block, the share of the merged→expert gap closed
(`gap_closed`) and the peak RSS in MiB. Accuracy, normalized accuracy and gap closed are shown in
percent with one decimal. A missing value (no base model without a zero-shot head, no calibrated
model when FeatCal is disabled, a non-finite number) is shown as "—" and left out of averages.

Pure library: matplotlib (Agg canvas, no pyplot, so no global backend is touched) is imported
inside the plotting functions.
"""

from __future__ import annotations

import html
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal_core.io.outputs import check_output, guarded_directory

__all__ = [
    "DASH",
    "MODEL_ORDER",
    "REPORT_FILES",
    "gap_closed",
    "plot_accuracy",
    "plot_drift",
    "write_report",
]

#: models of the evaluation table, in display order
MODEL_ORDER = ("base", "expert", "merged", "calibrated")
#: every file the report directory may hold
REPORT_FILES = ("report.md", "report.html", "accuracy.png", "drift.png")
#: shown for a missing value
DASH = "—"
#: |expert − merged| at or below this is "no gap" (guards against a float-noise denominator)
_GAP_EPS = 1e-12

_COLORS = {
    "base": "#9e9e9e",
    "expert": "#4c72b0",
    "merged": "#dd8452",
    "calibrated": "#55a868",
}
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
_MIB = 1024 * 1024


# ------------------------------------------------------------------------------------ numbers


def gap_closed(
    merged: float | None, calibrated: float | None, expert: float | None
) -> float | None:
    """Share of the merged→expert accuracy gap that calibration closed, in percent.

    (calibrated − merged) / (expert − merged) × 100: 0 when calibration changed nothing, 100 when
    it reached the expert, negative when it made things worse, above 100 when it beat the expert.
    None when a value is missing or non-finite, or when expert == merged (no gap to close).
    """
    values = (merged, calibrated, expert)
    if any(v is None or not math.isfinite(v) for v in values):
        return None
    gap = expert - merged
    if abs(gap) <= _GAP_EPS:
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


def _value_text(value: Any) -> str:
    """A record value as given: floats by repr (no rounding), containers as JSON."""
    if value is None or isinstance(value, bool | int | float | str):
        return str(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _short(digest: Any) -> str:
    return str(digest)[:12] if digest else DASH


def _duration(seconds: Any) -> str:
    value = _number(seconds)
    if value is None:
        return DASH
    text = f"{value:g} s"
    if value >= 60:
        minutes, rest = divmod(value, 60)
        hours, minutes = divmod(int(minutes), 60)
        text += (
            f" ({hours} h {minutes} min {rest:.0f} s)"
            if hours
            else f" ({minutes} min {rest:.0f} s)"
        )
    return text


def _mib(value: Any) -> str:
    number = _number(value)
    return DASH if number is None else f"{number / _MIB:.1f} MiB"


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


# ------------------------------------------------------------------------------------ sections


@dataclass
class _Section:
    """A report section, kept abstract so markdown and HTML render the same content."""

    title: str
    lines: list[str] = field(default_factory=list)  # paragraphs / bullet items (plain text)
    bullets: bool = True
    tables: list[tuple[list[str], list[list[str]]]] = field(default_factory=list)


_HEAD_MODELS = ("expert", "merged", "merged_heads", "calibrated", "calibrated_heads")


def _heads_section(evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> _Section | None:
    """Head calibration (beyond the paper), when the evaluation has "<model>_heads" rows:
    accuracy with the refit heads beside the paper-faithful numbers, and the gap each closes."""
    if not any("merged_heads" in (m or {}) or "calibrated_heads" in (m or {})
               for m in evaluation.values()):  # fmt: skip
        return None
    section = _Section("Head calibration (beyond the paper)")
    section.lines.append(
        "Each task's head refit in closed form on the calibration inputs to reproduce the "
        "expert's logits on the merged (or calibrated) tower; no labels. Gap closed is "
        "(model − merged) / (expert − merged)."
    )
    header = ["task", "expert", "merged", "merged + heads", "calibrated", "calibrated + heads",
              "gap closed: calibrated", "gap closed: merged + heads",
              "gap closed: calibrated + heads"]  # fmt: skip
    table, sums = [], {m: [] for m in _HEAD_MODELS}
    for task, models in evaluation.items():
        acc = {m: _number(((models or {}).get(m) or {}).get("accuracy")) for m in _HEAD_MODELS}
        for m in _HEAD_MODELS:
            sums[m].append(acc[m])
        table.append(_head_cells(str(task), acc))
    means = {m: _mean(values)[0] for m, values in sums.items()}
    table.append(_head_cells("average", means))
    section.tables.append((header, table))
    return section


def _head_cells(label: str, acc: Mapping[str, float | None]) -> list[str]:
    gaps = [gap_closed(acc["merged"], acc[m], acc["expert"])
            for m in ("calibrated", "merged_heads", "calibrated_heads")]  # fmt: skip
    return [label, *(_pct(acc[m]) for m in _HEAD_MODELS), *(_gap_text(g) for g in gaps)]


def _calibration_section(calibration: Mapping[str, Any] | None) -> _Section:
    section = _Section("Calibration")
    if calibration is None:
        section.lines = ["No calibration record: FeatCal was not run (or its record is missing)."]
        section.bullets = False
        return section
    blocks = calibration.get("blocks") or []
    restored = sum(bool(b.get("restored")) for b in blocks)
    section.lines = [
        f"architecture: {calibration.get('architecture', DASH)}",
        f"blocks: {len(blocks)} ({len(blocks) - restored} computed, {restored} restored)",
        f"wall time: {_duration(calibration.get('wall_seconds'))}",
        f"peak RSS: {_mib(calibration.get('peak_rss_bytes'))}",
    ]
    if _number(calibration.get("peak_device_bytes")):
        section.lines.append(f"peak device memory: {_mib(calibration['peak_device_bytes'])}")
    hp = calibration.get("hyperparameters") or {}
    if hp:
        section.tables.append(
            (["hyperparameter", "value"], [[str(k), _value_text(v)] for k, v in hp.items()])
        )
    means = _block_means(calibration)
    if means:
        section.tables.append(
            (
                ["block", "seconds", "restored", "mean drift before", "mean drift after"],
                [
                    [
                        str(index),
                        _value_text(block.get("seconds")),
                        "yes" if was_restored else "no",
                        DASH if before is None else f"{before:.4g}",
                        DASH if after is None else f"{after:.4g}",
                    ]
                    for (index, before, after, was_restored), block in zip(
                        means, blocks, strict=True
                    )
                ],
            )
        )
    return section


def _model_line(role: str, entry: Mapping[str, Any]) -> str:
    commit = entry.get("commit") or "local"
    files = entry.get("files") or {}
    shas = ", ".join(f"{name} {_short(sha)}" for name, sha in files.items())
    text = f"{role}: {entry.get('reference', DASH)} — commit {commit} — {len(files)} files"
    return text + (f" ({shas})" if shas else "")


def _inputs_section(lock: Mapping[str, Any] | None) -> _Section:
    section = _Section("Inputs")
    if lock is None:
        section.lines = ["No lock file."]
        section.bullets = False
        return section
    if lock.get("base"):
        section.lines.append(_model_line("base", lock["base"]))
    for task, entry in (lock.get("experts") or {}).items():
        section.lines.append(_model_line(f"expert {task}", entry))
    section.lines.append(f"lock digest: {lock.get('lock_digest') or DASH}")
    return section


def _merge_section(merge: Mapping[str, Any] | None) -> _Section:
    section = _Section("Merge")
    if merge is None:
        section.lines = ["No merge record."]
        section.bullets = False
        return section
    section.lines = [f"method: {merge.get('method', DASH)}"]
    hp = merge.get("hyperparameters") or {}
    if hp:
        section.tables.append(
            (["hyperparameter", "value"], [[str(k), _value_text(v)] for k, v in hp.items()])
        )
    return section


def _extra_section(extra: Mapping[str, Any] | None) -> _Section | None:
    if not extra:
        return None
    return _Section(
        "Run details",
        tables=[(["key", "value"], [[str(k), _value_text(v)] for k, v in extra.items()])],
    )


# ------------------------------------------------------------------------------------ markdown


def _md(text: str) -> str:
    """Text for a markdown table cell or line: no raw HTML, no column breaks, one line."""
    text = " ".join(str(text).splitlines())
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "\\<")


def _md_table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    bold_last: bool = False,
    numeric: bool = False,
) -> str:
    """A markdown table; `numeric`: every column but the first right-aligned."""
    align = "---:" if numeric else ":---"
    lines = [
        "| " + " | ".join(_md(h) for h in header) + " |",
        "|" + "|".join([":---"] + [align] * (len(header) - 1)) + "|",
    ]
    for i, row in enumerate(rows):
        cells = [_md(c) for c in row]
        if bold_last and i == len(rows) - 1:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md_section(section: _Section) -> str:
    parts = [f"## {_md(section.title)}"]
    if section.lines:
        prefix = "- " if section.bullets else ""
        parts.append("\n".join(prefix + _md(line) for line in section.lines))
    parts.extend(_md_table(header, rows) for header, rows in section.tables)
    return "\n\n".join(parts)


def _markdown(run_name, summary, rows, notes, plots, sections) -> str:
    parts = [f"# FeatCal report: {_md(run_name)}", _md(summary), "## Accuracy per task"]
    parts.append("Accuracy, normalized accuracy (÷ the expert's) and gap closed, in percent.")
    if rows:
        parts.append(_md_table(_COLUMNS, [_cells(r) for r in rows], bold_last=True, numeric=True))
    if notes:
        parts.append("\n".join(f"- {_md(n)}" for n in notes))
    parts.append("## Plots")
    parts.extend(f"![{alt}]({name})" for name, alt in plots)
    if not any(name == "drift.png" for name, _ in plots):
        parts.append("No drift plot: there is no calibration record with blocks.")
    parts.extend(_md_section(s) for s in sections)
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------ HTML

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 72rem;
       margin: 2rem auto; padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { font-size: 1.25rem; margin-top: 2rem;
     border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
table { border-collapse: collapse; margin: .8rem 0; font-size: .92rem; }
th, td { border: 1px solid #ccc; padding: .3rem .6rem; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.avg td { font-weight: bold; background: #fafafa; }
img { max-width: 100%; height: auto; display: block; margin: .8rem 0; }
.summary { font-size: 1.05rem; }
.note { color: #555; font-size: .9rem; }
code { font-size: .88rem; }
""".strip()


def _h(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _html_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1, avg_last=False
) -> str:
    out = [
        "<table>",
        "<thead><tr>" + "".join(f"<th>{_h(c)}</th>" for c in header) + "</tr></thead>",
    ]
    out.append("<tbody>")
    for i, row in enumerate(rows):
        cls = ' class="avg"' if avg_last and i == len(rows) - 1 else ""
        cells = "".join(
            f'<td class="num">{_h(c)}</td>' if j >= numeric_from else f"<td>{_h(c)}</td>"
            for j, c in enumerate(row)
        )
        out.append(f"<tr{cls}>{cells}</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def _html_section(section: _Section) -> str:
    parts = [f"<h2>{_h(section.title)}</h2>"]
    if section.lines:
        if section.bullets:
            parts.append("<ul>" + "".join(f"<li>{_h(x)}</li>" for x in section.lines) + "</ul>")
        else:
            parts.extend(f"<p>{_h(x)}</p>" for x in section.lines)
    parts.extend(_html_table(header, rows, numeric_from=99) for header, rows in section.tables)
    return "\n".join(parts)


def _html(run_name, summary, rows, notes, plots, sections) -> str:
    title = f"FeatCal report: {run_name}"
    body = [f"<h1>{_h(title)}</h1>", f'<p class="summary">{_h(summary)}</p>']
    body.append("<h2>Accuracy per task</h2>")
    body.append(
        '<p class="note">Accuracy, normalized accuracy (÷ the expert\'s) and gap closed, '
        "in percent.</p>"
    )
    if rows:
        body.append(_html_table(_COLUMNS, [_cells(r) for r in rows], avg_last=True))
    if notes:
        body.append('<ul class="note">' + "".join(f"<li>{_h(n)}</li>" for n in notes) + "</ul>")
    body.append("<h2>Plots</h2>")
    body.extend(f'<img src="{_h(name)}" alt="{_h(alt)}">' for name, alt in plots)
    if not any(name == "drift.png" for name, _ in plots):
        body.append("<p>No drift plot: there is no calibration record with blocks.</p>")
    body.extend(_html_section(s) for s in sections)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_h(title)}</title>\n<style>\n{_CSS}\n</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


# ------------------------------------------------------------------------------------ plots


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


# ------------------------------------------------------------------------------------ report


def write_report(
    out_dir: str | Path,
    *,
    run_name: str,
    evaluation: dict,
    calibration: dict | None,
    merge: dict | None,
    lock: dict | None,
    extra: dict | None = None,
) -> dict[str, Path]:
    """Write report.md, report.html, accuracy.png and drift.png (only when the calibration record
    has blocks) into `out_dir`, replacing an earlier report there atomically.

    evaluation: {task: {model: {"accuracy", "loss", "examples", "normalized"}}} (evaluate_models);
    calibration: featcal.json; merge: merge.json; lock: the lock file; extra: more key → value
    pairs shown under "Run details" (e.g. params, MLflow run id). Returns {file name: final path}.
    Raises FeatCalError when `out_dir` holds anything but report files; on any error an existing
    report is left as it was.
    """
    out = Path(out_dir)
    check_output(out, overwrite=True, flag="report directory")  # before any work
    rows = _rows(evaluation)
    notes = _average_notes(rows)
    summary = _summary(rows, calibration is not None)
    has_drift = bool(calibration and calibration.get("blocks"))
    plots = [("accuracy.png", "accuracy per task")]
    if has_drift:
        plots.append(("drift.png", "feature drift per block"))
    sections = [_calibration_section(calibration), _inputs_section(lock), _merge_section(merge)]
    if (heads_section := _heads_section(evaluation)) is not None:
        sections.insert(0, heads_section)
    if (extra_section := _extra_section(extra)) is not None:
        sections.append(extra_section)

    with guarded_directory(out, overwrite=True, flag="report directory") as tmp:
        plot_accuracy(tmp / "accuracy.png", evaluation)
        if has_drift:
            plot_drift(tmp / "drift.png", calibration)
        (tmp / "report.md").write_text(
            _markdown(run_name, summary, rows, notes, plots, sections), encoding="utf-8"
        )
        (tmp / "report.html").write_text(
            _html(run_name, summary, rows, notes, plots, sections), encoding="utf-8"
        )
        names = sorted(p.name for p in tmp.iterdir())
    return {name: out / name for name in names}
