"""evaluation.harness: causal LMs scored by lm-evaluation-harness on local tasks (a task YAML and
a 16-row JSON file) with the tiny Llama, against featcal's own label scoring of the same rows and
choices; the expert rows of a list and of a mapping; the checks before any work."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from factories import TINY_LLAMA, cli_fails, lm_eval_tasks, tiny_clip_model
from featcal_core.data.synthetic import word_tokenizer
from featcal_core.errors import FeatCalError
from featcal_core.evaluation import harness
from featcal_core.evaluation.harness import HarnessRun, expert_assignment, harness_table
from featcal_core.evaluation.language_model import label_continuation
from featcal_core.params import HarnessSettings

PROMPT = "{text} ->"
LABEL_WORDS = ["good", "bad", "fun"]  # one token each: featcal's loss is a mean log-likelihood
ROWS = 16


def write_tasks(folder: Path, seed: int = 0) -> list[dict]:
    return lm_eval_tasks(folder, LABEL_WORDS, ROWS, seed)


def tiny_llama(out: Path, seed: int) -> Path:
    """The tests' tiny Llama (TINY_LLAMA) with the word tokenizer, saved in `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_LLAMA,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", autouse=True)
def quick_lm_eval(tmp_path_factory):
    """lm-eval's environment report (`pip list` and more in subprocesses, seconds per model,
    kept out of featcal's rows) left out, and the JSON rows cached in a temporary folder."""
    import datasets.config
    import lm_eval.evaluator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("cache"))
        yield


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(tasks folder, rows, {name: model folder}) of three tiny Llamas."""
    root = tmp_path_factory.mktemp("harness")
    rows = write_tasks(root / "tasks")
    models = {name: tiny_llama(root / name, seed) for name, seed in (("a", 3), ("b", 4), ("c", 5))}
    return root / "tasks", rows, models


def _run(folder: Path, **kwargs) -> HarnessRun:
    return HarnessRun(tasks=("toy_choice", "toy_target"), include_path=str(folder), **kwargs)


@pytest.fixture(scope="module")
def scored(toy):
    """{model: {task: result}}: each model scored alone on both tasks (a's tokenizer)."""
    folder, _, models = toy
    return {
        n: harness.score_model(m, models["a"], _run(folder, batch_size=5))
        for n, m in models.items()
    }


def test_lm_eval_scores_as_featcal_scores_the_same_rows(toy, scored):
    """Multiple-choice accuracy is featcal's label-continuation accuracy on the same prompts and
    label words, and the true label word's mean log-likelihood is minus featcal's label loss, on
    three models; each model's result names its metric, stderr and row counts."""
    _, rows, models = toy
    texts, labels = [r["text"] for r in rows], [r["label"] for r in rows]
    for name, found in scored.items():
        ours = label_continuation(
            models[name], models["a"], texts, labels, LABEL_WORDS, PROMPT, batch_size=7
        )
        choice, target = found["toy_choice"], found["toy_target"]
        assert choice["accuracy"] == ours["accuracy"]
        assert 0 < ours["accuracy"] < 1  # the check can tell models apart
        assert -target["accuracy"] == pytest.approx(ours["loss"], rel=1e-5)
        p = choice["accuracy"]
        assert choice["stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (ROWS - 1)))
        assert (choice["metric"], target["metric"]) == ("acc", "perplexity")
        assert choice["examples"] == choice["task_rows"] == ROWS
        assert choice["num_fewshot"] == 0 and choice["evaluator"].startswith("lm-eval 0.4.")
    assert len({found["toy_target"]["accuracy"] for found in scored.values()}) == 3


def test_limit_counts_rows_or_a_fraction(toy):
    """`limit` as lm-eval reads it; offline (models.hub_offline) a local task runs the same, and
    datasets and the Hub client are online again afterwards."""
    import datasets.config
    import huggingface_hub.constants

    folder, rows, models = toy
    texts, labels = [r["text"] for r in rows], [r["label"] for r in rows]
    online = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    with harness._offline(True):
        assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == online
    for limit, count, offline in ((5, 5, True), (0.5, 8, False)):
        run = HarnessRun(
            tasks=("toy_choice",), include_path=str(folder), limit=limit, offline=offline
        )
        found = harness.score_model(models["b"], models["a"], run)["toy_choice"]
        assert (found["examples"], found["task_rows"]) == (count, ROWS)
        ours = label_continuation(
            models["b"], models["a"], texts[:count], labels[:count], LABEL_WORDS, PROMPT
        )
        assert found["accuracy"] == ours["accuracy"]
        assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == online


def test_expert_rows_of_a_list_and_of_a_mapping(toy, scored):
    """A list scores every expert on every task, the expert row being the best one there; a
    mapping scores each expert on its own tasks. Each row is lm-eval's number for its model."""
    folder, _, models = toy
    run = _run(folder, batch_size=5)  # as `scored` ran: the same batches, the same floats
    # the expert listed second scores higher on toy_choice: the row is not merely the first
    worse, better = sorted("bc", key=lambda name: scored[name]["toy_choice"]["accuracy"])
    assert scored[worse]["toy_choice"]["accuracy"] < scored[better]["toy_choice"]["accuracy"]
    experts = {"x": models[worse], "y": models[better]}
    alone = {"x": scored[worse], "y": scored[better]}
    table = harness_table(models["a"], experts, {}, run)
    for task, row in table.items():
        assert list(row) == ["base", "expert"] and row["base"] == scored["a"][task]
        best = max(alone, key=lambda expert: alone[expert][task]["accuracy"])
        assert row["expert"] == {**alone[best][task], "expert_task": best}
    assert table["toy_choice"]["expert"]["expert_task"] == "y"

    assignment = expert_assignment({"x": ["toy_target"], "y": ["toy_choice"]}, ["x", "y"])
    assert assignment == {"x": ["toy_target"], "y": ["toy_choice"]}
    own = harness_table(models["a"], experts, {"merged": models["c"]}, run, assignment)
    assert own["toy_choice"]["expert"] == {**alone["y"]["toy_choice"], "expert_task": "y"}
    assert own["toy_target"]["expert"] == {**alone["x"]["toy_target"], "expert_task": "x"}
    assert own["toy_choice"]["merged"] == scored["c"]["toy_choice"]
    assert expert_assignment({"y": ["toy_choice"]}, ["x", "y"]) == {"x": [], "y": ["toy_choice"]}
    with pytest.raises(FeatCalError, match=r"evaluation.harness.tasks.z: 'z' is no expert task"):
        expert_assignment({"z": ["toy_choice"]}, ["x", "y"])


def test_settings_checks(toy, tmp_path):
    folder, _, _ = toy
    settings = HarnessSettings(tasks={"x": ["toy_choice"]}, include_path=str(folder))
    assert harness.check_settings(settings, ["x"]) == []
    [(key, text)] = harness.check_settings(settings, ["y"])
    assert key == "evaluation.harness.tasks.x" and "no expert task" in text
    missing = HarnessSettings(tasks=["toy_choice"], include_path=str(tmp_path / "nowhere"))
    [(key, text)] = harness.check_settings(missing, None)
    assert key == "evaluation.harness.include_path" and "is not a folder" in text


def _params(tmp_path: Path, base: Path, folder: Path) -> Path:
    data = {"path": str(tmp_path / "rows"), "split": "test"}
    params = {
        "models": {"base": str(base), "experts": {"alpha": str(base)}},
        "tasks": {"alpha": {"calibration": {**data, "split": "train"}, "evaluation": data}},
        "evaluation": {"harness": {"tasks": ["toy_choice"], "include_path": str(folder)}},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_without_lm_eval_a_run_stops_with_one_line(toy, tmp_path, capsys, monkeypatch):
    """No lm-eval: `featcal check` and `featcal run` stop before any work, with one line."""
    folder, _, models = toy
    path = _params(tmp_path, models["a"], folder)
    monkeypatch.setattr(harness, "available", lambda: False)
    for command in ("check", "run"):
        err = cli_fails([command, "--params", str(path)], capsys, "needs lm-eval")
        assert err.strip() == ("featcal: error: " + harness.MISSING)
    assert not (tmp_path / "data").exists() and not (tmp_path / "rows").exists()
    with pytest.raises(FeatCalError, match=r"^evaluation.harness needs lm-eval: pip install"):
        harness.score_model(models["a"], models["a"], _run(folder))


def test_preflight_refuses_the_harness_for_a_classifier(toy, tmp_path):
    from featcal_core.params import load_params
    from featcal_core.preflight import check

    folder, _, _ = toy
    base = tiny_clip_model(tmp_path / "clip")
    problems, _ = check(load_params(str(_params(tmp_path, base, folder)), []))
    assert ("evaluation.harness" in dict(problems)) and "scores causal LMs" in dict(problems)[
        "evaluation.harness"
    ]
