"""Refused before any work, with inputs and the user's files unchanged: a run lock that is a hard
link to a user's file, settings that cannot take effect (refit heads in a `select:` candidate or
beside a repair of per-task modules), and a device the machine lacks."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
import yaml

from featcal_core.errors import FeatCalError
from featcal_core.io.run_lock import LOCK_NAME, run_lock
from featcal_core.params import load_params


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_lock_hard_linked_to_a_users_file_is_refused(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("the user's own notes\n")
    before = _digest(mine)
    results = tmp_path / "results"
    results.mkdir()
    os.link(mine, results / LOCK_NAME)
    with pytest.raises(FeatCalError, match=r"is a hard link to another file.*remove it"):
        with run_lock(results):
            pass
    assert _digest(mine) == before and mine.stat().st_nlink == 2
    (results / LOCK_NAME).unlink()
    with run_lock(results):  # a lock of its own: taken
        pass
    assert _digest(mine) == before


def _params(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "p.yaml"
    data = {
        "run": {"results_dir": str(tmp_path / "results")},
        "models": {"base": "a/b", "experts": {"t": "a/c"}},
        "tasks": {
            "t": {
                "calibration": {"path": "d", "split": "train"},
                "evaluation": {"path": "d", "split": "test"},
            }
        },
        **sections,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_select_candidate_may_not_set_refit_heads(tmp_path):
    select = {
        "candidates": [{"name": "a", "set": ["featcal.heads=true"]}, {"name": "b", "set": []}]
    }
    with pytest.raises(FeatCalError, match="candidate 'a': a candidate may not set featcal.heads"):
        load_params(_params(tmp_path, select=select))


def test_refit_heads_beside_per_task_modules_are_refused_in_compare(tmp_path):
    from featcal.flows.compare import load_compare

    compare = {
        "variants": [
            {"name": "s", "set": ["repair.method=surgery", "featcal.heads=true"]},
            {"name": "f", "set": ["featcal.heads=true"]},
        ]
    }
    path = _params(tmp_path, compare=compare)
    with pytest.raises(
        FeatCalError,
        match="variant 's': featcal.heads=true has no effect with repair.method surgery",
    ):
        load_compare(str(path), [])
    compare["variants"] = compare["variants"][1:]  # FeatCal under refit heads: fine
    path = _params(tmp_path, compare=compare)
    _, variants = load_compare(str(path), [])
    assert variants["f"].featcal.heads


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_before_any_write(tmp_path):
    from featcal.flows.steps import Steps

    params = load_params(_params(tmp_path), ["featcal.device=cuda"])
    with pytest.raises(FeatCalError, match="featcal.device: cuda, but no CUDA device"):
        with Steps(params).session():
            pass
    assert not (tmp_path / "results").exists()
    with Steps(load_params(_params(tmp_path), ["featcal.device=auto"])).session():
        pass


@pytest.mark.parametrize(
    ("featcal", "sets", "key"),
    [
        ({"heads": "yes"}, [], "featcal.heads"),  # YAML 1.1's boolean: text in YAML 1.2
        ({"alpha": "'0.5'"}, [], "featcal.alpha"),  # a quoted number is text
        ({}, ["featcal.heads=on"], "featcal.heads"),
        ({}, ["featcal.alpha='0.5'"], "featcal.alpha"),
    ],
)
def test_params_read_as_yaml_1_2(tmp_path, featcal, sets, key):
    path = _params(tmp_path)
    text = path.read_text() + "featcal:\n" + "".join(f"  {k}: {v}\n" for k, v in featcal.items())
    path.write_text(text if featcal else path.read_text())
    with pytest.raises(FeatCalError, match=key):
        load_params(path, sets)


def test_numbers_and_booleans_of_yaml_1_2_are_read_as_such(tmp_path):
    path = _params(tmp_path)
    path.write_text(path.read_text() + "featcal:\n  alpha: 1e-1\n  heads: true\n  eps: 1E-9\n")
    featcal = load_params(path).featcal
    assert (featcal.alpha, featcal.heads, featcal.eps) == (0.1, True, 1e-9)


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def _project_with_lock(tmp_path: Path, cmd: str) -> tuple[Path, Path]:
    """A DVC project whose dvc.lock records results/metrics.json as an output of a stage running
    `cmd`; returns (results folder, the metrics file)."""
    (tmp_path / ".dvc").mkdir()
    results = tmp_path / "results"
    results.mkdir()
    metrics = results / "metrics.json"
    metrics.write_text('{"accuracy": 0.91}\n')
    lock = {
        "schema": "2.0",
        "stages": {
            "score": {
                "cmd": cmd,
                "outs": [{"path": "results/metrics.json", "md5": _md5(metrics), "size": 19}],
            }
        },
    }
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump(lock))
    return results, metrics


def test_a_results_folder_of_the_users_own_dvc_stage_is_refused(tmp_path):
    from featcal_core.io.outputs import prepare_root

    results, metrics = _project_with_lock(tmp_path, "python score.py --out results")
    before = _digest(metrics)
    with pytest.raises(FeatCalError, match=r"metrics\.json.*featcal's own stages.*new or empty"):
        prepare_root(results)
    assert _digest(metrics) == before and sorted(p.name for p in results.iterdir()) == [
        "metrics.json"
    ]


def test_a_results_folder_of_featcals_own_dvc_stage_is_adopted(tmp_path):
    from featcal_core.io.outputs import check_root

    results, _ = _project_with_lock(tmp_path, "featcal report --params params.yaml")
    assert set(check_root(results) or {}) == {"metrics.json"}


@pytest.mark.parametrize(
    ("cmd", "featcal"),
    [
        ("featcal report --params params.yaml", True),
        (["featcal heads --params p.yaml", "featcal evaluate --params p.yaml"], True),
        ("featcal download --params p.yaml && mkdir -p data/models/x", True),
        (".venv/bin/featcal calibrate", True),
        ("python -m featcal_cli.main merge --params p.yaml", True),
        ("featcal report && python plot.py", False),
        ("python score.py", False),
        ("mkdir -p out", False),
        ("featcal 'unclosed", False),
        (None, False),
    ],
)
def test_which_dvc_stages_are_featcals(cmd, featcal):
    from featcal_core.io.restored import featcal_command

    assert featcal_command(cmd) is featcal


def test_a_pulled_results_folder_without_its_dvc_lock_says_how_to_adopt_it(tmp_path):
    from featcal_core.io.outputs import prepare_root

    (tmp_path / ".git").mkdir()  # a project root without dvc.lock: the search stops here
    copied = tmp_path / "copied-results"
    copied.mkdir()
    for name in ("models.lock.json", "evaluation.json"):
        (copied / name).write_text("{}\n")
    before = {p.name: _digest(p) for p in copied.iterdir()}
    with pytest.raises(FeatCalError, match=r"did not create.*no dvc\.lock.*`dvc pull` restored it"):
        prepare_root(copied)
    assert {p.name: _digest(p) for p in copied.iterdir()} == before


def test_a_compare_checks_every_variant_folder_first_and_takes_emptied_ones(tmp_path):
    from test_pipeline import write_params

    from featcal.flows.compare import run_compare
    from featcal_core.io.outputs import check_root, prepare_root

    params_path = write_params(tmp_path)
    params = yaml.safe_load(params_path.read_text())
    params["compare"] = {
        "variants": [{"name": "first", "set": []}, {"name": "second", "set": ["featcal.alpha=0.5"]}]
    }
    params_path.write_text(yaml.safe_dump(params))
    results = prepare_root(tmp_path / "results")
    mine = results / "variants" / "second" / "calibrated" / "mine.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's own\n")
    before = sorted(p.relative_to(results) for p in results.rglob("*"))
    with pytest.raises(
        FeatCalError, match=r"variants/second.*did not create.*mine\.txt|calibrated"
    ):
        run_compare(params_path)
    # refused before the first variant's repair, the merge or the calibration sets
    assert sorted(p.relative_to(results) for p in results.rglob("*")) == before
    assert mine.read_text() == "the user's own\n"
    mine.unlink()  # the user removes the file and leaves its folder: nothing there to lose
    assert check_root(results / "variants" / "second") is None


def test_a_model_reference_that_is_no_folder_and_no_hub_id_is_named_as_typed(tmp_path, capsys):
    from featcal_cli.main import main

    code = main(
        ["merge", "--base", "org//name", "--expert", "a=org//x", "--out", str(tmp_path / "out")]
        + ["--method", "task_arithmetic"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--base 'org//name' does not exist" in err[0] and "not a Hub id" in err[0]
    assert not (tmp_path / "out").exists()


def test_a_results_folder_of_the_users_is_refused_as_such_before_what_it_holds(tmp_path):
    from featcal_core.io.outputs import check_root

    folder = tmp_path / "shared"
    (folder / "experts" / "a").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine\n")
    with pytest.raises(FeatCalError, match=r"folder featcal did not create"):
        check_root(folder, inputs=[folder / "experts" / "a"])
    results = tmp_path / "results"  # featcal's own, holding an input: refused for that
    results.mkdir()
    with pytest.raises(FeatCalError, match=r"holds the input"):
        check_root(results, inputs=[tmp_path / "results" / "in"])


def test_an_offline_hub_dataset_says_it_is_not_cached(monkeypatch):
    from featcal_core.data.source_rows import open_source

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(
        FeatCalError, match=r"tasks\.a\.calibration: Hub dataset .*owner/ds.* not in"
    ):
        open_source({"hub": "owner/ds", "split": "train"}, key="tasks.a.calibration")


def _tmpfs(path: Path, size: str) -> bool:
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    return done.returncode == 0


def _fill(folder: Path) -> None:
    with open(folder / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"x" * (1 << 16))
        except OSError:
            pass


def test_a_results_folder_on_a_full_disk_leaves_nothing_behind(tmp_path):
    import subprocess

    from featcal_core.io.outputs import prepare_root

    mount = tmp_path / "disk"
    if not _tmpfs(mount, "64k"):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        _fill(mount)
        with pytest.raises(FeatCalError, match=r"results"):
            prepare_root(mount / "runs" / "results")
        assert sorted(p.name for p in mount.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_tracking_store_is_one_line(tmp_path, monkeypatch, capsys):
    import subprocess

    import featcal_cli.main as cli
    from featcal.tracking.store import ensure_experiment

    mount = tmp_path / "disk"
    if not _tmpfs(mount, "16m"):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        uri = f"sqlite:///{mount / 'mlflow.db'}"
        ensure_experiment("featcal", uri, str(tmp_path / "artifacts"))  # the store, migrated
        _fill(mount)
        capsys.readouterr()  # the store's own start-up lines

        def tracks(args):  # the command's tracking store is full
            import mlflow

            client = mlflow.MlflowClient(uri)
            experiment = client.get_experiment_by_name("featcal")
            for number in range(2000):
                client.set_experiment_tag(experiment.experiment_id, f"k{number}", "x" * 5000)
            return 0

        import dataclasses

        table = {**cli.commands()}
        table["lineage"] = dataclasses.replace(table["lineage"], run=tracks)
        monkeypatch.setattr(cli, "commands", lambda: table)
        assert cli.main(["lineage", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "MLflow tracking store failed" in err[0], err
        assert "full" in err[0]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_users_file_listed_by_an_edited_marker_is_never_deleted(tmp_path):
    """A marker edited to list the user's own file, beside damaged weights: the replacement is
    refused in one line naming that file, which keeps its bytes; damaged weights alone are
    replaced (a rerun heals them)."""
    import json

    from featcal_core.io.markers import MARKER
    from featcal_core.io.outputs import guarded_directory

    out = tmp_path / "merged"
    for _ in range(2):  # written, then replaced: featcal's own files
        with guarded_directory(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"weights")
            (tmp / "README.md").write_text("card\n")
    weights = out / "model.safetensors"
    weights.write_bytes(b"damaged")
    notes = out / "my_notes.txt"
    notes.write_text("the user's notes\n")
    marker = json.loads((out / MARKER).read_text())
    marker["files"]["my_notes.txt"] = "0" * 64
    (out / MARKER).write_text(json.dumps(marker))
    with pytest.raises(FeatCalError, match=r"holds .*my_notes\.txt, which featcal did not write"):
        with guarded_directory(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"weights")
    assert notes.read_text() == "the user's notes\n" and weights.read_bytes() == b"damaged"
    # a card the user edited is theirs too
    notes.unlink()
    del marker["files"]["my_notes.txt"]
    (out / MARKER).write_text(json.dumps(marker))
    (out / "README.md").write_text("my edits\n")
    with pytest.raises(FeatCalError, match=r"README\.md, which featcal did not write"):
        with guarded_directory(out, overwrite=True):
            pass
    (out / "README.md").write_text("card\n")
    # the user's file listed with its true sha256: the new output does not write it, so the
    # replacement is refused once the work is done, the file kept
    notes.write_text("the user's notes\n")
    marker = json.loads((out / MARKER).read_text())
    marker["files"]["my_notes.txt"] = hashlib.sha256(notes.read_bytes()).hexdigest()
    (out / MARKER).write_text(json.dumps(marker))
    with pytest.raises(FeatCalError, match=r"holds my_notes\.txt, which the new output does not"):
        with guarded_directory(out, overwrite=True, inputs=[tmp_path / "base"]) as tmp:
            (tmp / "model.safetensors").write_bytes(b"weights")
            (tmp / "README.md").write_text("card\n")
    assert notes.read_text() == "the user's notes\n" and weights.read_bytes() == b"damaged"
    assert not [p for p in tmp_path.iterdir() if "featcal-tmp" in p.name]
    notes.unlink()
    with guarded_directory(out, overwrite=True) as tmp:  # damaged weights alone: replaced
        (tmp / "model.safetensors").write_bytes(b"weights")
        (tmp / "README.md").write_text("card\n")
    assert weights.read_bytes() == b"weights"
