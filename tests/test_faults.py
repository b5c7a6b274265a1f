"""Fault injection: the guarantees of docs/reliability.md, each proved by one test or more (the
solver fallbacks are proved in test_fallbacks.py, the served API's token in test_serve.py, the
row-level hygiene checks in test_calibration_hygiene.py). Whole `featcal run`s use the tests'
shared Prefect server; the kills are real SIGKILLs at named places (featcal_core.io.failpoints),
the runs real Prefect flows, MLflow stores and safetensors checkpoints."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_pipeline import write_params

import factories
from featcal_cli.main import main
from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import MARKER, OLD_TAG, TEMP_TAG, guarded_directory, sweep
from featcal_core.io.run_lock import run_lock

# ------------------------------------------------------------------------------------ helpers


def _run(
    tmp_path: Path,
    params: Path,
    api: str,
    *extra: str,
    failpoint: str | None = None,
    background: bool = False,
):
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_API_URL": api,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    env.pop("FEATCAL_FAILPOINT", None)
    if failpoint is not None:
        env["FEATCAL_FAILPOINT"] = failpoint
    cmd = [sys.executable, "-m", "featcal_cli.main", "run", "--params", str(params), *extra]
    if background:
        return subprocess.Popen(
            cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)


def _weights(results: Path) -> dict[str, bytes]:
    """Every weight file and calibration set file of a results folder, by relative path."""
    found = {}
    for sub in ("merged", "calibrated", "calibration_sets"):
        for path in sorted((results / sub).rglob("*")):
            if path.is_file() and (path.suffix == ".safetensors" or sub == "calibration_sets"):
                found[str(path.relative_to(results))] = path.read_bytes()
    return found


def _accuracies(results: Path) -> dict:
    table = json.loads((results / "evaluation.json").read_text())
    return {
        task: {model: row.get("accuracy") for model, row in models.items()}
        for task, models in table.items()
        if isinstance(models, dict)
    }


def _stat_tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _leftovers(*roots: Path) -> list[str]:
    return [
        str(p)
        for root in roots
        if root.exists()
        for p in root.rglob("*")
        if TEMP_TAG in p.name or OLD_TAG in p.name or p.name == "work"
    ]


def _one_line(proc, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("featcal: error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A params file (tiny CLIP base, two experts, two image datasets) and a lone reference run."""
    root = tmp_path_factory.mktemp("faults")
    params = write_params(root)
    return root, params


@pytest.fixture(scope="module")
def reference(project, prefect_api):
    root, params = project
    proc = _run(root, params, prefect_api)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = root / "results"
    return _weights(results), _accuracies(results)


def _fresh(project, tmp_path: Path, **changes) -> Path:
    """The project's params with results and reports below tmp_path (and `changes` applied)."""
    root, params = project
    data = yaml.safe_load(params.read_text())
    data["run"]["results_dir"] = str(tmp_path / "results")
    for key, value in changes.items():
        section, _, name = key.partition(".")
        data.setdefault(section, {})[name] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --------------------------------------------------- SIGKILL at each step, then a clean rerun


def test_sigkill_at_every_step_then_rerun_is_bitwise_identical(
    project, reference, tmp_path, prefect_api
):
    params = _fresh(project, tmp_path)
    results, reports = tmp_path / "results", tmp_path / "reports"
    # each run dies at a later place; the next one recovers what the last one left behind
    for point in (
        "commit:alpha",
        "commit:merged",
        "commit:state",
        "commit:calibrated",
        "commit:evaluation.json",
        "commit:e2e",
    ):
        proc = _run(tmp_path, params, prefect_api, failpoint=point)
        assert proc.returncode == -9, (point, proc.returncode, proc.stderr[-2000:])
        assert _leftovers(results, reports), f"{point}: the kill left no temporary files"
    # what a killed statistics pass leaves in the state cache is swept too
    dead = 2**22 + 4321
    (results / "calibration" / "states" / f".statistics{TEMP_TAG}{dead}-0000").mkdir(parents=True)
    proc = _run(tmp_path, params, prefect_api)
    assert proc.returncode == 0, proc.stderr[-3000:]
    weights, accuracies = reference
    assert _weights(results) == weights
    assert _accuracies(results) == accuracies
    assert _leftovers(results, reports) == []
    assert (reports / "e2e" / "report.md").is_file()


# --------------------------------------------------------------------- two runs on one folder


def test_second_run_stops_before_writing_and_the_first_is_unchanged(
    project, reference, tmp_path, prefect_api
):
    params = _fresh(project, tmp_path)
    other = tmp_path / "other.yaml"  # a different merge scale, the same results folder
    other.write_text(params.read_text().replace("scale: 0.3", "scale: 0.5"))
    release = tmp_path / "release"
    first = _run(
        tmp_path, params, prefect_api, failpoint=f"commit:merged:wait={release}", background=True
    )
    lock = tmp_path / "results" / ".featcal.lock"
    deadline = time.monotonic() + 300
    try:
        # the failpoint creates release.waiting once the first run is paused there, before
        # renaming merged/ into place
        while not release.with_name(f"{release.name}.waiting").exists():
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        before = _stat_tree(tmp_path / "results")
        for second_params in (params, other):
            proc = _run(tmp_path, second_params, prefect_api)
            line = _one_line(proc, "is in use by another featcal run", f"pid {first.pid}")
            assert str(tmp_path / "results") in line
        assert _stat_tree(tmp_path / "results") == before  # the second runs wrote nothing
        assert json.loads(lock.read_text())["pid"] == first.pid
    finally:
        release.touch()
    _, err = first.communicate(timeout=900)
    assert first.returncode == 0, err[-3000:]
    weights, accuracies = reference
    assert _weights(tmp_path / "results") == weights
    assert _accuracies(tmp_path / "results") == accuracies
    provenance = json.loads((tmp_path / "results" / "provenance.json").read_text())
    assert provenance["params"] == "e2e"


def _children(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is `pid` (Linux /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().decode()
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    return found


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_sigterm_stops_the_run_removes_its_temporaries_and_prefects_server(project, tmp_path):
    """`featcal run` on Prefect's embedded server, stopped by SIGTERM while it writes merged/:
    it exits 143, leaves no temporary output and no lock held, and the temporary Prefect server
    it started is gone (before, the server outlived the killed run)."""
    params = _fresh(project, tmp_path)
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "FEATCAL_FAILPOINT": f"commit:merged:wait={tmp_path / 'never'}",
    }
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "featcal_cli.main", "run", "--params", str(params)]
    run = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    results = tmp_path / "results"
    deadline = time.monotonic() + 300
    try:
        while not any(TEMP_TAG in p.name and "merged" in p.name for p in results.glob(".*")):
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never reached the merge"
            time.sleep(0.05)
        servers = [p for p, cmdline in _children(run.pid).items() if "uvicorn" in cmdline]
        assert servers, "no temporary Prefect server under the run"
        run.terminate()
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 143, err[-3000:]
    assert _leftovers(results, tmp_path / "reports") == []
    assert not (results / "merged").exists()
    with run_lock(results, "the test"):  # free again
        pass
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in servers if _alive(pid)], "the Prefect server was left running"


def test_run_lock_names_its_holder_and_a_dead_holder_is_taken_over(tmp_path):
    code = (
        "import sys, time; from featcal_core.io.run_lock import run_lock\n"
        f"with run_lock({str(tmp_path)!r}):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FeatCalError, match=f"pid {holder.pid} on "):
            with run_lock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(tmp_path):  # the kernel released the dead holder's lock
        with run_lock(tmp_path):  # re-entrant within one process
            assert json.loads((tmp_path / ".featcal.lock").read_text())["pid"] == os.getpid()


# ------------------------------------------------------------ corrupted and deleted artifacts


def test_corrupt_or_deleted_merged_checkpoint_is_merged_again(
    project, reference, tmp_path, prefect_api, capsys, monkeypatch
):
    params = _fresh(project, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")  # in-process
    # a complete run's results and report: the reference run's, copied (a run of these params)
    root, _ = project
    shutil.copytree(root / "results", tmp_path / "results", symlinks=True)
    shutil.copytree(root / "reports", tmp_path / "reports", symlinks=True)
    weights = tmp_path / "results" / "merged" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # a flipped byte in a tensor
    weights.write_bytes(bytes(data))
    # lineage of the calibrated model names the merged checkpoint that no longer verifies
    assert main(["lineage", str(tmp_path / "results" / "calibrated")]) == 2
    proc = _run(tmp_path, params, prefect_api)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "does not verify" in proc.stderr
    assert _weights(tmp_path / "results") == reference[0]
    weights.unlink()
    proc = _run(tmp_path, params, prefect_api)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _weights(tmp_path / "results") == reference[0]
    assert main(["lineage", str(tmp_path / "results" / "calibrated")]) == 0
    # the single steps (the DVC stages) verify what they read: a changed calibration set, a
    # changed calibrated checkpoint, a changed locked expert
    results = tmp_path / "results"
    for damaged, command in (
        (next((results / "calibration_sets" / "alpha").glob("*.arrow")), "calibrate"),
        (results / "calibrated" / "model.safetensors", "evaluate"),
        (
            next(
                Path(yaml.safe_load(params.read_text())["models"]["experts"]["beta"]).glob(
                    "*.safetensors"
                )
            ),
            "merge",
        ),
    ):
        original = damaged.read_bytes()
        damaged.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        capsys.readouterr()
        assert main([command, "--params", str(params)]) == 2
        err = capsys.readouterr().err
        assert "does not verify" in err and damaged.name in err and err.count("\n") == 1, err
        damaged.write_bytes(original)


# ---------------------------------------------------------------------------- dangerous paths


@pytest.fixture
def zoo(tmp_path):
    return factories.clip_zoo(tmp_path / "clip")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("command", ["calibrate", "merge"])
def test_out_holding_the_inputs_is_refused_and_nothing_is_lost(zoo, command, capsys):
    folder = zoo.base.parent  # holds base, merged, experts and calibration sets
    (folder / "notes.txt").write_text("the user's own file")
    before = _snapshot(folder)
    args = (
        zoo.cli_args(folder)
        if command == "calibrate"
        else [
            "merge",
            "--base",
            str(zoo.base),
            "--method",
            "task_arithmetic",
            "--out",
            str(folder),
            *[a for t, p in zoo.experts.items() for a in ("--expert", f"{t}={p}")],
        ]
    )
    capsys.readouterr()
    assert main(args + ["--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds the input" in err and "\n" not in err, err
    assert _snapshot(folder) == before


def test_out_equal_to_merged_is_refused(zoo, capsys):
    before = _snapshot(zoo.merged)
    args = zoo.cli_args(zoo.merged) + ["--overwrite"]
    capsys.readouterr()
    assert main(args) == 2
    assert "is an input of this command" in capsys.readouterr().err
    assert _snapshot(zoo.merged) == before


@pytest.mark.parametrize("name", ["../../x", "/tmp/abs", "a/b", ".hidden"])
def test_task_names_that_are_paths_are_refused(zoo, tmp_path, name, capsys):
    expert = zoo.experts["alpha"]
    before = _snapshot(expert)
    args = [
        "calibrate",
        "--base",
        str(zoo.base),
        "--merged",
        str(zoo.merged),
        "--expert",
        f"{name}={expert}",
        "--calib",
        f"{name}={zoo.calib['alpha']}",
        "--out",
        str(tmp_path / "out"),
        "--heads",
    ]
    factories.cli_fails(args, capsys, "task name", "may hold only letters")
    assert _snapshot(expert) == before


def test_results_dir_of_the_user_is_refused(project, tmp_path, capsys):
    results = tmp_path / "mine"
    (results / "merged").mkdir(parents=True)
    (results / "merged" / "weights.bin").write_text("user data")
    (results / "evaluation.json").write_text("{}")
    (results / "thesis.tex").write_text("user data")
    before = _snapshot(results)
    params = _fresh(project, tmp_path)
    for command in (["run"], ["merge"], ["download"]):
        capsys.readouterr()
        assert main([*command, "--params", str(params), "--set", f"run.results_dir={results}"]) == 2
        err = capsys.readouterr().err
        assert "did not create" in err and str(results) in err, err
    assert _snapshot(results) == before


def test_results_root_and_run_name_outside_reports_are_refused(project, tmp_path, capsys):
    params = _fresh(project, tmp_path)
    for override, needle in (
        ("run.results_dir=/", "filesystem root"),
        ("run.name=../../x", "may hold only letters"),
        (f"run.results_dir={Path.home()}", "home folder"),
    ):
        capsys.readouterr()
        assert main(["run", "--params", str(params), "--set", override]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_user_file_inside_a_marked_output_is_never_deleted(tmp_path):
    out = tmp_path / "merged"
    with guarded_directory(out, overwrite=False) as tmp:
        (tmp / "model.safetensors").write_bytes(b"weights")
    (out / "mine.txt").write_text("user data")
    with pytest.raises(FeatCalError, match="mine.txt"):
        with guarded_directory(out, overwrite=True) as tmp:
            (tmp / "model.safetensors").write_bytes(b"new")
    assert (out / "mine.txt").read_text() == "user data"
    assert (out / "model.safetensors").read_bytes() == b"weights"


def test_replacing_an_output_never_leaves_its_path_missing(tmp_path):
    from featcal_core.io.outputs import exchange

    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "x").write_text("first")
    (second / "x").write_text("second")
    if not exchange(first, second):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here: the two-rename swap is used")
    assert (first / "x").read_text() == "second" and (second / "x").read_text() == "first"


def test_a_swap_cut_between_its_renames_restores_the_old_output(tmp_path):
    out = tmp_path / "calibrated"
    with guarded_directory(out, overwrite=False) as tmp:
        (tmp / "model.safetensors").write_bytes(b"old")
    dead = 2**22 + 12345  # no such process
    old = tmp_path / f".calibrated{OLD_TAG}{dead}-abcd"
    os.replace(out, old)  # what a kill between the two renames leaves
    (tmp_path / f".calibrated{TEMP_TAG}{dead}-ef01").mkdir()
    sweep(out)
    assert (out / "model.safetensors").read_bytes() == b"old" and (out / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibrated"]


# --------------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--alpha", "5", "less than or equal to 1"),
        ("--alpha", "-1", "greater than or equal to 0"),
        ("--lam", "-1", "greater than or equal to 0"),
        ("--rho", "-1", "greater than or equal to 0"),
        ("--rho", "nan", "--rho: 'nan' is not a number"),
        ("--eps", "-1", "greater than or equal to 0"),
    ],
)
def test_calibrate_flags_have_the_params_bounds(zoo, tmp_path, flag, value, needle, capsys):
    args = zoo.cli_args(tmp_path / "out") + [flag, value]
    factories.cli_fails(args, capsys, flag, needle)


@pytest.mark.parametrize(
    "values", [{"alpha": 5}, {"rho": -1}, {"lam": float("nan")}, {"eps": True}, {"alpha": "0.5"}]
)
def test_library_params_have_the_same_bounds(values):
    from featcal_core import FeatCalParams

    with pytest.raises(FeatCalError, match=f"FeatCal {next(iter(values))} must be"):
        FeatCalParams(**values)


@pytest.mark.parametrize(
    "override,needle",
    [
        ("featcal.num_per_task=true", "valid integer"),
        ("featcal.lam=.inf", "finite"),
        ("merge.hyperparameters.scale=.nan", "finite"),
        ("merge.hyperparameters.top_k=20", "top_k: hyperparameter 'top_k' is not used by"),
        ("featcal.heads=1", "valid boolean"),
    ],
)
def test_params_are_strict(project, tmp_path, override, needle, capsys):
    params = _fresh(project, tmp_path)
    capsys.readouterr()
    assert main(["run", "--params", str(params), "--set", override]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1, err


def test_calibrating_on_a_copy_of_the_test_split_is_refused(project, tmp_path, capsys):
    import datasets

    root, _ = project
    copy = tmp_path / "looks_like_train"  # the test rows, saved as a plain Dataset
    datasets.load_from_disk(str(root / "data_alpha"))["test"].save_to_disk(str(copy))
    params = _fresh(project, tmp_path)
    data = yaml.safe_load(params.read_text())
    data["tasks"]["alpha"]["calibration"] = {"path": str(copy), "split": None}
    params.write_text(yaml.safe_dump(data))
    assert main(["download", "--params", str(params)]) == 0
    capsys.readouterr()
    assert main(["calib-set", "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert "also rows of the evaluation data" in err and err.count("\n") == 1, err
    assert not (tmp_path / "results" / "calibration_sets" / "alpha").exists()


# ---------------------------------------------------------------------- failures are one line


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    return proc.returncode == 0


@pytest.mark.parametrize(
    "options,needle",
    [("size=64k", "No space left on device"), ("ro,size=1m", "Read-only file system")],
)
def test_full_or_read_only_disk_is_one_line_and_leaves_nothing(zoo, tmp_path, options, needle):
    mount = tmp_path / "disk"
    if not _mount_tmpfs(mount, options):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        out = mount / "merged"
        args = [
            "merge",
            "--base",
            str(zoo.base),
            "--method",
            "task_arithmetic",
            "--out",
            str(out),
            *[a for t, p in zoo.experts.items() for a in ("--expert", f"{t}={p}")],
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "featcal_cli.main", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        line = _one_line(proc, needle)
        assert str(out) in line
        assert list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_bad_input_inside_the_flow_is_one_line_without_traceback(project, tmp_path, prefect_api):
    root, _ = project
    broken = tmp_path / "broken_expert"
    shutil.copytree(root / "expert_alpha", broken)
    (broken / "config.json").write_text("{broken")
    params = _fresh(project, tmp_path)
    # caught by the preflight, before the flow starts: one line too
    proc = _run(tmp_path, params, prefect_api, "--set", f"models.experts.alpha={broken}")
    _one_line(proc, "models.experts.alpha", str(broken / "config.json"), "not valid JSON")
    # weights the preflight does not read (a truncated safetensors header): the flow's step
    shutil.copy(root / "expert_alpha" / "config.json", broken / "config.json")
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    proc = _run(tmp_path, params, prefect_api, "--set", f"models.experts.alpha={broken}")
    _one_line(proc, str(broken / "model.safetensors"))
    assert "download" in proc.stderr or "resolv" in proc.stderr, proc.stderr[-3000:]


def test_heads_without_heads_fails_before_calibrating(zoo, tmp_path, capsys, caplog):
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="featcal_core"):
        factories.cli_fails(zoo.cli_args(out) + ["--heads"], capsys, "classifier.safetensors")
    assert not out.exists()
    calibrated = [r.getMessage() for r in caplog.records if "mean drift" in r.getMessage()]
    assert calibrated == []  # not a single block was calibrated before the refusal


def test_null_images_in_a_calibration_set_are_one_line(zoo, tmp_path, capsys):
    import datasets

    broken = tmp_path / "broken_set"
    data = datasets.load_from_disk(str(zoo.calib["alpha"]))
    data = data.cast_column("image", datasets.Image(decode=False))
    rows = data.to_dict()
    rows["image"][0] = None
    datasets.Dataset.from_dict(rows, features=data.features).save_to_disk(str(broken))
    zoo.calib["alpha"] = broken
    factories.cli_fails(zoo.cli_args(tmp_path / "out"), capsys, str(broken), "image")


# ---------------------------------------------------------------- what stays untouched


def test_shared_leftovers_of_live_processes_are_kept(tmp_path):
    out = tmp_path / "merged"
    mine = tmp_path / f".merged{TEMP_TAG}{os.getpid()}-0000"
    mine.mkdir()
    sweep(out)
    assert mine.is_dir()  # a live writer's temporary folder is never swept


# ------------------------------------------ ownership, symlinks, records


def _tree(folder: Path) -> dict[str, str]:
    """Every entry below `folder`: files by sha256, links by target, folders as such."""
    import hashlib

    found = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = f"link:{os.readlink(path)}"
        elif path.is_file():
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[name] = "dir"
    return found


def _copy_run(project, reference, tmp_path: Path, monkeypatch) -> Path:
    """The reference run's results (and its report) copied below tmp_path, which becomes the
    working directory; returns params naming that copy, tracking off."""
    root, _ = project
    shutil.copytree(root / "results", tmp_path / "results", symlinks=True)
    shutil.copytree(root / "reports", tmp_path / "reports", symlinks=True)
    monkeypatch.chdir(tmp_path)
    return _fresh(project, tmp_path, **{"tracking.enabled": False})


_refused = factories.cli_fails


def test_a_users_folder_with_the_layouts_names_is_refused_whole(project, zoo, tmp_path, capsys):
    """A folder holding only entries named like the results layout (plots/, calibration/work/,
    work/) is the user's: every command refuses it before writing a byte (no marker, no lock
    added); the calibration flow's --results-dir too, before Prefect starts."""
    mine = tmp_path / "mine"
    for name, text in (
        ("plots/accuracy.csv", "task,mine\n"),
        ("calibration/work/thesis.tex", "\\section{mine}"),
        ("work/thesis.tex", "\\section{mine}"),
        ("merged/notes.md", "mine"),
    ):
        (mine / name).parent.mkdir(parents=True, exist_ok=True)
        (mine / name).write_text(text)
    before = _tree(mine)
    params = _fresh(project, tmp_path)
    for command in (["run"], ["download"], ["report"], ["evaluate"]):
        _refused(
            [*command, "--params", str(params), "--set", f"run.results_dir={mine}"],
            capsys,
            "did not create",
            str(mine),
        )
    args = zoo.cli_args(tmp_path / "calibrated") + ["--results-dir", str(mine)]
    _refused(args, capsys, "--results-dir", "did not create")
    _refused(
        zoo.cli_args(tmp_path / "calibrated") + ["--results-dir", str(mine / "work")],
        capsys,
        "--results-dir",
        "did not create",
    )
    assert _tree(mine) == before
    assert not (tmp_path / "calibrated").exists()


def test_symlinks_in_a_results_folder_are_never_written_through(
    project, reference, tmp_path, capsys, monkeypatch
):
    """results/plots replaced by a link to the user's folder, and the run lock by a link to a
    user's file: the rerun refuses in one line and the user's files are unchanged."""
    params = _copy_run(project, reference, tmp_path, monkeypatch)
    results, user = tmp_path / "results", tmp_path / "user"
    (user / "plots").mkdir(parents=True)
    (user / "plots" / "accuracy.csv").write_text("the user's numbers\n")
    (user / "notes.txt").write_text("the user's notes\n")
    before = _tree(user)
    shutil.rmtree(results / "plots")
    (results / "plots").symlink_to(user / "plots")
    _refused(["report", "--params", str(params)], capsys, "symlink", "plots")
    assert _tree(user) == before
    (results / "plots").unlink()

    (results / ".featcal.lock").unlink()
    (results / ".featcal.lock").symlink_to(user / "notes.txt")
    _refused(["report", "--params", str(params)], capsys, "run lock", "symlink")
    assert _tree(user) == before
    (results / ".featcal.lock").unlink()
    capsys.readouterr()
    assert main(["report", "--params", str(params)]) == 0  # the links gone, the rerun works
    assert (results / "plots" / MARKER).is_file()


def test_edited_records_are_named_by_lineage_and_refused_by_report(
    project, reference, tmp_path, capsys, monkeypatch
):
    """An accuracy edited in evaluation.json, or a number in report.md: `featcal lineage` names
    the file that changed (exit 2); `featcal report` refuses the edited evaluation."""
    params = _copy_run(project, reference, tmp_path, monkeypatch)
    results, report = tmp_path / "results", tmp_path / "reports" / "e2e"
    capsys.readouterr()
    assert main(["lineage", str(results / "calibrated")]) == 0  # as written: verifies
    evaluation = results / "evaluation.json"
    table = json.loads(evaluation.read_text())
    table["alpha"]["calibrated"]["accuracy"] = 0.99
    evaluation.write_text(json.dumps(table, indent=2) + "\n")
    _refused(["lineage", str(results / "calibrated")], capsys, "evaluation.json", "changed")
    _refused(["report", "--params", str(params)], capsys, "evaluation.json", "changed")
    markdown = report / "report.md"
    assert "99.0" not in markdown.read_text()
    shutil.copy(root_evaluation := project[0] / "results" / "evaluation.json", evaluation)
    assert json.loads(evaluation.read_text()) == json.loads(root_evaluation.read_text())
    capsys.readouterr()
    assert main(["lineage", str(report)]) == 0
    markdown.write_text(markdown.read_text().replace("| alpha", "| alpha (99.0 %)", 1))
    _refused(["lineage", str(report)], capsys, "report.md", "changed")


def test_code_digests_out_is_checked(zoo, tmp_path, capsys, monkeypatch):
    """`featcal code-digests --out` never writes into /, the home folder, a model folder featcal
    wrote (an input) or a user's folder (its merge.sha256 kept); a new folder works, and
    again."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    user = tmp_path / "user"
    user.mkdir()
    (user / "merge.sha256").write_text("the user's digest\n")
    written = tmp_path / "written"  # a model folder featcal wrote (marked, as zoo experts are)
    with guarded_directory(written, overwrite=False) as tmp:
        (tmp / "config.json").write_text("{}")
    watched = {p: _tree(p) for p in (tmp_path / "home", user, zoo.experts["alpha"], written)}
    for out, needle in (
        ("/", "filesystem root"),
        (str(tmp_path / "home"), "home folder"),
        (str(zoo.experts["alpha"]), "did not create"),
        (str(written), "not as code-digests"),
        (str(user), "did not create"),
    ):
        _refused(["code-digests", "--out", out], capsys, "--out", needle)
    assert {p: _tree(p) for p in watched} == watched
    for _ in range(2):
        capsys.readouterr()
        assert main(["code-digests", "--out", str(tmp_path / "code")]) == 0
    assert (tmp_path / "code" / "merge.sha256").is_file() and (tmp_path / "code" / MARKER).is_file()


def test_spill_dir_inside_an_input_is_refused(zoo, tmp_path, capsys):
    """`calibrate --spill-dir` inside an expert folder is refused before any work."""
    expert = zoo.experts["alpha"]
    before = _tree(expert)
    args = zoo.cli_args(tmp_path / "calibrated") + ["--spill-dir", str(expert / "spill")]
    _refused(args, capsys, "--spill-dir", "lies inside the input")
    assert _tree(expert) == before and not (tmp_path / "calibrated").exists()


def test_a_full_disk_at_the_run_lock_is_one_line(project, tmp_path, capsys):
    """The lock file cannot be written (disk full): one line naming it, no traceback."""
    from featcal_core.io.outputs import prepare_root

    mount = tmp_path / "disk"
    if not _mount_tmpfs(mount, "size=64k"):
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        results = prepare_root(mount / "results")
        filler = mount / "filler"
        with pytest.raises(OSError):
            filler.write_bytes(b"x" * (1 << 20))  # now full
        params = _fresh(project, tmp_path)
        _refused(
            ["download", "--params", str(params), "--set", f"run.results_dir={results}"],
            capsys,
            "run lock",
            str(results / ".featcal.lock"),
            "No space left",
        )
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_ownership_edge_cases_of_the_review(tmp_path, monkeypatch):
    """DVC's cache.type symlink (records are links into the cache: they verify by content); a
    folder of featcal outputs without a dvc.lock is not adopted as a results folder; an old
    results folder's plots/ is marked only when it holds the plot files alone."""
    from featcal_core.io.outputs import check_root, prepare_root, verify_file, write_json
    from featcal_core.report.plot_data import write_plot_data

    monkeypatch.chdir(tmp_path)
    results = prepare_root(tmp_path / "results")
    record = write_json(results / "evaluation.json", {"alpha": {}})
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(record, cache / "md5")
    record.unlink()
    record.symlink_to(cache / "md5")  # as `dvc checkout` leaves it with cache.type symlink
    assert verify_file(record) is None
    (cache / "md5").write_text('{"alpha": {"calibrated": {"accuracy": 0.99}}}\n')
    assert "changed" in verify_file(record)

    ckpts = tmp_path / "ckpts"  # `featcal merge --out ckpts/merged`, then ckpts as results_dir
    with guarded_directory(ckpts / "merged", overwrite=False) as tmp:
        (tmp / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(FeatCalError, match="did not create"):
        check_root(ckpts)

    for extra, marked in (((), True), (("mine.txt",), False)):
        old = tmp_path / f"old-{marked}"  # an earlier featcal's results folder
        (old / "plots").mkdir(parents=True)
        (old / MARKER).write_text(json.dumps({"tool": "featcal", "files": {}}))
        (old / ".featcal.lock").write_text("{}")
        for name in ("accuracy.csv", *extra):
            (old / "plots" / name).write_text("task,x\n")
        prepare_root(old)
        assert ((old / "plots" / MARKER).is_file()) == marked
        if not marked:
            with pytest.raises(FeatCalError, match="not written by featcal"):
                write_plot_data(old / "plots", {"alpha": {}}, None)
            assert (old / "plots" / "mine.txt").read_text() == "task,x\n"


def test_a_spill_dir_above_the_inputs_is_taken(zoo, tmp_path):
    """--spill-dir may hold the inputs (only a new hidden subfolder is made there, then
    removed); inside an input it is refused (test above)."""
    from featcal_core import calibrate

    before = _tree(zoo.base.parent)
    out = tmp_path / "calibrated"
    calibrate(
        zoo.base,
        zoo.merged,
        zoo.experts,
        zoo.calib,
        out,
        num_per_task=4,
        spill_dir=zoo.base.parent,
        progress=False,
    )
    assert (out / "featcal.json").is_file()
    assert _tree(zoo.base.parent) == before  # nothing left in the spill folder
