"""`write_report`: the report directory (report.md, report.html and the plots), written
atomically."""

from __future__ import annotations

from pathlib import Path

from featcal_core.io.outputs import check_output, guarded_directory
from featcal_core.report import plots as plotting  # looked up at call time (tests patch it)
from featcal_core.report.figures import headline_lines, summary_figures
from featcal_core.report.html import _html
from featcal_core.report.markdown import _markdown
from featcal_core.report.paper_reference import paper_section
from featcal_core.report.sections import (
    _calibration_section,
    _extra_section,
    _heads_section,
    _inputs_section,
    _merge_section,
    _Section,
)
from featcal_core.report.selection import selection_lines, selection_table
from featcal_core.report.tables import (
    _average_notes,
    _rows,
    _summary,
    above_expert,
    evaluated_precision,
    evaluated_rows,
    evaluation_cut,
    harness_metrics,
    table_caption,
)

__all__ = ["REPORT_FILES", "write_report"]

#: every file the report directory may hold
REPORT_FILES = ("report.md", "report.html", "accuracy.png", "drift.png")


def write_report(
    out_dir: str | Path,
    *,
    run_name: str,
    evaluation: dict,
    calibration: dict | None,
    merge: dict | None,
    lock: dict | None,
    extra: dict | None = None,
    selection: dict | None = None,
) -> dict[str, Path]:
    """Write report.md, report.html, accuracy.png and drift.png (only when the calibration record
    has blocks) into `out_dir`, replacing an earlier report there atomically.

    evaluation: {task: {model: {"accuracy", "loss", "examples", "normalized"}}} (evaluate_models);
    calibration: featcal.json; merge: merge.json; lock: the lock file; extra: more key → value
    pairs shown under "Run details" (e.g. params, MLflow run id); selection: the select step's
    record (selection.json), shown first when it chose. Returns {file name: final path}.
    Raises FeatCalError when `out_dir` holds anything but report files; on any error an existing
    report is left as it was.
    """
    out = Path(out_dir)
    check_output(out, overwrite=True, flag="report directory")  # before any work
    figures = summary_figures(evaluation)  # every average and ratio the report shows
    rows = _rows(evaluation, figures)
    headline = headline_lines(figures)
    notes = _average_notes(figures)
    if (counted := evaluated_rows(evaluation)) is not None:  # e.g. evaluation.max_examples_per_task
        notes.insert(0, f"evaluated on {counted} of the evaluation split")
    if (cut := evaluation_cut(evaluation)) is not None:
        notes.insert(
            0,
            f"evaluation cut short by evaluation.max_examples_per_task: {cut}; the "
            "numbers are on those first rows, not on the whole split",
        )
    if beyond := above_expert(evaluation):
        notes.append(
            "normalized accuracy above 100 % (the model beats the task's expert), "
            f"which lifts the normalized average: {', '.join(beyond)}"
        )
    if (dtype := evaluated_precision(evaluation)) is not None:  # evaluation.precision
        notes.append(f"evaluation forwards in {dtype}")
    if (harness := harness_metrics(evaluation)) is not None:  # evaluation.harness
        notes.insert(0, harness)
    summary = _summary(figures, calibration is not None)
    caption = table_caption(evaluation)
    if cut is not None:
        summary += " Evaluation was cut short (evaluation.max_examples_per_task; see the notes)."
    has_drift = bool(calibration and calibration.get("blocks"))
    plots = [("accuracy.png", "accuracy per task")]
    if has_drift:
        plots.append(("drift.png", "feature drift per block"))
    sections = [_calibration_section(calibration), _inputs_section(lock), _merge_section(merge)]
    if (paper := paper_section(lock, merge, evaluation)) is not None:  # the paper's CLIP setting
        sections.insert(0, paper)
    if (heads_section := _heads_section(evaluation)) is not None:
        sections.insert(0, heads_section)
    if selection is not None and selection.get("winner") is not None:
        sections.insert(0, _selection_section(selection))
    if (extra_section := _extra_section(extra)) is not None:
        sections.append(extra_section)

    with guarded_directory(out, overwrite=True, flag="report directory") as tmp:
        plotting.plot_accuracy(tmp / "accuracy.png", evaluation)
        if has_drift and calibration is not None:  # (has_drift implies a calibration)
            plotting.plot_drift(tmp / "drift.png", calibration)
        (tmp / "report.md").write_text(
            _markdown(run_name, summary, headline, rows, notes, plots, sections, caption),
            encoding="utf-8",
        )
        (tmp / "report.html").write_text(
            _html(run_name, summary, headline, rows, notes, plots, sections, caption),
            encoding="utf-8",
        )
        names = sorted(p.name for p in tmp.iterdir())
    return {name: out / name for name in names}


def _selection_section(selection: dict) -> _Section:
    """The choice among select:'s candidates: what won, on which score, and every candidate."""
    return _Section(
        "Choice of settings (select:)",
        lines=selection_lines(selection),
        tables=[selection_table(selection)],
    )
