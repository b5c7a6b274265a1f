"""A block pass queues its batches on the device: the times it reads a device value into Python
(each one a wait for the GPU) do not grow with the number of batches. The pieces that make it so
(`TokenPlan`, `FiniteChecks`, `DriftSums`, `HostRows`) against their direct forms."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import factories
from featcal_core.architectures.base import Architecture
from featcal_core.errors import FeatCalError
from featcal_core.method.calibration import Calibration
from featcal_core.method.drift import DriftSums, FiniteChecks, drift_sums
from featcal_core.method.settings import Settings
from featcal_core.method.streams import HiddenStreams
from featcal_core.method.token_selection import TokenPlan
from featcal_core.method.transfers import HostRows

CPU = torch.device("cpu")
#: the Tensor methods that turn a value into a Python object (on CUDA: wait for the device)
READS = {"__bool__", "__float__", "__int__", "__index__", "item", "tolist"}


class CountReads(TorchFunctionMode):
    """Counts the calls of `READS` made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["clip", "bert"])
def test_reads_per_block_do_not_grow_with_the_batches(tmp_path, family):
    zoo = (factories.clip_zoo if family == "clip" else factories.bert_zoo)(tmp_path / "zoo")
    counts = {}
    for batch_size in (1, 5, 12):  # 12, 3 and 1 batches per task
        run = Calibration(
            zoo.base, zoo.merged, zoo.experts, zoo.calib, settings=Settings(batch_size=batch_size)
        )
        streams = HiddenStreams(None)
        masks = run.stems(streams)
        assert {m.shape[0] for m in masks.values()} == {12}
        counts[batch_size] = []
        for index in range(run.num_blocks):  # the last one is pooled (CLIP) / a padded text
            with CountReads() as reads:
                run.block(index, streams, streams, masks)
            counts[batch_size].append(reads.count)
    assert counts[1] == counts[5] == counts[12], counts
    assert all(count > 0 for count in counts[1])  # the counter sees the block's reads


class _Arch:
    """The architectures' own token weights (padding 0, pooled token 1, others 0.01), with "k"
    exempt from pooling and "cross" reading the encoder's context."""

    pooled_position = 0
    pooled_exempt = ("k",)
    token_weights = Architecture.token_weights
    is_pooled_module = Architecture.is_pooled_module

    def reads_context(self, name):
        return name == "cross"


@pytest.mark.parametrize("last", [False, True])
def test_token_plan_selects_the_tokens_and_weights_of_the_masks(last):
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(7, 5, generator=g) > 0.3).float()
    mask[:3] = 1.0  # the first batch (3 rows) is unpadded
    context = (torch.rand(7, 4, generator=g) > 0.5).float()
    arch = _Arch()
    plan = TokenPlan(arch, last, mask, context, batch_size=3, device=CPU)
    for number, start in enumerate(range(0, 7, 3)):
        for name in ("q", "k", "cross"):
            source = context if name == "cross" else mask
            weights = arch.token_weights(name, last, source[start : start + 3]).reshape(-1)
            hidden = torch.randn(*source[start : start + 3].shape, 2, generator=g)
            keep = weights > 0
            selection = plan.select(number, name)
            assert torch.equal(selection.tokens(hidden), hidden.reshape(-1, 2)[keep])
            expected = None if bool((weights[keep] == 1).all()) else weights[keep]
            if expected is None:
                assert selection.weights is None
            else:
                assert torch.equal(selection.weights, expected)
            assert (selection.index is None) == bool(keep.all())
    assert plan.select(0, "q").index is None  # the unpadded batch keeps every token as it is


def test_finite_checks_name_the_first_bad_tensor_in_order():
    checks = FiniteChecks()
    checks.add(torch.ones(3), "first")
    checks.add(torch.tensor([1.0, float("inf")]), "second")
    checks.add(torch.tensor([float("nan")]), "third")
    with pytest.raises(FeatCalError, match="NaN or Inf in the second"):
        checks.raise_first()
    checks.raise_first()  # forgotten once raised
    checks.add(torch.tensor([-float("inf")], dtype=torch.bfloat16), "low")
    with pytest.raises(FeatCalError, match="in the low"):
        checks.raise_first()
    checks.add(torch.ones(2), "fine")
    checks.add(torch.zeros(0), "empty")
    checks.raise_first()


def test_drift_sums_over_batches_equal_the_per_batch_floats():
    g = torch.Generator().manual_seed(1)
    sums, sq_total, tok_total = DriftSums(), 0.0, 0.0
    for _ in range(4):
        student, expert = torch.randn(2, 3, 5, generator=g), torch.randn(2, 3, 5, generator=g)
        mask = (torch.rand(2, 3, generator=g) > 0.4).float()
        sums.add(student, expert, mask)
        sq, tok = drift_sums(student, expert, mask)
        sq_total, tok_total = sq_total + float(sq), tok_total + float(tok)
    assert sums.totals() == (sq_total, tok_total)
    assert DriftSums().totals() == (0.0, 0.0)


def test_host_rows_gather_the_batches_in_order():
    batches = [torch.randn(n, 2, 3) for n in (4, 4, 1)]
    rows = HostRows(9)
    for batch in batches:
        rows.add(batch)
    assert torch.equal(rows.tensor(), torch.cat(batches))
    short = HostRows(9)
    short.add(batches[0])
    with pytest.raises(ValueError, match="4 of the stream's 9 rows"):
        short.tensor()
    with pytest.raises(ValueError, match="12 rows added to a stream of 9"):
        for _ in range(3):
            short.add(batches[0])
