"""Process lifecycle: a featcal command's helper
processes die with it, its temporary Prefect API takes the project's token, and SIGTERM ends it
cleanly in every phase.

Real `featcal` subprocesses, paused at a named place (featcal_core.io.failpoints: `wait=FILE`
creates `FILE.waiting` once there), then killed by a real SIGKILL or SIGTERM. The local Prefect
server a command starts carries `FEATCAL_PREFECT_SERVER_OF=<its pid>` in its environment; a scan
of /proc for that marker finds it (and anything it started). The measured time from SIGTERM to
exit is reported (`reported figures`); the assertion is a generous bound.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_pipeline import write_params
from test_zoo import _toy_images

import factories
from featcal.flows.prefect_server import SERVER_OF, TOKEN_FILE
from featcal_core.io.outputs import OLD_TAG, TEMP_TAG, verify_output
from featcal_core.io.run_lock import run_lock

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

#: the bound asserted on SIGTERM → exit (the guarantee is about 1 s; a loaded CI host is slow)
BOUND_S = 10.0
STOPPED = "featcal: error: stopped by SIGTERM"


# ------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The tiny CLIP project of test_pipeline (base, two experts, two image datasets) and one
    PREFECT_HOME shared by the module's commands (its database is migrated once)."""
    root = tmp_path_factory.mktemp("lifecycle")
    return write_params(root), root / "prefect"


def _params(project, tmp_path: Path, data: dict | None = None) -> Path:
    """The project's params (or `data`) with results and reports below tmp_path."""
    params, _ = project
    data = data or yaml.safe_load(params.read_text())
    data["run"]["results_dir"] = str(tmp_path / "results")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _start(
    project,
    tmp_path: Path,
    args: list[str],
    *,
    api: str | None = None,
    failpoint: str | None = None,
) -> subprocess.Popen:
    """`featcal ARGS` in the background from tmp_path; api: PREFECT_API_URL (None: unset, the
    command starts its own server)."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(project[1]),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "FEATCAL_FAILPOINT"):
        env.pop(name, None)
    if api is not None:
        env["PREFECT_API_URL"] = api
    if failpoint is not None:
        env["FEATCAL_FAILPOINT"] = failpoint
    return subprocess.Popen(
        [sys.executable, "-m", "featcal_cli.main", *args],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_until(proc: subprocess.Popen, ready, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            pytest.fail(
                f"exited ({proc.returncode}) before {what}: {proc.communicate()[1][-3000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"never reached {what}")
        time.sleep(0.05)


def _paused(proc: subprocess.Popen, barrier: Path, what: str) -> None:
    _wait_until(proc, Path(f"{barrier}.waiting").exists, what)


def _marked(pid: int) -> list[int]:
    """The running processes whose environment names `pid` as the one that started them."""
    marker = f"{SERVER_OF}={pid}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # ended meanwhile, or not ours to read
        if marker in environ and state != "Z":
            found.append(int(entry.name))
    return found


def _gone(pid: int, timeout_s: float = 30) -> list[int]:
    """What still runs of the processes `pid` started after `timeout_s` (killed, then returned)."""
    deadline = time.monotonic() + timeout_s
    while (left := _marked(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for leftover in left:
        os.kill(leftover, signal.SIGKILL)
    return left


def _api(proc: subprocess.Popen) -> str:
    """The API URL of the local server `proc` started (from the server's command line)."""
    (server,) = _marked(proc.pid)
    argv = Path(f"/proc/{server}/cmdline").read_bytes().decode().split("\0")
    return f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/api"


def _status(api_url: str, auth: str | None) -> int:
    """The status of POST /flows/filter with basic auth `auth` (None: no Authorization)."""
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(
        f"{api_url}/flows/filter", data=b"{}", method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def _sigterm(proc: subprocess.Popen, record_property, phase: str) -> str:
    """SIGTERM `proc`; returns its stderr after checking it ended as featcal promises: within
    BOUND_S (the time is reported), exit status 143, the one featcal line last, no traceback."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    elapsed = time.monotonic() - started
    record_property(f"report: SIGTERM to exit, {phase} (s)", round(elapsed, 2))
    print(f"SIGTERM to exit, {phase}: {elapsed:.2f} s")
    assert proc.returncode == 143, (proc.returncode, err[-3000:])
    assert elapsed < BOUND_S, (elapsed, err[-3000:])
    assert err.strip().splitlines()[-1].startswith(STOPPED), err[-3000:]
    assert "Traceback" not in err and "Crash detected" not in err, err[-3000:]
    return err


def _leftovers(*roots: Path) -> list[str]:
    return [
        str(p)
        for root in roots
        if root.exists()
        for p in root.rglob("*")
        if TEMP_TAG in p.name or OLD_TAG in p.name
    ]


def _released(results: Path) -> None:
    with run_lock(results, "the test"):  # taken at once: the stopped run holds it no more
        pass


# ----------------------------------------------------------- SIGKILL leaves no Prefect server


def test_sigkilled_calibrate_leaves_no_prefect_server(tmp_path, project, record_property):
    """`featcal calibrate --results-dir` without PREFECT_API_URL starts its own Prefect server
    (Prefect's own temporary server, which it used before, outlived a SIGKILL for 12+ min);
    killed outright mid-calibration, the server goes with it (the parent-death signal)."""
    zoo = factories.clip_zoo(tmp_path / "pool")
    barrier = tmp_path / "never"
    args = zoo.cli_args(tmp_path / "out") + ["--results-dir", str(tmp_path / "results")]
    proc = _start(project, tmp_path, args, failpoint=f"commit:state:wait={barrier}")
    try:
        _paused(proc, barrier, "a block state's commit")
        servers = _marked(proc.pid)
        assert servers, "no local Prefect server under featcal calibrate --results-dir"
        assert _status(_api(proc), None) == 401  # its API takes the project's token too
    finally:
        killed = time.monotonic()
        proc.kill()
        proc.communicate()
    assert _gone(proc.pid) == [], "the Prefect server outlived the SIGKILLed command"
    record_property(
        "report: SIGKILL to no server left, calibrate --results-dir (s)",
        round(time.monotonic() - killed, 2),
    )


# ----------------------------------------------- the API's token, then SIGTERM during a block


def test_run_api_takes_the_token_and_sigterm_mid_block_stops_it_all(
    tmp_path, project, record_property
):
    """A plain `featcal run`'s temporary API refuses requests without the project's token (as
    `featcal serve`'s does); SIGTERM during a block's calibration (inside the calibration flow's
    Prefect task) ends the run at once: exit 143, one line, no temporaries, lock released, and
    its Prefect server stopped."""
    params, home = _params(project, tmp_path), project[1]
    barrier = tmp_path / "never"
    proc = _start(
        project,
        tmp_path,
        ["run", "--params", str(params)],
        failpoint=f"commit:state:wait={barrier}",
    )
    try:
        _paused(proc, barrier, "a block state's commit")
        api_url = _api(proc)
        token = (home / TOKEN_FILE).read_text().strip()
        assert _status(api_url, None) == 401
        assert _status(api_url, "featcal:wrong-token") == 401
        assert _status(api_url, f"featcal:{token}") == 200
        assert _leftovers(tmp_path / "results"), "paused before the state's rename"
    except BaseException:
        proc.kill()
        raise
    _sigterm(proc, record_property, "during a block calibration (featcal run)")
    results = tmp_path / "results"
    assert _leftovers(results, tmp_path / "reports") == []
    assert not (results / "calibrated").exists()
    _released(results)
    assert _gone(proc.pid, timeout_s=5) == [], "the Prefect server outlived the stopped run"


# -------------------------------------------------------------------- SIGTERM in other phases


def test_sigterm_at_the_run_lock(tmp_path, project, record_property):
    """Stopped while it holds the run lock, before the flow (and its server) starts."""
    params = _params(project, tmp_path)
    barrier = tmp_path / "never"
    proc = _start(
        project, tmp_path, ["run", "--params", str(params)], failpoint=f"locked:run:wait={barrier}"
    )
    _paused(proc, barrier, "the run lock")
    _sigterm(proc, record_property, "at the run lock (featcal run)")
    assert _leftovers(tmp_path / "results") == []
    _released(tmp_path / "results")


def test_sigterm_just_after_merged_appears(tmp_path, project, prefect_api, record_property):
    """Stopped the moment merged/ is renamed into place (the run goes on to MLflow tags and the
    calibration flow; Prefect's own handler would swallow the signal here and exit 0): merged/
    stays complete, nothing else is left half-written."""
    params = _params(project, tmp_path)
    results = tmp_path / "results"
    proc = _start(project, tmp_path, ["run", "--params", str(params)], api=prefect_api)
    _wait_until(proc, (results / "merged").exists, "merged/")
    _sigterm(proc, record_property, "just after merged/ appears (featcal run)")
    assert _leftovers(results, tmp_path / "reports") == []
    assert verify_output(results / "merged") is None
    _released(results)


def test_sigterm_during_zoo_training(tmp_path, project, prefect_api, record_property):
    """Stopped while the zoo's first expert trains (a Prefect task of the flow): the zoo being
    built (a temporary folder beside its target) is removed."""
    toy = {
        "left": _toy_images(tmp_path / "left", vertical=False, seed=0),
        "top": _toy_images(tmp_path / "top", vertical=True, seed=1),
    }
    data = {
        "run": {"name": "toy"},
        "zoo": {
            "preset": "vision",
            "name": "toy",
            "dir": str(tmp_path / "zoo"),
            "datasets": {t: str(p) for t, p in toy.items()},
            "pretrain_steps": 2,
            "expert_steps": 25,
        },
        "featcal": {"num_per_task": 8, "batch_size": 8},
    }
    params = _params(project, tmp_path, data)
    barrier = tmp_path / "never"
    proc = _start(
        project,
        tmp_path,
        ["run", "--params", str(params)],
        api=prefect_api,
        failpoint=f"train:left:wait={barrier}",
    )
    _paused(proc, barrier, "the expert's training")
    assert _leftovers(tmp_path), "the zoo is built in a temporary folder"
    _sigterm(proc, record_property, "during zoo training (featcal run)")
    assert _leftovers(tmp_path) == []
    assert not (tmp_path / "zoo").exists()
    _released(tmp_path / "results")


def test_api_auth_string_is_generated_once_by_concurrent_commands(tmp_path):
    """Two commands starting together on a new PREFECT_HOME get the same complete token (the
    file is linked into place once written: no one reads it half-written)."""
    code = (
        "import sys; from featcal.flows.prefect_server import api_auth_string; "
        "print(api_auth_string(sys.argv[1]))"
    )
    home = tmp_path / "prefect"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(home)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    tokens = {out.strip() for out, _ in outputs}
    assert len(tokens) == 1 and len(tokens.pop()) > 40
    assert sorted(p.name for p in home.iterdir()) == [TOKEN_FILE]


def test_commands_starting_together_on_a_fresh_home_all_get_a_server(tmp_path):
    """Two commands start their local servers at the same moment on one new PREFECT_HOME:
    without the start-up lock their database migrations race and a server exits with status 3
    (seen in 1 of 3 trials of two starts); with it each waits its turn and all answer."""
    home = tmp_path / "prefect"
    script = (
        "from featcal.flows.environment import command_api, command_scope\n"
        "with command_scope():\n    with command_api():\n        print('served')\n"
    )
    env = {**os.environ, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert all(code == 0 and out.strip() == "served" for code, out, _ in results), results
