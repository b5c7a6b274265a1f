"""`featcal serve --interval`: with no PREFECT_API_URL it starts and supervises a local Prefect
server, serves the pipeline as a deployment, and scheduled runs complete."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
from test_pipeline import write_params


def _completed_runs(api_url: str) -> int:
    body = json.dumps({"flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}).encode()
    request = urllib.request.Request(f"{api_url}/flow_runs/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        runs = json.loads(response.read())
    # scheduled runs of the deployment, not their subflows
    return sum(
        1 for run in runs if run.get("deployment_id") and run.get("parent_task_run_id") is None
    )


def test_serve_runs_on_a_schedule(tmp_path):
    params_path = write_params(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONUNBUFFERED="1",
               MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")  # fmt: skip
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "featcal_cli.main", "serve", "--params", str(params_path),
             "--interval", "5"],
            env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    api_url, completed = None, 0
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if api_url is None:
                found = re.search(r"local Prefect server at (\S+)", log_path.read_text())
                api_url = found.group(1) if found else None
            elif (completed := _completed_runs(api_url)) >= 2:
                break
            time.sleep(2)
    finally:
        proc.send_signal(signal.SIGINT)  # serving stops; the supervised server is stopped too
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        leftovers = _outlived(_servers(api_url)) if api_url else []
    assert api_url, log_path.read_text()[-3000:]
    assert completed >= 2, log_path.read_text()[-3000:]
    assert not leftovers, "the supervised Prefect server outlived featcal serve"


def _servers(api_url: str) -> list[psutil.Process]:
    """The `prefect server start` processes listening on the port of `api_url`."""
    port = api_url.split(":")[2].split("/")[0]
    return [p for p in psutil.process_iter(["cmdline"])
            if "server" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]  # fmt: skip


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
    script = ("import time\nfrom flows.prefect_server import local_server\n"
              "with local_server() as url:\n    print(url, flush=True)\n    time.sleep(600)\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    try:
        api_url = proc.stdout.readline().strip()
        assert api_url.startswith("http://127.0.0.1:"), "the local server did not start"
        servers = _servers(api_url)
        assert servers
    finally:
        proc.kill()
        proc.wait()
    assert not _outlived(servers), "the local Prefect server outlived the killed supervisor"
