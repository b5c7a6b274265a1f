"""The pieces of a block's statistics pass (docs/featcal.md, "Data flow", step 2).

`Capture` hooks record the input of every Linear and norm of a block module while it runs on a
batch of hidden states (B, S, d) with its token mask (B, S). `linear_groups` and `new_norm_stats`
make the accumulators (statistics.py) for one block: Linears that read the same tensor with the
same token weights share one `LinearInputStats` (Gram (d_in, d_in) ...), each norm gets a
`NormStats` ((d,) per channel). `accumulate` adds one batch's captured inputs, flattened to their weighted
tokens (N, d) with weights (N,) as a `TokenPlan` selects them, to them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from featcal_core.errors import FeatCalError
from featcal_core.method.hyperparameters import FeatCalParams
from featcal_core.method.norm_statistics import NormStats
from featcal_core.method.statistics import LinearInputStats, Scratch
from featcal_core.method.token_selection import TokenPlan, pooled_input


def run_block(arch, block, hidden, mask, context):
    """arch.run_block, with the decoder's context only when there is one."""
    if context is None:
        return arch.run_block(block, hidden, mask)
    return arch.run_block(block, hidden, mask, context=context)


class Capture:
    """Forward pre-hooks that record the input of the named submodules during `run`."""

    def __init__(self, arch, module: nn.Module, names: list[str]):
        self.arch = arch
        self.inputs: dict[str, torch.Tensor] = {}
        self._active = False
        for name in names:
            module.get_submodule(name).register_forward_pre_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(_module, args):
            if self._active:
                self.inputs[name] = args[0]

        return hook

    def run(self, block: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, context=None):
        """(block output, {module name: its input}) for one batch; the caller owns the dict."""
        self.inputs = {}
        self._active = True
        try:
            with torch.no_grad():
                out = run_block(self.arch, block, hidden, mask, context)
        finally:
            self._active = False
        inputs, self.inputs = self.inputs, {}
        return out, inputs


def linear_groups(
    arch,
    block: nn.Module,
    linears: list[str],
    captured: dict[str, torch.Tensor],
    last: bool,
    tokens: int,
    device: torch.device,
    precision: str = "float64",
    reuse: dict | None = None,
    *,
    params: FeatCalParams,
):
    """Group Linear modules that read the same tensor with the same token weights; each group
    is labelled by its first module's name (stable across processes). `precision`: of the
    token products (statistics.py); `params`: FeatCal's α, λ, ε, which the accumulators hold
    (statistics.py). `reuse`: accumulators (and their scratch) kept from an
    earlier task with the same group layout are taken from it, and new ones put in it, so the
    tasks of a block share their per-task buffers instead of allocating them (tens of MB per
    task: page faults and zeroing); the caller must fold or save one task's contributions (they
    are views of these buffers) before the next task's pass."""
    labels: dict[tuple[int, bool], str] = {}
    groups: dict[str, str] = {}
    members: dict[str, dict[str, tuple[int, bool]]] = {}
    for name in linears:
        label = labels.setdefault((id(captured[name]), pooled_input(arch, name, last)), name)
        groups[name] = label
        module = block.get_submodule(name)
        assert isinstance(module, nn.Linear)  # `linears` names Linear modules
        members.setdefault(label, {})[name] = (module.out_features, module.bias is not None)
    stats = {}
    kept = {} if reuse is None else reuse
    scratch = kept.setdefault("scratch", Scratch(device))
    for label, modules in members.items():
        first = block.get_submodule(label)
        assert isinstance(first, nn.Linear)  # a label is a Linear's name
        d_in = first.in_features
        key = (label, d_in, tuple(modules.items()), tokens, precision, params)
        if key not in kept:
            kept[key] = LinearInputStats(
                d_in,
                modules,
                device,
                tokens,
                scratch,
                precision,
                keeps_buffers=reuse is not None,
                params=params,
            )
        stats[label] = kept[key]
    return stats, groups


def new_norm_stats(
    block: nn.Module, norms: list[str], rms_norm_types: tuple, device: torch.device
) -> dict[str, NormStats]:
    """An empty `NormStats` for each norm module of `block` (its eps, RMS or not, bias or not)."""
    out = {}
    for name in norms:
        module = block.get_submodule(name)
        eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 1e-6)))
        rms = isinstance(module, rms_norm_types)
        has_bias = getattr(module, "bias", None) is not None
        assert isinstance(module.weight, torch.Tensor)  # a norm's own γ
        out[name] = NormStats(module.weight.shape[0], eps, rms, has_bias, device)
    return out


def accumulate(
    linears,
    x_s,
    x_e,
    plan: TokenPlan,
    number: int,
    groups,
    linear_stats,
    norm_stats,
    expert_params,
):
    """Add batch `number`'s captured inputs (student x_s, expert x_e: module → (B, S, d)) to the
    Linear groups' and norms' accumulators: each module's tokens and weights as `plan` selects
    them (`arch.token_weights`)."""
    done: set[str] = set()
    for name in linears:
        key = groups[name]
        if key in done:
            continue
        done.add(key)
        stats = linear_stats[key]
        selection = plan.select(number, name)
        params = {member: expert_params[member] for member in stats.targets}
        stats.add(
            selection.tokens(x_s[name]), selection.tokens(x_e[name]), selection.weights, params
        )
    for name, stats in norm_stats.items():
        selection = plan.select(number, name)
        stats.add(selection.tokens(x_s[name]), selection.weights)


@contextmanager
def tokens_needed(index: int, task: str, module: str) -> Iterator[None]:
    """Turn a statistics' "no weighted tokens" ValueError into a FeatCalError naming the task,
    block and module."""
    try:
        yield
    except ValueError as exc:
        raise FeatCalError(
            f"task {task!r} gives no weighted tokens to {module} in block {index} ({exc}); check "
            "its calibration set and token weighting"
        ) from exc
