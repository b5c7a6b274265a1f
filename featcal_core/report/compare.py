"""The comparison report of `featcal compare`: variants (merge × repair × hyperparameters) side by
side, with what each cost.

    rows = comparison_rows(evaluation, variants, reference="merged:ties")
    write_comparison("reports/vision-zoo-compare", run_name="vision-zoo", rows=rows, ...)

`evaluation` is one evaluation table ({task: {row: {"accuracy", "normalized", ...}}}, as
tasks/evaluate.py writes it) holding the experts, every distinct merge and every repaired model;
each variant names its row there. Gap closed is measured against one reference merge for every
variant (the params file's own merge), so variants with different merges compare on one scale:
(accuracy − reference merge's) / (expert's − reference merge's) × 100, in percent.

Units: accuracy, normalized accuracy and gap closed in percent; seconds; MiB.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from featcal_core.evaluation.selection import LABEL_FREE
from featcal_core.io.outputs import guarded_directory
from featcal_core.report.figures import LABELS, Figure, summary_figures

__all__ = [
    "COMPARE_FILES",
    "comparison_markdown",
    "comparison_rows",
    "label_free_summary",
    "sample_efficiency",
    "write_comparison",
]

COMPARE_FILES = ("compare.md", "compare.json", "accuracy_vs_cost.png")
#: written beside COMPARE_FILES when some variants differ only in `featcal.num_per_task`
CURVE_FILES = ("sample_efficiency.csv", "sample_efficiency.png")


def _percent(value: float | None) -> float | None:
    return None if value is None else 100.0 * value


def _value(figure: Figure | None) -> float | None:
    return None if figure is None else figure.value


def comparison_rows(
    evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]],
    variants: Sequence[Mapping[str, Any]],
    reference: str,
) -> list[dict[str, Any]]:
    """One row per variant: {"name", "merge", "repair", "set", "tasks": {task: {"accuracy",
    "normalized", "gap_closed"}}, "mean": {same keys: the summary figures of
    featcal_core.report.figures, gap closed of the mean accuracies}, "mean_over": {same keys: the
    tasks each mean is over, "over 2 tasks"}, "cost": {"merge_seconds", "repair_seconds",
    "total_seconds", "peak_rss_mb"}} (percent, seconds, MiB).

    Each variant mapping has "name", "row" (its evaluation row), "merge", "repair", "set" and
    "cost" ({"merge_seconds", "repair_seconds", "peak_rss_mb"}); `reference` is the evaluation
    row of the reference merge. A variant mapping with "curve" (a key shared by the variants
    whose settings differ only in the number of calibration inputs per task), "num_per_task"
    and "merge_row" (its merge's evaluation row) gets a row "curve" {"key", "n", "merge_row",
    "merge", "experts"} (the merge's and the experts' {"accuracy", "tasks"}), which
    `sample_efficiency` draws."""
    figures = summary_figures(
        evaluation, reference=reference, gap_rows=[str(v["row"]) for v in variants]
    )
    rows = []
    for variant in variants:
        name = str(variant["row"])
        tasks: dict[str, dict[str, float | None]] = {}
        for task in figures.tasks:
            values = figures.per_task.get(task, {}).get(name, {})
            tasks[task] = {
                "accuracy": _percent(values.get("accuracy")),
                "normalized": _percent(values.get("normalized")),
                "gap_closed": values.get("gap_closed"),
            }
        found = {key: figures.of(key).get(name) for key in ("accuracy", "normalized", "gap_closed")}
        mean = {
            "accuracy": _percent(_value(found["accuracy"])),
            "normalized": _percent(_value(found["normalized"])),
            "gap_closed": _value(found["gap_closed"]),
        }
        over = {key: figure.over() for key, figure in found.items() if figure is not None}
        cost = dict(variant["cost"])
        cost["total_seconds"] = cost.get("merge_seconds", 0.0) + cost.get("repair_seconds", 0.0)
        row = {
            "name": variant["name"],
            "merge": variant["merge"],
            "repair": variant["repair"],
            "set": list(variant.get("set", [])),
            "tasks": tasks,
            "mean": mean,
            "mean_over": over,
            "cost": cost,
        }
        if variant.get("curve") is not None:
            row["curve"] = {
                "key": str(variant["curve"]),
                "n": int(variant["num_per_task"]),
                "merge_row": str(variant["merge_row"]),
                "merge": _row_accuracy(figures, str(variant["merge_row"])),
                "experts": _row_accuracy(figures, "expert"),
            }
        if variant.get("label_free"):  # {task: {"agreement", "drift", ...}} on held-out inputs
            by_task = variant["label_free"]
            row["label_free"] = {
                "tasks": dict(by_task),
                **{key: sum(v[key] for v in by_task.values()) / len(by_task) for key in LABEL_FREE},
            }
        rows.append(row)
    return rows


def _row_accuracy(figures: Any, row: str) -> dict[str, Any]:
    """{"accuracy": mean %, "tasks": {task: %}} of evaluation row `row`."""
    tasks = {
        task: _percent(values[row].get("accuracy"))
        for task, values in figures.per_task.items()
        if row in values
    }
    return {"accuracy": _percent(_value(figures.of("accuracy").get(row))), "tasks": tasks}


def sample_efficiency(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The paper's sample-efficiency curves: per group of repaired variants that share every
    setting but the number of calibration inputs per task (their rows' "curve" key), with two
    or more distinct n, mean and per-task accuracy (%) against n, beside their merge's and the
    experts' (flat lines). [{"label" ("<repair>:<merge method>", made unique), "variants",
    "points": [{"n", "variant", "accuracy", "tasks"}] by n, "merge", "experts"}]."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        if row.get("curve") is not None and row["repair"] != "none":
            groups.setdefault(row["curve"]["key"], []).append(row)
    curves: list[dict[str, Any]] = []
    for members in groups.values():
        by_n: dict[int, Mapping[str, Any]] = {}
        for row in members:
            by_n.setdefault(row["curve"]["n"], row)  # the first variant of an n
        if len(by_n) < 2:
            continue
        first = members[0]
        label = f"{first['repair']}:{first['merge']['method']}"
        taken = {c["label"] for c in curves}
        if label in taken:
            label = f"{label}:{first['curve']['key'][:8]}"
        curves.append(
            {
                "label": label,
                "variants": [row["name"] for row in members],
                "points": [
                    {
                        "n": n,
                        "variant": row["name"],
                        "accuracy": row["mean"]["accuracy"],
                        "tasks": {t: v["accuracy"] for t, v in row["tasks"].items()},
                    }
                    for n, row in sorted(by_n.items())
                ],
                "merge": {"row": first["curve"]["merge_row"], **first["curve"]["merge"]},
                "experts": first["curve"]["experts"],
            }
        )
    return curves


def sample_efficiency_csv(curves: Sequence[Mapping[str, Any]]) -> str:
    """sample_efficiency.csv, one line per n (any curve's): `n`, each curve's mean accuracy
    (column: its label) and per task (`<label>/<task>`), each curve's merge
    (`merge:<label>`, `merge:<label>/<task>`) and the experts (`experts`, `experts/<task>`),
    in percent; a curve without that n leaves its cells empty. `dvc plots show
    sample_efficiency.csv -x n -y <label>` draws a curve."""
    import csv
    import io

    tasks = list(curves[0]["experts"]["tasks"]) if curves else []
    columns = ["n"]
    for curve in curves:
        label = curve["label"]
        columns += [label, *(f"{label}/{t}" for t in tasks)]
        columns += [f"merge:{label}", *(f"merge:{label}/{t}" for t in tasks)]
    columns += ["experts", *(f"experts/{t}" for t in tasks)]

    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.4f}"

    lines = []
    for n in sorted({p["n"] for c in curves for p in c["points"]}):
        line: dict[str, str] = {"n": str(n)}
        for curve in curves:
            label = curve["label"]
            point = next((p for p in curve["points"] if p["n"] == n), None)
            if point is not None:
                line[label] = cell(point["accuracy"])
                line.update({f"{label}/{t}": cell(point["tasks"].get(t)) for t in tasks})
            line[f"merge:{label}"] = cell(curve["merge"]["accuracy"])
            line.update({f"merge:{label}/{t}": cell(curve["merge"]["tasks"].get(t)) for t in tasks})
        line["experts"] = cell(curves[0]["experts"]["accuracy"])
        line.update({f"experts/{t}": cell(curves[0]["experts"]["tasks"].get(t)) for t in tasks})
        lines.append(line)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(lines)
    return out.getvalue()


def plot_sample_efficiency(curves: Sequence[Mapping[str, Any]], path: Path) -> None:
    """sample_efficiency.png: mean accuracy (%) against calibration inputs per task (log scale),
    one line per curve, its merge dashed and the experts dotted."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for curve in curves:
        xs = [p["n"] for p in curve["points"]]
        ys = [p["accuracy"] for p in curve["points"]]
        (line,) = axes.plot(xs, ys, marker="o", label=curve["label"].replace("$", r"\$"))
        if curve["merge"]["accuracy"] is not None:
            axes.axhline(
                curve["merge"]["accuracy"],
                linestyle="--",
                color=line.get_color(),
                label=f"merge ({curve['merge']['row']})".replace("$", r"\$"),
            )
    experts = curves[0]["experts"]["accuracy"] if curves else None
    if experts is not None:
        axes.axhline(experts, linestyle=":", color="black", label="experts")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("calibration inputs per task (n)")
    axes.set_ylabel("mean accuracy (%)")
    axes.set_title("sample efficiency")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def label_free_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """How well each label-free score ranks the variants as their mean test accuracy does:
    {score: {"spearman" (of the score oriented so higher is better, against mean accuracy),
    "choice", "accuracy", "gap_closed"}, "best_on_test": {"name", "accuracy", "gap_closed"}};
    None with under two scored variants."""
    from featcal_core.evaluation.selection import HIGHER_IS_BETTER, choose, spearman

    scored = [r for r in rows if r.get("label_free") and r["mean"]["accuracy"] is not None]
    if len(scored) < 2:
        return None
    accuracy = [r["mean"]["accuracy"] for r in scored]
    by_name = {r["name"]: r for r in scored}
    found: dict[str, Any] = {}
    for score in LABEL_FREE:
        sign = 1.0 if HIGHER_IS_BETTER[score] else -1.0
        values = [sign * r["label_free"][score] for r in scored]
        winner = choose({r["name"]: r["label_free"]["tasks"] for r in scored}, score)["winner"]
        found[score] = {
            "spearman": spearman(values, accuracy),
            "choice": winner,
            "accuracy": by_name[winner]["mean"]["accuracy"],
            "gap_closed": by_name[winner]["mean"]["gap_closed"],
        }
    best = max(scored, key=lambda r: r["mean"]["accuracy"])
    found["best_on_test"] = {
        "name": best["name"],
        "accuracy": best["mean"]["accuracy"],
        "gap_closed": best["mean"]["gap_closed"],
    }
    return found


def _pct(value: float | None, unit: str = "") -> str:
    return "—" if value is None else f"{value:.1f}{unit}"


def comparison_markdown(
    run_name: str,
    rows: Sequence[Mapping[str, Any]],
    reference: str,
    chosen: Mapping[str, Any] | None = None,
) -> str:
    """compare.md: a table of variants × tasks (accuracy %), the means (accuracy, normalized,
    gap closed against `reference`) and the cost columns; then what each variant set."""
    tasks = list(rows[0]["tasks"]) if rows else []
    lines = [
        f"# featcal compare: {run_name}",
        "",
        f"Accuracy (%) on the evaluation split; gap closed against the reference merge "
        f"`{reference}`, of the mean accuracies; cost = the variant's merge (shared by "
        "variants with the same merge) plus its repair, on this machine (a merge or "
        "calibration reused from an earlier run costs what reusing it took).",
        "",
    ]
    label_free = any(row.get("label_free") for row in rows)
    header = [
        "variant",
        *tasks,
        "mean acc",
        "mean norm",
        "gap closed",
        "merge s",
        "repair s",
        "total s",
        "peak RSS MiB",
    ] + (["agree %", "drift", "KL"] if label_free else [])
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cost = row["cost"]
        cells = [
            f"`{row['name']}`",
            *(_pct(row["tasks"][t]["accuracy"]) for t in tasks),
            _pct(row["mean"]["accuracy"]),
            _pct(row["mean"]["normalized"]),
            _pct(row["mean"]["gap_closed"], " %"),
            f"{cost.get('merge_seconds', 0):.1f}",
            f"{cost.get('repair_seconds', 0):.1f}",
            f"{cost['total_seconds']:.1f}",
            "—" if cost.get("peak_rss_mb") is None else f"{cost['peak_rss_mb']:.0f}",
        ]
        if label_free:
            scores = row.get("label_free") or {}
            cells += [
                _pct(scores.get("agreement")),
                *("—" if scores.get(k) is None else f"{scores[k]:.4f}" for k in ("drift", "kl")),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    partial = [
        f"- `{row['name']}`: {LABELS[key]} {over}"
        for row in rows
        for key, over in (row.get("mean_over") or {}).items()
        if " of " in over
    ]
    if partial:
        lines += ["", "Means over fewer than every task:", "", *partial]
    summary = label_free_summary(rows)
    if summary is not None:
        best = summary["best_on_test"]
        lines += [
            "",
            "Label-free scores (on held-out unlabeled calibration inputs, against each "
            "task's expert) as predictors of the mean test accuracy:",
            "",
        ]
        for score in LABEL_FREE:
            found = summary[score]
            rho = "—" if found["spearman"] is None else f"{found['spearman']:+.2f}"
            lines.append(
                f"- {score}: Spearman ρ {rho}; it would choose `{found['choice']}` "
                f"({_pct(found['accuracy'])} % mean accuracy, gap closed "
                f"{_pct(found['gap_closed'], ' %')})"
            )
        lines.append(
            f"- best on test: `{best['name']}` ({_pct(best['accuracy'])} %, gap closed "
            f"{_pct(best['gap_closed'], ' %')})"
        )
    curves = sample_efficiency(rows)
    if curves:
        lines += [
            "",
            "Sample efficiency: mean accuracy (%) against the calibration inputs per task "
            "(sample_efficiency.png; per task in sample_efficiency.csv):",
            "",
            "| n | " + " | ".join(f"`{c['label']}`" for c in curves) + " |",
            "|---|" + "---|" * len(curves),
        ]
        for n in sorted({p["n"] for c in curves for p in c["points"]}):
            found = [next((p for p in c["points"] if p["n"] == n), None) for c in curves]
            cells = [
                "—" if p is None else f"{_pct(p['accuracy'])} (`{p['variant']}`)" for p in found
            ]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        merges = [f"{_pct(c['merge']['accuracy'])} (`{c['merge']['row']}`)" for c in curves]
        lines.append("| merge | " + " | ".join(merges) + " |")
        lines.append(
            "| experts | " + " | ".join(_pct(c["experts"]["accuracy"]) for c in curves) + " |"
        )
    lines += ["", "| variant | merge | repair | overrides |", "|---|---|---|---|"]
    for row in rows:
        merge = f"{row['merge']['method']} {json.dumps(row['merge']['hyperparameters'])}"
        lines.append(
            f"| `{row['name']}` | {merge} | {row['repair']} | "
            f"{', '.join(f'`{s}`' for s in row['set']) or '—'} |"
        )
    if chosen:
        lines += ["", f"Chosen: `{chosen['name']}` ({chosen['why']})"]
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_cost(rows: Sequence[Mapping[str, Any]], path: Path) -> list[tuple]:
    """accuracy_vs_cost.png: mean accuracy (%) against total seconds, one labelled point per
    variant; returns the points drawn [(name, seconds, accuracy)]."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = [
        (r["name"], r["cost"]["total_seconds"], r["mean"]["accuracy"])
        for r in rows
        if r["mean"]["accuracy"] is not None
    ]
    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, seconds, accuracy in points:
        axes.scatter([seconds], [accuracy])
        axes.annotate(
            str(name).replace("$", r"\$"),
            (seconds, accuracy),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    axes.set_xlabel("cost: merge + repair (s)")
    axes.set_ylabel("mean accuracy (%)")
    axes.set_title("accuracy against cost")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    return points


def write_comparison(
    out_dir: str | Path,
    *,
    run_name: str,
    rows: Sequence[Mapping[str, Any]],
    reference: str,
    record: Mapping[str, Any],
) -> dict[str, Path]:
    """Write compare.md, compare.json (`record` plus the rows) and accuracy_vs_cost.png into
    `out_dir`, and the sample-efficiency curves (CURVE_FILES) when `sample_efficiency` finds
    any, replacing an earlier comparison there atomically; returns {file: final path}."""
    out = Path(out_dir)
    curves = sample_efficiency(rows)
    document = {
        **record,
        "reference": reference,
        "variants": list(rows),
        "label_free": label_free_summary(rows),
        "sample_efficiency": curves,
    }
    with guarded_directory(out, overwrite=True, flag="comparison folder") as tmp:
        chosen = record.get("chosen")
        (tmp / "compare.md").write_text(comparison_markdown(run_name, rows, reference, chosen))
        (tmp / "compare.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
        plot_accuracy_vs_cost(rows, tmp / "accuracy_vs_cost.png")
        if curves:
            (tmp / "sample_efficiency.csv").write_text(sample_efficiency_csv(curves))
            plot_sample_efficiency(curves, tmp / "sample_efficiency.png")
    names = COMPARE_FILES + (CURVE_FILES if curves else ())
    return {name: out / name for name in names}
