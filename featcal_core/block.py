"""Calibrate one block (method page, "Data flow", steps 1–4).

One pass of the *uncalibrated* merged block on each task's student stream and of expert t's block on
its expert stream gives every statistic; all Linear and norm parameters are then solved in closed
form, loaded into the merged block, and the calibrated block produces the next student stream.
Only one block of the base, the merged model and one expert is in memory at a time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from featcal_core.errors import FeatCalError
from featcal_core.model_set import ModelSet
from featcal_core.solvers import anchor
from featcal_core.statistics import LinearInputStats, NormStats, Scratch
from featcal_core.streams import EXPERT, STUDENT, HiddenStreams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FeatCalParams:
    """FeatCal hyperparameters (defaults: the authors' demo)."""

    alpha: float = 0.25  # teacher interpolation α
    rho: float = 2.2  # anchor blend ρ
    lam: float = 0.05  # ridge λ
    eps: float = 1e-8  # jitter ε


@dataclass
class BlockResult:
    index: int
    tensors: dict[str, torch.Tensor]  # local name → calibrated tensor, merged storage dtype
    # task → mean ‖student − expert‖² per real token (the pooled token only in a pooled last block)
    drift_before: dict[str, float] = field(default_factory=dict)
    drift_after: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


class _Capture:
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

    def run(self, block: nn.Module, hidden: torch.Tensor, mask: torch.Tensor):
        """(block output, {module name: its input}) for one batch; the caller owns the dict."""
        self.inputs = {}
        self._active = True
        try:
            with torch.no_grad():
                out = self.arch.run_block(block, hidden, mask)
        finally:
            self._active = False
        inputs, self.inputs = self.inputs, {}
        return out, inputs


class BlockRunner:
    """Reusable block modules (merged and expert) with capture hooks, for one architecture."""

    def __init__(self, models: ModelSet, dtype: torch.dtype, device: torch.device):
        self.models = models
        self.arch = models.arch
        self.dtype = dtype
        self.device = device
        self.merged_block = self.arch.build_block(dtype).to(device).requires_grad_(False)
        self.expert_block = self.arch.build_block(dtype).to(device).requires_grad_(False)
        norm_types = self.arch.norm_types + self.arch.rms_norm_types
        self.linears = [n for n, m in self.merged_block.named_modules() if isinstance(m, nn.Linear)]
        self.norms = [n for n, m in self.merged_block.named_modules() if isinstance(m, norm_types)]
        self.local_names = list(self.merged_block.state_dict().keys())
        self.merged_capture = _Capture(self.arch, self.merged_block, self.linears + self.norms)
        self.expert_capture = _Capture(self.arch, self.expert_block, self.linears + self.norms)

    def load(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        state = {name: tensors[name].to(self.device, self.dtype) for name in self.local_names}
        module.load_state_dict(state, strict=True)

    def read_block(self, checkpoint, index: int) -> dict[str, torch.Tensor]:
        prefix = self.arch.block_prefix(index)
        tensors = self.models.read(checkpoint, [prefix + name for name in self.local_names])
        return {name: tensors[prefix + name] for name in self.local_names}

    def forward(self, module: nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.arch.run_block(module, hidden, mask)

    @torch.no_grad()
    def calibrate(
        self,
        index: int,
        source: HiddenStreams,
        target: HiddenStreams,
        masks: dict[str, torch.Tensor],
        params: FeatCalParams,
        batch_size: int,
    ) -> BlockResult:
        """Calibrate block `index`: reads both streams of every task from `source` (block inputs)
        and writes the block outputs to `target` (may be the same object)."""
        start = time.perf_counter()
        arch = self.arch
        last = index == arch.num_blocks - 1
        merged_sd = self.read_block(self.models.merged, index)
        self.load(self.merged_block, merged_sd)
        result = BlockResult(index, {})
        linear_stats: dict[tuple[int, bool], LinearInputStats] | None = None
        groups: dict[str, tuple[int, bool]] = {}
        norm_stats: dict[str, NormStats] = {}

        for task, expert in self.models.experts.items():
            expert_sd = self.read_block(expert, index)
            self.load(self.expert_block, expert_sd)
            del expert_sd
            expert_params = {
                name: (mod.weight, mod.bias)
                for name in self.linears
                for mod in [self.expert_block.get_submodule(name)]
            }
            new_expert, sq_sum, tok_sum = [], 0.0, 0.0
            batches = zip(
                source.batches(STUDENT, task, batch_size),
                source.batches(EXPERT, task, batch_size),
                masks[task].split(batch_size),
                strict=True,
            )
            for student, expert_hidden, mask in batches:
                student = student.to(self.device)
                expert_hidden = expert_hidden.to(self.device)
                mask = mask.to(self.device)
                out_m, x_s = self.merged_capture.run(self.merged_block, student, mask)
                out_e, x_e = self.expert_capture.run(self.expert_block, expert_hidden, mask)
                _check_finite(out_e, f"expert {task!r} output of block {index}")
                _check_finite(out_m, f"merged output of block {index} on task {task!r}")
                if linear_stats is None:
                    tokens = min(int(m.sum()) for m in masks.values())
                    linear_stats, groups = self._linear_groups(x_s, last, tokens)
                    norm_stats = self._norm_stats()
                self._accumulate(x_s, x_e, mask, last, params.alpha, groups, linear_stats,
                                 norm_stats, expert_params)  # fmt: skip
                del x_s, x_e
                sq, tok = _drift_sums(out_m, out_e, self._drift_mask(mask, last))
                sq_sum, tok_sum = sq_sum + sq, tok_sum + tok
                new_expert.append(out_e.to("cpu"))
            result.drift_before[task] = sq_sum / max(tok_sum, 1.0)
            for stats in linear_stats.values():
                members = {name: expert_params[name] for name in stats.targets}
                stats.end_task(params.eps, params.alpha, members)
            for name, stats in norm_stats.items():
                module = self.expert_block.get_submodule(name)
                stats.end_task(module.weight, getattr(module, "bias", None))
            target.put(EXPERT, task, torch.cat(new_expert))
            del new_expert

        base_sd = self.read_block(self.models.base, index)
        solved = self._solve(linear_stats, norm_stats, merged_sd, base_sd, params)
        del linear_stats, norm_stats
        del base_sd
        result.tensors = {name: solved[name].to(merged_sd[name].dtype) for name in solved}
        merged_sd.update(result.tensors)
        self.load(self.merged_block, merged_sd)

        for task in self.models.experts:
            outputs, sq_sum, tok_sum = [], 0.0, 0.0
            batches = zip(
                source.batches(STUDENT, task, batch_size),
                target.batches(EXPERT, task, batch_size),
                masks[task].split(batch_size),
                strict=True,
            )
            for student, expert_out, mask in batches:
                out = self.forward(self.merged_block, student.to(self.device), mask.to(self.device))
                _check_finite(out, f"calibrated output of block {index} on task {task!r}")
                drift_mask = self._drift_mask(mask.to(self.device), last)
                sq, tok = _drift_sums(out, expert_out.to(self.device), drift_mask)
                sq_sum, tok_sum = sq_sum + sq, tok_sum + tok
                outputs.append(out.to("cpu"))
            result.drift_after[task] = sq_sum / max(tok_sum, 1.0)
            target.put(STUDENT, task, torch.cat(outputs))
        result.seconds = time.perf_counter() - start
        return result

    # ----- helpers ----------------------------------------------------------------------------
    def _drift_mask(self, mask: torch.Tensor, last: bool) -> torch.Tensor:
        """Tokens the drift is measured on: all real tokens; only the pooled one in the last block
        of a pooled model (the only output that matters there)."""
        if not last or self.arch.pooled_position is None:
            return mask
        only = torch.zeros_like(mask)
        only[:, self.arch.pooled_position] = mask[:, self.arch.pooled_position]
        return only

    def _pooled(self, name: str, last: bool) -> bool:
        return last and self.arch.pooled_position is not None and self.arch.is_pooled_module(name)

    def _linear_groups(self, captured: dict[str, torch.Tensor], last: bool, tokens: int):
        """Group Linear modules that read the same tensor with the same token weights."""
        groups: dict[str, tuple[int, bool]] = {}
        members: dict[tuple[int, bool], dict[str, tuple[int, bool]]] = {}
        for name in self.linears:
            key = (id(captured[name]), self._pooled(name, last))
            groups[name] = key
            module = self.merged_block.get_submodule(name)
            members.setdefault(key, {})[name] = (module.out_features, module.bias is not None)
        stats = {}
        scratch = Scratch(self.device)
        for key, modules in members.items():
            d_in = self.merged_block.get_submodule(next(iter(modules))).in_features
            stats[key] = LinearInputStats(d_in, modules, self.device, tokens, scratch)
        return stats, groups

    def _norm_stats(self) -> dict[str, NormStats]:
        out = {}
        for name in self.norms:
            module = self.merged_block.get_submodule(name)
            eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 1e-6)))
            rms = isinstance(module, self.arch.rms_norm_types)
            has_bias = getattr(module, "bias", None) is not None
            out[name] = NormStats(module.weight.shape[0], eps, rms, has_bias, self.device)
        return out

    def _accumulate(
        self, x_s, x_e, mask, last, alpha, groups, linear_stats, norm_stats, expert_params
    ):
        done: set[tuple[int, bool]] = set()
        for name in self.linears:
            key = groups[name]
            if key in done:
                continue
            done.add(key)
            stats = linear_stats[key]
            (xs, xe), w = _weighted_tokens(
                self.arch.token_weights(name, last, mask), x_s[name], x_e[name]
            )
            params = {member: expert_params[member] for member in stats.targets}
            stats.add(xs, xe, w, alpha, params)
        for name, stats in norm_stats.items():
            (xs,), w = _weighted_tokens(self.arch.token_weights(name, last, mask), x_s[name])
            stats.add(xs, w)

    def _solve(self, linear_stats, norm_stats, merged_sd, base_sd, params):
        lam, rho, eps = params.lam, params.rho, params.eps
        solved: dict[str, torch.Tensor] = {}

        def anchored(name: str) -> torch.Tensor | None:
            if name not in merged_sd or lam == 0:
                return None
            return anchor(merged_sd[name].to(self.device), base_sd[name].to(self.device), rho)

        for stats in linear_stats.values():
            anchors = {
                name: (anchored(f"{name}.weight"), anchored(f"{name}.bias"))
                for name in stats.targets
            }
            for name, (weight, bias) in stats.solve(lam, eps, anchors).items():
                solved[f"{name}.weight"] = weight.to("cpu")
                if bias is not None:
                    solved[f"{name}.bias"] = bias.to("cpu")
        for name, stats in norm_stats.items():
            gamma, beta = stats.solve(
                lam, eps, anchored(f"{name}.weight"), anchored(f"{name}.bias")
            )
            solved[f"{name}.weight"] = gamma.to("cpu")
            if beta is not None:
                solved[f"{name}.bias"] = beta.to("cpu")
        for name, tensor in solved.items():
            _check_finite(tensor, f"solved parameter {name}")
        return solved


def _weighted_tokens(weights: torch.Tensor, *hidden: torch.Tensor):
    """Flatten (B, S, d) inputs to their tokens of non-zero weight: ([tokens (N, d), ...], w (N))
    with w None when every kept weight is 1."""
    weights = weights.reshape(-1)
    keep = weights > 0
    flat = [h.reshape(-1, h.shape[-1]) for h in hidden]
    if not bool(keep.all()):
        weights = weights[keep]
        flat = [h[keep] for h in flat]
    w = None if bool((weights == 1).all()) else weights
    return flat, w


def _drift_sums(
    student: torch.Tensor, expert: torch.Tensor, mask: torch.Tensor
) -> tuple[float, float]:
    """(Σ mask·‖s − e‖², Σ mask) over tokens, in float64."""
    sq = (student.to(torch.float64) - expert.to(torch.float64)).pow(2).sum(-1)
    mask = mask.to(torch.float64)
    return float((sq * mask).sum()), float(mask.sum())


def _check_finite(tensor: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise FeatCalError(
            f"NaN or Inf in the {what}; check that checkpoint's weights and its dtype's range "
            "(try float32 weights)"
        )
