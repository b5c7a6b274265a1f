"""What `select:` refuses before any candidate runs (candidates none of which may win, a model no
candidate can be scored on), and `featcal lineage` on a comparison folder
(reports/<run>-compare/): traced to the results it compared, every file under its marker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from test_pipeline import write_params

from featcal_cli.main import main
from featcal_core.errors import FeatCalError
from featcal_core.params import load_params

SURGERIES = [
    {"name": "surgery-8", "set": ["repair.method=surgery", "repair.surgery_rank=8"]},
    {"name": "surgery-4", "set": ["repair.method=surgery", "repair.surgery_rank=4"]},
]


def _select_params(tmp_path: Path, candidates: list[dict]) -> Path:
    path = write_params(tmp_path)
    params = yaml.safe_load(path.read_text())
    params["select"] = {"holdout_per_task": 6, "candidates": candidates}
    path.write_text(yaml.safe_dump(params))
    return path


def test_candidates_none_of_which_may_win_are_refused_before_any_runs(tmp_path):
    """Every candidate repairs with per-task modules (a winner is one checkpoint): `featcal run`
    and the select step refuse in one line naming select.candidates and both ways out, before a
    folder is written or a merge runs."""
    from featcal.flows.pipeline import run_pipeline
    from featcal.flows.selection import select
    from featcal.flows.selection_record import check_candidates
    from featcal.flows.steps import Steps

    path = _select_params(tmp_path, SURGERIES)
    results = tmp_path / "results"
    started = time.monotonic()
    with pytest.raises(FeatCalError) as refused:
        run_pipeline(path)
    assert time.monotonic() - started < 30
    message = str(refused.value)
    assert message.startswith("select.candidates: none may win") and "\n" not in message
    assert "surgery" in message and "featcal" in message
    assert "select.allow_task_modules: true" in message
    assert not results.exists()

    # the select step (`featcal select`, the DVC stage): after the download and the sets, before
    # any merge or repair
    steps = Steps(load_params(path))
    steps.download()
    steps.calibration_sets()
    with pytest.raises(FeatCalError, match=r"^select\.candidates: none may win"):
        select(steps, None)
    assert not steps.paths["merges"].exists() and not steps.paths["candidates"].exists()
    assert not steps.paths["selection"].exists()

    # the user's --set makes every candidate a surgery: refused the same way
    mixed = _select_params(tmp_path / "mixed", [SURGERIES[0], {"name": "plain", "set": []}])
    check_candidates(load_params(mixed))  # one checkpoint candidate: it may win
    with pytest.raises(FeatCalError, match="select.candidates: none may win"):
        check_candidates(load_params(mixed, ["repair.method=surgery"]))
    check_candidates(load_params(path, ["select.allow_task_modules=true"]))  # opted in


def test_a_language_model_select_is_refused_before_any_candidate_runs(tmp_path, monkeypatch):
    """A generating language model has no head to score candidates under: the select step stops
    before the held-out sets, merges or repairs."""
    from transformers import LlamaConfig

    from featcal.flows import selection
    from featcal.flows.steps import Steps

    llama = tmp_path / "llama"
    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(llama)
    steps = Steps(load_params(_select_params(tmp_path, SURGERIES[:1] + [{"name": "p", "set": []}])))
    monkeypatch.setattr(Steps, "models", lambda self: (str(llama), {}))
    ran = []
    monkeypatch.setattr(selection, "run_merges", lambda *args: ran.append(args))
    monkeypatch.setattr(selection, "exhausted_tasks", lambda steps: ran.append(steps) or {})
    with pytest.raises(FeatCalError, match="select: causal language models have no"):
        selection.select(steps, None)
    assert ran == []


def _comparison(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A comparison folder as `featcal compare` writes it (flows.compare._report) beside the
    results it compared (lock and calibration sets by the real steps); (report, results)."""
    from featcal.flows.compare import _report
    from featcal.flows.steps import Steps
    from featcal_core.report.compare import comparison_rows

    params = load_params(write_params(tmp_path), ["run.name=cmp"])
    steps = Steps(params)
    lock = steps.download()
    steps.calibration_sets()
    evaluation = {
        t: {"expert": {"accuracy": 0.9}, "merged": {"accuracy": 0.5}, "v": {"accuracy": 0.7}}
        for t in params.tasks
    }
    variant = {
        "name": "v",
        "row": "v",
        "merge": {"method": "task_arithmetic", "hyperparameters": {"scale": 0.3}},
        "repair": "featcal",
        "set": [],
        "cost": {"merge_seconds": 1.0, "repair_seconds": 2.0, "peak_rss_mb": 100.0},
    }
    rows = comparison_rows(evaluation, [variant], "merged")
    monkeypatch.chdir(tmp_path)  # reports/ is relative to the project root
    summary = _report(params, rows, {}, evaluation, None, lock, steps.paths["root"])
    return Path(summary["report"]).resolve().parent, steps.paths["root"]


def test_lineage_verifies_a_comparison_folder_and_names_an_edited_file(
    tmp_path, monkeypatch, capsys
):
    report, results = _comparison(tmp_path, monkeypatch)
    record = json.loads((report / "compare.json").read_text())
    assert (report / record["results_dir"]).resolve() == results.resolve()
    assert main(["lineage", str(report)]) == 0
    out = capsys.readouterr().out
    assert "all recorded inputs verify" in out and str(results.resolve()) in out

    compare_md = report / "compare.md"
    compare_md.write_text(compare_md.read_text().replace("70.0", "99.0"))
    assert main(["lineage", str(report)]) == 2
    err = capsys.readouterr().err
    assert f"{compare_md} changed since it was written" in err and err.count("\n") == 1


def test_lineage_names_an_edited_comparison_record(tmp_path, monkeypatch, capsys):
    """compare.json edited: named, whether the edit keeps its pointer to the results or not."""
    report, _ = _comparison(tmp_path, monkeypatch)
    compare_json = report / "compare.json"
    original = compare_json.read_text()
    record = json.loads(original)
    record["variants"][0]["mean"]["accuracy"] = 99.0
    compare_json.write_text(json.dumps(record))
    assert main(["lineage", str(report)]) == 2
    assert f"{compare_json} changed since it was written" in capsys.readouterr().err
    compare_json.write_text("{")  # its pointer gone with it
    assert main(["lineage", str(report)]) == 2
    assert str(compare_json) in capsys.readouterr().err


def test_lineage_of_a_comparison_whose_results_were_rerun_on_other_models(
    tmp_path, monkeypatch, capsys
):
    report, results = _comparison(tmp_path, monkeypatch)
    lock = results / "models.lock.json"
    data = json.loads(lock.read_text())
    data["lock_digest"] = "0" * 64
    lock.write_text(json.dumps(data))
    assert main(["lineage", str(report)]) == 2
    err = capsys.readouterr().err
    assert f"{report / 'compare.json'} compared models of lock digest" in err
