"""No silent fallbacks: every least-squares fallback, clamped value and task without tokens is
logged as a WARNING and recorded in the block summary (featcal.json); the block cache key covers
all code that shapes a state."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import factories
import featcal.tasks.calibration as task_module
from featcal_core.errors import FeatCalError
from featcal_core.method import solvers
from featcal_core.method.block_statistics import tokens_needed
from featcal_core.method.calibration import Calibration, block_summary
from featcal_core.method.drift import mean_drift
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.norm_statistics import NormStats
from featcal_core.method.solvers import Fallbacks
from featcal_core.method.statistics import LinearInputStats
from featcal_core.method.streams import HiddenStreams
from featcal_core.method.task_statistics import TaskStatistics

D64 = torch.float64
CPU = torch.device("cpu")
KEYS = {"kind", "module", "parameter", "task", "count", "reason"}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_singular_system_falls_back_to_lstsq_logged_and_recorded(caplog):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 6, generator=gen, dtype=D64)
    lhs = x.T @ x  # rank 3 of 6: singular, and λ = 0 adds no ridge
    rhs = torch.randn(6, 4, generator=gen, dtype=D64)
    found = Fallbacks("block 7")
    with caplog.at_level(logging.WARNING, logger="featcal_core"):
        system = solvers.ridge_system(lhs, 0.0, 0.0, fallbacks=found, modules=("q", "k"))
    assert system.factor is None and "Cholesky failed at column" in system.fallback
    expected = torch.linalg.lstsq(lhs, rhs, driver="gelsd").solution
    torch.testing.assert_close(system.solve(rhs.clone()), expected, rtol=0, atol=0)
    assert [(e["kind"], e["module"], e["parameter"]) for e in found.entries] == [
        ("lstsq", "q", "weight"),
        ("lstsq", "k", "weight"),
    ]
    assert all(set(e) == KEYS and e["task"] is None and e["count"] == 1 for e in found.entries)
    (message,) = _warnings(caplog)
    assert "block 7" in message and "q.weight, k.weight" in message and "least squares" in message


def test_positive_definite_system_records_nothing(caplog):
    found = Fallbacks()
    lhs = torch.eye(4, dtype=D64)
    with caplog.at_level(logging.WARNING, logger="featcal_core"):
        assert solvers.ridge_system(lhs, 0.0, 1e-8, fallbacks=found).fallback is None
        assert solvers.ridge_system(lhs, 0.5, 1e-8, fallbacks=found).fallback is None
    assert found.entries == [] and _warnings(caplog) == []


def test_linear_stats_with_a_dead_input_feature_fall_back_per_module(caplog):
    """A feature that is zero in every token (λ = ε = 0): Cholesky fails at column 1; every
    module sharing the input is solved by least squares, equal to lstsq on the same system."""
    gen = torch.Generator().manual_seed(3)
    stats = LinearInputStats(
        5, {"q": (3, True), "k": (2, False)}, CPU, params=FeatCalParams(alpha=0.0, lam=0.0, eps=0.0)
    )
    gram, cross_q = torch.zeros(5, 5, dtype=D64), torch.zeros(5, 3, dtype=D64)
    for _ in range(2):
        x_s, x_e = torch.randn(20, 5, generator=gen, dtype=D64), torch.randn(20, 5, generator=gen)
        x_s[:, 0] = 0
        w_q, w_k = torch.randn(3, 5, generator=gen, dtype=D64), torch.randn(2, 5, generator=gen)
        params = {"q": (w_q, torch.zeros(3, dtype=D64)), "k": (w_k, None)}
        stats.add(x_s, x_e, None, params)  # α = 0: the teacher input is x_s
        s_t = 1.0 / float(torch.linalg.matrix_norm(x_s.T @ x_s / 20))
        gram += s_t * x_s.T @ x_s / 20
        cross_q += s_t * x_s.T @ x_s @ w_q.T / 20
        stats.end_task(params)
    found = Fallbacks("block 0")
    with caplog.at_level(logging.WARNING, logger="featcal_core"):
        weight_q = stats.solve({}, found)["q"][0]
    assert [(e["kind"], e["module"]) for e in found.entries] == [("lstsq", "q"), ("lstsq", "k")]
    assert "column 1 " in found.entries[0]["reason"]
    expected = torch.linalg.lstsq(gram, cross_q, driver="gelsd").solution.T
    torch.testing.assert_close(weight_q, expected, rtol=1e-9, atol=1e-12)
    assert len(_warnings(caplog)) == 1


def test_norm_clamps_are_recorded(caplog):
    gen = torch.Generator().manual_seed(8)
    layer = NormStats(4, 1e-5, rms=False, has_bias=True, device=CPU)
    layer.add(torch.randn(1, 4, generator=gen).expand(10, 4), None)  # z the same in every token
    layer.end_task(torch.ones(4), torch.zeros(4))
    rms = NormStats(4, 1e-6, rms=True, has_bias=False, device=CPU)
    x = torch.randn(10, 4, generator=gen)
    x[:, 2] = 0  # channel 2: Σ e_t = 0
    rms.add(x, None)
    rms.end_task(torch.ones(4), None)
    found = Fallbacks("block 1")
    with caplog.at_level(logging.WARNING, logger="featcal_core"):
        layer.solve(0.0, 1e-8, None, None, found, "layer_norm1")
        rms.solve(0.0, 1e-8, None, None, found, "norm")
    assert [(e["kind"], e["module"], e["parameter"], e["count"]) for e in found.entries] == [
        ("clamped_determinant", "layer_norm1", "weight,bias", 4),
        ("clamped_denominator", "norm", "weight", 1),
    ]
    assert len(_warnings(caplog)) == 2 and "layer_norm1.weight,bias" in _warnings(caplog)[0]


def test_clamped_task_scale_names_the_task(caplog):
    gen = torch.Generator().manual_seed(2)
    stats = LinearInputStats(3, {"fc": (2, True)}, CPU)
    x = 1e-6 * torch.randn(8, 3, generator=gen, dtype=D64)  # ‖C_t‖_F ≈ 1e-12 < ε
    params = {"fc": (torch.ones(2, 3, dtype=D64), torch.zeros(2, dtype=D64))}
    stats.add(x, x, None, params)  # α 0.25, ε 1e-8: the defaults
    found = Fallbacks("block 2")
    with caplog.at_level(logging.WARNING, logger="featcal_core"):
        contribution = stats.task_contribution(params, fallbacks=found, task="mnist")
    assert float(contribution["scale"][0]) == pytest.approx(1e8)
    (entry,) = found.entries
    assert (entry["kind"], entry["module"], entry["task"]) == ("clamped_task_scale", "fc", "mnist")
    assert "task 'mnist'" in _warnings(caplog)[0]


def test_task_without_weighted_tokens(caplog):
    found = Fallbacks("block 0")
    with caplog.at_level(logging.WARNING, logger="featcal_core"):
        assert mean_drift(0.0, 0.0, "svhn", "after calibration", found) == 0.0
        assert mean_drift(6.0, 3.0, "svhn", "after calibration", found) == 2.0
    assert [(e["kind"], e["task"], e["module"]) for e in found.entries] == [
        ("no_tokens", "svhn", None)
    ]
    assert len(_warnings(caplog)) == 1
    stats = LinearInputStats(3, {"fc": (2, False)}, CPU)
    with pytest.raises(FeatCalError, match="task 'svhn' gives no weighted tokens to fc in block 4"):
        with tokens_needed(4, "svhn", "fc"):
            stats.task_contribution({})


def test_task_statistics_carry_their_fallbacks_through_a_file(tmp_path):
    entry = {
        "kind": "clamped_task_scale",
        "module": "fc",
        "parameter": None,
        "task": "a",
        "count": 1,
        "reason": "r",
    }
    TaskStatistics("a", 0, {}, {}, {}, 0.5, [entry]).save(tmp_path / "s.safetensors")
    assert TaskStatistics.load(tmp_path / "s.safetensors").fallbacks == [entry]


def _dead_feature_zoo(root: Path):
    """A tiny CLIP pool whose merged block 0 has fc1 row 0 (weight and bias) zeroed: fc2's input
    feature 0 is exactly 0 for every token, so its λ = 0, ε = 0 system is singular."""
    zoo = factories.clip_zoo(root)
    path = zoo.merged / "model.safetensors"
    tensors = load_file(str(path))
    for key in ("encoder.layers.0.mlp.fc1.weight", "encoder.layers.0.mlp.fc1.bias"):
        tensors[key][0] = 0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return zoo


def test_tiny_calibration_records_the_fallback_in_the_block_summary(tmp_path, caplog):
    zoo = _dead_feature_zoo(tmp_path / "zoo")
    params = FeatCalParams(lam=0.0, eps=0.0)

    def run(scratch: Path | None):
        cal = Calibration(zoo.base, zoo.merged, zoo.experts, zoo.calib, params)
        streams = HiddenStreams(None)
        masks = cal.stems(streams)
        return cal, cal.block(0, streams, streams, masks, scratch_dir=scratch)

    with caplog.at_level(logging.WARNING, logger="featcal_core"):
        cal, result = run(None)
    lstsq = [e for e in result.fallbacks if e["kind"] == "lstsq"]
    assert lstsq == [
        {
            "kind": "lstsq",
            "module": "mlp.fc2",
            "parameter": "weight",
            "task": None,
            "count": 1,
            "reason": lstsq[0]["reason"],
        }
    ]
    assert "Cholesky failed at column 1 " in lstsq[0]["reason"]
    assert any("block 0" in m and "mlp.fc2.weight" in m for m in _warnings(caplog))
    # the least-squares solution is the minimum-norm one: no weight on the dead feature
    assert float(result.tensors["mlp.fc2.weight"][:, 0].abs().max()) < 1e-6
    assert all(torch.isfinite(t).all() for t in result.tensors.values())

    summary = block_summary(result)
    assert summary["fallbacks"] == result.fallbacks
    assert json.loads(json.dumps(summary, sort_keys=True)) == summary  # the manifest round trip
    record = cal.record([summary], 0.0)
    assert record["fallbacks"] == len(result.fallbacks) >= 1
    assert record["fallbacks_by_kind"]["lstsq"] == 1
    json.dumps(record)

    # statistics saved to files and folded group by group: the same entries, the same block
    (tmp_path / "scratch").mkdir()
    _, again = run(tmp_path / "scratch")
    assert again.fallbacks == result.fallbacks
    assert all(torch.equal(again.tensors[k], v) for k, v in result.tensors.items())


def test_default_parameters_record_no_fallbacks(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "zoo")
    cal = Calibration(zoo.base, zoo.merged, zoo.experts, zoo.calib)
    streams = HiddenStreams(None)
    masks = cal.stems(streams)
    result = cal.block(0, streams, streams, masks)
    assert result.fallbacks == [] and block_summary(result)["fallbacks"] == []
    assert cal.record([block_summary(result)], 0.0)["fallbacks"] == 0


def test_code_version_covers_tasks_and_flows_calibration(tmp_path, monkeypatch):
    import featcal.flows.calibration as flow_module

    flow = {"flows/calibration.py": Path(flow_module.__file__)}
    original = task_module.code_version(flow)
    assert task_module.code_version(flow) == original  # deterministic
    assert task_module.code_version() != original  # the flow's module counts
    for module in (task_module, flow_module):
        source = Path(module.__file__)
        copy = tmp_path / module.__name__ / source.name
        copy.parent.mkdir(parents=True)
        shutil.copy2(source, copy)
        with monkeypatch.context() as patch:
            patch.setattr(module, "__file__", str(copy))
            moved = {"flows/calibration.py": Path(flow_module.__file__)}
            assert task_module.code_version(moved) == original  # same bytes elsewhere: same key
            copy.write_bytes(copy.read_bytes() + b"\n# a change\n")
            assert task_module.code_version(moved) != original
        assert task_module.code_version(flow) == original
