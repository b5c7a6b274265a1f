"""Records cover what featcal writes and say what ran: `featcal params export` never writes into a
model folder the params name; every file a run writes is under its markers' digests, so
`featcal lineage` names an edited or deleted one; every calibration record says the precision
asked for, the one that ran and whether the device ran it natively or emulated."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_pipeline import write_params

import factories
from featcal_cli.main import main
from featcal_core.io.markers import MARKER, read_marker
from featcal_core.io.run_lock import LOCK_NAME
from featcal_core.precision import native_bfloat16

# ------------------------------------------------------------------------------------ helpers


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(*folders: Path) -> dict[str, str]:
    """Every entry below `folders`: files by sha256, links by target, folders as such."""
    found = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink():
                found[str(path)] = f"link:{os.readlink(path)}"
            elif path.is_file():
                found[str(path)] = _sha256(path)
            else:
                found[str(path)] = "dir"
    return found


def _lineage_fails(path: Path, capsys, *needles: str) -> str:
    """`featcal lineage PATH` exits 2 with one line holding every needle, and never says that
    everything verifies; returns that line."""
    capsys.readouterr()
    assert main(["lineage", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "all recorded inputs verify" not in out, out
    line = err.strip()
    assert line.startswith("featcal: error: ") and "\n" not in line, err
    for needle in needles:
        assert needle in line, (needle, line)
    return line


#: the fields every record holds for the precision of what it records
PRECISION_FIELDS = ("precision", "precision_requested", "precision_reason", "precision_execution")


def _bfloat16_execution() -> str:
    native, _ = native_bfloat16(torch.device("cpu"))
    return "native" if native else "emulated"


def _assert_precision(fields: dict, ran: str, requested: str, execution: str) -> None:
    assert {key: fields.get(key) for key in PRECISION_FIELDS} == {
        "precision": ran,
        "precision_requested": requested,
        "precision_reason": fields.get("precision_reason"),
        "precision_execution": execution,
    }, fields
    assert fields["precision_reason"], fields


@pytest.fixture(scope="module")
def run(tmp_path_factory, prefect_api):
    """A tiny `featcal run --set featcal.precision=bfloat16` (CLIP base, two experts)."""
    root = tmp_path_factory.mktemp("records")
    params = write_params(root)
    proc = factories.run_featcal(root, params, prefect_api, "--set", "featcal.precision=bfloat16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, params


# ----------------------------------------------------------------- params export: model folders


def test_params_export_never_writes_into_a_model_folder_the_params_name(
    tmp_path, capsys, monkeypatch
):
    """--out an expert's or the base's config.json (--overwrite or not), a new file inside an
    expert's folder, a Hub model's snapshot in the cache (a link into its blobs), or the
    default params.yaml run from inside an expert's folder: one line naming the file, the model
    folder and the params key, exit 2, every model file byte for byte unchanged."""
    pool = factories.clip_zoo(tmp_path / "pool")
    hub = tmp_path / "hub"
    repo = hub / "models--org--beta-expert"
    commit = "0" * 40
    blob = repo / "blobs" / "c0ffee"
    blob.parent.mkdir(parents=True)
    blob.write_text('{"model_type": "clip_vision_model"}\n')
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(Path("..", "..", "blobs", "c0ffee"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    params = {
        "run": {"name": "mine", "results_dir": str(tmp_path / "results")},
        "models": {
            "base": str(pool.base),
            "experts": {"alpha": str(pool.experts["alpha"]), "beta": "org/beta-expert"},
            "hub_cache": str(hub),
        },
        "tasks": {
            task: {
                "calibration": {"path": str(pool.calib[task])},
                "evaluation": {"path": str(pool.calib[other])},
            }
            for task, other in (("alpha", "beta"), ("beta", "alpha"))
        },
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    watched = (pool.base, pool.experts["alpha"], pool.experts["beta"], pool.merged, hub)
    before = _tree(*watched)
    export = ["params", "export", "--params", str(path)]
    alpha = pool.experts["alpha"].resolve()
    for out, overwrite, folder, key in (
        (pool.experts["alpha"] / "config.json", True, alpha, "models.experts.alpha"),
        (pool.experts["alpha"] / "config.json", False, alpha, "models.experts.alpha"),
        (pool.base / "config.json", True, pool.base.resolve(), "models.base"),
        (pool.experts["alpha"] / "params.yaml", False, alpha, "models.experts.alpha"),
        (snapshot / "config.json", True, snapshot.resolve(), "models.experts.beta"),
        (repo / "refs" / "main", True, repo.resolve(), "models.experts.beta"),
    ):
        args = [*export, "--out", str(out), *(["--overwrite"] if overwrite else [])]
        factories.cli_fails(
            args, capsys, f"--out {out} ", f"model folder {folder},", key, "choose another --out"
        )
        assert _tree(*watched) == before
    monkeypatch.chdir(pool.experts["alpha"])  # the default --out params.yaml, there
    factories.cli_fails([*export, "--overwrite"], capsys, "model folder", "models.experts.alpha")
    assert _tree(*watched) == before

    monkeypatch.chdir(tmp_path)  # any other file: written, and replaced with --overwrite
    out = tmp_path / "exported.yaml"
    out.write_text("run: {name: other}\n")
    assert main([*export, "--out", str(out), "--overwrite"]) == 0
    assert yaml.safe_load(out.read_text())["models"]["experts"]["beta"] == "org/beta-expert"
    assert _tree(*watched) == before


# ------------------------------------------------------------- every file a run writes, covered


def _state_manifest_lists(cache: Path, path: Path) -> bool:
    """Whether `path`, in the calibration flow's resume cache `cache`, is a block state file
    that its state's manifest lists with this sha256 (each state verifies by its manifest)."""
    parts = path.relative_to(cache).parts
    if len(parts) < 3 or parts[0] != "states":
        return False
    manifest = cache / "states" / parts[1] / "manifest.json"
    if path == manifest:
        return True
    files = json.loads(manifest.read_text())["files"]
    return files.get(Path(*parts[2:]).as_posix()) == _sha256(path)


def _uncovered(results: Path) -> list[str]:
    """Every file below `results` that no digest covers: each must be listed, with its sha256,
    in the marker of its nearest marked folder; in the calibration flow's resume cache (a
    results folder of its own below, `calibration/`), its block state's manifest lists it
    (Prefect's own result files there, `prefect-results/`, point at those states)."""
    found = []
    for path in sorted(results.rglob("*")):
        if (path.is_dir() and not path.is_symlink()) or path.name in (MARKER, LOCK_NAME):
            continue
        folder = next(f for f in path.parents if read_marker(f) is not None)
        marker = read_marker(folder)
        assert marker is not None
        if folder != results and marker.get("kind"):  # the resume cache
            if path.parent.name == "prefect-results" or _state_manifest_lists(folder, path):
                continue
        name = path.relative_to(folder).as_posix()
        if marker["files"].get(name) != _sha256(path):
            found.append(f"{path.relative_to(results)} (not in {folder / MARKER})")
    return found


def test_every_file_a_run_writes_is_under_the_digests_and_lineage_names_a_changed_one(
    run, tmp_path, capsys
):
    """After a real run, every file below the results folder is listed with its sha256 by a
    marker (the class-embedding cache in heads/ too); in a copy, an edited metrics.json (the
    DVC metric) or plots/accuracy.csv (what `dvc plots` draws), or a deleted evaluation.json,
    makes `featcal lineage` exit 2 naming that file; the run's own folder stays as it was."""
    root, _ = run
    results = root / "results"
    assert _uncovered(results) == []
    for name in ("metrics.json", "evaluation.json", "models.lock.json", "provenance.json"):
        assert name in read_marker(results)["files"], name
    assert list((results / "plots").iterdir()) and read_marker(results / "plots") is not None
    assert read_marker(results / "heads")["files"]  # the class-embedding cache is listed
    before = _tree(results)

    copy = tmp_path / "results"
    shutil.copytree(results, copy, symlinks=True)
    capsys.readouterr()
    assert main(["lineage", str(copy)]) == 0
    assert "all recorded inputs verify" in capsys.readouterr().out

    metrics = copy / "metrics.json"
    kept = metrics.read_bytes()
    headline = json.loads(kept)
    edited = {
        key: (value + 0.5 if isinstance(value, float) else value) for key, value in headline.items()
    }
    assert edited != headline
    metrics.write_text(json.dumps(edited, indent=2) + "\n")
    _lineage_fails(copy, capsys, str(metrics), "changed")
    metrics.write_bytes(kept)

    accuracy = copy / "plots" / "accuracy.csv"
    kept = accuracy.read_bytes()
    accuracy.write_text(accuracy.read_text().replace("\nalpha,", "\nalpha,9", 1))
    assert accuracy.read_bytes() != kept
    _lineage_fails(copy, capsys, str(accuracy), "changed")
    accuracy.write_bytes(kept)
    capsys.readouterr()
    assert main(["lineage", str(copy)]) == 0  # restored: verifies again

    (copy / "evaluation.json").unlink()
    _lineage_fails(copy, capsys, str(copy / "evaluation.json"), "missing")
    _lineage_fails(copy / "calibrated", capsys, str(copy / "evaluation.json"), "missing")
    assert _tree(results) == before


# -------------------------------------------------------------- precision in every record


def test_every_calibration_record_says_the_precision_asked_for_what_ran_and_how(
    run, tmp_path, prefect_api
):
    """bfloat16 asked for through `featcal calibrate --precision`, `featcal run --set
    featcal.precision=` and a `compare:` variant's own overrides, and on float64 checkpoints:
    featcal.json says what was asked for, what ran, why, and native or emulated (a CPU without
    avx512_bf16/AMX emulates bfloat16); so do evaluation.json's rows; the pools unchanged."""
    bf16 = _bfloat16_execution()
    for dtype, ran, execution in (
        (torch.float32, "bfloat16", bf16),
        (torch.float64, "float64", "native"),
    ):
        pool = factories.clip_zoo(tmp_path / f"pool-{dtype}", dtype=dtype)
        inputs = (pool.base, pool.merged, *pool.experts.values(), *pool.calib.values())
        before = _tree(*inputs)
        out = tmp_path / f"calibrated-{dtype}"
        assert main([*pool.cli_args(out), "--precision", "bfloat16"]) == 0
        record = json.loads((out / "featcal.json").read_text())
        _assert_precision(record["hyperparameters"], ran, "bfloat16", execution)
        assert _tree(*inputs) == before
    float64 = json.loads((tmp_path / "calibrated-torch.float64" / "featcal.json").read_text())
    assert float64["hyperparameters"]["precision_reason"] == "the checkpoints are float64"

    root, params = run  # featcal run --set featcal.precision=bfloat16
    record = json.loads((root / "results" / "calibrated" / "featcal.json").read_text())
    _assert_precision(record["hyperparameters"], "bfloat16", "bfloat16", bf16)
    evaluation = json.loads((root / "results" / "evaluation.json").read_text())
    for row in evaluation.values():
        for result in row.values():
            _assert_precision(result, "bfloat16", "bfloat16", bf16)

    # featcal compare: a variant that asks for bfloat16 itself, on a copy of the run's results
    shutil.copytree(root / "results", tmp_path / "results", symlinks=True)
    data = yaml.safe_load(params.read_text())
    data["run"].update(name="cmp", results_dir=str(tmp_path / "results"))
    data["tracking"] = {"enabled": False}
    data["compare"] = {"variants": [{"name": "bf16", "set": ["featcal.precision=bfloat16"]}]}
    compare = tmp_path / "compare.yaml"
    compare.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": prefect_api}
    proc = subprocess.run(
        [sys.executable, "-m", "featcal_cli.main", "compare", "--params", str(compare)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    variant = tmp_path / "results" / "variants" / "bf16" / "calibrated" / "featcal.json"
    _assert_precision(
        json.loads(variant.read_text())["hyperparameters"], "bfloat16", "bfloat16", bf16
    )
    table = json.loads((tmp_path / "reports" / "cmp-compare" / "compare.json").read_text())
    for row in table["evaluation"].values():
        for result in row.values():
            assert set(PRECISION_FIELDS) <= set(result), result
