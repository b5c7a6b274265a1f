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


@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_cuda_block_waits_for_the_gpu_per_task_not_per_batch(tmp_path, kind, record_property):
    """torch's sync debug mode warns at every call that makes the host wait for the GPU: a block
    makes as many at 12 batches per task as at one."""
    import warnings

    from featcal_core.method.calibration import Calibration
    from featcal_core.method.settings import Settings
    from featcal_core.method.streams import HiddenStreams

    build = {"clip": factories.clip_zoo, "bert": factories.bert_zoo}[kind]
    zoo = build(tmp_path / "zoo", tasks=("alpha", "beta"), dtype=torch.float32)
    waits = {}
    for batch_size in (1, 12):
        run = Calibration(
            zoo.base,
            zoo.merged,
            zoo.experts,
            zoo.calib,
            settings=Settings(batch_size=batch_size, device="cuda", precision="float32"),
        )
        streams = HiddenStreams(None)
        masks = run.stems(streams)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run.block(0, streams, streams, masks)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits[batch_size] = sum("synchroniz" in str(w.message) for w in caught)
    record_property(f"report: cuda waits for block 0 ({kind}), 1 / 12 rows a batch", str(waits))
    assert waits[1] == waits[12], waits
