"""lm-eval's task names, remembered per installation (featcal_core.evaluation.harness_index): the
key follows every task file, a remembered index is read instead of lm-eval's registry, and one that
is stale, corrupt or unwritable costs only a rebuild."""

from __future__ import annotations

import json
import os

import pytest

from featcal_core.evaluation import harness_index


class _Registry:
    """Stands in for lm-eval's TaskManager build (the real one is run by test_paper_llama's
    `featcal check` subprocesses): counts how often the registry is built."""

    def __init__(self, names):
        self.names = list(names)
        self.builds = 0

    def __call__(self, include_path, defaults):
        assert include_path is None and defaults
        self.builds += 1
        return type("Manager", (), {"all_tasks": list(self.names)})()


@pytest.fixture
def registry(tmp_path, monkeypatch):
    tasks = tmp_path / "lm_eval_tasks"
    (tasks / "arc").mkdir(parents=True)
    (tasks / "arc" / "arc_easy.yaml").write_text("task: arc_easy\n")
    (tasks / "gsm8k.yaml").write_text("task: gsm8k\n")
    monkeypatch.setattr(harness_index, "_tasks_folder", lambda: tasks)
    monkeypatch.setenv("FEATCAL_DIGEST_CACHE", str(tmp_path / "cache" / "digests.sqlite"))
    fake = _Registry(["arc_easy", "gsm8k", "ai2_arc"])
    monkeypatch.setattr(harness_index, "_task_manager", fake)
    return tasks, fake, tmp_path / "cache" / "lm-eval-tasks"


def test_the_key_follows_every_task_file(tmp_path):
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "a.yaml").write_text("task: a\n")
    key = harness_index.registry_key(folder)
    assert harness_index.registry_key(folder) == key
    (folder / "a.yaml").write_text("task: b\n")  # same size, new mtime
    os.utime(folder / "a.yaml", ns=(1, 1))
    moved = harness_index.registry_key(folder)
    assert moved != key
    (folder / "b.yaml").write_text("task: b\n")
    added = harness_index.registry_key(folder)
    assert added not in (key, moved)
    (folder / "b.yaml").unlink()
    assert harness_index.registry_key(folder) == moved


def test_the_registry_is_built_once_then_read(registry):
    tasks, fake, index = registry
    first = harness_index.registry_names()
    assert first == {"arc_easy", "gsm8k", "ai2_arc"} and fake.builds == 1
    assert harness_index.registry_names() == first and fake.builds == 1
    (written,) = index.iterdir()
    assert written.name == f"{harness_index.registry_key()}.json"
    assert json.loads(written.read_text())["names"] == sorted(first)

    # a task file of lm-eval changes: another key, the registry is read again
    (tasks / "gsm8k.yaml").write_text("task: gsm8k\nnum_fewshot: 5\n")
    fake.names.append("gsm8k_cot")
    assert "gsm8k_cot" in harness_index.registry_names() and fake.builds == 2
    assert len(list(index.iterdir())) == 2


@pytest.mark.parametrize(
    "content", ["{not json", json.dumps({"key": "other", "names": ["x"]}), json.dumps([1])]
)
def test_a_corrupt_or_foreign_index_is_rebuilt(registry, content):
    _, fake, index = registry
    index.mkdir(parents=True)
    (index / f"{harness_index.registry_key()}.json").write_text(content)
    assert harness_index.registry_names() == {"arc_easy", "gsm8k", "ai2_arc"}
    assert fake.builds == 1
    assert harness_index.registry_names() and fake.builds == 1  # rewritten, read from now on


def test_without_a_cache_every_call_builds(registry, monkeypatch):
    _, fake, index = registry
    monkeypatch.setenv("FEATCAL_DIGEST_CACHE", "off")
    harness_index.registry_names()
    harness_index.registry_names()
    assert fake.builds == 2 and not index.exists()


def test_an_unwritable_cache_costs_only_the_build(registry, tmp_path, monkeypatch):
    _, fake, _ = registry
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("FEATCAL_DIGEST_CACHE", str(blocked / "digests.sqlite"))
    assert harness_index.registry_names() == {"arc_easy", "gsm8k", "ai2_arc"}
    assert fake.builds == 1


def test_known_names_skip_the_registry_when_the_folder_holds_every_task(registry, monkeypatch):
    _, fake, _ = registry
    own = type("Manager", (), {"all_tasks": ["mine"]})()

    def managers(include_path, defaults):
        return own if include_path is not None else fake(include_path, defaults)

    monkeypatch.setattr(harness_index, "_task_manager", managers)
    assert harness_index.known_names(["mine"], "/somewhere") == {"mine"}
    assert fake.builds == 0
    assert harness_index.known_names(["mine", "gsm8k"], "/somewhere") == {
        "mine",
        "arc_easy",
        "gsm8k",
        "ai2_arc",
    }
    assert fake.builds == 1
