"""`select:`: the choice among candidates on held-out unlabeled inputs (or validation data).

Units: the choice and the rank correlation against brute force, the label-free scores against a
hand computation, the held-out draw (disjoint from the calibration set), the params checks. End
to end: `featcal run` with select: on tiny checkpoints (real Prefect flow, real MLflow store),
then the single steps that apply the recorded choice, and a stale choice refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_pipeline import write_params

from featcal_core.data.calibration_sets import sample_rows
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.agreement import HeadOutputs, agreement_scores
from featcal_core.evaluation.selection import choose, spearman
from featcal_core.params import load_params

CANDIDATES = [
    {"name": "ta", "set": ["repair.method=none"]},
    {"name": "ta-featcal", "set": []},
    {"name": "ties-featcal", "set": ["merge.method=ties", "featcal.alpha=0.5"]},
]


# ------------------------------------------------------------------------------------- units
def test_choose_ranks_by_mean_over_tasks_in_the_scores_direction():
    scores = {
        "a": {"x": {"agreement": 80.0, "drift": 0.5}, "y": {"agreement": 60.0, "drift": 0.1}},
        "b": {"x": {"agreement": 70.0, "drift": 0.2}, "y": {"agreement": 90.0, "drift": 0.3}},
        "c": {"x": {"agreement": 75.0, "drift": 0.2}, "y": {"agreement": 85.0, "drift": 0.3}},
    }
    up = choose(scores, "agreement")
    assert up["means"] == pytest.approx({"a": 70.0, "b": 80.0, "c": 80.0})
    assert up["ranking"] == ["b", "c", "a"] and up["winner"] == "b"  # a tie goes to the first
    assert "b: 80 % agreement" in up["why"] and "next best (c)" in up["why"]
    down = choose(scores, "drift")
    assert down["ranking"] == ["b", "c", "a"] and not down["higher_is_better"]
    with pytest.raises(FeatCalError, match="not one of"):
        choose(scores, "accuracy")


def test_an_ineligible_candidate_is_ranked_but_never_wins():
    scores = {
        "surgery": {"x": {"agreement": 95.0}},
        "a": {"x": {"agreement": 80.0}},
        "b": {"x": {"agreement": 70.0}},
    }
    choice = choose(scores, "agreement", {"surgery": "adds a module per task"})
    assert choice["ranking"] == ["surgery", "a", "b"] and choice["winner"] == "a"
    assert "next best (b)" in choice["why"]
    assert "ranked above it but not eligible: surgery (95: adds a module per task)" in choice["why"]
    assert choose(scores, "agreement")["winner"] == "surgery"  # eligible when nothing says not
    with pytest.raises(FeatCalError, match="no candidate may win"):
        choose({"surgery": scores["surgery"]}, "agreement", {"surgery": "adds a module per task"})


def test_spearman_matches_the_pearson_correlation_of_average_ranks():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(3, 9))
        xs = rng.integers(0, 4, n).astype(float).tolist()  # with ties
        ys = rng.normal(size=n).tolist()
        ranks = []
        for values in (xs, ys):  # brute force: each value's rank = mean position of its equals
            ordered = sorted(values)
            ranks.append(
                [np.mean([i + 1 for i, v in enumerate(ordered) if v == x]) for x in values]
            )
        if np.std(ranks[0]) == 0:
            assert spearman(xs, ys) is None
            continue
        assert spearman(xs, ys) == pytest.approx(np.corrcoef(*ranks)[0, 1])
    assert spearman([1.0, 2.0], [2.0, 1.0]) is None


def test_agreement_scores_by_hand():
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    expert_logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 3.0]])
    expert = HeadOutputs(features, expert_logits)
    model_logits = torch.tensor([[1.0, 0.0], [0.5, 0.0], [0.0, 2.0]])
    model = HeadOutputs(torch.tensor([[1.0, 1.0], [0.0, 2.0], [0.0, 0.0]]), model_logits)
    assert model.predictions.tolist() == [0, 0, 1]
    scores = agreement_scores(model, expert)
    assert scores["agreement"] == pytest.approx(200 / 3) and scores["examples"] == 3
    assert scores["drift"] == pytest.approx((1 / 1 + 0 / 4 + 25 / 25) / 3)
    # KL(p ‖ q) = Σ_c p_c log(p_c / q_c), written out with plain exponentials per row
    kl = 0.0
    for e_row, m_row in zip(expert_logits.tolist(), model_logits.tolist(), strict=True):
        p = [math.exp(v) / sum(math.exp(w) for w in e_row) for v in e_row]
        q = [math.exp(v) / sum(math.exp(w) for w in m_row) for v in m_row]
        kl += sum(pc * math.log(pc / qc) for pc, qc in zip(p, q, strict=True))
    assert scores["kl"] == pytest.approx(kl / 3, rel=1e-9) and scores["kl"] > 0
    assert agreement_scores(expert, expert)["kl"] == 0.0
    with pytest.raises(FeatCalError, match="same rows"):
        agreement_scores(HeadOutputs(torch.zeros(2, 2), torch.zeros(2, 2)), expert)
    with pytest.raises(FeatCalError, match="logits differ"):
        agreement_scores(HeadOutputs(features, torch.zeros(3, 5)), expert)


def test_held_out_rows_avoid_the_calibration_rows():
    drawn = sample_rows(100, 30, seed=3)
    held = sample_rows(100, 20, seed=3, exclude=drawn)
    assert len(held) == 20 and not set(held) & set(drawn) and held == sorted(held)
    assert held == sample_rows(100, 20, seed=3, exclude=drawn)  # deterministic
    assert sorted(sample_rows(10, 50, seed=0, exclude=range(4))) == list(range(4, 10))


def _params(tmp_path, select):
    path = tmp_path / "p.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "models": {"base": "a/b", "experts": {"t": "a/c"}},
                "tasks": {
                    "t": {
                        "calibration": {"path": "d", "split": "train"},
                        "evaluation": {"path": "d", "split": "test"},
                    }
                },
                "select": select,
            }
        )
    )
    return path


@pytest.mark.parametrize(
    ("select", "message"),
    [
        ({"candidates": [{"name": "a", "set": []}]}, "select.candidates"),
        ({"candidates": [{"name": "a", "set": []}, {"name": "a", "set": []}]}, "appears twice"),
        (
            {
                "candidates": [
                    {"name": "a", "set": ["tasks.t.evaluation.split=x"]},
                    {"name": "b", "set": []},
                ]
            },
            "a variant may set only",
        ),
        (
            {
                "candidates": [
                    {"name": "a", "set": ["featcal.num_per_task=64"]},
                    {"name": "b", "set": []},
                ]
            },
            "may not change featcal.num_per_task",
        ),
        (
            {
                "score": "validation",
                "candidates": [{"name": "a", "set": []}, {"name": "b", "set": []}],
            },
            "tasks.t.validation",
        ),
        (
            {
                "holdout_per_task": 0,
                "candidates": [{"name": "a", "set": []}, {"name": "b", "set": []}],
            },
            "select.holdout_per_task",
        ),
    ],
)
def test_bad_select_sections_fail_with_the_key(tmp_path, select, message):
    with pytest.raises(FeatCalError, match=message):
        load_params(_params(tmp_path, select))


def test_a_candidate_override_that_does_not_validate_is_named(tmp_path):
    from featcal.flows.selection_record import check_candidates

    params = load_params(
        _params(
            tmp_path,
            {"candidates": [{"name": "a", "set": []}, {"name": "b", "set": ["featcal.alpha=-1"]}]},
        )
    )
    with pytest.raises(FeatCalError, match="select.candidates 'b':.*featcal.alpha"):
        check_candidates(params)


def test_the_users_set_wins_over_every_candidate_of_the_demo_params():
    """`--set featcal.alpha=0.5` on the root params.yaml: every candidate runs with α 0.5 (its own
    α is replaced, and the record says so); a key under a candidate's mapping merges into it."""
    from featcal.flows.selection_record import candidate_overrides, candidate_params

    root = Path(__file__).resolve().parents[1] / "params.yaml"
    plain = load_params(root)
    assert {c.name for c in plain.select.candidates if any("featcal.alpha" in o for o in c.set)}
    params = load_params(
        root, ["featcal.alpha=0.5", "merge.hyperparameters.scale=0.7", "tracking.enabled=false"]
    )
    for candidate in params.select.candidates:
        sets, replaced = candidate_overrides(params, candidate)
        assert sets[-2:] == ["featcal.alpha=0.5", "merge.hyperparameters.scale=0.7"]
        assert all(o in replaced for o in candidate.set if o.startswith("featcal.alpha="))
        chosen = candidate_params(params, candidate.name, sets)
        own = candidate_params(plain, candidate.name, candidate_overrides(plain, candidate)[0])
        assert chosen.featcal.alpha == 0.5
        assert chosen.merge.hyperparameters.get("scale") == 0.7
        # everything else stays the candidate's own
        assert chosen.merge.method == own.merge.method
        assert chosen.repair.method == own.repair.method
        assert chosen.featcal.lam == own.featcal.lam
        hps = {k: v for k, v in own.merge.hyperparameters.items() if k != "scale"}
        assert {k: v for k, v in chosen.merge.hyperparameters.items() if k != "scale"} == hps


def test_the_users_set_wins_over_every_compare_variant(tmp_path):
    from featcal.flows.compare import load_compare, variant_set

    path = _params(tmp_path, None)
    data = yaml.safe_load(path.read_text())
    data["compare"] = {
        "variants": [
            {"name": "a", "set": ["featcal.alpha=1.0", "merge.method=ties"]},
            {
                "name": "b",
                "set": ["merge.method=ties", "merge.hyperparameters={scale: 0.5, top_k: 20}"],
            },
        ]
    }
    path.write_text(yaml.safe_dump(data))
    params, variants = load_compare(
        str(path), ["featcal.alpha=0.5", "merge.hyperparameters.scale=0.9"]
    )
    assert variants["a"].featcal.alpha == variants["b"].featcal.alpha == 0.5
    assert variants["a"].merge.method == "ties"
    assert variants["b"].merge.hyperparameters == {"scale": 0.9, "top_k": 20}
    assert variant_set(params, "a") == [
        "merge.method=ties",
        "featcal.alpha=0.5",
        "merge.hyperparameters.scale=0.9",
    ]


def test_a_dvc_experiments_changed_params_win_as_a_set_does(tmp_path, monkeypatch):
    """Inside `dvc exp run -S featcal.alpha=0.5` (DVC_EXP_BASELINE_REV set), the keys the
    experiment changed against the baseline commit's params file are the user's --set."""
    from featcal.flows.selection_record import candidate_overrides
    from featcal_cli.step_runner import BASELINE, experiment_set

    root = Path(__file__).resolve().parents[1] / "params.yaml"
    path = tmp_path / "params.yaml"
    path.write_text(root.read_text())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    for cmd in (["init", "-q"], ["add", "params.yaml"], ["commit", "-qm", "p"]):
        subprocess.run([*git, *cmd], check=True, capture_output=True)
    data = yaml.safe_load(path.read_text())
    data["featcal"]["alpha"] = 0.5  # what `-S featcal.alpha=0.5` writes
    data["merge"]["hyperparameters"] = {"scale": 0.7}
    data["evaluation"]["batch_size"] = 7  # not a candidate key: stays the file's own
    path.write_text(yaml.safe_dump(data))
    assert experiment_set(path) == []  # outside an experiment
    monkeypatch.setenv(BASELINE, "HEAD")
    found = experiment_set(path)
    assert found == ['merge.hyperparameters={"scale": 0.7}', "featcal.alpha=0.5"]
    params = load_params(path, found)
    for candidate in params.select.candidates:
        sets, _ = candidate_overrides(params, candidate)
        assert sets[-2:] == found
    monkeypatch.setenv(BASELINE, "0" * 40)  # an unknown commit: a warning, no overrides
    assert experiment_set(path) == []


def test_validation_data_may_not_be_the_evaluation_data(tmp_path):
    path = _params(tmp_path, None)
    with pytest.raises(FeatCalError, match="tasks.t.validation.*tuned-on-test"):
        load_params(path, ["tasks.t.validation={path: d, split: test}"])


# ---------------------------------------------------------------------------------- end to end
def _select_params(tmp_path):
    path = write_params(tmp_path)
    params = yaml.safe_load(path.read_text())
    params["run"]["name"] = "sel"
    params["select"] = {"holdout_per_task": 6, "candidates": CANDIDATES}
    path.write_text(yaml.safe_dump(params))
    return path


def _cli(tmp_path, env, *args):
    cmd = [sys.executable, "-m", "featcal_cli.main", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_run_chooses_a_candidate_and_runs_it(tmp_path, prefect_api):
    params_path = _select_params(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": uri,
        "PREFECT_API_URL": prefect_api,
    }
    # the user's --set wins over a candidate's own setting of the same key
    user = ["featcal.alpha=0.3"]
    proc = _cli(tmp_path, env, "run", "--params", str(params_path), "--set", user[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = tmp_path / "results"
    record = json.loads((results / "selection.json").read_text())
    assert record["user_set"] == user
    by_name = {c["name"]: c for c in record["candidates"]}
    assert by_name["ties-featcal"]["replaced_by_user_set"] == ["featcal.alpha=0.5"]
    assert by_name["ties-featcal"]["set"] == ["merge.method=ties", *user]
    for name in ("ta-featcal", "ties-featcal"):
        calibrated = results / "candidates" / name / "calibrated" / "featcal.json"
        assert json.loads(calibrated.read_text())["hyperparameters"]["alpha"] == 0.3
    names = [c["name"] for c in CANDIDATES]
    assert sorted(record["ranking"]) == sorted(names) and record["winner"] == record["ranking"][0]
    means = {c["name"]: c["mean"] for c in record["candidates"]}
    assert means[record["winner"]] == max(means.values())
    for candidate in record["candidates"]:
        for task in ("alpha", "beta"):
            scores = candidate["tasks"][task]
            assert 0 <= scores["agreement"] <= 100 and scores["drift"] >= 0
            assert scores["examples"] == 6
        assert candidate["mean"] == pytest.approx(
            np.mean([candidate["tasks"][t]["agreement"] for t in ("alpha", "beta")])
        )
    # the held-out inputs: none is a calibration row
    for task in ("alpha", "beta"):
        held = json.loads((results / "selection_sets" / task / "calibration_set.json").read_text())
        calib = json.loads(
            (results / "calibration_sets" / task / "calibration_set.json").read_text()
        )
        assert len(held["row_ids"]) == 6 and not set(held["row_ids"]) & set(calib["row_ids"])
    # the run went on with the winner's settings
    winner = next(c for c in CANDIDATES if c["name"] == record["winner"])
    merge = json.loads((results / "merged" / "merge.json").read_text())
    expected = "ties" if "merge.method=ties" in winner["set"] else "task_arithmetic"
    assert merge["method"] == expected
    assert (results / "calibrated").is_dir() == (winner["name"] != "ta")
    assert f"chosen: {record['winner']}" in proc.stdout and "mean agreement" in proc.stdout
    report = (tmp_path / "reports" / "sel" / "report.md").read_text()
    assert "Choice of settings (select:)" in report and record["why"] in report
    import mlflow

    client = mlflow.MlflowClient(uri)
    run = client.search_runs(
        [client.get_experiment_by_name("featcal").experiment_id],
        filter_string="tags.mlflow.runName = 'sel'",
    )[0]
    assert run.data.tags["select.winner"] == record["winner"]
    assert run.data.metrics[f"select/agreement/{record['winner']}"] == pytest.approx(
        means[record["winner"]]
    )

    # the single steps (DVC stages) apply the recorded choice; a changed select: asks for the
    # select step again before writing anything
    from featcal.flows.steps import Steps

    steps = Steps(load_params(params_path, user))
    assert steps.selection["winner"] == record["winner"] and steps.params.select is None
    assert steps.params.merge.method == expected and steps.params.featcal.alpha == 0.3
    # the choice was made under the user's --set: without it, it is not this params' choice
    assert Steps(load_params(params_path)).selection is None
    stale = Steps(load_params(params_path, [*user, "select.holdout_per_task=5"]))
    with pytest.raises(FeatCalError, match="featcal select --params FILE"):
        stale.merge()
    assert json.loads((results / "merged" / "merge.json").read_text())["method"] == expected

    # a second select (a rerun of `featcal run`) on steps that already run the winner chooses
    # again from the params as asked for, and keeps the record's key (it once wrote "no select:")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from featcal.flows.selection import select_step

    with temporary_settings(updates={PREFECT_API_URL: prefect_api}):
        again = select_step(steps)
    assert again["key"] == record["key"] and again["winner"] == record["winner"]
    assert [c["mean"] for c in again["candidates"]] == [c["mean"] for c in record["candidates"]]
    assert Steps(load_params(params_path, user)).selection["winner"] == record["winner"]


def test_scores_of_an_expert_against_itself_and_on_validation_data(tmp_path):
    """An expert scored against itself agrees on every held-out input with zero drift; with
    score validation, a candidate's score is its accuracy on the task's validation split."""
    from featcal.tasks.evaluate import task_head
    from featcal.tasks.selection import build_selection_sets, score_candidates
    from featcal_core.evaluation.accuracy import evaluate

    params = load_params(
        write_params(tmp_path),
        [
            f"tasks.{t}.validation={{path: {tmp_path / f'data_{t}'}, split: train}}"
            for t in ("alpha", "beta")
        ],
    )
    calibration = tmp_path / "results" / "calibration_sets"
    from featcal.tasks.calibration_sets import build_calibration_sets

    build_calibration_sets.fn(params, "image", str(calibration))
    sets = build_selection_sets.fn(params, "image", str(calibration), str(tmp_path / "held"), 5)
    assert all(r["n_rows"] == 5 for r in sets.values())
    base, experts = (
        str(params.models.base.path),
        {t: str(r.path) for t, r in params.models.experts.items()},
    )
    held = {t: str(tmp_path / "held" / t) for t in experts}
    candidates = {"alpha-expert": (experts["alpha"], None)}
    free = score_candidates.fn(params, base, experts, candidates, held, str(tmp_path / "results"))
    assert free["alpha-expert"]["alpha"] == {
        "agreement": 100.0,
        "drift": 0.0,
        "kl": 0.0,
        "examples": 5,
    }
    assert free["alpha-expert"]["beta"]["examples"] == 5
    labelled = score_candidates.fn(
        params, base, experts, candidates, held, str(tmp_path / "results"), "validation"
    )
    head, _ = task_head(
        "alpha",
        params.tasks["alpha"],
        params.models.base.path,
        params.models.experts["alpha"].path,
        tmp_path / "results",
    )
    direct = evaluate(experts["alpha"], head, tmp_path / "data_alpha", "train", progress=False)
    assert labelled["alpha-expert"]["alpha"]["validation"] == pytest.approx(
        100 * direct["accuracy"]
    )


def test_a_calibration_set_of_every_row_stops_select_early_and_skips_compare_scores(
    tmp_path,
):
    """A calibration set that holds every row of its source leaves nothing to hold out: select:
    stops with one line before any candidate runs, and compare goes on without label-free
    scores (a WARNING names the task)."""
    from featcal.flows.compare import _label_free
    from featcal.flows.selection import select
    from featcal.flows.steps import Steps

    params_path = _select_params(tmp_path)
    steps = Steps(load_params(params_path, ["featcal.num_per_task=20"]))  # train holds 20 rows
    steps.download()
    with pytest.raises(FeatCalError, match="does not exist; run `featcal calib-set`"):
        select(steps, None)  # no calibration sets yet: one line, not a traceback
    steps.calibration_sets()
    with pytest.raises(
        FeatCalError,
        match=r"tasks\.alpha\.calibration: all 20 rows are in the "
        r"calibration set.*lower featcal\.num_per_task",
    ):
        select(steps, None)
    assert not any(steps.paths["candidates"].glob("*")) and not steps.paths["merges"].exists()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # Prefect's logging config leaves caplog's root handler out
    logger = logging.getLogger("featcal.flows.compare")
    logger.addHandler(handler)
    try:
        assert _label_free(steps, steps.params, {}, {}, {}, steps.models()[0]) is None
    finally:
        logger.removeHandler(handler)
    (message,) = [r.getMessage() for r in records]
    assert "no label-free scores" in message and "alpha (20 rows)" in message
