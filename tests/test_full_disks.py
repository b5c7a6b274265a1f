"""A full (or read-only) disk under each place a featcal command writes: Prefect's home, the
MLflow store, the results folder. Each ends in one `featcal: error:` line naming the place and
the fix, exit 2, with nothing half-written left there. The disks are real tmpfs mounts, filled
to the last byte (skipped where no tmpfs can be mounted); the commands are real `featcal`
processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_pipeline import write_params

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import OLD_TAG, TEMP_TAG


def _mount(path: Path, options: str) -> None:
    """A tmpfs at `path`; skips the test where none can be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def _fill(folder: Path, leave: int = 0) -> None:
    """Fill the disk under `folder`, leaving `leave` bytes free (0: to the last byte)."""
    total = os.statvfs(folder)
    free = total.f_bavail * total.f_frsize
    with open(folder / "filler", "wb", buffering=0) as handle:
        try:
            if leave:
                handle.write(b"x" * (free - leave))
            else:
                while True:
                    handle.write(b"x" * (1 << 12))
        except OSError:
            pass


def _featcal(cwd: Path, env: dict[str, str], *args: str, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-m", "featcal_cli.main", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


def _only_line(returncode: int, stderr: str, *needles: str) -> str:
    """The one line on stderr, which is featcal's, naming every needle."""
    lines = stderr.strip().splitlines()
    assert returncode == 2 and len(lines) == 1, (returncode, stderr[-3000:])
    assert lines[0].startswith("featcal: error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A params file (tiny CLIP base, two experts, two image datasets) and its compare twin,
    one FeatCal variant."""
    root = tmp_path_factory.mktemp("full-disks")
    params = write_params(root)
    data = yaml.safe_load(params.read_text())
    data["run"]["name"] = "cmp"
    data["compare"] = {"variants": [{"name": "ta-featcal", "set": []}]}
    compare = root / "compare.yaml"
    compare.write_text(yaml.safe_dump(data))
    return params, compare


def _env(tmp_path: Path, **values: str) -> dict[str, str]:
    """The command's environment: its own Prefect home and MLflow store, no Prefect server
    (the command starts its own) unless `values` name one."""
    env = {**os.environ}
    env.pop("PREFECT_API_URL", None)
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return {**env, **values}


@pytest.mark.parametrize(
    "options,problem,fix",
    [
        ("size=64k", "has no space left", "free space there"),
        ("ro,size=1m", "cannot be written", "make it writable"),
    ],
)
def test_a_full_prefect_home_is_one_line_naming_it(project, tmp_path, options, problem, fix):
    """The command's local Prefect server would exit at once ("status 3"): PREFECT_HOME (on
    the full disk, a home used before: its token is there) is checked before it starts, and
    named with the fix; nothing is written there."""
    from featcal.flows.prefect_server import TOKEN_FILE, api_auth_string

    params, _ = project
    mount = tmp_path / "disk"
    _mount(mount, options)
    try:
        home = mount / "prefect"
        if not options.startswith("ro"):
            api_auth_string(home)
            _fill(mount)
        env = _env(tmp_path, PREFECT_HOME=str(home))
        results = f"run.results_dir={tmp_path / 'results'}"
        code, err = _finish(
            _featcal(tmp_path, env, "run", "--params", str(params), "--set", results)
        )
        _only_line(code, err, f"PREFECT_HOME {home} {problem}", fix, "point PREFECT_HOME at")
        kept = [] if options.startswith("ro") else ["filler", f"prefect/{TOKEN_FILE}"]
        assert _files(mount) == kept
    finally:
        _unmount(mount)


def test_a_prefect_server_that_exits_on_a_nearly_full_home_names_it(tmp_path):
    """A home with room for the check but not for the server's database: the server exits at
    start-up, and the line names the home, its free space and the fix."""
    from featcal.flows.prefect_server import local_server

    mount = tmp_path / "disk"
    _mount(mount, "size=1m")
    try:
        home = mount / "prefect"
        home.mkdir()
        _fill(mount, leave=256 << 10)
        with pytest.raises(FeatCalError) as caught:
            with local_server(120, home=home, temporary=True):
                pass
        message = str(caught.value)
        assert "exited with status" in message and f"PREFECT_HOME {home} has only" in message
        assert "MiB free" in message and "point PREFECT_HOME at" in message
    finally:
        _unmount(mount)


def test_a_full_tracking_store_prints_only_featcals_line(project, tmp_path, prefect_api):
    """The parent run cannot be written: no traceback (Prefect's failed flow run, MLflow's SQL
    store), one line naming the store's file and the fix; the store keeps what it held."""
    import mlflow

    from featcal.tracking.store import ensure_experiment

    params, _ = project
    mount = tmp_path / "disk"
    _mount(mount, "size=16m")
    try:
        uri = f"sqlite:///{mount / 'mlflow.db'}"
        ensure_experiment("featcal", uri, str(tmp_path / "artifacts"))  # the store, migrated
        _fill(mount)
        env = _env(tmp_path, MLFLOW_TRACKING_URI=uri, PREFECT_API_URL=prefect_api)
        results = f"run.results_dir={tmp_path / 'results'}"
        code, err = _finish(
            _featcal(tmp_path, env, "run", "--params", str(params), "--set", results)
        )
        _only_line(
            code,
            err,
            "the MLflow tracking store failed (sqlite3.OperationalError: database or disk is "
            f"full) in {mount / 'mlflow.db'}; ",
            "free space on its filesystem",
            "MLFLOW_TRACKING_URI",
        )
        client = mlflow.MlflowClient(uri)
        experiment = client.get_experiment_by_name("featcal")
        assert experiment is not None
        assert client.search_runs([experiment.experiment_id]) == []
    finally:
        _unmount(mount)


def test_a_full_results_disk_in_compare_leaves_no_temporary_state(project, tmp_path, prefect_api):
    """The disk fills once the first calibration state is in place: the next state is never
    half-written (its temporary folder is removed), the line names it, and the state already
    in place still verifies."""
    from featcal_core.method.state import verify

    _, compare = project
    mount = tmp_path / "disk"
    barrier = tmp_path / "go"
    _mount(mount, "size=8m")
    proc = None
    try:
        env = _env(
            tmp_path,
            PREFECT_API_URL=prefect_api,
            FEATCAL_FAILPOINT=f"commit:state:wait={barrier}",
        )
        results = mount / "results"
        proc = _featcal(
            tmp_path,
            env,
            "compare",
            "--params",
            str(compare),
            "--set",
            f"run.results_dir={results}",
        )
        deadline = time.monotonic() + 600
        waiting = Path(f"{barrier}.waiting")
        while not waiting.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert waiting.exists(), _finish(proc, 60)[1][-3000:]
        _fill(mount)  # the stems state is written, about to be renamed into place
        barrier.touch()
        code, err = _finish(proc)
        assert code == 2, err[-3000:]
        line = err.strip().splitlines()[-1]
        assert line.startswith("featcal: error: cannot write calibration state "), line
        assert str(results / "variants" / "ta-featcal") in line and "free space" in line, line
        assert "Traceback" not in err, err[-3000:]
        leftovers = [p for p in mount.rglob("*") if TEMP_TAG in p.name or OLD_TAG in p.name]
        assert leftovers == []
        states = sorted(results.rglob("states/*"))
        assert states and all(verify(state) is not None for state in states), states
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        _unmount(mount)
