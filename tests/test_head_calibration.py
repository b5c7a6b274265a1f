"""Head calibration: the closed form against brute-force least squares, and the refit head on a
real (tiny) BERT classification expert."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_evaluation import (  # noqa: F401  (module fixtures: tiny BERT expert, tiny CLIP)
    CLASS_NAMES,
    TEMPLATES,
    bert,
    clip,
)
from transformers import AutoTokenizer, BertForSequenceClassification

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.accuracy import evaluate, evaluate_linears
from featcal_core.evaluation.expert_head import ExpertHead
from featcal_core.evaluation.zero_shot_head import ZeroShotHead
from featcal_core.method.head_calibration import HeadStatistics, calibrate_head, fit_linear_head

DTYPE = torch.float64


def _stats(student: torch.Tensor, expert: torch.Tensor, batch: int = 7) -> HeadStatistics:
    stats = HeadStatistics(student.shape[1])
    for start in range(0, student.shape[0], batch):
        stats.add(student[start : start + batch], expert[start : start + batch])
    return stats


def _brute_force(student, expert, weight, bias, lam, eps=1e-8):
    """Weight: min s/N Σ‖W z_s − W_e z_e‖² + (λ+ε)‖W‖-ridge toward W_e (stacked lstsq);
    bias: min s/N Σ‖W z_s + b − y‖² + λ‖b − b_e‖² with the new W."""
    n, d = student.shape
    gram = student.T @ student / n
    s = 1.0 / float(torch.linalg.matrix_norm(gram))
    target = expert @ weight.T
    rows = [(s / n) ** 0.5 * student, ((lam + eps) ** 0.5) * torch.eye(d, dtype=DTYPE)]
    # ε regularises toward 0, λ toward W_e: rhs for the ridge rows is λ W_eᵀ / sqrt(λ+ε)
    rhs = [(s / n) ** 0.5 * target, (lam / (lam + eps) ** 0.5) * weight.T]
    solution = torch.linalg.lstsq(torch.cat(rows), torch.cat(rhs)).solution
    new_weight = solution.T
    logits = expert @ weight.T + bias
    residual = (logits - student @ new_weight.T).mean(0)
    new_bias = (s * residual + lam * bias) / (s + lam)
    return new_weight, new_bias


@pytest.mark.parametrize("lam", [0.0, 0.05, 3.0])
def test_fit_matches_brute_force(lam):
    gen = torch.Generator().manual_seed(0)
    n, d, classes = 40, 6, 3
    expert = torch.randn(n, d, generator=gen, dtype=DTYPE)
    student = expert + 0.3 * torch.randn(n, d, generator=gen, dtype=DTYPE) + 0.2
    weight = torch.randn(classes, d, generator=gen, dtype=DTYPE)
    bias = torch.randn(classes, generator=gen, dtype=DTYPE)
    got_w, got_b = fit_linear_head(_stats(student, expert), weight, bias, lam)
    want_w, want_b = _brute_force(student, expert, weight, bias, lam)
    torch.testing.assert_close(got_w, want_w, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(got_b, want_b, rtol=1e-7, atol=1e-9)


def test_same_features_give_the_expert_head_back():
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(30, 5, generator=gen, dtype=DTYPE)
    weight = torch.randn(4, 5, generator=gen, dtype=DTYPE)
    bias = torch.randn(4, generator=gen, dtype=DTYPE)
    for lam in (0.0, 0.5):
        got_w, got_b = fit_linear_head(_stats(features, features), weight, bias, lam)
        torch.testing.assert_close(got_w, weight, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_b, bias, rtol=1e-6, atol=1e-6)


def test_bad_statistics_are_clear_errors():
    stats = HeadStatistics(3)
    with pytest.raises(FeatCalError, match="no calibration inputs"):
        fit_linear_head(stats, torch.zeros(2, 3), torch.zeros(2), 0.1)
    with pytest.raises(FeatCalError, match="must both be"):
        stats.add(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(FeatCalError, match="NaN or Inf"):
        stats.add(torch.full((2, 3), float("nan")), torch.zeros(2, 3))


def _pooled_and_logits(directory, tokenizer, texts):
    model = BertForSequenceClassification.from_pretrained(directory).eval()
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        pooled = model.bert(**enc).pooler_output.double()
    return model, pooled


def test_calibrated_bert_head_matches_the_closed_form_and_the_expert_better(bert):  # noqa: F811
    head = ExpertHead(bert["expert"])
    texts = bert["texts"]
    weight, bias = calibrate_head(head, bert["expert"], bert["bare"], texts, lam=0.05, batch_size=5)

    # independent features: the expert's own model, and the same model with the student's tower
    tokenizer = AutoTokenizer.from_pretrained(bert["expert"])
    expert_model, expert_pooled = _pooled_and_logits(bert["expert"], tokenizer, texts)
    student_model = BertForSequenceClassification.from_pretrained(bert["expert"]).eval()
    student_model.bert.load_state_dict(bert["backbone"])
    enc = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        student_pooled = student_model.bert(**enc).pooler_output.double()
    w_e = expert_model.classifier.weight.double().detach()
    b_e = expert_model.classifier.bias.double().detach()
    want_w, want_b = _brute_force(student_pooled, expert_pooled, w_e, b_e, 0.05)
    torch.testing.assert_close(weight.double(), want_w, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bias.double(), want_b, rtol=1e-4, atol=1e-5)

    # the refit head reproduces the expert's logits better than the expert's head does
    expert_logits = expert_pooled @ w_e.T + b_e
    before = (student_pooled @ w_e.T + b_e - expert_logits).pow(2).mean()
    after = (student_pooled @ want_w.T + want_b - expert_logits).pow(2).mean()
    assert after < before

    # evaluation with the replaced head uses exactly that Linear
    refit = head.with_linear(weight, bias)
    classifier = refit.classifier(bert["bare"], torch.device("cpu"))
    with torch.no_grad():
        logits = classifier(**refit.preprocess(texts)).double()
    torch.testing.assert_close(
        logits, student_pooled @ weight.double().T + bias.double(), rtol=1e-4, atol=1e-5
    )
    result = evaluate(bert["bare"], refit, bert["data"], "test", progress=False)
    assert 0.0 <= result["accuracy"] <= 1.0 and result["examples"] == len(texts)


def test_one_tower_pass_gives_every_linears_separate_result(bert):  # noqa: F811
    """evaluate_linears (the evaluate step's merged + merged_heads rows in one pass of the tower)
    gives what separate `evaluate` calls give, for the head's own classifier (a BERT expert:
    its model forward) and for two replacement Linears."""
    head = ExpertHead(bert["expert"])
    generator = torch.Generator().manual_seed(3)
    d = 32  # the tiny BERT's hidden size
    pairs = {
        f"refit{i}": (
            torch.randn(head.num_classes, d, generator=generator),
            torch.randn(head.num_classes, generator=generator),
        )
        for i in range(2)
    }
    together = evaluate_linears(
        bert["bare"],
        head,
        bert["data"],
        "test",
        {"own": None, **pairs},
        batch_size=3,
        progress=False,
    )
    alone = {
        "own": evaluate(bert["bare"], head, bert["data"], "test", batch_size=3, progress=False)
    }
    for name, (weight, bias) in pairs.items():
        alone[name] = evaluate(
            bert["bare"],
            head.with_linear(weight, bias),
            bert["data"],
            "test",
            batch_size=3,
            progress=False,
        )
    assert list(together) == ["own", *pairs]
    for name, result in alone.items():
        assert together[name]["accuracy"] == result["accuracy"]
        assert together[name]["examples"] == result["examples"]
        assert together[name]["loss"] == pytest.approx(result["loss"], rel=1e-5)
    assert len({round(r["loss"], 6) for r in together.values()}) == 3  # three different heads
    with pytest.raises(FeatCalError, match="at least one"):
        evaluate_linears(bert["bare"], head, bert["data"], "test", {}, progress=False)


def test_shared_input_batches_preprocess_each_row_once_and_change_no_number(bert, monkeypatch):  # noqa: F811
    """The evaluate step's InputBatches: two models evaluated on one set preprocess each batch
    once and give exactly what they give alone; with no budget nothing is kept."""
    from featcal_core.evaluation.input_batches import InputBatches

    head = ExpertHead(bert["expert"])
    calls = []
    preprocess = head.preprocess
    monkeypatch.setattr(
        head, "preprocess", lambda rows: calls.append(len(rows)) or preprocess(rows)
    )
    models = {"bare": bert["bare"], "expert": bert["expert"]}
    alone = {
        name: evaluate_linears(
            path, head, bert["data"], "test", {name: None}, batch_size=3, progress=False
        )[name]
        for name, path in models.items()
    }
    rows = sum(calls[: len(calls) // 2])
    calls.clear()
    batches = InputBatches()
    shared = {
        name: evaluate_linears(
            path,
            head,
            bert["data"],
            "test",
            {name: None},
            batch_size=3,
            progress=False,
            batches=batches,
        )[name]
        for name, path in models.items()
    }
    assert shared == alone
    assert sum(calls) == rows and batches.made == len(calls) == batches.reused
    assert alone["bare"]["loss"] != alone["expert"]["loss"]  # two different models
    calls.clear()
    none_kept = InputBatches(budget_mb=0)
    for path in models.values():
        evaluate_linears(
            path,
            head,
            bert["data"],
            "test",
            {"m": None},
            batch_size=3,
            progress=False,
            batches=none_kept,
        )
    assert sum(calls) == 2 * rows and none_kept.reused == 0 and none_kept.kept_bytes == 0


def test_with_linear_checks_shapes(bert):  # noqa: F811
    head = ExpertHead(bert["expert"])
    with pytest.raises(FeatCalError, match="classes"):
        head.with_linear(torch.zeros(head.num_classes + 1, 8), torch.zeros(head.num_classes + 1))
    with pytest.raises(FeatCalError, match="weight"):
        head.with_linear(torch.zeros(head.num_classes, 8), torch.zeros(2, 2))


def test_featcal_calibrate_heads_writes_refit_heads(tmp_path, prefect_api):
    """--heads refits the heads after the direct calibration and after the resumable flow
    (--results-dir) alike: the same heads, byte for byte."""
    from test_pipeline import _bert_with_heads, _labelled_texts

    from featcal_cli.main import main
    from featcal_core.evaluation.linear_head import load_linear_head
    from featcal_core.merging.run import merge_checkpoints

    base, experts = _bert_with_heads(tmp_path)
    merged = tmp_path / "merged"
    merge_checkpoints(base, experts, merged, "task_arithmetic", {"scale": 0.5}, progress=False)
    argv = [
        "calibrate",
        "--base",
        str(base),
        "--merged",
        str(merged),
        "--out",
        str(tmp_path / "out"),
        "--num-per-task",
        "10",
        "--heads",
        "--head-lam",
        "0.2",
        "--no-progress",
    ]
    for i, (task, path) in enumerate(experts.items()):
        data = _labelled_texts(tmp_path / f"text_{task}", seed=i)
        argv += ["--expert", f"{task}={path}", "--calib", f"{task}={data}"]
    assert main(argv) == 0
    for task, path in experts.items():
        head = load_linear_head(tmp_path / "out" / "heads" / task)
        original = ExpertHead(path).parts(path, torch.device("cpu"))[1]
        assert head.weight.shape == original.weight.shape
        assert not torch.equal(head.weight, original.weight.detach())

    # the resumable flow in its own process (as the CLI runs it), on the tests' Prefect server
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": prefect_api}
    flow_out = tmp_path / "flow_out"
    flow_argv = [str(flow_out) if a == str(tmp_path / "out") else a for a in argv]
    cmd = [
        sys.executable,
        "-m",
        "featcal_cli.main",
        *flow_argv,
        "--results-dir",
        str(tmp_path / "results"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for task in experts:
        weights = sorted((tmp_path / "out" / "heads" / task).glob("*.safetensors"))
        assert weights
        for file in weights:
            assert (flow_out / "heads" / task / file.name).read_bytes() == file.read_bytes()


def test_flags_that_would_be_ignored_are_refused(tmp_path, capsys):
    """With --params the step reads the params file: other flags are refused, not ignored;
    --set needs --params; --memory-budget needs --results-dir."""
    from featcal_cli.main import main

    params = tmp_path / "p.yaml"
    params.write_text("run: {name: x}\n")
    cases = [
        (
            ["calibrate", "--params", str(params), "--alpha", "0.3", "--out", "o"],
            ["--alpha", "--out", "--set"],
        ),
        (["merge", "--params", str(params), "--method", "ties"], ["--method"]),
        (
            ["calibrate", "--base", "b", "--merged", "m", "--out", "o", "--set", "featcal.alpha=1"],
            ["--set", "needs --params"],
        ),
        (
            ["calibrate", "--base", "b", "--merged", "m", "--out", "o", "--memory-budget", "1"],
            ["--memory-budget", "--results-dir"],
        ),
    ]
    for argv, needles in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("featcal: error: ") and "\n" not in err, err
        for needle in needles:
            assert needle in err, (needle, err)
    assert not (tmp_path / "o").exists()


def test_zero_shot_class_embeddings_are_refit(clip, tmp_path):  # noqa: F811
    """CLIP: the head is exp(logit_scale) · class embeddings on the normalised image embedding;
    refit for a perturbed tower toward the base tower's logits."""
    head = ZeroShotHead(clip["base"], CLASS_NAMES, TEMPLATES, cache_dir=tmp_path)
    images = clip["images"]
    weight, bias = calibrate_head(head, clip["base"], clip["vision5"], images, lam=0.1)
    cpu = torch.device("cpu")
    expert_features, linear = head.parts(clip["base"], cpu)
    student_features, _ = head.parts(clip["vision5"], cpu)
    inputs = head.preprocess(images)
    with torch.no_grad():
        z_e, z_s = expert_features(**inputs).double(), student_features(**inputs).double()
    w_e = linear.weight.double().detach()
    want_w, want_b = _brute_force(z_s, z_e, w_e, torch.zeros(w_e.shape[0], dtype=DTYPE), 0.1)
    torch.testing.assert_close(weight.double(), want_w, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bias.double(), want_b, rtol=1e-4, atol=1e-5)
    refit = head.with_linear(weight, bias)
    with torch.no_grad():
        before = head.classifier(clip["vision5"], cpu)(**inputs).double()
        after = refit.classifier(clip["vision5"], cpu)(**inputs).double()
    target = z_e @ w_e.T
    assert (after - target).pow(2).mean() < (before - target).pow(2).mean()
