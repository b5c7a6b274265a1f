"""The repair registry (featcal_core.repair.registry): the built-in repairs, one validation of
every option, the generated commands, and a repair registered at run time running through
`featcal run` and `featcal compare` without any change to the flows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_pipeline import write_params

from featcal_core.errors import FeatCalError
from featcal_core.repair.registry import available, get, register, unregister

HERE = Path(__file__).resolve().parent


def test_the_built_in_repairs_and_what_they_declare():
    assert available()[:5] == ["featcal", "regmean", "surgery", "adamerging", "none"]
    outputs = {name: get(name).output for name in available()[:5]}
    assert outputs == {
        "featcal": "checkpoint",
        "regmean": "checkpoint",
        "surgery": "task_modules",
        "adamerging": "checkpoint",
        "none": "none",
    }
    assert get("featcal").blockwise and get("featcal").command is None
    assert [name for name in available() if get(name).command] == [
        "regmean",
        "surgery",
        "adamerging",
    ]
    with pytest.raises(FeatCalError, match="unknown repair 'nope'.*featcal, regmean"):
        get("nope")


def test_a_name_is_taken_once_and_built_ins_stay():
    copy = get("none")
    with pytest.raises(ValueError, match="'none' is taken"):
        register(type(copy)(**{**copy.__dict__, "summary": "other"}))
    with pytest.raises(ValueError, match="built-in"):
        unregister("featcal")


@pytest.mark.parametrize(
    ("name", "values", "message"),
    [
        (
            "regmean",
            {"regmean_alpha": 1.5},
            r"regmean --alpha must be a number in \[0, 1\] \(got 1.5\)",
        ),
        ("surgery", {"surgery_rank": 0}, r"surgery --rank must be a whole number >= 1 \(got 0\)"),
        ("surgery", {"surgery_rank": 2.5}, r"--rank must be a whole number >= 1 \(got 2.5\)"),
        ("surgery", {"surgery_lr": 0.0}, r"--lr must be a number > 0 \(got 0.0\)"),
        ("adamerging", {"adamerging_lr": float("nan")}, r"--lr must be a number > 0 \(got nan\)"),
        ("regmean", {"pooled_weights": "yes"}, r"--pooled-weights must be true or false"),
    ],
)
def test_every_option_is_checked_by_one_rule(name, values, message):
    repair = get(name)
    with pytest.raises(FeatCalError, match=message):
        repair.check(values, where=lambda option: f"--{option.flag}")
    filled = repair.check({}, where=str)
    assert filled == {o.key: o.default for o in repair.options}


def test_surgery_rank_is_bounded_by_the_feature_width():
    import torch

    from featcal_core.repair.surgery import fit_surgery

    z = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(FeatCalError, match="rank 5 .*exceeds the width 4.*at most 4"):
        fit_surgery(
            z, z, rank=5, steps=1, lr=1e-3, batch_size=4, generator=torch.Generator().manual_seed(0)
        )
    module, _ = fit_surgery(
        z, z, rank=4, steps=1, lr=1e-3, batch_size=4, generator=torch.Generator().manual_seed(0)
    )
    assert module is not None


def test_the_generated_commands_take_each_option_as_a_flag(capsys):
    from featcal_cli.main import build_parser

    parser = build_parser()
    for name in ("regmean", "surgery", "adamerging"):
        with pytest.raises(SystemExit):
            parser.parse_args([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for option in get(name).options:
            assert f"--{option.flag}" in text
        assert f"params: repair.{get(name).params_options()[0].key}" in text


def _run_with_plugin(tmp_path, env, *args):
    """`featcal ARGS` in a process that registered tests/dummy_repair.py's `copy` first."""
    program = (
        "import sys, dummy_repair; from featcal_cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**env, "PYTHONPATH": os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", program, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )


def test_a_registered_repair_runs_through_run_and_compare(tmp_path, prefect_api):
    params_path = write_params(tmp_path)
    data = yaml.safe_load(params_path.read_text())
    data["run"]["name"] = "plugin"
    data["featcal"]["heads"] = False
    data["compare"] = {
        "variants": [
            {"name": "copied", "set": ["repair.method=copy"]},
            {"name": "plain", "set": ["repair.method=none"]},
        ]
    }
    params_path.write_text(yaml.safe_dump(data))
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "PREFECT_API_URL": prefect_api,
    }

    reads = tmp_path / "reads.txt"
    proc = _run_with_plugin(
        tmp_path,
        {**env, "FEATCAL_TEST_READS": str(reads)},
        "run",
        "--params",
        str(params_path),
        "--set",
        "repair.method=copy",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert reads.read_text().splitlines() == [str(params_path)]  # the params file, read once
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert summary["repair"]["method"] == "copy"
    calibrated = tmp_path / "results" / "calibrated"
    assert json.loads((calibrated / "copy.json").read_text())["tasks"] == ["alpha", "beta"]
    evaluation = json.loads((tmp_path / "results" / "evaluation.json").read_text())
    for task in ("alpha", "beta"):  # the copy is the merge: the same accuracy
        rows = evaluation[task]
        assert rows["calibrated"]["accuracy"] == rows["merged"]["accuracy"]

    proc = _run_with_plugin(tmp_path, env, "compare", "--params", str(params_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "reports" / "plugin-compare" / "compare.json").read_text())
    rows = {v["name"]: v for v in record["variants"]}
    assert rows["copied"]["repair"] == "copy"
    for task in ("alpha", "beta"):
        assert rows["copied"]["tasks"][task]["accuracy"] == pytest.approx(
            rows["plain"]["tasks"][task]["accuracy"]
        )

    # without the plugin the same params are refused before any work, naming the key
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "featcal_cli.main",
            "run",
            "--params",
            str(params_path),
            "--set",
            "repair.method=copy",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "unknown repair 'copy'" in proc.stderr
