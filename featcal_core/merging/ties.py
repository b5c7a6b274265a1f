"""TIES-Merging (Yadav et al. 2023, "Resolving Interference When Merging Models"), per tensor.

For one tensor with base θ0 and experts θ_1..θ_T:

1. task vectors τ_t = θ_t − θ0;
2. trim: keep the k = ceil(top_k/100 · n) largest-magnitude entries of each τ_t (n = number of
   entries of the tensor; at least one entry is kept) and zero the rest;
3. elect sign: γ = sign(Σ_t trimmed τ_t);
4. disjoint merge: at each entry, the mean of the trimmed τ_t that are nonzero and have sign γ
   (0 where there are none, including where γ = 0);
5. θ = θ0 + λ · merged.

Tie rule of the trim: the threshold is the k-th largest |τ_t| and every entry with |τ_t| >= that
threshold is kept, so entries tied at the threshold are all kept (possibly more than k). Entries
that are exactly zero never count (a zero kept by the rule stays zero and votes for no sign).

Unlike the paper's reference code, trimming is per tensor rather than over the whole flattened
model, and an exact zero sign sum is not replaced by a majority sign.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from featcal_core.merging import register
from featcal_core.merging.base import MergeMethod, as_compute, real


def kept_count(numel: int, top_k: float) -> int:
    """Entries kept of a tensor with `numel` entries at `top_k` percent: ceil, at least 1."""
    return min(numel, max(1, math.ceil(numel * top_k / 100.0)))


def trim(tau: torch.Tensor, top_k: float) -> torch.Tensor:
    """τ (S, float64) with all but its top_k % largest-magnitude entries zeroed (in place).

    Ties at the threshold are all kept (see the module docstring).
    """
    numel = tau.numel()
    if numel == 0:
        return tau
    keep = kept_count(numel, top_k)
    if keep < numel:
        magnitude = tau.abs().reshape(-1)
        threshold = torch.kthvalue(magnitude, numel - keep + 1).values
        tau.masked_fill_(tau.abs() < threshold, 0.0)
    return tau


@register
class Ties(MergeMethod):
    """TIES-Merging: trim, elect sign, disjoint mean (module docstring).

    hp: `top_k` percent of entries kept per task vector and tensor, 0 < top_k <= 100 (default 20);
    `scale` λ applied to the merged task vector (any finite number; default 1.0).
    """

    name = "ties"
    defaults = {"top_k": 20.0, "scale": 1.0}

    def validate(self, hp: dict[str, Any]) -> None:
        real(hp, "top_k", self.name, above=0.0, at_most=100.0)
        real(hp, "scale", self.name)

    def merge_tensor(
        self, base: torch.Tensor, experts: list[torch.Tensor], hp: dict[str, Any]
    ) -> torch.Tensor:
        """base (S), experts T × (S) → θ0 + λ · disjoint mean of trimmed τ_t, float64 (S)."""

        def task_vector(t: int) -> Iterator[torch.Tensor]:
            yield as_compute(experts[t]).sub_(as_compute(base))

        thresholds = self.prepare(task_vector, len(experts), base.numel(), hp)
        return self.merge_chunk(base, experts, hp, thresholds)

    def prepare(
        self,
        task_vectors: Callable[[int], Iterator[torch.Tensor]],
        count: int,
        numel: int,
        hp: dict[str, Any],
    ) -> list[float | None]:
        """Each expert's trim threshold: the k-th largest |τ_t| over the whole tensor (None: keep
        every entry). The magnitudes of one task vector are gathered in one float64 array and
        partially sorted in place, so the threshold is exact (as `trim`'s)."""
        keep = kept_count(numel, hp["top_k"]) if numel else 0
        if keep >= numel:
            return [None] * count
        thresholds: list[float | None] = []
        for t in range(count):
            magnitudes = np.empty(numel, dtype=np.float64)
            filled = 0
            for chunk in task_vectors(t):
                flat = chunk.reshape(-1).abs().numpy()
                magnitudes[filled : filled + flat.size] = flat
                filled += flat.size
            if filled != numel:
                raise ValueError(f"task vector {t} has {filled} entries, expected {numel}")
            magnitudes.partition(numel - keep)
            thresholds.append(float(magnitudes[numel - keep]))
            del magnitudes
        return thresholds

    def merge_chunk(
        self,
        base: torch.Tensor,
        experts: list[torch.Tensor],
        hp: dict[str, Any],
        prepared: list[float | None],
    ) -> torch.Tensor:
        """Trim (with the whole tensor's thresholds), elect sign and take the disjoint mean of
        one chunk. Two passes over the experts (the trim is recomputed in the second) so that
        only one trimmed task vector exists at a time."""
        theta0 = as_compute(base)

        def trimmed(t: int) -> torch.Tensor:
            tau = as_compute(experts[t]).sub_(theta0)
            if prepared[t] is not None:
                tau.masked_fill_(tau.abs() < prepared[t], 0.0)
            return tau

        votes = torch.zeros_like(theta0)
        for t in range(len(experts)):
            votes.add_(trimmed(t))
        sign = votes.sign_()  # γ ∈ {−1, 0, +1}
        total = torch.zeros_like(theta0)
        count = torch.zeros_like(theta0)
        for t in range(len(experts)):
            tau = trimmed(t)
            agrees = (tau.sign() == sign) & (tau != 0)
            total.add_(tau.masked_fill_(~agrees, 0.0))
            count.add_(agrees)
        merged = total.div_(count.clamp_(min=1.0))
        return theta0.add_(merged, alpha=hp["scale"])
