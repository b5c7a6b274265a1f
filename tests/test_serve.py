"""`featcal serve --interval`: with no PREFECT_API_URL it starts and supervises a local Prefect
server, serves the pipeline as a deployment, and scheduled runs complete. The local server's API
refuses requests without the token kept (mode 0600) in PREFECT_HOME."""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from test_pipeline import write_params

from featcal.flows.prefect_server import TOKEN_FILE, api_auth_string, local_server
from featcal_core.errors import FeatCalError


def _post(api_url: str, path: str, body: dict, auth: str | None) -> tuple[int, object]:
    """POST `body` to the API with basic auth `auth` (None: no Authorization header)."""
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(
        f"{api_url}{path}", data=json.dumps(body).encode(), method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, None


def _completed_runs(api_url: str, auth: str) -> int:
    body = {"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
    status, runs = _post(api_url, "/flow_runs/filter", body, auth)
    assert status == 200, status
    # scheduled runs of the deployment, not their subflows
    return sum(
        1 for run in runs if run.get("deployment_id") and run.get("parent_task_run_id") is None
    )


def _default_sigint() -> None:
    """In the child before exec: SIGINT's default disposition, as a shell gives a foreground
    command (an ignored SIGINT is inherited across exec, and a suite started in the background
    by a non-interactive shell, `./scripts/test &`, runs with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _deployment_ready(api_url: str, auth: str | None) -> bool:
    """Whether the server lists the served deployment as READY (its runner polls for runs)."""
    body = {"deployments": {"name": {"any_": ["featcal-scheduled"]}}}
    status, found = _post(api_url, "/deployments/filter", body, auth)
    assert status == 200, status
    return any(d.get("status") == "READY" for d in found or [])


def _run_logs(api_url: str, auth: str) -> list[dict]:
    """The log lines of the completed flow runs (the scheduled runs and their subflows: this
    server serves this test alone), as the Prefect UI shows them."""
    body = {"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
    status, runs = _post(api_url, "/flow_runs/filter", body, auth)
    assert status == 200, status
    ids = [run["id"] for run in runs]
    status, logs = _post(
        api_url, "/logs/filter", {"logs": {"flow_run_id": {"any_": ids}}, "limit": 200}, auth
    )
    assert status == 200, status
    return logs


def test_serve_runs_on_a_schedule(tmp_path):
    params_path = write_params(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),
        PYTHONUNBUFFERED="1",
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
        # the runner asks the server for due runs every second (Prefect's default: every 10 s,
        # waited out before each run, as runs wait their turn: limit 1)
        PREFECT_RUNNER_POLL_FREQUENCY="1",
    )
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "featcal_cli.main",
                "serve",
                "--params",
                str(params_path),
                "--interval",
                "5",
            ],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
    api_url, completed, refused, triggered, logs = None, 0, None, None, []
    token_file = tmp_path / "prefect" / TOKEN_FILE
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if api_url is None:
                found = re.search(r"local Prefect server at (\S+)", log_path.read_text())
                api_url = found.group(1) if found else None
                if api_url:  # without the token the API refuses to list (or start) runs
                    refused = _post(api_url, "/flow_runs/filter", {}, None)[0]
                    auth = api_auth_string(token_file.parent)  # the token serve generated
            elif triggered is None and "start a run now" in log_path.read_text():
                # the printed trigger command, run as printed from a shell without featcal's env
                command = re.search(
                    r"start a run now, from any shell: (.*)", log_path.read_text()
                ).group(1)
                shell = {k: v for k, v in env.items() if not k.startswith("PREFECT_API")}
                triggered = subprocess.run(
                    ["bash", "-c", command],
                    env=shell,
                    cwd=tmp_path,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            elif (completed := _completed_runs(api_url, auth)) >= 2:
                logs = _run_logs(api_url, auth)
                break
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)  # serving stops; the supervised server is stopped too
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        leftovers = _outlived(_servers(api_url)) if api_url else []
    assert api_url, log_path.read_text()[-3000:]
    assert refused == 401
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert completed >= 2, log_path.read_text()[-3000:]
    assert triggered is not None and triggered.returncode == 0, triggered
    assert "Created flow run" in triggered.stdout, triggered.stdout[-2000:]
    assert "Your flow" not in log_path.read_text()  # Prefect's message, whose command fails
    assert not leftovers, "the supervised Prefect server outlived featcal serve"
    # a scheduled run runs in a process of its own: its featcal lines reach the Prefect UI too,
    # detail lines (per block) included
    featcal_lines = [entry["message"] for entry in logs if entry["name"].startswith("featcal")]
    assert any(m.startswith("block ") for m in featcal_lines), [e["name"] for e in logs]


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_serve_stopped_while_waiting_ends_normally(tmp_path, prefect_api, stop):
    """`featcal serve` waiting for its next run (a yearly cron), stopped by SIGTERM (on its own
    local server, which it stops too) or Ctrl-C (SIGINT; on the tests' shared server): exit
    status 0, one INFO line `stopped`, no error line; the trigger command it printed names an
    executable by its absolute path."""
    params_path = write_params(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONUNBUFFERED="1")
    if stop == "SIGINT":
        env["PREFECT_API_URL"] = prefect_api
    log_path = tmp_path / "serve.log"
    command = ["serve", "--params", str(params_path), "--cron", "0 0 1 1 *"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "featcal_cli.main", *command],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_default_sigint,
        )
    try:
        deadline = time.monotonic() + 240
        while "serving featcal-scheduled" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        api_url = re.search(r"local Prefect server at (\S+)", log_path.read_text())
        servers = _servers(api_url.group(1)) if api_url else []
        # Prefect's runner registers the deployment and starts polling after that line (seconds
        # on a loaded machine): the signal goes once the server marks the deployment READY
        api = api_url.group(1) if api_url else prefect_api
        auth = api_auth_string(tmp_path / "prefect") if api_url else None
        while not _deployment_ready(api, auth):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.5)
        time.sleep(2)
        proc.send_signal(getattr(signal, stop))
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert "error" not in text.lower() and "Traceback" not in text, text[-3000:]
    assert [line for line in text.splitlines() if line.endswith(" stopped")] == [
        text.strip().splitlines()[-1]
    ], text[-3000:]
    assert text.strip().splitlines()[-1].endswith("INFO featcal_cli.serve: stopped")
    trigger = re.search(r"start a run now, from any shell: (.*)", text).group(1)
    words = [w for w in shlex.split(trigger) if not re.match(r"^[A-Z_]+=", w)]
    assert Path(words[0]).is_absolute() and os.access(words[0], os.X_OK), trigger
    assert not _outlived(servers), "the local Prefect server outlived the stopped featcal serve"


def _servers(api_url: str) -> list[psutil.Process]:
    """The `prefect server start` processes listening on the port of `api_url`."""
    port = api_url.split(":")[2].split("/")[0]
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if "server" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])
    ]


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _outlived(servers: list[psutil.Process]) -> list[psutil.Process]:
    """The servers still running after 30 s (a server may still be shutting down; zombies,
    exited but not yet reaped, are gone); they are killed so that no test leaves one behind."""
    _, alive = psutil.wait_procs(servers, timeout=30)
    leftovers = [p for p in alive if _running(p)]
    for p in leftovers:
        p.kill()
    return leftovers


def test_supervised_server_dies_with_a_killed_featcal_serve(tmp_path):
    """Serving killed outright (SIGKILL: no cleanup runs) still takes its local server down."""
    script = (
        "import time\nfrom flows.prefect_server import local_server\n"
        "with local_server() as url:\n    print(url, flush=True)\n    time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        api_url = proc.stdout.readline().strip()
        assert api_url.startswith("http://127.0.0.1:"), "the local server did not start"
        servers = _servers(api_url)
        assert servers
    finally:
        proc.kill()
        proc.wait()
    assert not _outlived(servers), "the local Prefect server outlived the killed supervisor"


def test_local_server_refuses_requests_without_the_token(tmp_path):
    """With auth, the API answers only requests carrying the token (GET /health stays open);
    with ui=True the same server also serves Prefect's web UI."""
    home = tmp_path / "prefect"
    auth = api_auth_string(home)
    assert api_auth_string(home) == auth, "the token is generated once and then reused"
    assert stat.S_IMODE((home / TOKEN_FILE).stat().st_mode) == 0o600
    user = auth.split(":")[0]
    with local_server(home=home, auth=auth, ui=True) as api_url:  # `featcal serve --ui`'s server
        with urllib.request.urlopen(f"{api_url}/health", timeout=10) as response:
            assert response.status == 200
        with urllib.request.urlopen(api_url.removesuffix("/api"), timeout=30) as response:
            assert response.status == 200 and b"<html" in response.read().lower()  # the web UI
        # the UI's page finds the API through /ui-settings: this server's port, not 4200
        settings_url = api_url.removesuffix("/api") + "/ui-settings"
        with urllib.request.urlopen(settings_url, timeout=30) as response:
            settings = json.loads(response.read())
        assert settings["api_url"] == api_url and settings["auth"] == "BASIC", settings
        assert _post(api_url, "/flows/filter", {}, None)[0] == 401
        assert _post(api_url, "/flows/filter", {}, f"{user}:wrong-token")[0] == 401
        assert _post(api_url, "/flows/filter", {}, auth) == (200, [])


def test_token_file_readable_by_others_is_refused(tmp_path):
    api_auth_string(tmp_path)
    path = tmp_path / TOKEN_FILE
    path.chmod(0o640)
    with pytest.raises(FeatCalError, match=re.escape(f"chmod 600 {path}")):
        api_auth_string(tmp_path)
    path.chmod(0o600)
    if os.getuid() == 0:  # as root, a file owned by someone else can be made
        os.chown(path, 4242, -1)
        with pytest.raises(FeatCalError, match="owned by uid 4242"):
            api_auth_string(tmp_path)
