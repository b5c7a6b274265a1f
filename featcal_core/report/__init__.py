"""The run report: one directory with report.md, report.html and two plots.

    paths = write_report(
        "data/results/report", run_name="clip-vit-b32 8 tasks",
        evaluation=table,          # tasks/evaluate.py evaluate_models
        calibration=featcal_json,  # featcal_core/method/calibration.py record, or None (FeatCal disabled)
        merge=merge_json,          # featcal_core/merging/run.py record, or None
        lock=lock,                 # featcal_core/provenance/lock.py lock file, or None
    )

The directory is written atomically (`guarded_directory`, overwrite=True): every file is written
under a temporary name beside it and only a complete report replaces the old one, so a failed
write leaves the previous report as it was. The directory belongs to the report: one that holds
anything but report files is refused rather than replaced.

Numbers are shown as given in the records; the derived figures (the averages over tasks, the
per-task normalized accuracy and gap closed, the headline) come from `figures.summary_figures`,
the one definition every surface shares (the module doc has it), besides the mean drift over
tasks of each block (drawn beside each task's drift) and the peak RSS in MiB. Accuracy,
normalized accuracy and gap closed are shown in percent with one decimal. A missing value (no
base model without a zero-shot head, no calibrated model when FeatCal is disabled, a non-finite
number, a ratio that is undefined) is shown as "—" and left out of averages, which then say over
how many tasks they are.

Pure library: matplotlib (Agg canvas, no pyplot, so no global backend is touched) is imported
inside the plotting functions.

The package: `figures` (the summary figures and their labels), `tables` (the accuracy table's
rows, per-block drift means), `sections` (the other sections, as content), `markdown` and `html`
(rendering), `plots` (the two PNGs: accuracy of every evaluated row per task, drift per task and
its mean per block; what each draws is `accuracy_series` / `drift_series`), `writer`
(`write_report`: the directory).
"""

from featcal_core.report.figures import (
    LABELS,
    Figures,
    gap_closed,
    headline_lines,
    headline_metrics,
    per_task_metrics,
    summary_figures,
)
from featcal_core.report.plots import accuracy_series, drift_series, plot_accuracy, plot_drift
from featcal_core.report.tables import DASH, MODEL_ORDER
from featcal_core.report.writer import REPORT_FILES, write_report

__all__ = [
    "DASH",
    "LABELS",
    "MODEL_ORDER",
    "REPORT_FILES",
    "Figures",
    "accuracy_series",
    "drift_series",
    "gap_closed",
    "headline_lines",
    "headline_metrics",
    "per_task_metrics",
    "summary_figures",
    "plot_accuracy",
    "plot_drift",
    "write_report",
]
