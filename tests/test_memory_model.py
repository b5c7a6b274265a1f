"""The memory model (featcal_core/method/memory_model.py) against the code it models: its
constants, its named sizes against the tensors of a tiny Llama block (task statistics, the saved
file, the block modules, the streams, the via-X choice), and its predicted peak against the peak
RSS of a block measured in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from factories import TINY_LLAMA
from featcal_core import precision
from featcal_core.data.synthetic import WORDS, build_pool
from featcal_core.io.safetensors_io import read_header
from featcal_core.method import memory_model as mm
from featcal_core.method import solvers, statistics
from featcal_core.method.block import BlockRunner
from featcal_core.method.calibration import Calibration
from featcal_core.method.settings import Settings
from featcal_core.method.streams import HiddenStreams

REPO = Path(__file__).resolve().parents[1]


def _long_texts(path: Path, rows: int, words: int, seed: int) -> None:
    """`rows` texts of at most `words` random words, the first exactly `words` long (so every
    task pads to the same length)."""
    rng = np.random.default_rng(seed)
    sizes = [words] + [int(rng.integers(words - 8, words)) for _ in range(rows - 1)]
    texts = [" ".join(rng.choice(WORDS, size=size)) for size in sizes]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))


def _pool(root: Path, config: dict, words: int, tasks=("a", "b"), rows: int = 12):
    pool = build_pool(root, "llama", config, tasks, dtype=torch.float32, rows=rows)
    for i, task in enumerate(tasks):  # longer texts than the synthetic ones: real batches
        path = pool.calib[task]
        path.rename(path.with_name(path.name + "_short"))
        _long_texts(path, rows, words, seed=i)
    return pool


def test_constants_mirror_the_code():
    assert mm.TOKEN_CHUNK == statistics.TOKEN_CHUNK
    assert mm.TOKEN_CHUNK_FP32 == statistics.TOKEN_CHUNK_FP32
    assert mm.SYMMETRIC_BLOCK == statistics.SYMMETRIC_BLOCK
    assert mm.SYMMETRIC_BLOCK_FP32 == statistics.SYMMETRIC_BLOCK_FP32
    assert mm.SYMMETRIC_BLOCK_CUDA == statistics.SYMMETRIC_BLOCK_CUDA
    assert mm.SOLVE_COLUMNS == solvers.SOLVE_COLUMNS
    assert mm.BF16_MIN_LAM == precision.BF16_MIN_LAM
    assert mm.BATCH_SIZE == Settings().batch_size
    for name, dtype in precision.PRODUCT_DTYPES.items():
        assert mm.PRODUCT_BYTES[name] == dtype.itemsize


@pytest.fixture(scope="module")
def tiny_pool(tmp_path_factory):
    """A tiny float32 Llama pool (2 tasks) with texts of up to 31 tokens."""
    return _pool(tmp_path_factory.mktemp("memory_model") / "zoo", TINY_LLAMA, words=30)


@pytest.mark.parametrize("products", ["float32", "float64"])
def test_named_sizes_are_the_tensors_of_a_tiny_block(tiny_pool, tmp_path, products):
    config, pool = TINY_LLAMA, tiny_pool
    cal = Calibration(
        pool.base, pool.merged, pool.experts, pool.calib, settings=Settings(precision=products)
    )
    streams = HiddenStreams(None)
    masks = cal.stems(streams)
    length = {m.shape[1] for m in masks.values()}.pop()  # the same for both tasks
    tokens = min(int(m.sum()) for m in masks.values())
    geometry = mm.Geometry(
        config["hidden_size"],
        config["intermediate_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        layers=config["num_hidden_layers"],
    )
    work = mm.Workload(
        tasks=2, inputs=12, tokens=length, real_tokens=tokens, precision=products, weight_bytes=4
    )
    estimate = mm.estimate(geometry, work)
    terms = estimate["terms"]

    streamed = sum(t.nbytes for t in streams._memory.values())
    assert streamed == terms["all streams (2 per task)"]
    runner = BlockRunner(cal.models, cal.dtype, cal.device, cal.precision, cal.products)
    block = sum(t.nbytes for t in runner.merged_block.state_dict().values())
    assert block == terms["block weights (one model)"]

    stats = runner.task_statistics(
        0, "a", streams, HiddenStreams(None), masks, cal.params, 16, reuse=True
    )
    accumulators = [v for k, v in runner._reused.items() if k != "scratch"]
    labels = {next(iter(a.modules)).split(".")[-1]: a.via_x for a in accumulators}
    assert labels == estimate["via_x"]
    assert set(estimate["via_x"].values()) == {True, False}  # both ways are exercised
    buffers = sum(
        t.nbytes
        for a in accumulators
        for t in [a._task_gram, a._task_mixed, a._task_student, a._task_expert]
        + [target.task_cross for target in a.targets.values()]
        if t is not None
    )
    kept_cross = sum(
        8 * g.d_in * g.width_out for g in geometry.groups() if estimate["via_x"][g.label]
    )
    assert buffers == terms["one task's statistics while it runs"] + kept_cross
    contribution = sum(
        t.nbytes for c in [*stats.linear.values(), *stats.norms.values()] for t in c.values()
    )
    assert contribution == terms["one task's statistics file"]
    stats.save(tmp_path / "stats.safetensors")
    entries, _ = read_header(tmp_path / "stats.safetensors")
    assert sum(e.end - e.start for e in entries.values()) == terms["one task's statistics file"]
    assert (
        estimate["disk_per_block"]["statistics written"] == 2 * terms["one task's statistics file"]
    )


def test_spilling_bounds_the_peak_by_one_task_and_the_peak_adds_up():
    geometry = mm.GEOMETRIES["llama-3.1-8b"]
    spilled = mm.estimate(geometry, mm.Workload(tasks=4, inputs=8, tokens=128, spill=True))
    held = mm.estimate(geometry, mm.Workload(tasks=4, inputs=8, tokens=128, spill=False))
    for estimate in (spilled, held):
        assert sum(estimate["host"]["live"].values()) == estimate["host"]["peak_bytes"]
        assert estimate["device"] is None
    sums = held["terms"]["running sums (in memory)"]
    assert held["host"]["peak_bytes"] - spilled["host"]["peak_bytes"] > 0.5 * sums
    # more tasks: the in-memory peak stays (sums are folded), the spilled disk traffic grows
    eight = mm.estimate(geometry, mm.Workload(tasks=8, inputs=8, tokens=128, spill=True))
    assert eight["host"]["peak_bytes"] == pytest.approx(spilled["host"]["peak_bytes"], rel=0.02)
    assert (
        eight["disk_per_block"]["statistics written"]
        == 2 * spilled["disk_per_block"]["statistics written"]
    )
    cuda = mm.estimate(geometry, mm.Workload(tasks=4, inputs=8, tokens=128, device="cuda"))
    assert cuda["device"]["peak_bytes"] > cuda["terms"]["one task's statistics while it runs"]
    with pytest.raises(ValueError, match="precision"):
        mm.Workload(tasks=1, inputs=1, tokens=1, precision="float16")


def test_flops_and_seconds():
    geometry = mm.Geometry(1024, 4096, 8, 8)
    work = mm.Workload(tasks=2, inputs=4, tokens=100, precision="float64", weight_bytes=8)
    counted = mm.flops(geometry, work)
    solve = sum(g.d_in**3 // 3 + 2 * g.d_in**2 * g.width_out for g in geometry.groups())
    assert counted["solve"] == solve
    # the Gram's upper block rows: about half the products at d = 4096 (block 768)
    assert 0.5 < mm._gram_flops(400, 4096, 768) / (2 * 400 * 4096**2) < 0.6
    assert mm._gram_flops(400, 1000, 768) == 2 * 400 * 1000**2
    rates = {"float64": 1e9, "float32": 2e9, "bfloat16": 4e9}
    time = mm.seconds(mm.estimate(geometry, work), rates)
    assert time["solve"] == pytest.approx(solve / 1e9)
    assert time["total"] == pytest.approx(time["forward"] + time["statistics"] + time["solve"])


#: run in a fresh process: one block as a warm-up, then the peak RSS of the next one. Freed
#: memory goes straight back to the system (mmap above 64 KiB), so the peak is the live bytes.
_MEASURE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from featcal_core.memory import compact_allocator, peak_rss_bytes, reset_peak_rss
    compact_allocator(64 << 10)
    import featcal_core.method.block as block
    block.compact_allocator = lambda: True  # keep the 64 KiB threshold in the spill mode too
    from featcal_core.method.calibration import Calibration
    from featcal_core.method.settings import Settings
    from featcal_core.method.streams import HiddenStreams
    spec = json.loads(sys.argv[1])
    cal = Calibration(spec["base"], spec["merged"], spec["experts"], spec["calib"],
                      settings=Settings(precision="float32"))
    scratch = Path(spec["scratch"]) if spec["spill"] else None
    streams = HiddenStreams(scratch / "streams" if scratch else None)
    masks = cal.stems(streams)
    cal.block(0, streams, streams, masks, scratch_dir=scratch)
    reset_peak_rss()
    start = int(Path("/proc/self/statm").read_text().split()[1]) * 4096
    cal.block(1, streams, streams, masks, scratch_dir=scratch)
    print(json.dumps({"delta": peak_rss_bytes() - start,
                      "length": {m.shape[1] for m in masks.values()}.pop(),
                      "tokens": min(int(m.sum()) for m in masks.values())}))
    """
)


@pytest.mark.parametrize("spill", [True, False])
def test_predicted_peak_is_the_measured_peak_rss_of_a_block(tmp_path, spill, record_property):
    """Within 15 % on a block wide enough for the statistics to dominate (d 512, f 2048)."""
    config = dict(TINY_LLAMA, hidden_size=512, intermediate_size=2048, num_attention_heads=8)
    pool = _pool(tmp_path / "zoo", config, words=60, rows=16)
    (tmp_path / "scratch").mkdir()
    spec = {
        "base": str(pool.base),
        "merged": str(pool.merged),
        "experts": {t: str(p) for t, p in pool.experts.items()},
        "calib": {t: str(p) for t, p in pool.calib.items()},
        "scratch": str(tmp_path / "scratch"),
        "spill": spill,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    geometry = mm.Geometry(512, 2048, 8, config["num_key_value_heads"], layers=2)
    work = mm.Workload(
        tasks=2,
        inputs=16,
        tokens=measured["length"],
        real_tokens=measured["tokens"],
        weight_bytes=4,
        spill=spill,
        baseline_bytes=0,
    )
    estimate = mm.estimate(geometry, work)
    # what was already there when the second block started: streams, the block modules
    live = estimate["host"]["live"]
    at_start = live.get("streams (in memory)", 0) + live["block modules (merged, expert)"]
    predicted = estimate["host"]["peak_bytes"] - at_start
    record_property(
        f"report: measured / predicted peak RSS of a block ({'spilled' if spill else 'in memory'})",
        f"{measured['delta'] / predicted:.3f}",
    )
    assert measured["delta"] == pytest.approx(predicted, rel=0.15), (
        measured["delta"] / predicted,
        measured,
        estimate["host"],
    )
