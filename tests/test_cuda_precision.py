"""The tiny end-to-end calibration on a CUDA GPU in bfloat16 and float32 (TF32), each against the
float64 path on the CPU (skipped without a GPU: CI never has one; run it through the device tool
when one is lent, `pytest -m cuda -rA`). Prints the worst and median relative weight differences
and the seconds of each run."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

import factories
from featcal_core import calibrate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_cuda_bfloat16_and_float32_against_cpu_float64(tmp_path, kind, record_property):
    build = {"clip": factories.clip_zoo, "bert": factories.bert_zoo}[kind]
    zoo = build(tmp_path / "zoo", tasks=("alpha", "beta", "gamma"), dtype=torch.float32)
    runs = {"float64": "cpu", "float32": "cuda", "bfloat16": "cuda"}
    weights, seconds = {}, {}
    for precision, device in runs.items():
        out = tmp_path / precision
        started = time.perf_counter()
        record = calibrate(
            zoo.base,
            zoo.merged,
            zoo.experts,
            zoo.calib,
            out,
            num_per_task=8,
            device=device,
            precision=precision,
            progress=False,
        )
        seconds[precision] = time.perf_counter() - started
        assert record["hyperparameters"]["precision"] == precision
        weights[precision] = load_file(str(out / "model.safetensors"))
    merged = load_file(str(zoo.merged / "model.safetensors"))
    exact = weights["float64"]
    calibrated = [k for k in exact if not torch.equal(exact[k], merged[k])]
    assert calibrated
    for precision, bound in (("float32", 1e-2), ("bfloat16", 5e-2)):  # TF32 is ~1e-3 relative
        errors = sorted(_relative(weights[precision][k], exact[k]) for k in calibrated)
        worst, median = errors[-1], errors[len(errors) // 2]
        record_property(
            f"report: cuda {precision} vs cpu float64 ({kind})",
            f"worst {worst:.2e}, median {median:.2e}, {seconds[precision]:.1f} s",
        )
        assert worst <= bound
