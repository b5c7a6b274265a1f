"""Per-task statistics computed apart (another Calibration object, saved and loaded as a file, the
way a Dask worker hands them back) fold to the same block, bit for bit, as computing them in place."""

from __future__ import annotations

import pytest
import torch

import factories
from featcal_core.errors import FeatCalError
from featcal_core.method.calibration import Calibration
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.norm_statistics import NormStats
from featcal_core.method.statistics import LinearInputStats
from featcal_core.method.streams import EXPERT, STUDENT, HiddenStreams
from featcal_core.method.task_statistics import TaskStatistics

CPU = torch.device("cpu")


def _batches(seed: int, tasks: int, d_in: int, d_out: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(tasks):
        x_s, x_e = torch.randn(30, d_in, generator=g), torch.randn(30, d_in, generator=g)
        w = torch.rand(30, generator=g)
        params = {"q": (torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g))}
        out.append((x_s, x_e, w, params))
    return out


@pytest.mark.parametrize("via_x", [False, True])
def test_linear_contributions_merged_elsewhere_equal_end_task(via_x):
    hint = 30 if via_x else None
    tasks = _batches(0, 3, 6, 4)
    hp = FeatCalParams(alpha=0.3, lam=0.05, eps=1e-8)
    in_place = LinearInputStats(6, {"q": (4, True)}, CPU, hint, params=hp)
    merged_only = LinearInputStats(6, {"q": (4, True)}, CPU, hint, params=hp)
    for x_s, x_e, w, params in tasks:
        in_place.add(x_s, x_e, w, params)
        in_place.end_task(params)
        apart = LinearInputStats(6, {"q": (4, True)}, CPU, hint, params=hp)  # one per task
        apart.add(x_s, x_e, w, params)
        merged_only.merge({k: v.clone() for k, v in apart.task_contribution(params).items()})
    assert merged_only._task_gram is None  # an accumulator that only merges has no task buffers
    assert torch.equal(in_place.gram, merged_only.gram)
    assert in_place.scale_sum == merged_only.scale_sum
    anchors = {"q": (torch.ones(4, 6, dtype=torch.float64), torch.ones(4, dtype=torch.float64))}
    a = in_place.solve(anchors)["q"]
    b = merged_only.solve(anchors)["q"]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("precision", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("via_x", [False, True])
def test_one_accumulator_reused_across_tasks_equals_a_fresh_one_per_task(via_x, precision):
    """The block runner keeps one task's accumulators for the next task of the block: the
    contributions must be those of fresh accumulators, bit for bit (buffers zeroed, nothing of
    the previous task left; the via-X cross term buffer too)."""
    hint = 30 if via_x else None
    modules = {"q": (4, True), "k": (5, False)}
    g = torch.Generator().manual_seed(3)
    tasks = []
    for _ in range(3):
        x_s, x_e = torch.randn(30, 6, generator=g), torch.randn(30, 6, generator=g)
        params = {
            name: (torch.randn(d, 6, generator=g), torch.randn(d, generator=g))
            for name, (d, _) in modules.items()
        }
        tasks.append((x_s, x_e, torch.rand(30, generator=g), params))
    hp = FeatCalParams(alpha=0.3, eps=1e-8)
    reused = LinearInputStats(
        6, modules, CPU, hint, precision=precision, keeps_buffers=True, params=hp
    )
    for x_s, x_e, w, params in tasks:
        fresh = LinearInputStats(6, modules, CPU, hint, precision=precision, params=hp)
        for acc in (reused, fresh):
            acc.add(x_s[:20], x_e[:20], w[:20], params)
            acc.add(x_s[20:], x_e[20:], w[20:], params)
        mine = {k: v.clone() for k, v in reused.task_contribution(params).items()}
        theirs = fresh.task_contribution(params)
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(mine[key], value), key


def test_norm_contributions_merged_elsewhere_equal_end_task():
    g = torch.Generator().manual_seed(1)
    in_place = NormStats(5, 1e-5, rms=False, has_bias=True, device=CPU)
    merged_only = NormStats(5, 1e-5, rms=False, has_bias=True, device=CPU)
    for _ in range(3):
        x, gamma, beta = (
            torch.randn(20, 5, generator=g),
            torch.randn(5, generator=g),
            torch.randn(5, generator=g),
        )
        in_place.add(x, None)
        in_place.end_task(gamma, beta)
        apart = NormStats(5, 1e-5, rms=False, has_bias=True, device=CPU)
        apart.add(x, None)
        merged_only.merge(apart.task_contribution(gamma, beta))
    a = in_place.solve(0.0, 1e-8, None, None)
    b = merged_only.solve(0.0, 1e-8, None, None)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("family", ["clip", "bert"])
def test_block_from_saved_task_statistics_is_bitwise_identical(tmp_path, family):
    zoo = (factories.clip_zoo if family == "clip" else factories.bert_zoo)(
        tmp_path / "zoo", tasks=("a", "b", "c")
    )
    make = lambda: Calibration(zoo.base, zoo.merged, zoo.experts, zoo.calib)  # noqa: E731
    local = make()
    streams = HiddenStreams(tmp_path / "local")
    masks = local.stems(streams)
    start = HiddenStreams(tmp_path / "start")
    for kind in (STUDENT, EXPERT):
        for task in zoo.experts:
            start.put(kind, task, torch.cat(list(streams.batches(kind, task, 1000))))

    for index in range(local.num_blocks):
        worker = make()  # "another process": its own models, blocks and buffers
        target = HiddenStreams(tmp_path / f"apart{index}")
        for task in zoo.experts:
            stats = worker.task_statistics(index, task, start, target, masks)
            stats.save(tmp_path / f"stats-{index}-{task}.safetensors")
        apart = make().block(
            index,
            start,
            target,
            masks,
            lambda t, i=index: TaskStatistics.load(tmp_path / f"stats-{i}-{t}.safetensors"),
        )
        here = local.block(index, streams, streams, masks)
        assert apart.tensors.keys() == here.tensors.keys()
        for name, tensor in here.tensors.items():
            assert torch.equal(apart.tensors[name], tensor), name
        assert apart.drift_before == here.drift_before and apart.drift_after == here.drift_after
        for kind in (STUDENT, EXPERT):
            for task in zoo.experts:
                assert torch.equal(
                    next(target.batches(kind, task, 1000)), next(streams.batches(kind, task, 1000))
                )
        start = target


def test_statistics_of_another_task_or_block_are_refused(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "zoo")
    cal = Calibration(zoo.base, zoo.merged, zoo.experts, zoo.calib)
    streams = HiddenStreams(None)
    masks = cal.stems(streams)
    other = HiddenStreams(None)
    alpha = cal.task_statistics(0, "alpha", streams, other, masks)
    with pytest.raises(
        FeatCalError, match="statistics of task 'alpha', block 0 were given for task 'beta'"
    ):
        cal.block(0, streams, other, masks, lambda t: alpha)
    with pytest.raises(FeatCalError, match="not one of"):
        cal.task_statistics(0, "gamma", streams, other, masks)
    not_stats = tmp_path / "x.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(not_stats))
    with pytest.raises(FeatCalError, match="holds no FeatCal task statistics"):
        TaskStatistics.load(not_stats)


def test_only_the_spill_mode_turns_on_the_compact_allocator(tmp_path, monkeypatch):
    """The mmap threshold costs page faults (docs/benchmarks.md): the in-memory mode
    leaves glibc's default, the memory-bounded mode (statistics in files) sets it; both give
    the same block."""
    from featcal_core.method import block as block_module

    calls = []
    monkeypatch.setattr(block_module, "compact_allocator", lambda: calls.append(1) or True)
    zoo = factories.clip_zoo(tmp_path / "zoo", tasks=("a", "b"))
    results = {}
    for mode in ("memory", "files"):
        cal = Calibration(zoo.base, zoo.merged, zoo.experts, zoo.calib)
        streams = HiddenStreams(None)
        masks = cal.stems(streams)
        scratch = tmp_path / mode if mode == "files" else None
        if scratch is not None:
            scratch.mkdir()
        results[mode] = cal.block(0, streams, streams, masks, scratch_dir=scratch)
        assert len(calls) == (1 if mode == "files" else 0)
    for name, tensor in results["memory"].tensors.items():
        assert torch.equal(results["files"].tensors[name], tensor), name
