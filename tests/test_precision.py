"""The float32 product path (`precision="float32"`, the default for float32/bf16 models) against
the float64 path: the accumulators on random tokens (direct and via-X cross terms, the wide
symmetric Gram, token weights, several chunks per batch), and whole calibrations of tiny CLIP and BERT
pools. The worst relative error of the calibrated weights is reported in the test summary
(`tests/conftest.py` prints each test's `report:` properties)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import factories
from featcal_core import calibrate
from featcal_core.errors import FeatCalError
from featcal_core.method import statistics
from featcal_core.method.calibration import Calibration
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.settings import Settings
from featcal_core.method.statistics import LinearInputStats

CPU = torch.device("cpu")
#: the stated tolerance: worst |Δ| over max |W| per calibrated tensor
TOLERANCE = 1e-4


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _solve(precision: str, d_in: int, d_out: int, via_x: bool, tokens: int, weighted: bool):
    g = torch.Generator().manual_seed(7)
    hint = tokens if via_x else None
    hp = FeatCalParams(alpha=0.25, lam=0.05, eps=1e-8)
    stats = LinearInputStats(d_in, {"fc": (d_out, True)}, CPU, hint, precision=precision, params=hp)
    assert stats.via_x == via_x
    for _ in range(3):  # tasks
        params = {
            "fc": (
                torch.randn(d_out, d_in, generator=g) / d_in**0.5,
                torch.randn(d_out, generator=g),
            )
        }
        mean = torch.randn(d_in, generator=g)  # uncentered inputs, as hidden states are
        for _ in range(0, tokens, 700):  # batches
            x_s = mean + torch.randn(700, d_in, generator=g)
            x_e = x_s + 0.1 * torch.randn(700, d_in, generator=g)
            w = torch.rand(700, generator=g) if weighted else None
            stats.add(x_s.float(), x_e.float(), w, params)
        stats.end_task(params)
    anchors = {
        "fc": (
            torch.zeros(d_out, d_in, dtype=torch.float64),
            torch.zeros(d_out, dtype=torch.float64),
        )
    }
    return stats.solve(anchors)["fc"]


@pytest.mark.parametrize(
    "d_in, d_out, via_x, weighted",
    [(48, 40, False, True), (48, 200, True, False), (1600, 24, False, False)],
    ids=["direct-weighted", "via-x", "wide-symmetric-gram"],
)
def test_float32_products_match_float64_accumulators(d_in, d_out, via_x, weighted, monkeypatch):
    monkeypatch.setattr(statistics, "TOKEN_CHUNK_FP32", 256)  # several chunks per batch
    tokens = 2800 if d_in < 1000 else 1400
    w64, b64 = _solve("float64", d_in, d_out, via_x, tokens, weighted)
    w32, b32 = _solve("float32", d_in, d_out, via_x, tokens, weighted)
    assert w32.dtype == torch.float64  # solved in float64 either way
    assert not torch.equal(w32, w64)  # the products did run in float32
    assert _relative(w32, w64) <= TOLERANCE and _relative(b32, b64) <= TOLERANCE


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_wide_contributions_are_full_and_fold_anywhere(precision):
    """A task's Gram leaves `task_contribution` full and symmetric, whatever block layout its
    accumulator used, so folding it into an accumulator made elsewhere (as `fold` does, from the
    layout only) solves the same as folding in place."""
    g = torch.Generator().manual_seed(3)
    d_in, d_out = 1600, 8
    params = {"fc": (torch.randn(d_out, d_in, generator=g) / 40, torch.randn(d_out, generator=g))}
    hp = FeatCalParams(alpha=0.25, lam=0.05, eps=1e-8)
    in_place = LinearInputStats(d_in, {"fc": (d_out, True)}, CPU, precision=precision, params=hp)
    elsewhere = LinearInputStats(d_in, {"fc": (d_out, True)}, CPU, params=hp)  # float64 layout
    for _ in range(2):
        x_s = torch.randn(600, d_in, generator=g)
        x_e = x_s + 0.1 * torch.randn(600, d_in, generator=g)
        apart = LinearInputStats(d_in, {"fc": (d_out, True)}, CPU, precision=precision, params=hp)
        apart.add(x_s, x_e, None, params)
        contribution = apart.task_contribution(params)
        torch.testing.assert_close(contribution["gram"], contribution["gram"].T, rtol=0, atol=0)
        elsewhere.merge({k: v.clone() for k, v in contribution.items()})
        in_place.add(x_s, x_e, None, params)
        in_place.end_task(params)
    anchors = {
        "fc": (
            torch.zeros(d_out, d_in, dtype=torch.float64),
            torch.zeros(d_out, dtype=torch.float64),
        )
    }
    a = in_place.solve(anchors)["fc"]
    b = elsewhere.solve(anchors)["fc"]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision"):
        LinearInputStats(4, {"q": (2, False)}, CPU, precision="float16")


@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_float32_calibration_matches_the_float64_path(tmp_path, kind, record_property):
    build = {"clip": factories.clip_zoo, "bert": factories.bert_zoo}[kind]
    zoo = build(tmp_path / "zoo", tasks=("alpha", "beta", "gamma"), dtype=torch.float32)
    outs = {}
    for precision in ("float32", "float64"):
        out = outs[precision] = tmp_path / precision
        record = calibrate(
            zoo.base,
            zoo.merged,
            zoo.experts,
            zoo.calib,
            out,
            num_per_task=8,
            precision=precision,
            progress=False,
        )
        assert record["hyperparameters"]["precision"] == precision
    fast = load_file(str(outs["float32"] / "model.safetensors"))
    exact = load_file(str(outs["float64"] / "model.safetensors"))
    merged = load_file(str(zoo.merged / "model.safetensors"))
    calibrated = [k for k in exact if not torch.equal(exact[k], merged[k])]
    assert calibrated  # the comparison covers calibrated tensors
    worst = max(_relative(fast[k], exact[k]) for k in calibrated)
    record_property(
        "report: worst relative error, float32 vs float64 products", f"{kind}: {worst:.2e}"
    )
    print(
        f"{kind}: worst relative error of the calibrated weights, float32 vs float64: {worst:.2e}"
    )
    assert worst <= TOLERANCE


def test_float64_models_always_use_float64_products(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "zoo", tasks=("alpha", "beta"), dtype=torch.float64)
    out = tmp_path / "out"
    calibrate(
        zoo.base,
        zoo.merged,
        zoo.experts,
        zoo.calib,
        out,
        num_per_task=4,
        precision="float32",
        progress=False,
    )
    record = json.loads((out / "featcal.json").read_text())
    assert record["hyperparameters"]["precision"] == "float64"
    with pytest.raises(FeatCalError, match="--precision"):
        calibrate(
            zoo.base,
            zoo.merged,
            zoo.experts,
            zoo.calib,
            tmp_path / "bad",
            precision="half",
            progress=False,
        )


# ------------------------------------------------------------------ bfloat16 and auto

#: the measured bounds of the bfloat16 path against float64 on the tiny pools (three tasks,
#: eight inputs each; measured 2.2e-2 worst and 1.3e-3–1.5e-3 median per calibrated tensor, the
#: worst on small bias and norm vectors): worst |Δ| / max |W| per tensor, and the median
BF16_WORST, BF16_MEDIAN = 5e-2, 5e-3


@pytest.mark.parametrize(
    "d_in, d_out, via_x, weighted",
    [(48, 40, False, True), (48, 200, True, False), (1600, 24, False, False)],
    ids=["direct-weighted", "via-x", "wide-symmetric-gram"],
)
def test_bfloat16_products_stay_near_the_float64_accumulators(
    d_in, d_out, via_x, weighted, monkeypatch, record_property
):
    """Measured: 2.0e-2 (direct, weighted), 3.1e-3 (via X), 4.4e-3 (wide Gram); CPU products are
    rounded to bfloat16 per chunk before the float64 add."""
    monkeypatch.setattr(statistics, "TOKEN_CHUNK_FP32", 256)  # several chunks per batch
    tokens = 2800 if d_in < 1000 else 1400
    w64, b64 = _solve("float64", d_in, d_out, via_x, tokens, weighted)
    w16, b16 = _solve("bfloat16", d_in, d_out, via_x, tokens, weighted)
    assert w16.dtype == torch.float64  # solved in float64 whatever ran the products
    error = max(_relative(w16, w64), _relative(b16, b64))
    record_property("report: bfloat16 products vs float64, solved weights", f"{error:.2e}")
    assert 0 < error <= 5e-2  # bfloat16 ran (not bit-equal), and the solve stays close


@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_bfloat16_calibration_against_the_float64_path(tmp_path, kind, record_property):
    build = {"clip": factories.clip_zoo, "bert": factories.bert_zoo}[kind]
    zoo = build(tmp_path / "zoo", tasks=("alpha", "beta", "gamma"), dtype=torch.float32)
    outs, records = {}, {}
    for precision in ("bfloat16", "float64"):
        out = outs[precision] = tmp_path / precision
        records[precision] = calibrate(
            zoo.base,
            zoo.merged,
            zoo.experts,
            zoo.calib,
            out,
            num_per_task=8,
            precision=precision,
            progress=False,
        )
        assert records[precision]["hyperparameters"]["precision"] == precision
    fast = load_file(str(outs["bfloat16"] / "model.safetensors"))
    exact = load_file(str(outs["float64"] / "model.safetensors"))
    merged = load_file(str(zoo.merged / "model.safetensors"))
    calibrated = [k for k in exact if not torch.equal(exact[k], merged[k])]
    errors = sorted(_relative(fast[k], exact[k]) for k in calibrated)
    worst, median = errors[-1], errors[len(errors) // 2]
    drift = [(records[p]["blocks"][-1]["drift_after"]) for p in ("bfloat16", "float64")]
    shift = max(abs(drift[0][t] / drift[1][t] - 1) for t in drift[1])
    record_property(
        "report: bfloat16 vs float64 calibrated weights (worst, median; last-block drift)",
        f"{kind}: {worst:.2e}, {median:.2e}; {shift:.2%}",
    )
    assert fast[calibrated[0]].dtype == torch.float32  # written in the checkpoint's dtype
    assert 0 < worst <= BF16_WORST and median <= BF16_MEDIAN
    assert shift <= 0.01  # the last block's drift after calibration moves by under 1 %


def test_auto_picks_bfloat16_only_where_the_hardware_has_it(monkeypatch):
    from featcal_core import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    chosen = precision.resolve("auto", cpu, torch.float32)
    assert chosen.name == "bfloat16" and "avx512_bf16" in chosen.reason
    # the machine decides, not the load of the moment: nothing is timed, the reason is the same
    # words every time
    assert chosen.reason == precision.resolve("auto", cpu, torch.float32).reason
    assert "×" not in chosen.reason and "measured" not in chosen.reason
    # the user's override, either way, named in the reason
    monkeypatch.setenv(precision.CPU_BF16_ENV, "0")
    chosen = precision.resolve("auto", cpu, torch.float32)
    assert chosen.name == "float32" and "FEATCAL_CPU_BFLOAT16=0" in chosen.reason
    monkeypatch.setenv(precision.CPU_BF16_ENV, "yes")
    with pytest.raises(FeatCalError, match=r"^FEATCAL_CPU_BFLOAT16 must be 1 or 0 \(got 'yes'\)"):
        precision.resolve("auto", cpu, torch.float32)
    monkeypatch.delenv(precision.CPU_BF16_ENV)
    assert precision.resolve("auto", cpu, torch.float64).name == "float64"
    assert precision.resolve("float32", cpu, torch.float32).reason == "asked for"
    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset({"avx2"}))
    chosen = precision.resolve("auto", cpu, torch.float32)
    assert chosen.name == "float32" and "neither avx512_bf16 nor amx_bf16" in chosen.reason
    monkeypatch.setenv(precision.CPU_BF16_ENV, "1")
    assert precision.resolve("auto", cpu, torch.float32).name == "bfloat16"
    monkeypatch.delenv(precision.CPU_BF16_ENV)
    assert precision.resolve("bfloat16", cpu, torch.float32).name == "bfloat16"  # runs, emulated
    # CUDA: compute capability 8.0 and up has bfloat16; an older GPU refuses it in one line
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    gpu = torch.device("cuda")
    assert precision.resolve("auto", gpu, torch.float16).name == "float32"
    with pytest.raises(FeatCalError, match=r"^--precision bfloat16: Tesla V100.*float32"):
        precision.resolve("bfloat16", gpu, torch.float32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert precision.resolve("auto", gpu, torch.float32).name == "bfloat16"


def test_the_record_says_which_precision_ran_and_why(tmp_path, monkeypatch):
    from featcal_core import precision

    monkeypatch.setattr(precision, "_cpu_flags", lambda: frozenset())
    zoo = factories.clip_zoo(tmp_path / "zoo")
    record = calibrate(
        zoo.base,
        zoo.merged,
        zoo.experts,
        zoo.calib,
        tmp_path / "out",
        num_per_task=4,
        progress=False,
    )
    settings = record["hyperparameters"]
    assert settings["precision"] == "float32" and settings["precision_requested"] == "auto"
    # where the wall time went: the stages add up to no more than the whole, and the blocks'
    # stage holds every block's own seconds
    stages = record["stage_seconds"]
    assert list(stages) == ["setup", "stems", "blocks", "export"]
    assert all(seconds > 0 for seconds in stages.values())
    assert sum(stages.values()) <= record["wall_seconds"] + 0.01
    assert stages["blocks"] >= sum(block["seconds"] for block in record["blocks"]) - 0.01
    assert settings["precision_reason"].startswith("auto: no native bfloat16")


def test_bfloat16_without_a_ridge_keeps_float32_products(tmp_path):
    """At λ = 0 bfloat16 products made block 1's drift worse than before calibration (18.6 > 14.8
    on this pool, α 1); below BF16_MIN_LAM the products stay float32 and the passes bfloat16."""
    from featcal_core.method.hyperparameters import FeatCalParams

    zoo = factories.clip_zoo(tmp_path / "zoo", tasks=("a", "b", "c"), rows=16, blocks_only=True)
    record = calibrate(
        zoo.base,
        zoo.merged,
        zoo.experts,
        zoo.calib,
        tmp_path / "out",
        params=FeatCalParams(alpha=1.0, lam=0.0),
        precision="bfloat16",
        progress=False,
    )
    settings = record["hyperparameters"]
    assert settings["precision"] == "bfloat16" and settings["products_precision"] == "float32"
    for block in record["blocks"]:
        assert sum(block["drift_after"].values()) < sum(block["drift_before"].values()), block
    ridge = calibrate(
        zoo.base,
        zoo.merged,
        zoo.experts,
        zoo.calib,
        tmp_path / "ridge",
        precision="bfloat16",
        progress=False,
    )["hyperparameters"]
    assert ridge["products_precision"] == "bfloat16"  # the paper's λ 0.05: bfloat16 products


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_isfinite(dtype):
    """The two-reduction check against `torch.isfinite(t).all()`, a bad value anywhere."""
    from featcal_core.finite import all_finite

    g = torch.Generator().manual_seed(3)
    for shape in [(1,), (7, 5), (1600, 96), (3, 4, 1025)]:
        clean = torch.randn(shape, generator=g).to(dtype)
        assert all_finite(clean)
        for bad in (float("nan"), float("inf"), float("-inf")):
            for position in (0, clean.numel() // 2, clean.numel() - 1):
                dirty = clean.clone().reshape(-1)
                dirty[position] = bad
                assert all_finite(dirty) is False
                assert not bool(torch.isfinite(dirty).all())
    assert all_finite(torch.empty(0)) and all_finite(torch.tensor([1, 2]))


def test_bfloat16_checkpoints_run_float32_passes_under_float32(tmp_path):
    """--precision float32 on bfloat16 checkpoints runs the stems, block passes and streams in
    float32 and writes bfloat16. Block 0 then equals, bit for bit, the same calibration of the
    same weights stored as float32, rounded to bfloat16 at the end; later blocks see the
    calibrated block's weights as written (bfloat16), so they only stay close."""
    zoo = factories.clip_zoo(tmp_path / "zoo", dtype=torch.bfloat16)
    wide = tmp_path / "wide"
    for name in ("base", "merged", *zoo.experts):
        source = Path(
            zoo.base if name == "base" else zoo.merged if name == "merged" else zoo.experts[name]
        )
        shutil.copytree(source, wide / name)
        weights = wide / name / "model.safetensors"
        tensors = {k: v.float() for k, v in load_file(str(weights)).items()}
        save_file(tensors, str(weights), metadata={"format": "pt"})
        config = json.loads((wide / name / "config.json").read_text())
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = "float32"
        (wide / name / "config.json").write_text(json.dumps(config))
    run = Calibration(
        zoo.base, zoo.merged, zoo.experts, zoo.calib, settings=Settings(precision="float32")
    )
    assert (run.checkpoint_dtype, run.dtype) == (torch.bfloat16, torch.float32)
    slow = Calibration(
        zoo.base, zoo.merged, zoo.experts, zoo.calib, settings=Settings(precision="bfloat16")
    )
    assert slow.dtype == torch.bfloat16  # bfloat16 asked: the passes stay 16-bit
    outs = {}
    for kind, models in (
        ("narrow", (zoo.base, zoo.merged, zoo.experts)),
        ("wide", (wide / "base", wide / "merged", {t: wide / t for t in zoo.experts})),
    ):
        outs[kind] = tmp_path / f"out_{kind}"
        calibrate(
            *models, zoo.calib, outs[kind], num_per_task=4, precision="float32", progress=False
        )
    narrow = load_file(str(outs["narrow"] / "model.safetensors"))
    widened = load_file(str(outs["wide"] / "model.safetensors"))
    assert set(narrow) == set(widened)
    records = [json.loads((outs[k] / "featcal.json").read_text()) for k in ("narrow", "wide")]
    assert records[0]["blocks"][0]["drift_before"] == records[1]["blocks"][0]["drift_before"]
    for key, tensor in narrow.items():
        assert tensor.dtype == torch.bfloat16, key
        rounded = widened[key].to(torch.bfloat16)
        if ".layers.1." in key:
            torch.testing.assert_close(tensor.float(), rounded.float(), rtol=0.02, atol=1e-3)
        else:  # block 0 and the tensors FeatCal does not change
            assert torch.equal(tensor, rounded), key
