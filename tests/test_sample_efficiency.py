"""The sample-efficiency curves of `featcal compare` (featcal_core.report.compare): the variants
that differ only in the calibration inputs per task form one curve of mean and per-task accuracy
against n, beside their merge and the experts; compare.md, compare.json, a PNG and a CSV that
`dvc plots` draws hold it; which variants share a curve (flows.compare.curve_key)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from pathlib import Path

import pytest

from featcal_core.params import load_params
from featcal_core.report.compare import (
    CURVE_FILES,
    comparison_rows,
    sample_efficiency,
    write_comparison,
)

ROOT = Path(__file__).resolve().parents[1]

EVALUATION = {
    "a": {
        "expert": {"accuracy": 0.9},
        "merged": {"accuracy": 0.5},
        "n8": {"accuracy": 0.7},
        "n32": {"accuracy": 0.75},
        "n256": {"accuracy": 0.8},
        "again32": {"accuracy": 0.1},
        "other": {"accuracy": 0.6},
    },
    "b": {
        "expert": {"accuracy": 0.8},
        "merged": {"accuracy": 0.6},
        "n8": {"accuracy": 0.6},
        "n32": {"accuracy": 0.7},
        "n256": {"accuracy": 0.7},
        "again32": {"accuracy": 0.1},
        "other": {"accuracy": 0.6},
    },
}


def _variant(name, repair="featcal", curve="k", n=32):
    return {
        "name": name,
        "row": "merged" if repair == "none" else name,
        "merge": {"method": "task_arithmetic", "hyperparameters": {"scale": 0.3}},
        "repair": repair,
        "set": [],
        "cost": {"merge_seconds": 1.0, "repair_seconds": 2.0, "peak_rss_mb": None},
        "curve": curve,
        "num_per_task": n,
        "merge_row": "merged",
    }


def _rows():
    variants = [
        _variant("ta", repair="none", n=32),  # the merge itself: no point of a curve
        _variant("n256", n=256),
        _variant("n8", n=8),
        _variant("n32", n=32),
        _variant("again32", n=32),  # a second variant at n 32: the first one is the point
        _variant("other", curve="alpha-1", n=32),  # alone on its curve: none drawn
    ]
    return comparison_rows(EVALUATION, variants, "merged")


def test_one_curve_of_the_variants_that_differ_only_in_n():
    (curve,) = sample_efficiency(_rows())
    assert curve["label"] == "featcal:task_arithmetic"
    assert curve["variants"] == ["n256", "n8", "n32", "again32"]
    assert [(p["n"], p["variant"]) for p in curve["points"]] == [
        (8, "n8"),
        (32, "n32"),
        (256, "n256"),
    ]
    assert [p["accuracy"] for p in curve["points"]] == pytest.approx([65.0, 72.5, 75.0])
    assert curve["points"][0]["tasks"] == pytest.approx({"a": 70.0, "b": 60.0})
    assert curve["merge"]["row"] == "merged"
    assert curve["merge"]["accuracy"] == pytest.approx(55.0)
    assert curve["merge"]["tasks"] == pytest.approx({"a": 50.0, "b": 60.0})
    assert curve["experts"]["accuracy"] == pytest.approx(85.0)


def test_no_curve_without_two_values_of_n(tmp_path):
    rows = [r for r in _rows() if r["name"] in ("ta", "n32", "other")]
    assert sample_efficiency(rows) == []
    files = write_comparison(tmp_path / "c", run_name="r", rows=rows, reference="merged", record={})
    assert not any(name in files for name in CURVE_FILES)
    assert not (tmp_path / "c" / "sample_efficiency.csv").exists()
    assert "Sample efficiency" not in files["compare.md"].read_text()


def test_the_report_holds_the_curve_and_dvc_plots_draws_it(tmp_path):
    out = tmp_path / "compare"
    files = write_comparison(out, run_name="r", rows=_rows(), reference="merged", record={})
    assert files["sample_efficiency.png"].read_bytes()[:4] == b"\x89PNG"
    table = files["compare.md"].read_text()
    assert "| 8 | 65.0 (`n8`) |" in table and "| 256 | 75.0 (`n256`) |" in table
    assert "| merge | 55.0 (`merged`) |" in table and "| experts | 85.0 |" in table
    document = json.loads(files["compare.json"].read_text())
    assert [p["n"] for p in document["sample_efficiency"][0]["points"]] == [8, 32, 256]

    text = files["sample_efficiency.csv"].read_text()
    lines = list(csv.DictReader(io.StringIO(text)))
    label = "featcal:task_arithmetic"
    assert [line["n"] for line in lines] == ["8", "32", "256"]
    assert [float(line[label]) for line in lines] == pytest.approx([65.0, 72.5, 75.0])
    assert [float(line[f"{label}/b"]) for line in lines] == pytest.approx([60.0, 70.0, 70.0])
    assert {float(line[f"merge:{label}"]) for line in lines} == {55.0}
    assert {float(line["experts/a"]) for line in lines} == {90.0}

    # `dvc plots show` reads the CSV as it is: x = n, y = the curve
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    shown = subprocess.run(
        [
            "dvc",
            "plots",
            "show",
            "--json",
            "-x",
            "n",
            "-y",
            label,
            str(out / "sample_efficiency.csv"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    found = json.loads(shown.stdout[shown.stdout.index("{") :])
    points = [
        (int(p["n"]), float(p[label]))
        for plot in found["data"].values()
        for entry in plot
        for p in entry["content"]["data"]["values"]
    ]
    assert points == [(8, 65.0), (32, 72.5), (256, 75.0)]


def test_curve_key_differs_only_where_the_settings_do():
    """On a shipped compare file whose models come from a zoo (not filled in yet): the variants
    that differ only in n share a key, every other variant setting separates them."""
    from featcal.flows.compare import curve_key, variant_params

    params = load_params(ROOT / "params" / "compare-text-paper.yaml")
    assert params.models is None  # the zoo fills them in later
    keys = {v.name: curve_key(variant_params(params, v.name)) for v in params.compare.variants}
    curve = {name for name, key in keys.items() if key == keys["ta.featcal"]}
    assert curve == {f"ta.featcal{n}" for n in ("", "-n2", "-n8", "-n128", "-n256")}
    assert len(set(keys.values())) == len(keys) - 4
    base = variant_params(params, "ta.featcal")
    for change in (
        "featcal.alpha=1.0",
        "featcal.lam=0.5",
        "featcal.heads=true",
        "merge.hyperparameters={scale: 0.5}",
        "repair.method=regmean",
    ):
        assert curve_key(base.with_overrides([change])) != keys["ta.featcal"], change
