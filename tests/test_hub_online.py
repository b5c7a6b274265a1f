"""Online commands against a loopback Hugging Face Hub (tests/mock_hub.py), as a Hub user runs
them: `featcal check` and `featcal merge` with Hub ids print featcal's own lines only (no
library's INFO lines, e.g. httpx2's HTTP requests) unless -v; a base with pickled weights only on
its default branch whose conversion pull request cannot be listed ends in one line that names
the fix (`owner/name@refs/pr/N`), which then works."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mock_hub import MockHub
from test_pipeline import write_params

pytestmark = pytest.mark.slow  # featcal processes

#: a log line of featcal's console handler: "<date> <time> LEVEL logger: message"
LOG_LINE = re.compile(r"^\S+ \S+ (?P<level>[A-Z]+) (?P<name>[\w.]+): ")
OWN = ("featcal", "featcal_core", "featcal_cli")


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """The tiny zero-shot CLIP setting of test_pipeline (base, experts alpha and beta, data) and
    its params with the models as Hub ids owner/base, owner/expert-alpha, owner/expert-beta."""
    root = tmp_path_factory.mktemp("online")
    local = yaml.safe_load(write_params(root).read_text())
    folders = {"owner/base": Path(local["models"]["base"])}
    folders |= {f"owner/expert-{t}": Path(p) for t, p in local["models"]["experts"].items()}
    hub_params = dict(local)
    hub_params["models"] = {
        "base": "owner/base",
        "experts": {t: f"owner/expert-{t}" for t in local["models"]["experts"]},
    }
    path = root / "hub.yaml"
    path.write_text(yaml.safe_dump(hub_params))
    return root, path, folders


def featcal(hub: MockHub, cache: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(hub.env(cache))
    cmd = [sys.executable, "-m", "featcal_cli.main", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def library_lines(stderr: str) -> list[str]:
    """The log lines of loggers that are not featcal's own, below WARNING."""
    found = []
    for line in stderr.splitlines():
        match = LOG_LINE.match(line)
        own = match and any(
            match["name"] == name or match["name"].startswith(name + ".") for name in OWN
        )
        if match and not own and match["level"] in ("DEBUG", "INFO"):
            found.append(line)
    return found


def test_check_and_merge_with_hub_ids_print_no_library_lines_unless_verbose(setting, tmp_path):
    root, params, folders = setting
    with MockHub() as hub:
        for repo_id, folder in folders.items():
            hub.add(repo_id, folder)
        merge = [
            "merge",
            "--base",
            "owner/base",
            "--expert",
            "alpha=owner/expert-alpha",
            "--expert",
            "beta=owner/expert-beta",
            "--method",
            "task_arithmetic",
            "--no-progress",
        ]
        for verbose in ([], ["-v"]):
            cache = tmp_path / f"hf{len(verbose)}"
            checked = featcal(hub, cache, root, "check", "--params", str(params), *verbose)
            assert checked.returncode == 0, checked.stderr[-3000:]
            assert "no problems found (2 tasks)" in checked.stdout
            out = tmp_path / f"merged{len(verbose)}"
            merged = featcal(hub, cache, root, *merge, "--out", str(out), *verbose)
            assert merged.returncode == 0, merged.stderr[-3000:]
            assert (out / "model.safetensors").is_file()
            assert any(method == "GET" and "/resolve/" in path for method, path in hub.requests)
            for proc in (checked, merged):
                lines = library_lines(proc.stderr)
                if verbose:  # every module's log: the HTTP client's request lines among them
                    assert any("HTTP Request" in line for line in lines), proc.stderr[-3000:]
                else:
                    assert lines == [], "\n".join(lines)
                    assert "HTTP Request" not in proc.stderr and "httpx" not in proc.stderr


def _pickled_main_and_conversion(hub: MockHub, base: Path, tmp_path: Path) -> None:
    """openai/clip as openai/clip-vit-base-patch32 is on the Hub: config and pickled weights only
    on main, the safetensors in its conversion pull request refs/pr/66."""
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(base / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"pickle")
    hub.add("openai/clip", pickled)
    hub.add("openai/clip", base, revision="refs/pr/66")


def test_failed_conversion_look_up_names_the_pull_request_revision(setting, tmp_path):
    root, params, folders = setting
    merge = ["merge", "--expert", "alpha=owner/expert-alpha", "--expert", "beta=owner/expert-beta"]
    merge += ["--method", "task_arithmetic", "--no-progress"]
    data = yaml.safe_load(params.read_text())
    data["models"]["base"] = "openai/clip"
    on_main = tmp_path / "on_main.yaml"
    on_main.write_text(yaml.safe_dump(data))
    with MockHub() as hub:
        for repo_id, folder in folders.items():
            hub.add(repo_id, folder)
        _pickled_main_and_conversion(hub, folders["owner/base"], tmp_path)
        hub.discussions["openai/clip"] = 401  # the listing of its pull requests fails
        cache = tmp_path / "hf"

        failed = featcal(hub, cache, root, *merge, "--base", "openai/clip", "--out", "x")
        assert failed.returncode == 2, failed.stderr[-3000:]
        error = failed.stderr.strip().splitlines()[-1]
        assert error.startswith("featcal: error: --base: Hub model 'openai/clip' "), error
        assert "the look-up of its safetensors conversion failed (HTTP 401" in error, error
        assert "openai/clip@refs/pr/N" in error and "SFconvertbot" in error, error
        warning = [line for line in failed.stderr.splitlines() if "pull requests of" in line]
        assert len(warning) == 1 and warning[0].endswith("(HTTP 401 Unauthorized)"), warning
        assert not (root / "x").exists()

        checked = featcal(hub, cache, root, "check", "--params", str(on_main))
        assert checked.returncode == 2, checked.stderr[-3000:]
        problem = [line for line in checked.stderr.splitlines() if "models.base" in line]
        assert len(problem) == 1 and "openai/clip@refs/pr/N" in problem[0], checked.stderr

        # the fix the line names: the conversion's revision after '@'
        out = tmp_path / "merged"
        fixed = featcal(hub, cache, root, *merge, "--base", "openai/clip@refs/pr/66", "--out", out)
        assert fixed.returncode == 0, fixed.stderr[-3000:]
        assert (out / "model.safetensors").is_file()
        data["models"]["base"] = "openai/clip@refs/pr/66"
        on_main.write_text(yaml.safe_dump(data))
        checked = featcal(hub, cache, root, "check", "--params", str(on_main))
        assert checked.returncode == 0, checked.stderr[-3000:]

        # the listing answers: the conversion is found by itself
        hub.discussions["openai/clip"] = [(12, "someone"), (66, "SFconvertbot")]
        out = tmp_path / "found"
        found = featcal(hub, tmp_path / "hf2", root, *merge, "--base", "openai/clip", "--out", out)
        assert found.returncode == 0, found.stderr[-3000:]
        assert "using the safetensors conversion refs/pr/66" in found.stderr
