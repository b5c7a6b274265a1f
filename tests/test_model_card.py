"""The model card (featcal_core/provenance/model_card.py, card_metadata.py): a Hugging Face card
that huggingface_hub loads, with base_model, tags, license and, once there is an evaluation
table, a model-index; written after calibration and again after evaluation (flows/steps.py)
without breaking the checkpoint folder's marker."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard

import factories
from featcal_core.io.outputs import read_marker, sha256_file, verify_output
from featcal_core.params import load_params
from featcal_core.provenance.card_metadata import base_models, license_fields, read_license
from featcal_core.provenance.lineage import trace
from featcal_core.provenance.lock import write_lock
from featcal_core.provenance.model_card import (
    model_card_fields,
    render_model_card,
    write_model_card,
)

TASKS = ("alpha", "beta")
BASE_ID, ALPHA_ID = "acme/clip-base", "acme/clip-alpha"


def _result(accuracy, expert):
    return {
        "accuracy": accuracy,
        "loss": 1.0 - accuracy,
        "examples": 20,
        "normalized": accuracy / expert if expert else float("nan"),
    }


def _evaluation(heads: bool = True) -> dict:
    table = {}
    for task, (expert, merged, calibrated, merged_h, calibrated_h) in {
        "alpha": (0.9, 0.5, 0.7, 0.75, 0.8),
        "beta": (0.8, 0.6, 0.65, 0.7, 0.75),
    }.items():
        row = {
            "expert": _result(expert, expert),
            "merged": _result(merged, expert),
            "calibrated": _result(calibrated, expert),
        }
        if heads:
            row["merged_heads"] = _result(merged_h, expert)
            row["calibrated_heads"] = _result(calibrated_h, expert)
        table[task] = row
    return table


@pytest.fixture
def run(tmp_path) -> dict:
    """A tiny calibrated run by the real writers: the base and expert alpha locked as Hub models
    (kind hub, found in local folders), expert beta as a local folder; every input's README.md
    says license: mit."""
    from featcal_core.data.calibration_sets import draw_calibration_set
    from featcal_core.merging.run import merge_checkpoints
    from featcal_core.method.calibration import calibrate
    from featcal_core.provenance.resolve import resolve_model

    zoo = factories.clip_zoo(tmp_path / "zoo", rows=6)
    for folder in (zoo.base, *zoo.experts.values()):
        (folder / "README.md").write_text("---\nlicense: mit\n---\n\nan input's own card\n")
    results = tmp_path / "results"

    def hub(model, repo_id):
        return dataclasses.replace(
            model,
            kind="hub",
            repo_id=repo_id,
            revision="main",
            reference=f"{repo_id}@main",
            commit="c" * 40,
        )

    base = hub(resolve_model({"kind": "local", "path": str(zoo.base)}, "models.base"), BASE_ID)
    experts = {
        t: resolve_model({"kind": "local", "path": str(p)}, f"models.experts.{t}")
        for t, p in zoo.experts.items()
    }
    experts["alpha"] = hub(experts["alpha"], ALPHA_ID)
    write_lock(results / "models.lock.json", base, experts, {"architecture": "hf-clip-vision"})
    sets = {
        t: draw_calibration_set(
            t,
            {"path": str(p)},
            None,
            results / "calibration_sets" / t,
            n=4,
            seed=0,
            modality="image",
        )["path"]
        for t, p in zoo.calib.items()
    }
    merge_checkpoints(
        zoo.base, zoo.experts, results / "merged", "task_arithmetic", {"scale": 0.3}, progress=False
    )
    calibrate(
        zoo.base,
        results / "merged",
        zoo.experts,
        sets,
        results / "calibrated",
        num_per_task=3,
        seed=5,
        progress=False,
    )
    return {"zoo": zoo, "results": results, "calibrated": results / "calibrated"}


def _fake_heads(results: Path, calibrated: Path, weights: dict[str, str] | None = None) -> Path:
    """refit_heads/calibrated/<task>/ as `featcal heads` lays it out (files' content unused)."""
    folder = results / "refit_heads" / "calibrated"
    for task in TASKS:
        (folder / task).mkdir(parents=True, exist_ok=True)
        (folder / task / "classifier.safetensors").write_bytes(b"not read")
        (folder / task / "classifier.json").write_text("{}")
    if weights is None:
        weights = {"model.safetensors": sha256_file(calibrated / "model.safetensors")}
    (folder / "fitted_on.json").write_text(json.dumps({"weights": weights}))
    return folder


def _metrics(card: ModelCard) -> dict[tuple[str, str], float]:
    return {(r.dataset_name, r.metric_name): r.metric_value for r in card.data.eval_results}


# ------------------------------------------------------------------------- a calibrated run


def test_card_of_a_calibrated_run_before_and_after_evaluation(run):
    calibrated = run["calibrated"]
    path = write_model_card(calibrated, **model_card_fields(trace(calibrated)))
    card = ModelCard.load(path)  # a file path: read, not downloaded
    data = card.data
    assert data.base_model == [BASE_ID, ALPHA_ID]  # expert beta is a local folder
    assert data.to_dict()["base_model_relation"] == "merge"
    assert data.library_name == "transformers"
    assert data.tags == [
        "featcal",
        "model-merging",
        "task_arithmetic",
        "hf-clip-vision",
        "clip_vision_model",
    ]
    assert data.license == "mit"  # every input's README.md says so
    assert data.eval_results is None and "model-index" not in data.to_dict()
    assert "## Evaluation results" not in card.text
    assert "model = CLIPVisionModel.from_pretrained(folder)" in card.text  # the class saved
    assert "AutoImageProcessor" in card.text and "heads = {" not in card.text
    for section in ("## How it was made", "## Inputs", "## License"):
        assert section in card.text
    assert sha256_file(run["zoo"].base / "model.safetensors") in card.text
    assert verify_output(calibrated) is None

    # what `Steps.evaluate` does: the same card with the table and the refit heads
    _fake_heads(run["results"], calibrated)
    fields = model_card_fields(trace(calibrated))
    assert set(fields["heads"]) == set(TASKS)
    path = write_model_card(calibrated, **{**fields, "evaluation": _evaluation()})
    card = ModelCard.load(path)
    results = card.data.eval_results
    assert card.data.to_dict()["model-index"][0]["name"] == "results-calibrated"
    assert len({r.dataset_name for r in results}) == len(TASKS)  # one model-index result per task
    assert {r.task_type for r in results} == {"image-classification"}
    assert {r.metric_type for r in results} == {"accuracy"}
    assert _metrics(card) == pytest.approx(
        {
            ("alpha", "accuracy (calibrated)"): 0.7,
            ("alpha", "accuracy (calibrated + refit heads)"): 0.8,
            ("alpha", "accuracy (merged, before FeatCal)"): 0.5,
            ("beta", "accuracy (calibrated)"): 0.65,
            ("beta", "accuracy (calibrated + refit heads)"): 0.75,
            ("beta", "accuracy (merged, before FeatCal)"): 0.6,
        }
    )
    text = card.text
    assert (
        "| task | expert | merged | calibrated | merged + refit heads | calibrated + refit heads |"
    ) in text
    assert "| alpha | 90.0 | 50.0 | 70.0 | 75.0 | 80.0 |" in text
    assert "| **average** | **85.0** | **55.0** | **67.5** | **72.5** | **77.5** |" in text
    assert "| beta | calibrated_heads | 0.7500 |" in text  # every metric, too
    assert '"alpha": folder / "../refit_heads/calibrated/alpha",' in text  # relative paths
    assert str(run["results"]) not in text.split("## Usage", 1)[1].split("## Evaluation", 1)[0]

    # the rewritten card is in the folder's marker: the checkpoint still verifies
    assert read_marker(calibrated)["files"]["README.md"] == sha256_file(path)
    assert verify_output(calibrated) is None
    assert trace(calibrated)["problems"] == []


def test_heads_fit_on_other_weights_are_not_shown(run):
    _fake_heads(run["results"], run["calibrated"], weights={"model.safetensors": "0" * 64})
    assert model_card_fields(trace(run["calibrated"]))["heads"] is None


def test_steps_evaluate_rewrites_the_card_and_the_folder_verifies(run, tmp_path, monkeypatch):
    from featcal.flows.steps import Steps
    from featcal.tasks import evaluate as evaluate_task

    zoo, calibrated = run["zoo"], run["calibrated"]
    params = {
        "run": {"name": "card", "results_dir": str(run["results"]), "seed": 0},
        "models": {"base": str(zoo.base), "experts": {t: str(p) for t, p in zoo.experts.items()}},
        "tasks": {
            t: {
                "calibration": {"path": str(zoo.calib[t])},  # (evaluation: not read)
                "evaluation": {"path": str(zoo.calib[o])},
            }
            for t, o in zip(TASKS, TASKS[::-1], strict=True)
        },
        "featcal": {"num_per_task": 3},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    steps = Steps(load_params(tmp_path / "params.yaml"))
    write_model_card(calibrated, **{**model_card_fields(trace(calibrated)), "evaluation": None})
    before = (calibrated / "README.md").read_bytes()

    class Stub:  # the Prefect task: Steps calls its .fn outside a flow
        @staticmethod
        def fn(params, base, experts, models, results_dir, refit_heads, surgeries=None):
            assert set(models) == {"merged", "calibrated"} and refit_heads is None
            assert surgeries is None
            return _evaluation(heads=False)

    monkeypatch.setattr(evaluate_task, "evaluate_models", Stub)
    monkeypatch.setenv("DVC_STAGE", "evaluate")  # as a DVC stage: calibrate's output untouched
    assert steps.evaluate() == _evaluation(heads=False)
    assert (calibrated / "README.md").read_bytes() == before

    monkeypatch.delenv("DVC_STAGE")
    steps.evaluate()
    card = ModelCard.load(calibrated / "README.md")
    assert _metrics(card)[("beta", "accuracy (calibrated)")] == pytest.approx(0.65)
    # the model-index names each task's evaluation data (here local folders: by their name)
    assert {(r.dataset_name, r.dataset_type) for r in card.data.eval_results} == {
        ("alpha", "calib_beta"),
        ("beta", "calib_alpha"),
    }
    assert ("alpha", "accuracy (calibrated + refit heads)") not in _metrics(card)
    assert verify_output(calibrated) is None  # what `featcal evaluate` / `report` check next
    assert Steps.verified(calibrated, "the calibrated checkpoint", "x") == calibrated


# --------------------------------------------------------------------------------- by hand


def _inputs(**licenses) -> dict:
    def model(reference, kind, license_=None):
        entry = {"reference": reference, "kind": kind, "sha256": {"model.safetensors": "ab" * 32}}
        return {**entry, "license": license_} if license_ else entry

    return {
        "base": model(f"{BASE_ID}@main", "hub", licenses.get("base")),
        "experts": {
            "alpha": model("./experts/alpha", "local", licenses.get("alpha")),
            "beta": model("someone/clip-beta", None, licenses.get("beta")),
        },
    }


def _card(tmp_path, name="card", **kwargs) -> ModelCard:
    arguments = {
        "title": "t",
        "recipe": {"merge": {"method": "ties"}, "featcal": {"alpha": 1}},
        "inputs": _inputs(),
        "model": {"modality": "text"},
        **kwargs,
    }
    folder = tmp_path / name
    folder.mkdir()
    return ModelCard.load(write_model_card(folder, **arguments))


def test_base_model_and_license_rules(tmp_path):
    assert base_models(_inputs()) == [BASE_ID, "someone/clip-beta"]  # no local path
    assert license_fields(_inputs())[0] == {}
    same = license_fields(_inputs(base="mit", alpha="mit", beta="mit"))[0]
    assert same == {"license": "mit"}
    mixed, stated = license_fields(_inputs(base="mit", alpha="apache-2.0"))
    assert mixed == {"license": "other"}
    assert dict(stated) == {
        "base": {"license": "mit"},
        "expert alpha": {"license": "apache-2.0"},
        "expert beta": None,
    }

    card = _card(tmp_path, inputs=_inputs(base="mit", alpha="apache-2.0"))
    assert card.data.license == "other"
    assert "| expert alpha | `apache-2.0` |" in card.text
    assert "| expert beta | not stated" in card.text
    card = _card(tmp_path, "none")
    assert card.data.license is None and "No input states a license" in card.text

    folder = tmp_path / "model"
    folder.mkdir()
    assert read_license(folder) is None and read_license(tmp_path / "missing") is None
    (folder / "config.json").write_text(json.dumps({"license": "apache-2.0"}))
    assert read_license(folder) == {"license": "apache-2.0"}
    (folder / "README.md").write_text("---\nlicense: other\nlicense_name: acme-1\n---\nx\n")
    assert read_license(folder) == {"license": "other", "license_name": "acme-1"}
    (folder / "README.md").write_text("---\n: [not yaml\n---\n")
    assert read_license(folder) == {"license": "apache-2.0"}  # unreadable card: the config


def test_missing_or_bad_evaluation_gives_no_model_index(tmp_path, caplog):
    for name, evaluation in (
        ("none", None),
        ("flat", {"alpha": {"accuracy": 0.5}}),
        ("text", {"alpha": "oops"}),
        ("empty", {}),
    ):
        caplog.clear()
        with caplog.at_level(logging.WARNING, "featcal_core.provenance.card_metadata"):
            card = _card(tmp_path, name, evaluation=evaluation)
        assert card.data.eval_results is None and "model-index" not in card.data.to_dict()
        assert "## Evaluation results" not in card.text
        assert card.data.base_model == [BASE_ID, "someone/clip-beta"]  # still a valid card
        assert bool(caplog.records) == (evaluation is not None)

    evaluation = _evaluation(heads=False)
    evaluation["beta"]["calibrated"]["accuracy"] = math.nan
    card = _card(tmp_path, "nan", evaluation=evaluation)
    assert ("beta", "accuracy (calibrated)") not in _metrics(card)  # no value, no metric
    assert _metrics(card)[("beta", "accuracy (merged, before FeatCal)")] == pytest.approx(0.6)
    assert {r.task_type for r in card.data.eval_results} == {"text-classification"}
    assert "| beta | 80.0 | 60.0 | — |" in card.text


def test_evaluation_passed_as_metrics_and_a_merged_card(tmp_path):
    text = render_model_card(
        title="m", recipe={"merge": {"method": "ties"}}, inputs={}, metrics=_evaluation()
    )
    card = ModelCard(text)
    assert _metrics(card) == pytest.approx(
        {
            ("alpha", "accuracy (merged)"): 0.5,
            ("alpha", "accuracy (merged + refit heads)"): 0.75,
            ("beta", "accuracy (merged)"): 0.6,
            ("beta", "accuracy (merged + refit heads)"): 0.7,
        }
    )
    assert card.data.eval_results[0].task_type == "other"  # modality unknown
    assert "base_model" not in card.data.to_dict() and "## Metrics" not in text


def test_a_hub_calibration_source_shows_its_dataset_commit():
    from featcal_core.provenance.model_card import _with_commit

    source = "hub ylecun/mnist, split train"
    assert _with_commit(source, "b" * 40) == f"{source} (commit {'b' * 12})"
    assert _with_commit(source, None) == source  # offline or local: the rows' digest only


def test_model_index_names_the_hub_dataset_split_revision_and_rows(tmp_path):
    from featcal_core.provenance.card_metadata import evaluation_datasets
    from featcal_core.provenance.records import EVALUATION_SOURCE

    tasks = {
        "alpha": {"evaluation": {"hub": "owner/alpha-data", "split": "test", "revision": "main"}},
        "beta": {"evaluation": {"path": str(tmp_path / "beta_eval"), "split": "test"}},
    }
    data_root = tmp_path / "evaluation_data"
    (data_root / "alpha").mkdir(parents=True)
    identity = ["hub", "owner/alpha-data", None, "test", "main"]
    (data_root / "alpha" / EVALUATION_SOURCE).write_text(
        json.dumps({"identity": identity, "commit": "d" * 40})
    )
    datasets = evaluation_datasets(tasks, data_root)
    assert datasets["alpha"]["revision"] == "d" * 40  # the commit the saved rows came from
    assert datasets["beta"] == {
        "type": "beta_eval",
        "split": "test",
        "source": datasets["beta"]["source"],
    }
    evaluation = _evaluation(heads=False)
    for row in evaluation["alpha"].values():
        row.update(examples=48, split_rows=397)  # evaluation.max_examples_per_task: 48

    card = _card(tmp_path, evaluation=evaluation, datasets=datasets)
    alpha = [r for r in card.data.eval_results if r.dataset_name == "alpha"]
    assert alpha and all(
        (r.dataset_type, r.dataset_split, r.dataset_revision)
        == ("owner/alpha-data", "test", "d" * 40)
        for r in alpha
    )
    assert all(r.dataset_args == {"rows_evaluated": 48, "rows_in_split": 397} for r in alpha)
    beta = next(r for r in card.data.eval_results if r.dataset_name == "beta")
    assert (beta.dataset_type, beta.dataset_split, beta.dataset_revision) == (
        "beta_eval",
        "test",
        None,
    )
    assert beta.dataset_args == {"rows_evaluated": 20}  # split_rows not recorded
    index = card.data.to_dict()["model-index"][0]["results"][0]["dataset"]
    assert index["type"] == "owner/alpha-data" and index["args"]["rows_in_split"] == 397
    assert f"| alpha | `owner/alpha-data` | — | test | `{'d' * 40}` | 48 | 397 |" in card.text

    # another source than the saved rows': the revision asked for, not the saved commit
    tasks["alpha"]["evaluation"]["revision"] = "v2"
    assert evaluation_datasets(tasks, data_root)["alpha"]["revision"] == "v2"


def test_an_lm_eval_task_is_named_by_itself_and_scored_by_its_metric():
    """A harness row keeps its lm-eval metric (not "accuracy") and is never given the dataset of
    a featcal task that happens to share its name."""
    from featcal_core.provenance.card_metadata import eval_results

    row = {"accuracy": 0.25, "metric": "acc_norm", "examples": 16, "task_rows": 40}
    evaluation = {
        "toy": {"calibrated": {**row, "evaluator": "lm-eval 0.4.13"}},
        "own": {"calibrated": {"accuracy": 0.5, "examples": 8, "split_rows": 9}},
    }
    table = {
        task: {"calibrated": rows["calibrated"]["accuracy"]} for task, rows in evaluation.items()
    }
    datasets = {"toy": {"type": "someone/toy", "split": "test"}, "own": {"type": "me/own"}}
    by_task = {
        r.dataset_name: r for r in eval_results(table, "calibrated", "text", datasets, evaluation)
    }
    toy, own = by_task["toy"], by_task["own"]
    assert (toy.metric_type, toy.dataset_type, toy.dataset_split) == ("acc_norm", "toy", None)
    assert toy.metric_name.startswith("acc_norm") and toy.metric_value == 0.25
    assert toy.dataset_args == {"rows_evaluated": 16, "rows_in_split": 40}
    assert (own.metric_type, own.dataset_type) == ("accuracy", "me/own")
    assert own.dataset_args == {"rows_evaluated": 8, "rows_in_split": 9}
