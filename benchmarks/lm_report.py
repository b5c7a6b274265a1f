"""The report of `lm_token_weighting.py`: the markdown tables (validation grid, selected settings
on test) and the CSV, written atomically to <out>/lm_token_weighting.{md,csv}."""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path

from lm_settings import ALPHAS, LAMS, RHO, TASKS, WEIGHTINGS


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "w", newline="") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600
    os.replace(tmp, path)


def report(args, record, grid, finals, winner: str, seconds: float, noise: dict[str, float]):
    """Markdown and CSV; returns the markdown."""
    fmt = lambda v: f"{v:g}"  # noqa: E731
    lines = [
        "# FeatCal token weighting on tiny Llama LMs: all tokens vs answer tokens",
        "",
        "Built by `benchmarks/lm_token_weighting.py` (see its docstring): a word-level tokenizer "
        f"({record['vocab_size']} entries) and a tiny LlamaForCausalLM (hidden 128, 4 layers, "
        f"4 heads / 2 kv heads, intermediate 256) pretrained {args.steps_pretrain} steps on the "
        "train texts of rotten_tomatoes, subjectivity, polarity and hedge; one expert per task "
        f'fine-tuned {args.steps_finetune} steps on `"{{text}} ->" + " <label word>"`; Task '
        f"Arithmetic merge, scale {fmt(record['scale'])} chosen on validation "
        f"({', '.join(f'{s}: {pct(v)}' for s, v in record['merge_validation'].items())}); "
        f"FeatCal with n = {args.n} calibration rows per task (train split, seed {args.seed}), "
        f"ρ = {RHO}. Accuracy = label-continuation accuracy (%), validation ≤ {args.max_val} rows "
        f"per task, test ≤ {args.max_test or 'all'} rows per task. Selection on validation only; "
        f"the test split is scored only for the rows of the second table. Run time "
        f"{seconds / 60:.1f} min (zoo build {record['build_seconds'] / 60:.1f} min).",
        "",
        "## Validation grid (average validation accuracy, %)",
        "",
        "| α | λ | all | answer |",
        "|---|---|---|---|",
    ]
    for alpha in ALPHAS:
        for lam in LAMS:
            cells = [pct(grid[w, alpha, lam]["avg"]) for w in WEIGHTINGS]
            lines.append(f"| {fmt(alpha)} | {fmt(lam)} | {' | '.join(cells)} |")
    lines += [
        "",
        f"Validation prefers token weighting **{winner}** "
        + "("
        + ", ".join(
            f"{f['weighting']}: {pct(f['validation']['avg'])}"
            for f in finals
            if f["kind"] == "featcal (val-selected)"
        )
        + "); binomial standard error of each of these averages: "
        + ", ".join(f"{w} ± {100 * noise[w]:.1f}" for w in WEIGHTINGS)
        + " points (both are scored on the same rows, so their difference is less noisy than "
        "that suggests, but a difference of about one point is within noise).",
        "",
        "## Selected settings: validation and test accuracy (%)",
        "",
        "| model | weighting | α | λ | val avg | test avg | "
        + " | ".join(f"test {t}" for t in TASKS)
        + " | gap closed (test) |",
        "|---|---|---|---|---|---|" + "---|" * len(TASKS) + "---|",
    ]
    csv_rows = []
    header = [
        "section",
        "model",
        "weighting",
        "alpha",
        "lam",
        "rho",
        "scale",
        "split",
        "avg",
        *TASKS,
        "gap_closed_pct",
    ]
    for (w, alpha, lam), scores in grid.items():
        csv_rows.append(
            [
                "grid",
                "featcal",
                w,
                alpha,
                lam,
                RHO,
                record["scale"],
                "validation",
                scores["avg"],
                *(scores[t] for t in TASKS),
                "",
            ]
        )
    for f in finals:
        gap = f.get("gap")
        lines.append(
            f"| {f['kind']} | {f.get('weighting') or '—'} | "
            f"{fmt(f['alpha']) if f.get('alpha') is not None else '—'} | "
            f"{fmt(f['lam']) if f.get('lam') is not None else '—'} | "
            f"{pct(f['validation']['avg']) if f.get('validation') else '—'} | "
            f"{pct(f['test']['avg'])} | "
            + " | ".join(pct(f["test"][t]) for t in TASKS)
            + f" | {'—' if gap is None else f'{gap:.1f} %'} |"
        )
        for split in ("validation", "test"):
            if f.get(split):
                csv_rows.append(
                    [
                        "final",
                        f["kind"],
                        f.get("weighting") or "",
                        f.get("alpha", ""),
                        f.get("lam", ""),
                        RHO if f.get("alpha") is not None else "",
                        record["scale"] if f["kind"] != "base" and f["kind"] != "experts" else "",
                        split,
                        f[split]["avg"],
                        *(f[split][t] for t in TASKS),
                        "" if gap is None or split != "test" else gap,
                    ]
                )
    experts = ", ".join(
        f"{t} {pct(v['validation_accuracy'])}" for t, v in record["experts"].items()
    )
    lines += ["", f"Experts' validation accuracy on their own task: {experts}.", ""]
    markdown = "\n".join(lines)
    out = Path(args.out)
    write_atomic(out / "lm_token_weighting.md", markdown)
    buffer = _csv_text(header, csv_rows)
    write_atomic(out / "lm_token_weighting.csv", buffer)
    return markdown


def _csv_text(header: list, rows: list[list]) -> str:
    import io

    handle = io.StringIO()
    writer = csv.writer(handle, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])
    return handle.getvalue()
