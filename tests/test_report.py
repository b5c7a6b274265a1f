"""The run report (featcal_core/report/) from hand-built evaluation tables and records."""

from __future__ import annotations

import math

import pytest

from featcal_core import report
from featcal_core.errors import FeatCalError
from featcal_core.report import DASH, gap_closed, plots, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(accuracy, expert):
    return {
        "accuracy": accuracy,
        "loss": 1.0 - accuracy,
        "examples": 100,
        "normalized": accuracy / expert if expert > 0 else float("nan"),
    }


def _task(expert, merged, calibrated=None, base=None):
    row = {"expert": _result(expert, expert), "merged": _result(merged, expert)}
    if calibrated is not None:
        row["calibrated"] = _result(calibrated, expert)
    if base is not None:
        row = {"base": _result(base, expert), **row}
    return row


def _evaluation():
    return {
        "mnist": _task(0.9, 0.5, 0.7, base=0.3),  # gap closed 50 %
        "svhn": _task(0.8, 0.6, 0.8),  # gap closed 100 %, no base
        "<b>x</b>": _task(0.6, 0.6, 0.65),  # expert == merged: no gap
    }


def _calibration(restored=(1,), drift_scale=1.0):
    blocks = []
    for i in range(4):
        before = {"mnist": drift_scale * 10.0 ** (i - 1), "svhn": drift_scale * 2 * 10.0 ** (i - 1)}
        after = {task: value * 1e-3 for task, value in before.items()}
        blocks.append(
            {
                "index": i,
                "seconds": 0.5 + i,
                "restored": i in restored,
                "drift_before": before,
                "drift_after": after,
            }
        )
    return {
        "featcal_record_version": 1,
        "architecture": "hf-clip-vision",
        "hyperparameters": {"alpha": 0.5, "rho": 0.1, "lam": 1e-4, "eps": 1e-6, "dtype": "float32"},
        "inputs": {},
        "blocks": blocks,
        "wall_seconds": 123.456,
        "peak_rss_bytes": 3 * 1024 * 1024 * 1024 + 512 * 1024 * 1024,
        "peak_device_bytes": 0,
    }


def _lock():
    def model(role, reference, commit):
        return {
            "role": role,
            "reference": reference,
            "kind": "hub" if commit else "local",
            "commit": commit,
            "path": "/somewhere",
            "files": {"config.json": "a" * 64, "model.safetensors": "b" * 64},
        }

    return {
        "version": 1,
        "base": model("models.base", "openai/clip-vit-base-patch32@main", "c" * 40),
        "experts": {
            "mnist": model("models.experts.mnist", "someone/clip-mnist", "d" * 40),
            "svhn": model("models.experts.svhn", "./experts/svhn", None),
        },
        "lock_digest": "e" * 64,
    }


def _merge():
    return {"method": "task_arithmetic", "hyperparameters": {"scaling": 0.3}}


def _write(out, **overrides):
    kwargs = {
        "run_name": "demo run",
        "evaluation": _evaluation(),
        "calibration": _calibration(),
        "merge": _merge(),
        "lock": _lock(),
    }
    kwargs.update(overrides)
    return write_report(out, **kwargs)


def _table_rows(markdown):
    """{first cell: cells} of the per-task markdown table."""
    lines = markdown.split("| task |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    rows = {}
    for line in lines:
        cells = [c.strip().strip("*") for c in line.strip().strip("|").split(" | ")]
        rows[cells[0]] = cells[1:]
    return rows


# ------------------------------------------------------------------------------------ gap_closed


def test_gap_closed():
    assert gap_closed(0.5, 0.7, 0.9) == pytest.approx(50.0)
    assert gap_closed(0.6, 0.8, 0.8) == pytest.approx(100.0)
    assert gap_closed(0.5, 0.4, 0.9) == pytest.approx(-25.0)
    assert gap_closed(0.6, 0.65, 0.6) is None
    # the merged model already beats the expert: no gap, not "-100 %" or "600 %"
    assert gap_closed(0.9, 0.8, 0.85) is None and gap_closed(0.9, 0.95, 0.85) is None
    assert gap_closed(0.5, None, 0.9) is None
    assert gap_closed(0.5, float("nan"), 0.9) is None


# ------------------------------------------------------------------------------------ files


def test_files_and_pngs(tmp_path):
    out = tmp_path / "report"
    paths = _write(out)
    assert set(paths) == {"report.md", "report.html", "accuracy.png", "drift.png"}
    for name, path in paths.items():
        assert path == out / name and path.is_file()
    for name in ("accuracy.png", "drift.png"):
        data = paths[name].read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 5_000
    html = paths["report.html"].read_text(encoding="utf-8")
    assert '<img src="accuracy.png"' in html and '<img src="drift.png"' in html
    assert "<style>" in html
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # no temporary leftovers


def test_table_numbers(tmp_path):
    markdown = _write(tmp_path / "r")["report.md"].read_text(encoding="utf-8")
    rows = _table_rows(markdown)
    #          base   expert  merged  calibrated  norm(m)  norm(c)  gap
    assert rows["mnist"] == ["30.0", "90.0", "50.0", "70.0", "55.6", "77.8", "50.0"]
    assert rows["svhn"] == [DASH, "80.0", "60.0", "80.0", "75.0", "100.0", "100.0"]
    # expert == merged: no gap to close
    assert rows["\\<b>x\\</b>"] == [DASH, "60.0", "60.0", "65.0", "100.0", "108.3", DASH]
    # averages over tasks of each column; gap closed of the averages
    expert, merged, calibrated = (
        (0.9 + 0.8 + 0.6) / 3,
        (0.5 + 0.6 + 0.6) / 3,
        (0.7 + 0.8 + 0.65) / 3,
    )
    gap = (calibrated - merged) / (expert - merged) * 100
    norm_m = (0.5 / 0.9 + 0.6 / 0.8 + 1.0) / 3
    norm_c = (0.7 / 0.9 + 1.0 + 0.65 / 0.6) / 3
    assert rows["average"] == [
        "30.0",  # base: only one task has it
        f"{expert * 100:.1f}",
        f"{merged * 100:.1f}",
        f"{calibrated * 100:.1f}",
        f"{norm_m * 100:.1f}",
        f"{norm_c * 100:.1f}",
        f"{gap:.1f}",
    ]
    assert "base: averaged over 1 of 3 tasks; left out: svhn, \\<b>x\\</b>, not evaluated" in (
        markdown
    )
    assert f"Calibration closed {gap:.1f} % of the merged→expert gap (over 3 tasks)" in markdown
    # the headline, as every surface shows it (featcal_core.report.figures.headline_lines)
    assert (
        "- normalized accuracy, average: base 33.3 % (over 1 of 3 tasks; left out: svhn, "
        f"\\<b>x\\</b>, not evaluated), merged {norm_m * 100:.1f} % (over 3 tasks), "
        f"calibrated {norm_c * 100:.1f} % (over 3 tasks)" in markdown
    )
    assert f"- gap closed, average (over 3 tasks): calibrated {gap:.1f} %" in markdown
    assert "# FeatCal report: demo run" in markdown


def test_headline_is_the_average_row():
    from featcal_core.report.tables import headline

    evaluation = _evaluation()
    evaluation["svhn"]["merged"]["examples"] = 40  # one row cut shorter
    found = headline(evaluation)
    expert, merged, calibrated = (
        (0.9 + 0.8 + 0.6) / 3,
        (0.5 + 0.6 + 0.6) / 3,
        (0.7 + 0.8 + 0.65) / 3,
    )
    assert set(found) == {
        "tasks",
        *(f"accuracy_mean{s}/{m}" for s in ("", "_tasks") for m in report.MODEL_ORDER),
        *(
            f"normalized_mean{s}/{m}"
            for s in ("", "_tasks")
            for m in ("base", "merged", "calibrated")
        ),
        "gap_closed_mean/calibrated",
        "gap_closed_mean_tasks/calibrated",
        "examples_min",
    }
    assert found["tasks"] == 3 and found["examples_min"] == 40
    assert found["accuracy_mean/base"] == pytest.approx(0.3)  # over the tasks that have it
    assert found["accuracy_mean_tasks/base"] == 1 and found["accuracy_mean_tasks/expert"] == 3
    assert found["accuracy_mean/calibrated"] == pytest.approx(calibrated)
    assert found["normalized_mean/merged"] == pytest.approx((0.5 / 0.9 + 0.6 / 0.8 + 1.0) / 3)
    assert found["gap_closed_mean/calibrated"] == pytest.approx(
        (calibrated - merged) / (expert - merged) * 100
    )
    # no calibrated model, merged at the expert: no such keys, no gap
    plain = headline({"a": _task(0.7, 0.7)})
    assert "accuracy_mean/calibrated" not in plain and not any("gap_closed" in k for k in plain)
    assert headline({}) == {"tasks": 0}
    # merged at the expert with a calibrated model: no gap, the count and no value (never NaN)
    flat = headline({"a": _task(0.7, 0.7, 0.75)})
    assert (
        "gap_closed_mean/calibrated" not in flat and flat["gap_closed_mean_tasks/calibrated"] == 1
    )


def test_cut_evaluation_and_normalized_above_100_are_stated(tmp_path):
    evaluation = _evaluation()
    for task, rows in (("mnist", 10000), ("svhn", 100)):  # svhn ran on its whole split
        for result in evaluation[task].values():
            result["split_rows"] = rows
    markdown = _write(tmp_path / "r", evaluation=evaluation)["report.md"].read_text("utf-8")
    assert "Evaluation was cut short (evaluation.max_examples_per_task" in markdown
    assert "evaluation cut short by evaluation.max_examples_per_task: mnist 100 of 10000 rows;" in (
        markdown
    )
    assert "svhn 100 of" not in markdown
    # the table's own caption says it (and the table a run prints at its end)
    assert (
        "in percent, on the first rows of each evaluation split only (evaluation cut short: "
        "mnist 100 of 10000 rows)." in markdown
    )
    from featcal.flows.summary import accuracy_table

    assert accuracy_table(evaluation).splitlines()[0] == (
        "accuracy (%) on the first rows of each evaluation split only (evaluation cut short: "
        "mnist 100 of 10000 rows)"
    )
    # "<b>x</b>": calibrated 65 % against the expert's 60 %
    assert "normalized accuracy above 100 %" in markdown and "(calibrated) 108.3 %" in markdown
    html = (tmp_path / "r" / "report.html").read_text("utf-8")
    assert "cut short" in html and "&lt;b&gt;x&lt;/b&gt; (calibrated) 108.3 %" in html

    whole = {
        t: {m: {**r, "split_rows": 100} for m, r in rows.items() if m != "calibrated"}
        for t, rows in _evaluation().items()
    }
    markdown = _write(tmp_path / "w", evaluation=whole)["report.md"].read_text("utf-8")
    assert "cut short" not in markdown and "above 100 %" not in markdown


def test_the_papers_numbers_beside_a_run_of_the_papers_setting(tmp_path):
    lock = {
        "base": {"repo_id": "openai/clip-vit-base-patch32"},
        "experts": {
            "svhn": {"repo_id": "tanganke/clip-vit-base-patch32_svhn"},
            "mnist": {"repo_id": "tanganke/clip-vit-base-patch32_mnist"},
        },
    }
    merge = {"method": "task_arithmetic", "hyperparameters": {"scale": 0.3}}
    evaluation = {"svhn": _task(0.9, 0.6, 0.8), "mnist": _task(0.99, 0.95, 0.97)}
    markdown = _write(tmp_path / "r", evaluation=evaluation, lock=lock, merge=merge)[
        "report.md"
    ].read_text("utf-8")
    assert "## The paper's numbers" in markdown and "+ FeatCal 85.5" in markdown
    # the section's table: task, paper TA, paper TA + FeatCal, this run's merged and calibrated
    assert "| svhn | 77.9 | 95.1 | 60.0 | 80.0 |" in markdown
    assert "| mnist | 96.1 | 98.8 | 95.0 | 97.0 |" in markdown
    # another expert, another merge or scale: not the paper's setting, no section
    for changed_lock, changed_merge in (
        ({**lock, "experts": {**lock["experts"], "x": {"repo_id": "me/clip-x"}}}, merge),
        (lock, {"method": "ties", "hyperparameters": {}}),
        (lock, {"method": "task_arithmetic", "hyperparameters": {"scale": 0.4}}),
    ):
        other = _write(
            tmp_path / "o", evaluation=evaluation, lock=changed_lock, merge=changed_merge
        )["report.md"].read_text("utf-8")
        assert "The paper's numbers" not in other


def test_known_gap_case(tmp_path):
    evaluation = {"t": _task(0.9, 0.5, 0.7)}
    markdown = _write(tmp_path / "r", evaluation=evaluation)["report.md"].read_text("utf-8")
    rows = _table_rows(markdown)
    assert rows["t"][-1] == "50.0"
    assert rows["average"][-1] == "50.0"
    assert "closed 50.0 % of the merged→expert gap" in markdown


def test_no_calibration_no_base(tmp_path):
    evaluation = {"a": _task(0.9, 0.5), "b": _task(0.7, 0.7)}
    paths = _write(tmp_path / "r", evaluation=evaluation, calibration=None, merge=None, lock=None)
    assert set(paths) == {"report.md", "report.html", "accuracy.png"}
    assert paths["accuracy.png"].read_bytes()[:8] == PNG_MAGIC
    markdown = paths["report.md"].read_text(encoding="utf-8")
    rows = _table_rows(markdown)
    assert rows["a"] == [DASH, "90.0", "50.0", DASH, "55.6", DASH, DASH]
    assert rows["b"] == [DASH, "70.0", "70.0", DASH, "100.0", DASH, DASH]
    assert rows["average"] == [DASH, "80.0", "60.0", DASH, "77.8", DASH, DASH]
    assert "FeatCal was not run" in markdown
    assert "No lock file." in markdown and "No merge record." in markdown
    assert "drift.png" not in paths["report.html"].read_text(encoding="utf-8")


def test_nan_normalized_is_missing(tmp_path):
    evaluation = {"zero": _task(0.0, 0.0, 0.0), "t": _task(0.9, 0.5, 0.7)}
    rows = _table_rows(_write(tmp_path / "r", evaluation=evaluation)["report.md"].read_text())
    assert rows["zero"][4:] == [DASH, DASH, DASH]
    assert rows["average"][4] == "55.6"  # NaN left out of the average
    assert math.isnan(evaluation["zero"]["merged"]["normalized"])  # input untouched


def test_html_escaping(tmp_path):
    extra = {"note": "<script>alert(1)</script>"}
    html = _write(tmp_path / "r", run_name="run & <i>co</i>", extra=extra)["report.html"]
    text = html.read_text(encoding="utf-8")
    assert "&lt;b&gt;x&lt;/b&gt;" in text
    assert "<b>x</b>" not in text
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert "run &amp; &lt;i&gt;co&lt;/i&gt;" in text


def test_sections(tmp_path):
    paths = _write(tmp_path / "r", extra={"mlflow_run_id": "abc123"})
    for name in ("report.md", "report.html"):
        text = paths[name].read_text(encoding="utf-8")
        assert "hf-clip-vision" in text
        assert "4 (3 computed, 1 restored)" in text
        assert "123.456 s" in text
        assert "3584.0 MiB" in text
        assert "0.0001" in text  # lam as given
        assert "openai/clip-vit-base-patch32@main" in text and "c" * 40 in text
        assert "./experts/svhn" in text and "commit local" in text
        assert "2 files" in text and "a" * 12 in text and "a" * 13 not in text
        assert "e" * 64 in text  # lock digest
        assert "task_arithmetic" in text and "scaling" in text and "0.3" in text
        assert "mlflow_run_id" in text and "abc123" in text


def test_drift_plot_linear_and_symlog(tmp_path):
    # no restored blocks, narrow range (linear y); and zeros among wide-range values (symlog)
    calibration = _calibration(restored=())
    for block in calibration["blocks"]:
        block["drift_before"] = {"mnist": 1.0 + block["index"]}
        block["drift_after"] = {"mnist": 0.5}
    report.plot_drift(tmp_path / "linear.png", calibration)
    calibration["blocks"][0]["drift_after"] = {"mnist": 0.0}
    calibration["blocks"][1]["drift_after"] = {"mnist": 1e-6}
    report.plot_drift(tmp_path / "symlog.png", calibration)
    for name in ("linear.png", "symlog.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_accuracy_plot_draws_every_evaluated_row(tmp_path, monkeypatch):
    evaluation = _evaluation()
    evaluation["mnist"]["merged_heads"] = _result(0.75, 0.9)
    evaluation["mnist"]["calibrated_heads"] = _result(0.85, 0.9)
    evaluation["svhn"]["calibrated_heads"] = _result(0.9, 0.8)
    evaluation["svhn"]["ties_v2"] = _result(0.55, 0.8)  # any other variant row of the table
    evaluation["<b>x</b>"]["calibrated_heads"] = {"accuracy": float("nan")}
    groups, series = report.accuracy_series(evaluation)
    assert groups == ["mnist", "svhn", "<b>x</b>", "average"]
    assert list(series) == [
        "base",
        "expert",
        "merged",
        "calibrated",
        "merged_heads",
        "calibrated_heads",
        "ties_v2",
    ]
    assert series["calibrated_heads"] == pytest.approx([0.85, 0.9, None, 0.875])
    assert series["merged_heads"] == pytest.approx([0.75, None, None, 0.75])
    assert series["ties_v2"] == pytest.approx([None, 0.55, None, 0.55])
    assert series["base"] == pytest.approx([0.3, None, None, 0.3])
    assert series["calibrated"][-1] == pytest.approx((0.7 + 0.8 + 0.65) / 3)
    # the plot draws exactly that, and the report's plot is this one
    assert plots.plot_accuracy(tmp_path / "a.png", evaluation) == (groups, series)
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG_MAGIC
    drawn = []
    real = plots.plot_accuracy
    monkeypatch.setattr(plots, "plot_accuracy", lambda *a: drawn.append(real(*a)))
    _write(tmp_path / "r", evaluation=evaluation)
    assert drawn == [(groups, series)]
    assert report.accuracy_series({}) == ([], {})


def test_drift_plot_draws_each_task_and_the_mean(tmp_path):
    calibration = _calibration(restored=(1,))
    calibration["blocks"][2]["drift_after"]["svhn"] = float("nan")
    data = report.drift_series(calibration)
    assert data["blocks"] == [0, 1, 2, 3] and data["restored"] == [False, True, False, False]
    assert list(data["before"]) == list(data["after"]) == ["mnist", "svhn"]
    assert data["before"]["mnist"] == pytest.approx([0.1, 1.0, 10.0, 100.0])
    assert data["before"]["svhn"] == pytest.approx([0.2, 2.0, 20.0, 200.0])
    assert data["mean_before"] == pytest.approx([0.15, 1.5, 15.0, 150.0])
    assert data["after"]["svhn"][2] is None  # not finite: a gap in the line
    assert data["mean_after"][2] == pytest.approx(0.01)  # the mean of the tasks that have one
    assert plots.plot_drift(tmp_path / "d.png", calibration) == data
    assert (tmp_path / "d.png").read_bytes()[:8] == PNG_MAGIC
    # a task present in only some blocks
    calibration["blocks"][3]["drift_before"]["extra"] = 5.0
    assert report.drift_series(calibration)["before"]["extra"] == [None, None, None, 5.0]
    assert report.drift_series({}) == {
        "blocks": [],
        "restored": [],
        "before": {},
        "after": {},
        "mean_before": [],
        "mean_after": [],
    }


# ------------------------------------------------------------------------------------ atomicity


def test_failed_write_leaves_old_report(tmp_path, monkeypatch):
    out = tmp_path / "report"
    _write(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*args, **kwargs):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(plots, "plot_drift", boom)
    with pytest.raises(RuntimeError, match="plotting failed"):
        _write(out, run_name="second run")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # temporary directory removed


def test_rewrite_replaces_report(tmp_path):
    out = tmp_path / "report"
    _write(out)
    paths = _write(out, run_name="second run", calibration=None)
    names = sorted(p.name for p in out.iterdir())
    assert names == [".featcal-output.json", "accuracy.png", "report.html", "report.md"]
    assert "second run" in paths["report.md"].read_text(encoding="utf-8")


def test_refuses_directory_with_other_files(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "evaluation.json").write_text("{}")
    with pytest.raises(FeatCalError, match="was not written by featcal"):
        _write(out)
    assert [p.name for p in out.iterdir()] == ["evaluation.json"]


def test_plot_data_csv_holds_what_the_plots_draw(tmp_path):
    """accuracy.csv / drift.csv (dvc.yaml's plots) are the plots' own series, in percent for
    accuracy; every evaluated row is a column, every block a row."""
    import csv

    from featcal_core.report import accuracy_series, drift_series
    from featcal_core.report.plot_data import write_plot_data

    files = write_plot_data(tmp_path / "plots", _evaluation(), _calibration())
    with open(files["accuracy.csv"]) as f:
        accuracy = list(csv.DictReader(f))
    groups, series = accuracy_series(_evaluation())
    assert [r["task"] for r in accuracy] == [g for g in groups if g != "average"]
    for i, row in enumerate(accuracy):
        for model, values in series.items():
            want = values[i]
            assert row[model] == ("" if want is None else f"{100 * want:.6g}")
    with open(files["drift.csv"]) as f:
        drift = list(csv.DictReader(f))
    expected = drift_series(_calibration())
    assert [int(r["block"]) for r in drift] == expected["blocks"]
    assert [float(r["drift_after/svhn"]) for r in drift] == pytest.approx(expected["after"]["svhn"])
    assert [float(r["drift_before_mean"]) for r in drift] == pytest.approx(expected["mean_before"])
    assert set(write_plot_data(tmp_path / "only", _evaluation(), None)) == {"accuracy.csv"}


def test_comparison_rows_measure_every_variant_against_one_reference_merge(tmp_path):
    """featcal compare's rows: accuracy and normalized per task in percent, gap closed against
    the reference merge (per task, and of the mean accuracies), the costs summed; the report's
    files are written."""
    import json

    from featcal_core.report.compare import comparison_rows, write_comparison

    evaluation = {
        "a": {
            "expert": {"accuracy": 0.9},
            "merged": {"accuracy": 0.5},
            "ties-m": {"accuracy": 0.6},
            "v": {"accuracy": 0.7},
        },
        "b": {
            "expert": {"accuracy": 0.8},
            "merged": {"accuracy": 0.6},
            "ties-m": {"accuracy": 0.5},
            "v": {"accuracy": 0.8},
        },
    }
    variants = [
        {
            "name": "v",
            "row": "v",
            "merge": {"method": "ties", "hyperparameters": {}},
            "repair": "featcal",
            "set": ["merge.method=ties"],
            "cost": {"merge_seconds": 1.5, "repair_seconds": 2.0, "peak_rss_mb": 900.0},
        }
    ]
    (row,) = comparison_rows(evaluation, variants, "merged")
    assert row["tasks"]["a"] == pytest.approx(
        {"accuracy": 70.0, "normalized": 70 / 0.9, "gap_closed": 50.0}
    )
    assert row["tasks"]["b"]["gap_closed"] == pytest.approx(100.0)
    # of the means: (0.75 − 0.55) / (0.85 − 0.55)
    assert row["mean"]["gap_closed"] == pytest.approx(100 * 0.2 / 0.3)
    assert row["mean"]["accuracy"] == pytest.approx(75.0)
    assert row["cost"]["total_seconds"] == pytest.approx(3.5)
    files = write_comparison(
        tmp_path / "cmp", run_name="r", rows=[row], reference="merged", record={"run": "r"}
    )
    assert "| `v` | 70.0 | 80.0 | 75.0 |" in files["compare.md"].read_text()
    assert json.loads(files["compare.json"].read_text())["variants"][0]["name"] == "v"
