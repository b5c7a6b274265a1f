"""The expert-only forward passes RegMean needs: expert t on task t's calibration inputs, its own
stem and its own blocks, block by block, with the inputs of every Linear of the block captured.

Hidden states are (B, S, d) batches with token masks (B, S). Each task keeps one stream (its
expert's hidden states, (n_t, S_t, d), in the model dtype) in a `HiddenStreams`; only one block
module (one expert's block at a time) is in memory. A Linear's tokens are the ones FeatCal uses:
real tokens (padding out; with token weighting "answer" only the answer positions; T5's
cross-attention keys/values the encoder's tokens), each weighing 1 (or FeatCal's ω with
`pooled_weights`). Passes and token products run in `precision` (featcal_core/precision.py); sums are float64.
"""

from __future__ import annotations

import torch
from torch import nn

from featcal_core.architectures.base import WEIGHT_MASK
from featcal_core.errors import FeatCalError
from featcal_core.method.block_statistics import Capture
from featcal_core.method.drift import check_finite
from featcal_core.method.model_set import ModelSet
from featcal_core.method.solvers import DTYPE
from featcal_core.method.streams import (
    EXPERT,
    EXPERT_CONTEXT,
    EXPERT_DECODER,
    HiddenStreams,
    decoder_mask_key,
    weight_mask_key,
)
from featcal_core.precision import PRODUCT_DTYPES, autocast, product

#: tokens per work chunk of a Gram update (bounds the (chunk, d_in) product-dtype copies)
TOKEN_CHUNK = 1024
#: Gram rows per float32 product (bounds the float32 temporary to ROW_BLOCK × d_in)
ROW_BLOCK = 1024


class GramSum:
    """Σ ω x xᵀ (d_in, d_in) in float64 and Σ ω over one task's tokens x (N, d_in)."""

    def __init__(self, d_in: int, device: torch.device, precision: str):
        self.gram = torch.zeros(d_in, d_in, dtype=DTYPE, device=device)
        self.weight = 0.0
        self.product = PRODUCT_DTYPES[precision]

    def add(self, x: torch.Tensor, w: torch.Tensor) -> None:
        """Add tokens x (N, d_in) with weights w (N,) (all > 0)."""
        for start in range(0, x.shape[0], TOKEN_CHUNK):
            xc = x[start : start + TOKEN_CHUNK].to(self.product)
            wc = w[start : start + TOKEN_CHUNK]
            xw = xc if bool((wc == 1).all()) else xc * wc.to(self.product)[:, None]
            if self.product == DTYPE:
                self.gram.addmm_(xw.T, xc)
            else:  # each float32/bfloat16 product covers one chunk only, added in float64
                for row in range(0, xc.shape[1], ROW_BLOCK):
                    part = product(xw[:, row : row + ROW_BLOCK].T, xc)
                    self.gram[row : row + part.shape[0]].add_(part.to(DTYPE))
            self.weight += float(wc.sum(dtype=DTYPE))

    def mean(self) -> torch.Tensor:
        """G_t = Σ ω x xᵀ / Σ ω (the per-token mean, as the RegMean reference code)."""
        if self.weight <= 0:
            raise ValueError("no weighted tokens")
        return self.gram.div_(self.weight)


class ExpertPasses:
    """Runs each expert's stem and blocks on its own task's inputs and collects Linear Grams."""

    def __init__(
        self,
        models: ModelSet,
        dtype: torch.dtype,
        device: torch.device,
        precision: str,
        pooled_weights: bool = False,
    ):
        self.models = models
        self.arch = models.arch
        self.dtype = dtype
        self.device = device
        self.precision = precision
        self.pooled_weights = pooled_weights
        self._kinds: dict[str | None, tuple] = {}

    # ----- stems ------------------------------------------------------------------------------
    def stems(self, sets, streams: HiddenStreams, batch_size: int, max_length: int) -> dict:
        """Each expert's stem on its task's inputs → `streams` (EXPERT, and EXPERT_DECODER for
        encoder-decoders); returns the masks: task → (n, S) and the decoder / weight masks."""
        arch = self.arch
        stem = arch.build_stem(self.dtype).to(self.device).requires_grad_(False)
        names = list(stem.state_dict())
        masks: dict[str, torch.Tensor] = {}
        for task, calibration in sets.items():
            inputs = arch.prepare_inputs(
                str(self.models.base.directory), calibration.rows, max_length, calibration.targets
            )
            masks[task] = inputs["attention_mask"].to(torch.float32)
            if WEIGHT_MASK in inputs:
                masks[weight_mask_key(task)] = inputs.pop(WEIGHT_MASK).to(torch.float32)
            state = self.models.read(self.models.experts[task], names)
            stem.load_state_dict({k: v.to(self.device, self.dtype) for k, v in state.items()})
            streams.put(EXPERT, task, self._run_stem(stem, inputs, batch_size, task, False))
            if arch.decoder_start is not None:
                dec = {
                    "input_ids": inputs["decoder_input_ids"],
                    "attention_mask": inputs["decoder_attention_mask"],
                }
                masks[decoder_mask_key(task)] = dec["attention_mask"].to(torch.float32)
                streams.put(EXPERT_DECODER, task, self._run_stem(stem, dec, batch_size, task, True))
        return masks

    def _run_stem(self, stem, inputs, batch_size, task, decoder) -> torch.Tensor:
        run = self.arch.run_decoder_stem if decoder else self.arch.run_stem
        out = []
        with torch.no_grad():
            for start in range(0, inputs["attention_mask"].shape[0], batch_size):
                batch = {
                    k: v[start : start + batch_size].to(self.device) for k, v in inputs.items()
                }
                hidden = run(stem, batch)
                check_finite(hidden, f"expert {task!r} stem output")
                out.append(hidden.to("cpu"))
        return torch.cat(out)

    # ----- blocks -----------------------------------------------------------------------------
    def _use(self, index: int) -> tuple:
        """(block module, its Linear names, its state names, capture) of block `index`'s kind."""
        kind = self.arch.block_kind(index)
        if kind not in self._kinds:
            block = (
                self.arch.build_block(self.dtype)
                if kind is None
                else self.arch.build_block(  # type: ignore[call-arg]  # its arch takes a kind
                    self.dtype, kind
                )
            )
            block = block.to(self.device).requires_grad_(False)
            linears = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
            self._kinds[kind] = (
                block,
                linears,
                list(block.state_dict()),
                Capture(self.arch, block, linears),
            )
        return self._kinds[kind]

    def linears(self, index: int) -> dict[str, tuple[int, int, bool]]:
        """Block `index`'s Linear modules: local name → (d_in, d_out, has_bias)."""
        block, names, _, _ = self._use(index)
        return {
            n: (m.in_features, m.out_features, m.bias is not None)
            for n in names
            for m in [block.get_submodule(n)]
        }

    def _phase(self, index: int) -> str:
        start = self.arch.decoder_start
        if start is None:
            return "single"
        return "encoder" if index < start else "bridge" if index == start else "decoder"

    def load_expert_block(self, task: str, index: int) -> nn.Module:
        """Block `index` of expert `task`, loaded into the reusable block module."""
        block, _, names, _ = self._use(index)
        keys = {n: self.arch.checkpoint_key(index, n) for n in names}
        tensors = self.models.read(self.models.experts[task], list(keys.values()))
        block.load_state_dict({n: tensors[k].to(self.device, self.dtype) for n, k in keys.items()})
        return block

    @torch.no_grad()
    def task_grams(
        self, index: int, task: str, streams: HiddenStreams, masks: dict, batch_size: int
    ) -> tuple[dict[str, GramSum], dict[str, str]]:
        """Expert `task`'s block `index` on its stream: replaces the stream by the block output
        and returns (group label → its GramSum, Linear name → group label). Linears reading the
        same tensor with the same token weights share one group (labelled by the first)."""
        arch, phase = self.arch, self._phase(index)
        last = index == arch.num_blocks - 1
        block, linears, _, capture = self._use(index)
        self.load_expert_block(task, index)
        if phase == "bridge":  # the decoder's context: this expert's encoder output, its bridge
            names = list(arch.bridge_names)
            tensors = {
                k: v.to(self.device, self.dtype)
                for k, v in self.models.read(self.models.experts[task], names).items()
            }
            done = [
                arch.run_bridge(tensors, h.to(self.device)).to("cpu")
                for h in streams.batches(EXPERT, task, batch_size)
            ]
            streams.put(EXPERT_CONTEXT, task, torch.cat(done))
        decoder = phase in ("bridge", "decoder")
        source = EXPERT_DECODER if phase == "bridge" else EXPERT
        mask = masks[decoder_mask_key(task)] if decoder else masks[task]
        weighted = masks.get(weight_mask_key(task), mask) if phase == "single" else mask
        contexts = (
            streams.batches(EXPERT_CONTEXT, task, batch_size)
            if decoder
            else (None for _ in mask.split(batch_size))
        )
        sums: dict[str, GramSum] = {}
        groups: dict[str, str] = {}
        outputs = []
        batches = zip(
            streams.batches(source, task, batch_size),
            mask.split(batch_size),
            weighted.split(batch_size),
            masks[task].split(batch_size),
            contexts,
            strict=True,
        )
        for hidden, m, w, encoder_mask, encoder_out in batches:
            m, w = m.to(self.device), w.to(self.device)
            context: tuple[torch.Tensor, torch.Tensor] | None = None
            if encoder_out is not None:
                context = (encoder_out.to(self.device), encoder_mask.to(self.device))
            with autocast(self.precision, self.device):  # bfloat16 passes for bfloat16
                out, captured = capture.run(block, hidden.to(self.device), m, context)
            out = out.to(self.dtype)
            check_finite(out, f"expert {task!r} output of block {index}")
            if not groups:
                groups = self._groups(captured, linears, last)
            for name in linears:
                label = groups[name]
                if label != name:
                    continue
                if arch.reads_context(name):
                    assert context is not None  # a decoder block: it has the encoder's output
                    tokens = context[1]
                else:
                    tokens = w
                weights = (
                    arch.token_weights(name, last, tokens)
                    if self.pooled_weights
                    else tokens.to(DTYPE)
                )
                x = captured[name]
                if label not in sums:
                    sums[label] = GramSum(x.shape[-1], self.device, self.precision)
                flat, keep = x.reshape(-1, x.shape[-1]), weights.reshape(-1)
                chosen = keep > 0
                sums[label].add(flat[chosen], keep[chosen])
            del captured
            outputs.append(out.to("cpu"))
        if not outputs:
            raise FeatCalError(f"task {task!r} has no calibration inputs for block {index}")
        streams.put(EXPERT, task, torch.cat(outputs))
        return sums, groups

    def _group_key(self, captured, name: str, last: bool) -> tuple:
        """Linears with equal keys read the same tensor with the same token weights."""
        if name not in captured:
            raise FeatCalError(
                f"{self.arch.name}: Linear {name} did not run in the block's forward; RegMean "
                "needs every Linear of a block to see its input"
            )
        pooled = (
            last
            and self.pooled_weights
            and self.arch.pooled_position is not None
            and self.arch.is_pooled_module(name)
        )
        return (id(captured[name]), self.arch.reads_context(name), pooled)

    def _groups(self, captured, linears, last) -> dict[str, str]:
        labels: dict[tuple, str] = {}
        keys = {name: self._group_key(captured, name, last) for name in linears}
        for name, key in keys.items():
            labels.setdefault(key, name)
        return {name: labels[key] for name, key in keys.items()}

    def expert_params(self, index: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """(W_t (d_out, d_in), b_t or None) of every Linear of the block module as last loaded."""
        block, names, _, _ = self._use(index)
        return {n: (m.weight, m.bias) for n in names for m in [block.get_submodule(n)]}
