"""`featcal merge` writes a model of its own: the merged weights and the files a model carries
(never the base repository's README.md, .gitattributes or LICENSE), `merge.json` naming each
input's Hub id, revision and commit (a local folder: its path), and its own model card (README.md:
the recipe, base_model, tags merge and featcal, library_name transformers); with Hub ids the same
files online (a loopback Hub, tests/mock_hub.py) and offline (from the Hugging Face cache)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard, constants
from mock_hub import MockHub
from test_resolve import hub_cache

import factories
from featcal_cli.main import main
from featcal_core.io.markers import MARKER, read_marker, verify_output
from featcal_core.provenance.lineage import trace
from featcal_core.version import featcal_version

#: a Hub repository's own files, which are not the model's
REPOSITORY_FILES = {
    "README.md": "---\nlicense: mit\n---\n\nthe base repository's own card\n",
    ".gitattributes": "*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "LICENSE": "the base repository's license text\n",
}
#: what differs between two runs of the same merge (merge.json's timing and memory)
RUN_FIELDS = ("wall_seconds", "peak_rss_bytes")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny CLIP pool whose base folder is as a Hub repository holds it (its own card,
    .gitattributes and LICENSE beside the model's files)."""
    pool = factories.clip_zoo(tmp_path_factory.mktemp("merge_output"), rows=2)
    for name, text in REPOSITORY_FILES.items():
        (pool.base / name).write_text(text)
    return pool


def _merge_args(base: str, experts: dict[str, str], out: Path) -> list[str]:
    args = ["merge", "--base", base, "--method", "task_arithmetic", "--scale", "0.4"]
    for task, model in experts.items():
        args += ["--expert", f"{task}={model}"]
    return [*args, "--out", str(out), "--no-progress"]


def _assert_own_model(out: Path) -> dict:
    """`out` is a model of its own: none of the base repository's files, featcal's own card;
    returns merge.json."""
    for name in (".gitattributes", "LICENSE"):
        assert not (out / name).exists(), name
    assert "the base repository's own card" not in (out / "README.md").read_text()
    assert verify_output(out) is None
    return json.loads((out / "merge.json").read_text())


def test_a_hub_merge_from_the_cache_records_and_cards_its_origins(zoo, tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    _, base_commit = hub_cache(cache, "owner/base", zoo.base)  # README, .gitattributes too
    _, alpha_commit = hub_cache(cache, "owner/expert-alpha", zoo.experts["alpha"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    out = tmp_path / "merged"
    experts = {"alpha": "owner/expert-alpha", "beta": str(zoo.experts["beta"])}
    assert main(_merge_args("owner/base@main", experts, out)) == 0

    record = _assert_own_model(out)
    assert record["featcal_version"] == featcal_version()
    base, alpha, beta = (
        record["inputs"]["base"],
        record["inputs"]["experts"]["alpha"],
        record["inputs"]["experts"]["beta"],
    )
    assert {k: base[k] for k in ("kind", "reference", "repo_id", "revision", "commit")} == {
        "kind": "hub",
        "reference": "owner/base@main",
        "repo_id": "owner/base",
        "revision": "main",
        "commit": base_commit,
    }
    assert base["path"].endswith(f"snapshots/{base_commit}")
    assert (alpha["repo_id"], alpha["revision"], alpha["commit"]) == (
        "owner/expert-alpha",
        None,  # the default branch
        alpha_commit,
    )
    assert beta["kind"] == "local" and beta["path"] == str(zoo.experts["beta"].resolve())
    assert not {"repo_id", "revision", "commit"} & set(beta)

    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == ["owner/base", "owner/expert-alpha"]  # beta: a local folder
    assert data["base_model_relation"] == "merge"
    assert data["library_name"] == "transformers"
    assert {"merge", "featcal", "task_arithmetic"} <= set(data["tags"])
    for shown in ("`owner/base@main`", base_commit, alpha_commit, "| scale | 0.4 |"):
        assert shown in card.text, shown
    assert f"| featcal version | {featcal_version()} |" in card.text
    assert "model = CLIPVisionModel.from_pretrained(folder)" in card.text
    assert read_marker(out)["files"].keys() >= {"README.md", "merge.json", "model.safetensors"}

    # lineage (no lock beside a command's merge) names the Hub origins merge.json records
    chain = trace(out)["chain"]
    assert (chain["base"]["repo_id"], chain["base"]["commit"]) == ("owner/base", base_commit)
    assert "repo_id" not in chain["experts"]["beta"]


def test_the_pipeline_merge_is_redone_when_an_input_comes_from_elsewhere(zoo, tmp_path):
    from featcal.tasks.merge import merge_task

    out = tmp_path / "merged"
    experts = {t: str(p) for t, p in zoo.experts.items()}
    merge = merge_task.fn
    merge(str(zoo.base), experts, str(out), "average", {})
    written = out.stat().st_ino
    merge(str(zoo.base), experts, str(out), "average", {})
    assert out.stat().st_ino == written  # the same inputs from the same places: reused
    hub = {"kind": "hub", "reference": "owner/base", "repo_id": "owner/base", "commit": "c" * 40}
    record = merge(str(zoo.base), experts, str(out), "average", {}, None, base_source=hub)
    assert out.stat().st_ino != written  # the same weights from the Hub: merged and named anew
    assert record["inputs"]["base"]["repo_id"] == "owner/base"
    assert "owner/base" in ModelCard.load(out / "README.md").data.base_model


def _featcal(hub: MockHub, cache: Path, cwd: Path, *args: str, offline: bool = False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(hub.env(cache))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "featcal_cli.main", *args]
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def _files(out: Path) -> dict[str, object]:
    """Every file of `out` by content; merge.json and the marker without what differs between
    two runs of one merge (its timing, and the record's digest)."""
    found: dict[str, object] = {}
    for path in sorted(out.iterdir()):
        if path.name == "merge.json":
            record = json.loads(path.read_text())
            found[path.name] = {k: v for k, v in record.items() if k not in RUN_FIELDS}
        elif path.name == MARKER:
            files = dict(read_marker(out)["files"])
            files.pop("merge.json")
            found[path.name] = files
        else:
            found[path.name] = path.read_bytes()
    return found


@pytest.mark.slow  # featcal processes against a loopback Hub
def test_a_hub_merge_writes_the_same_files_online_and_offline(zoo, tmp_path):
    experts = {"alpha": "owner/expert-alpha", "beta": "owner/expert-beta"}
    with MockHub() as hub:
        base_commit = hub.add("owner/base", zoo.base)
        for task in experts:
            hub.add(f"owner/expert-{task}", zoo.experts[task])
        cache = tmp_path / "hf"
        online = tmp_path / "online" / "merged"
        done = _featcal(hub, cache, tmp_path, *_merge_args("owner/base", experts, online))
        assert done.returncode == 0, done.stderr[-3000:]

        # the cache also holds the repository's .gitattributes (as `hf download` leaves it)
        snapshot = cache / "models--owner--base" / "snapshots" / base_commit
        assert (snapshot / "README.md").is_file()  # fetched: the license the card names
        shutil.copy(zoo.base / ".gitattributes", snapshot / ".gitattributes")
        offline = tmp_path / "offline" / "merged"
        asked = len(hub.requests)
        args = _merge_args("owner/base", experts, offline)
        done = _featcal(hub, cache, tmp_path, *args, offline=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(hub.requests) == asked  # offline: the Hub was not asked

    record = _assert_own_model(online)
    _assert_own_model(offline)
    assert _files(online) == _files(offline)
    assert record["inputs"]["base"]["commit"] == base_commit
    assert record["inputs"]["base"]["repo_id"] == "owner/base"
    card = ModelCard.load(online / "README.md")  # the base states mit, the experts nothing
    assert card.data.license == "other" and "| base | `mit` |" in card.text
