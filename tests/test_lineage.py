"""Lineage (featcal_core/provenance/lineage.py, `featcal lineage`): a results layout built by hand with the
records' real shapes, traced, verified, tampered with; the model card; and one chain written by
the real writers (lock, calibration sets, merge, calibrate) on a tiny synthetic pool."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from featcal_cli import lineage_command
from featcal_cli.main import build_parser
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import sha256_file, sha256_tree
from featcal_core.provenance import lineage
from featcal_core.provenance.lineage import check, trace
from featcal_core.provenance.lineage_text import format_trace
from featcal_core.provenance.lock import read_lock, write_lock
from featcal_core.provenance.model_card import (
    model_card_fields,
    render_model_card,
    write_model_card,
)
from featcal_core.provenance.resolve import ResolvedModel

TASKS = ("alpha", "beta")
HUB_ID = "openai/clip-vit-base-patch32"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHARDS = (
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
)
SINGLE = ("model.safetensors",)
HYPERPARAMETERS = {
    "alpha": 0.25,
    "rho": 2.2,
    "lam": 0.05,
    "eps": 1e-08,
    "num_per_task": 3,
    "batch_size": 16,
    "seed": 7,
    "device": "cpu",
    "max_length": 128,
    "pooling": None,
    "pooled_position": 0,
}
PROVENANCE = {
    "git_commit": "c" * 40,
    "git_dirty": False,
    "mlflow_run_id": "4f1c2a9be0d34e6b",
    "prefect_flow_run_id": "7d0e5a52-1b2c-4d3e-8f90-123456789abc",
    "dvc_stage": "calibrate",
}


# ----- a hand-built results layout -------------------------------------------------------------
def _model(directory: Path, seed: int, weights: tuple[str, ...]) -> Path:
    """A directory shaped like a save_pretrained checkpoint (tiny fake files)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    for i, name in enumerate(weights):
        (directory / name).write_bytes(bytes([seed, i]) * 32)
    return directory


def _describe(directory: Path, weights: tuple[str, ...]) -> dict:
    """An `inputs` entry of merge.json / featcal.json (path resolved, sha256 per weight file)."""
    return {
        "path": str(directory.resolve()),
        "sha256": {name: sha256_file(directory / name) for name in weights},
    }


def _files(directory: Path, weights: tuple[str, ...]) -> dict[str, str]:
    """A lock entry's `files`: config.json plus every weight file."""
    return {name: sha256_file(directory / name) for name in ("config.json", *weights)}


def _calibration_set(directory: Path, task: str, seed: int, row_ids: list[int], total: int):
    """What draw_calibration_set writes: data files, then calibration_set.json with their digest."""
    directory.mkdir(parents=True)
    (directory / "data-00000-of-00001.arrow").write_bytes(f"{task} rows {row_ids}".encode() * 8)
    (directory / "dataset_info.json").write_text(json.dumps({"features": {"image": {}}}))
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data"}]}))
    record = {
        "task": task,
        "source": f"path /data/{task} (split train)",
        "source_identity": ["local", f"/data/{task}", "train"],
        "split": "train",
        "modality": "image",
        "columns": {"input": "image", "label": "label"},
        "seed": seed,
        "n_requested": len(row_ids),
        "rows_available": total,
        "n_rows": len(row_ids),
        "row_ids": row_ids,
    }
    record["digest"] = sha256_tree(directory)
    (directory / "calibration_set.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _backdate(root: Path, seconds: float = 1000.0) -> None:
    """Make every file look written `seconds` ago (the run is over before anyone tampers)."""
    then = time.time() - seconds
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (then, then))


@pytest.fixture
def run(tmp_path) -> dict[str, Path]:
    """models/ (a Hub-like base, local experts) and results/ in the pipeline's layout."""
    models = tmp_path / "models"
    base = _model(models / "base", 1, SHARDS)
    experts = {t: _model(models / f"expert_{t}", 10 + i, SINGLE) for i, t in enumerate(TASKS)}
    results = tmp_path / "results"
    results.mkdir()

    # models.lock.json, by the real writer
    write_lock(
        results / "models.lock.json",
        ResolvedModel(
            role="models.base",
            reference=f"{HUB_ID}@main",
            kind="hub",
            path=base,
            commit=COMMIT,
            files=_files(base, SHARDS),
            repo_id=HUB_ID,
            revision="main",
        ),
        {
            t: ResolvedModel(
                role=f"models.experts.{t}",
                reference=str(p),
                kind="local",
                path=p,
                commit=None,
                files=_files(p, SINGLE),
            )
            for t, p in experts.items()
        },
        {"architecture": "hf-clip-vision"},
    )

    sets = {
        t: _calibration_set(results / "calibration_sets" / t, t, 7, [2, 5, 11], 20) for t in TASKS
    }

    merged = _model(results / "merged", 2, SHARDS)
    (merged / "merge.json").write_text(
        json.dumps(
            {
                "merge_record_version": 1,
                "method": "task_arithmetic",
                "hyperparameters": {"scale": 0.3},
                "inputs": {
                    "base": _describe(base, SHARDS),
                    "experts": {t: _describe(p, SINGLE) for t, p in experts.items()},
                },
                "tensors": {"merged": 40, "copied": 2},
                "wall_seconds": 1.5,
                "peak_rss_bytes": 1 << 30,
            },
            indent=2,
        )
    )

    (results / "calibration").mkdir()
    calibrated = _model(results / "calibrated", 3, SHARDS)
    (calibrated / "featcal.json").write_text(
        json.dumps(
            {
                "featcal_record_version": 1,
                "architecture": "hf-clip-vision",
                "hyperparameters": HYPERPARAMETERS,
                "inputs": {
                    "base": _describe(base, SHARDS),
                    "merged": _describe(merged, SHARDS),
                    "experts": {t: _describe(p, SINGLE) for t, p in experts.items()},
                    "calibration": {
                        t: {
                            "path": str((results / "calibration_sets" / t).resolve()),
                            "sha256": sha256_tree(results / "calibration_sets" / t),
                            "rows": sets[t]["n_rows"],
                            "indices": [0, 1, 2],
                        }
                        for t in TASKS
                    },
                },
                "blocks": [
                    {
                        "index": i,
                        "seconds": 0.1,
                        "restored": i == 0,
                        "drift_before": {t: 1.0 for t in TASKS},
                        "drift_after": {t: 0.1 for t in TASKS},
                    }
                    for i in range(3)
                ],
                "wall_seconds": 3.2,
                "peak_rss_bytes": 1 << 30,
                "peak_device_bytes": 0,
                "results_dir": str((results / "calibration").resolve()),
                "inputs_digest": "f" * 64,
            },
            indent=2,
        )
    )

    def row(accuracy, expert):
        return {
            "accuracy": accuracy,
            "loss": 1 - accuracy,
            "examples": 50,
            "normalized": accuracy / expert if expert else float("nan"),
        }

    (results / "evaluation.json").write_text(
        json.dumps(
            {
                "alpha": {
                    "expert": row(0.9, 0.9),
                    "merged": row(0.6, 0.9),
                    "calibrated": row(0.8, 0.9),
                },
                "beta": {
                    "expert": row(0.0, 0.0),
                    "merged": row(0.5, 0.0),
                    "calibrated": row(0.7, 0.0),
                },
            },
            indent=2,
        )
    )
    (results / "provenance.json").write_text(json.dumps(PROVENANCE))
    (results / "report").mkdir()
    (results / "report" / "report.md").write_text("# report\n")
    _backdate(tmp_path)
    return {
        "root": tmp_path,
        "base": base,
        "experts": experts,
        "results": results,
        "merged": merged,
        "calibrated": calibrated,
        "sets": results / "calibration_sets",
    }


def _tamper(path: Path) -> None:
    with open(path, "ab") as handle:
        handle.write(b"\x00")


# ----- trace -----------------------------------------------------------------------------------
def test_record_names_are_the_writers():
    from featcal_core.data import calibration_sets
    from featcal_core.merging import run as merging_run
    from featcal_core.method import calibration

    assert lineage.FEATCAL_RECORD == calibration.RECORD_NAME
    assert lineage.MERGE_RECORD == merging_run.RECORD_NAME
    assert lineage.SET_RECORD == calibration_sets.RECORD_NAME


def test_trace_of_calibrated_checkpoint_finds_the_chain(run):
    result = trace(run["calibrated"])
    assert result["problems"] == [], result["problems"]
    assert result["kind"] == "calibrated"
    assert result["checkpoint"] == str(run["calibrated"].resolve())
    chain = result["chain"]
    assert chain["results_dir"] == str(run["results"].resolve())
    assert chain["calibrated"]["hyperparameters"]["alpha"] == 0.25
    assert chain["calibrated"]["blocks"] == 3 and chain["calibrated"]["restored"] == 1
    assert chain["merged"]["method"] == "task_arithmetic"
    assert chain["merged"]["hyperparameters"] == {"scale": 0.3}
    assert chain["merged"]["record"] == str(run["merged"].resolve() / "merge.json")
    assert set(chain["merged"]["files"]) == set(SHARDS)

    base = chain["base"]
    assert base["reference"] == f"{HUB_ID}@main" and base["commit"] == COMMIT
    assert base["revision"] == "main" and base["kind"] == "hub"
    assert set(base["files"]) == {"config.json", *SHARDS}  # config.json: from the lock
    assert all(f["status"] == "ok" for f in base["files"].values())
    assert base["files"][SHARDS[0]]["sha256"] == sha256_file(run["base"] / SHARDS[0])
    assert len(base["recorded_in"]) == 3  # featcal.json, merge.json, models.lock.json
    assert set(chain["experts"]) == set(TASKS)
    assert chain["experts"]["alpha"]["kind"] == "local"

    assert chain["lock"]["lock_digest_ok"]
    assert (
        chain["lock"]["lock_digest"]
        == read_lock(run["results"] / "models.lock.json")["lock_digest"]
    )
    sets = chain["calibration_sets"]
    assert set(sets) == set(TASKS)
    record = json.loads((run["sets"] / "alpha" / "calibration_set.json").read_text())
    assert sets["alpha"]["row_ids"] == [2, 5, 11] and sets["alpha"]["n_rows"] == 3
    assert sets["alpha"]["digest"] == record["digest"] and sets["alpha"]["status"] == "ok"
    assert sets["alpha"]["seed"] == 7 and sets["alpha"]["indices"] == [0, 1, 2]

    assert chain["evaluation"]["alpha"]["calibrated"]["accuracy"] == 0.8
    assert chain["provenance"] == PROVENANCE
    assert result["verified"]["calibration_sets"] == 2
    # base 4 files, 2 experts x 2, merged 3
    assert result["verified"]["files"] == 4 + 2 * 2 + 3
    assert check(run["calibrated"])["problems"] == []

    text = format_trace(result)
    assert text.startswith(f"lineage of {run['calibrated'].resolve()}")
    assert "task_arithmetic" in text and COMMIT in text and "2, 5, 11" in text
    assert "all recorded inputs verify" in text and "CHANGED" not in text


def test_trace_of_results_dir_report_dir_and_record_file(run):
    by_checkpoint = trace(run["calibrated"])["chain"]
    for where in (run["results"], run["results"] / "report", run["calibrated"] / "featcal.json"):
        result = trace(where)
        assert result["problems"] == [], where
        assert result["chain"]["calibrated"] == by_checkpoint["calibrated"]
        assert result["chain"]["calibration_sets"] == by_checkpoint["calibration_sets"]
    assert trace(run["results"])["kind"] == "results"
    assert trace(run["results"] / "report")["kind"] == "results"


def test_trace_of_merged_checkpoint(run):
    result = trace(run["merged"])
    assert result["problems"] == []
    assert result["kind"] == "merged"
    chain = result["chain"]
    assert chain["calibrated"] is None and chain["calibration_sets"] == {}
    assert chain["merged"]["method"] == "task_arithmetic"
    assert chain["base"]["commit"] == COMMIT and chain["lock"]["lock_digest_ok"]


def test_report_dir_pointing_elsewhere_with_provenance_json(run, tmp_path):
    report = tmp_path / "elsewhere" / "report"
    report.mkdir(parents=True)
    (report / "provenance.json").write_text(
        json.dumps({"results_dir": os.path.relpath(run["results"], report), "mlflow_run_id": "X"})
    )
    result = trace(report)
    assert result["problems"] == [] and result["kind"] == "results"
    assert result["chain"]["provenance"]["mlflow_run_id"] == "X"  # the nearest file wins
    assert result["chain"]["provenance"]["dvc_stage"] == "calibrate"


def test_results_dir_moved_uses_its_layout(run, tmp_path):
    moved = tmp_path / "moved-results"
    shutil.move(run["results"], moved)
    result = trace(moved / "calibrated")
    assert result["problems"] == [], result["problems"]
    assert result["chain"]["merged"]["path"] == str(moved / "merged")
    assert result["chain"]["calibration_sets"]["alpha"]["path"] == str(
        moved / "calibration_sets" / "alpha"
    )
    assert any("does not exist; using" in note for note in result["notes"])


def test_not_a_traceable_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeatCalError, match="holds no featcal.json"):
        trace(tmp_path / "empty")
    with pytest.raises(FeatCalError, match="is not a directory"):
        trace(tmp_path / "nothing-here")


# ----- verification --------------------------------------------------------------------------
def test_changed_weight_file_is_a_problem_and_check_raises(run):
    weight = run["experts"]["beta"] / "model.safetensors"
    _tamper(weight)
    result = trace(run["calibrated"])
    assert len(result["problems"]) == 1, result["problems"]
    problem = result["problems"][0]
    assert problem["file"] == str(weight.resolve()) and problem["kind"] == "changed"
    assert str(weight.resolve()) in problem["message"]
    recorded = {Path(p).name for p in problem["recorded_in"]}
    assert recorded == {"featcal.json", "merge.json", "models.lock.json"}
    assert result["chain"]["experts"]["beta"]["files"]["model.safetensors"]["status"] == "changed"
    assert "CHANGED" in format_trace(result)

    with pytest.raises(FeatCalError) as raised:
        check(run["calibrated"])
    message = str(raised.value)
    assert "\n" not in message
    assert str(weight.resolve()) in message and "rerun the pipeline" in message
    assert "other problem" not in message


def test_missing_weight_file_and_other_problems_are_counted(run):
    missing = run["base"] / SHARDS[1]
    missing.unlink()
    _tamper(run["merged"] / SHARDS[0])
    result = trace(run["calibrated"])
    kinds = {(Path(p["file"]).name, p["kind"]) for p in result["problems"]}
    assert (SHARDS[0], "changed") in kinds and (SHARDS[1], "missing") in kinds
    assert len(result["problems"]) == 2
    assert result["chain"]["base"]["files"][SHARDS[1]]["status"] == "missing"
    with pytest.raises(FeatCalError, match=r"1 other problem: featcal lineage"):
        check(result)


def test_changed_calibration_set_file_is_named(run):
    data = run["sets"] / "beta" / "data-00000-of-00001.arrow"
    _tamper(data)
    result = trace(run["calibrated"])
    assert len(result["problems"]) == 1, result["problems"]
    problem = result["problems"][0]
    assert problem["kind"] == "digest"
    assert problem["file"] == str(data.resolve())  # the one file changed after the record
    assert data.name in problem["message"] and str(data.parent.resolve()) in problem["message"]
    recorded = {Path(p).name for p in problem["recorded_in"]}
    assert recorded == {"calibration_set.json", "featcal.json"}
    assert result["chain"]["calibration_sets"]["beta"]["status"] == "changed"
    assert result["chain"]["calibration_sets"]["alpha"]["status"] == "ok"
    with pytest.raises(FeatCalError, match=data.name):
        check(run["calibrated"])


def test_changed_calibration_set_without_time_hint_names_its_directory(run):
    directory = run["sets"] / "alpha"
    _tamper(directory / "state.json")
    _backdate(directory, 10)  # every file equally recent: no hint which one changed
    problem = trace(run["calibrated"])["problems"][0]
    assert problem["file"] == str(directory.resolve())
    assert str(directory.resolve()) in problem["message"]


def test_edited_calibration_set_record_is_named(run):
    record_path = run["sets"] / "alpha" / "calibration_set.json"
    record = json.loads(record_path.read_text())
    record["seed"] = 8  # the data still matches its digest; featcal.json's sha256_tree does not
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    result = trace(run["calibrated"])
    assert [p["file"] for p in result["problems"]] == [str(record_path.resolve())]
    assert "featcal.json" in result["problems"][0]["message"]


def test_calibration_set_of_results_dir_without_featcal_record(run):
    shutil.rmtree(run["calibrated"])
    _tamper(run["sets"] / "alpha" / "state.json")
    result = trace(run["results"])
    assert result["chain"]["calibrated"] is None
    assert result["chain"]["merged"]["method"] == "task_arithmetic"
    assert [Path(p["file"]).name for p in result["problems"]] == ["state.json"]


def test_edited_lock_and_inconsistent_records(run):
    lock_path = run["results"] / "models.lock.json"
    lock = json.loads(lock_path.read_text())
    lock["architecture"] = "hf-bert"
    lock_path.write_text(json.dumps(lock, indent=2))
    merge_path = run["merged"] / "merge.json"
    merge = json.loads(merge_path.read_text())
    merge["inputs"]["base"]["sha256"][SHARDS[0]] = "0" * 64
    merge_path.write_text(json.dumps(merge, indent=2))
    result = trace(run["calibrated"])
    kinds = {p["kind"] for p in result["problems"]}
    assert {"lock", "inconsistent", "changed"} <= kinds
    assert not result["chain"]["lock"]["lock_digest_ok"]
    inconsistent = next(p for p in result["problems"] if p["kind"] == "inconsistent")
    assert inconsistent["file"] == str(merge_path.resolve())


def test_records_naming_different_tasks_are_inconsistent(run):
    merge_path = run["merged"] / "merge.json"
    merge = json.loads(merge_path.read_text())
    del merge["inputs"]["experts"]["beta"]
    merge_path.write_text(json.dumps(merge))
    problems = trace(run["calibrated"])["problems"]
    assert any(p["kind"] == "inconsistent" and "['alpha']" in p["message"] for p in problems)


def test_unreadable_record_is_a_problem(run):
    (run["merged"] / "merge.json").write_text("{not json")
    problems = trace(run["calibrated"])["problems"]
    assert [p["kind"] for p in problems] == ["record"]
    assert "merge.json" in problems[0]["message"]


# ----- model card ------------------------------------------------------------------------------
def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    head, _, _ = text[4:].partition("\n---\n")
    return yaml.safe_load(head)


def test_model_card_from_trace(run):
    stale = run["calibrated"] / "README.md"
    stale.write_text("---\nbase_model: someone/else\n---\nthe base model's card\n")
    result = trace(run["calibrated"])
    path = write_model_card(run["calibrated"], **model_card_fields(result))
    assert path == run["calibrated"] / "README.md"
    text = path.read_bytes().decode("utf-8")  # valid UTF-8
    front = _front_matter(text)  # the experts are local folders: only the base is a Hub id
    assert {k: v for k, v in front.items() if k != "model-index"} == {
        "library_name": "transformers",
        "base_model": [HUB_ID],
        "base_model_relation": "merge",
        "tags": [
            "featcal",
            "model-merging",
            "task_arithmetic",
            "hf-clip-vision",
            "clip_vision_model",
        ],
    }
    assert [r["dataset"]["name"] for r in front["model-index"][0]["results"]] == list(TASKS)
    body = text.split("\n---\n", 1)[1]
    assert "# calibrated: FeatCal-calibrated task_arithmetic merge of 2 experts" in body
    for section in ("## How it was made", "## Inputs", "## Evaluation results", "## Provenance"):
        assert section in body
    for number in ("α (alpha", "0.25", "ρ (rho", "2.2", "λ (lam", "0.05", "1e-08", "scale"):
        assert number in body
    assert "| n per task (calibration inputs per task) | 3 |" in body
    assert "| seed (calibration sample) | 7 |" in body
    assert f"`{HUB_ID}@main`" in body and COMMIT in body
    assert sha256_file(run["base"] / SHARDS[0]) in body
    assert sha256_file(run["experts"]["beta"] / "model.safetensors") in body
    digest = json.loads((run["sets"] / "beta" / "calibration_set.json").read_text())["digest"]
    assert digest in body
    assert "| alpha | calibrated | 0.8000 |" in body
    assert "| beta | expert | 0.0000 | — |" in body  # NaN normalized accuracy
    for value in ("c" * 40, PROVENANCE["mlflow_run_id"], PROVENANCE["prefect_flow_run_id"]):
        assert value in body
    assert "| DVC stage | `calibrate` |" in body
    for line in body.splitlines():  # every table row is closed
        if line.startswith("|"):
            assert line.endswith("|"), line
    assert sorted(p.name for p in run["calibrated"].iterdir() if p.name.startswith(".")) == []
    # the card is not part of any record: the chain still verifies
    assert trace(run["calibrated"])["problems"] == []


def test_model_card_arguments_by_hand(tmp_path):
    recipe = {
        "merge": {"method": "ties", "hyperparameters": {"scale": 1.0, "top_k": 20}},
        "featcal": {"alpha": 0.3, "rho": 1.5, "lambda": 0.01, "n_per_task": 64, "seed": 3},
    }
    inputs = {
        "base": {
            "reference": "./models/base",
            "kind": "local",
            "sha256": {"model.safetensors": "ab" * 32},
        },
        "experts": {
            "a|b": {
                "reference": "me/expert-a",
                "revision": "v1",
                "commit": "d" * 40,
                "sha256": {"model.safetensors": "cd" * 32},
            }
        },
        "calibration_sets": {"a|b": {"digest": "ef" * 32, "n_rows": 64, "seed": 3}},
    }
    path = write_model_card(
        tmp_path,
        title="My merged model",
        recipe=recipe,
        inputs=inputs,
        metrics={"a|b": {"accuracy": 0.91234, "examples": 10}},
    )
    text = path.read_text(encoding="utf-8")
    front = _front_matter(text)
    assert front["base_model"] == ["me/expert-a"]  # a local base is no Hub id; the expert is
    assert front["tags"] == ["featcal", "model-merging", "ties"]
    assert "model-index" not in front  # a flat metrics table is no evaluation table
    assert "| λ (lam, ridge weight) | 0.01 |" in text
    assert "| n per task (calibration inputs per task) | 64 |" in text
    assert "| top_k | 20 |" in text and "`ties`" in text
    assert "| a\\|b | 0.9123 | 10 |" in text  # pipes escaped, metrics rounded
    assert "## Provenance" not in text

    hub = render_model_card(
        title="t", recipe={}, inputs={"base": {"reference": f"{HUB_ID}@abc", "kind": "hub"}}
    )
    assert _front_matter(hub)["base_model"] == [HUB_ID]
    assert "FeatCal calibration: not applied." in hub

    with pytest.raises(FeatCalError, match="not a directory"):
        write_model_card(tmp_path / "missing", title="t", recipe={}, inputs={})


# ----- the command ------------------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_command_json_and_text(run, capsys):
    assert lineage_command.run(_parse(["lineage", str(run["calibrated"]), "--json"])) == 0
    data = _strict(capsys.readouterr().out)  # NaN written as null
    assert data["problems"] == [] and data["chain"]["merged"]["method"] == "task_arithmetic"
    assert data["chain"]["evaluation"]["beta"]["expert"]["normalized"] is None

    assert lineage_command.run(_parse(["lineage", str(run["results"])])) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"lineage of {run['results'].resolve()} (results directory)")
    assert "all recorded inputs verify" in out


def test_command_fails_on_a_changed_input(run, capsys):
    weight = run["merged"] / SHARDS[1]
    _tamper(weight)
    with pytest.raises(FeatCalError, match="rerun the pipeline"):
        lineage_command.run(_parse(["lineage", str(run["calibrated"]), "--json"]))
    data = _strict(capsys.readouterr().out)  # the chain is printed all the same
    assert [p["file"] for p in data["problems"]] == [str(weight.resolve())]
    with pytest.raises(FeatCalError):
        lineage_command.run(_parse(["lineage", str(run["calibrated"])]))
    assert "problems (1):" in capsys.readouterr().out


# ----- the real writers ---------------------------------------------------------------------------
def test_chain_written_by_the_real_writers(tmp_path):
    """Lock (resolve_model), calibration sets, merge and calibrate on a tiny synthetic pool."""
    import factories
    from featcal_core.data.calibration_sets import draw_calibration_set
    from featcal_core.merging.run import merge_checkpoints
    from featcal_core.method.calibration import calibrate
    from featcal_core.provenance.resolve import resolve_model

    zoo = factories.clip_zoo(tmp_path / "zoo", rows=6)
    results = tmp_path / "results"
    write_lock(
        results / "models.lock.json",
        resolve_model({"kind": "local", "path": str(zoo.base)}, "models.base"),
        {
            t: resolve_model({"kind": "local", "path": str(p)}, f"models.experts.{t}")
            for t, p in zoo.experts.items()
        },
        {"architecture": "hf-clip-vision"},
    )
    sets = {
        t: draw_calibration_set(
            t,
            {"path": str(p)},
            None,
            results / "calibration_sets" / t,
            n=4,
            seed=0,
            modality="image",
        )
        for t, p in zoo.calib.items()
    }
    merge_checkpoints(
        zoo.base,
        zoo.experts,
        results / "merged",
        "task_arithmetic",
        {"scale": 0.3},
        progress=False,
    )
    calibrate(
        zoo.base,
        results / "merged",
        zoo.experts,
        {t: s["path"] for t, s in sets.items()},
        results / "calibrated",
        num_per_task=3,
        seed=5,
        progress=False,
    )

    result = check(results / "calibrated")
    chain = result["chain"]
    assert chain["merged"]["method"] == "task_arithmetic" and chain["lock"]["lock_digest_ok"]
    assert chain["calibrated"]["hyperparameters"]["num_per_task"] == 3
    assert set(chain["calibration_sets"]) == set(zoo.experts)
    for task, record in sets.items():
        entry = chain["calibration_sets"][task]
        assert entry["digest"] == record["digest"] and entry["row_ids"] == record["row_ids"]
        assert entry["status"] == "ok" and len(entry["indices"]) == 3
    assert {Path(p).name for p in chain["base"]["recorded_in"]} == {
        "featcal.json",
        "merge.json",
        "models.lock.json",
    }

    card = write_model_card(results / "calibrated", **model_card_fields(result))
    assert "| seed (calibration sample) | 5 |" in card.read_text(encoding="utf-8")

    task = next(iter(sets))
    arrow = sorted((results / "calibration_sets" / task).glob("*.arrow"))[0]
    _backdate(results / "calibration_sets" / task)
    _tamper(arrow)
    problems = trace(results)["problems"]
    assert [p["file"] for p in problems] == [str(arrow.resolve())]


def test_relative_lock_paths_are_found_from_the_folders_above(run, monkeypatch):
    """A local model locked as `models/expert_alpha` (relative to the project root)."""
    lock_path = run["results"] / "models.lock.json"
    lock = read_lock(lock_path)
    base, experts = ResolvedModel.from_dict(lock["base"]), {}
    for task, entry in lock["experts"].items():
        model = ResolvedModel.from_dict(entry)
        model.path = model.path.relative_to(run["root"])
        experts[task] = model
    write_lock(lock_path, base, experts, {"architecture": "hf-clip-vision"})
    monkeypatch.chdir(run["results"] / "report")
    result = trace(run["calibrated"])
    assert result["problems"] == [], result["problems"]
    assert "paths" not in result["chain"]["experts"]["alpha"]  # one directory, however recorded


def test_report_dir_of_the_pipeline_is_found_by_its_lock_digest(run, tmp_path):
    """reports/<run name>/ (featcal_core.report) sits beside the results, not inside them."""
    from featcal_core.report import write_report

    def load(path: Path) -> dict:
        return json.loads(path.read_text())

    report = tmp_path / "reports" / "run-1"
    write_report(
        report,
        run_name="run-1",
        evaluation=load(run["results"] / "evaluation.json"),
        calibration=load(run["calibrated"] / "featcal.json"),
        merge=load(run["merged"] / "merge.json"),
        lock=load(run["results"] / "models.lock.json"),
    )
    result = trace(report)
    assert result["problems"] == [] and result["kind"] == "results"
    assert result["chain"]["results_dir"] == str(run["results"].resolve())
    assert result["chain"]["calibrated"]["hyperparameters"]["rho"] == 2.2

    other = tmp_path / "reports" / "run-2"
    other.mkdir()
    (other / "report.md").write_text(f"- lock digest: {'e' * 64}\n")
    with pytest.raises(FeatCalError, match="report directory"):
        trace(other)
