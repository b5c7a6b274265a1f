"""The forwards that only read a head's features (evaluation, held-out scoring for `select:`,
head calibration's feature pass) in bfloat16 against float32: what ran, and how far the numbers
move on tiny real experts. Each measured distance is printed in the test summary (`report:`)."""

from __future__ import annotations

import pytest
import torch
from test_evaluation import (  # noqa: F401  (module fixtures: tiny BERT expert, tiny CLIP)
    CLASS_NAMES,
    TEMPLATES,
    bert,
    clip,
)

from featcal_core import precision
from featcal_core.evaluation.accuracy import evaluate
from featcal_core.evaluation.agreement import agreement_scores, head_outputs
from featcal_core.evaluation.expert_head import ExpertHead
from featcal_core.evaluation.zero_shot_head import ZeroShotHead
from featcal_core.method.head_calibration import calibrate_head

#: bounds about 5-10x the measured distances (this machine, torch 2.14): held-out features
#: 3.5e-3 / 6.1e-3 relative (BERT pooler, CLIP image embeddings), evaluation losses 1.6e-5 /
#: 3.1e-3 relative, the refit head's weight 7.5e-4
FEATURES_BOUND = 3e-2
LOSS_BOUND = 2e-2
HEAD_BOUND = 1e-2


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture
def cases(bert, clip, tmp_path):  # noqa: F811
    """(name, model folder, head, held-out rows folder, evaluate kwargs) per tiny expert."""
    zero_shot = ZeroShotHead(clip["base"], CLASS_NAMES, TEMPLATES, cache_dir=tmp_path / "cache")
    return [
        ("bert", bert["bare"], ExpertHead(bert["expert"]), bert["data"], {"split": "test"}),
        ("clip", clip["vision5"], zero_shot, clip["data"], {"image_column": "img"}),
    ]


def test_evaluation_runs_the_tower_in_bfloat16_and_stays_near_float32(cases, record_property):
    for name, model, head, data, where in cases:
        found = {
            p: evaluate(model, head, data, batch_size=4, progress=False, precision=p, **where)
            for p in ("float32", "bfloat16")
        }
        fast, exact = found["bfloat16"], found["float32"]
        moved = abs(fast["loss"] / exact["loss"] - 1)
        record_property(f"report: {name} evaluation loss, bfloat16 vs float32", f"{moved:.2e}")
        assert fast["loss"] != exact["loss"]  # the tower ran in bfloat16
        assert moved <= LOSS_BOUND
        assert fast["examples"] == exact["examples"]
        assert abs(fast["accuracy"] - exact["accuracy"]) <= 2 / exact["examples"]


def test_held_out_scoring_in_bfloat16_keeps_the_scores(cases, tmp_path, record_property):
    """The select step's features and agreement under bfloat16 forwards."""
    import datasets

    for name, model, head, data, _ in cases:
        rows = datasets.load_from_disk(str(data))
        rows = rows["test"] if isinstance(rows, datasets.DatasetDict) else rows
        column = "img" if "img" in rows.column_names else "text"
        held_out = tmp_path / f"{name}-held-out"
        rows = rows.select_columns([column])
        if column != head.modality:
            rows = rows.rename_column(column, head.modality)
        rows.save_to_disk(str(held_out))
        outputs = {
            p: head_outputs(model, head, held_out, batch_size=4, precision=p)
            for p in ("float32", "bfloat16")
        }
        error = _relative(outputs["bfloat16"].features, outputs["float32"].features)
        record_property(f"report: {name} held-out features, bfloat16 vs float32", f"{error:.2e}")
        assert outputs["bfloat16"].features.dtype == torch.float32  # scored in float32
        assert 0 < error <= FEATURES_BOUND
        scores = agreement_scores(outputs["bfloat16"], outputs["float32"])
        assert scores["agreement"] >= 100.0 * (1 - 2 / scores["examples"])


def test_head_calibration_feature_pass_in_bfloat16(bert, record_property):  # noqa: F811
    head = ExpertHead(bert["expert"])
    fitted = {
        p: calibrate_head(
            head, bert["expert"], bert["bare"], bert["texts"], lam=0.05, batch_size=5, precision=p
        )
        for p in ("float32", "bfloat16")
    }
    error = _relative(fitted["bfloat16"][0], fitted["float32"][0])
    record_property("report: refit head weight, bfloat16 vs float32", f"{error:.2e}")
    assert fitted["bfloat16"][0].dtype == torch.float32
    assert 0 < error <= HEAD_BOUND


def test_forward_precision_follows_the_calibration_rules(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    assert precision.resolve_forwards("auto", cpu).name == "bfloat16"
    assert precision.resolve_forwards("float32", cpu).name == "float32"
    asked = precision.resolve_forwards("float64", cpu)
    assert asked.name == "float32" and "towers run in float32" in asked.reason
    wide = precision.resolve_forwards("auto", cpu, torch.float64)  # float64 checkpoints
    assert wide.name == "float32" and wide.reason.startswith("the checkpoints are float64")
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset())
    assert precision.resolve_forwards("auto", cpu).name == "float32"
