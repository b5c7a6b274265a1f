"""TIES-Merging (Yadav et al. 2023, "TIES-Merging: Resolving Interference When Merging Models").

For base θ0 and experts θ_1..θ_T, per tensor:

1. task vectors τ_t = θ_t − θ0;
2. trim: keep the k = ceil(top_k/100 · n) largest-magnitude entries of each τ_t and zero the
   rest (at least one entry is kept). `trim: tensor` (the default): n and the threshold are the
   tensor's own; `trim: global` (the paper's reference code): n counts every merged entry of the
   checkpoint and each expert has one threshold over its whole task vector;
3. elect sign: γ = sign(Σ_t trimmed τ_t);
4. disjoint merge: at each entry, the mean of the trimmed τ_t that are nonzero and have sign γ
   (0 where there are none, including where γ = 0);
5. θ = θ0 + λ · merged.

Tie rule of the trim: the threshold is the k-th largest |τ_t| and every entry with |τ_t| >= that
threshold is kept, so entries tied at the threshold are all kept (possibly more than k). Entries
that are exactly zero never count (a zero kept by the rule stays zero and votes for no sign).

Defaults: top_k 20 and λ = 1.0, the paper's. Differences from the paper's reference code: the
default trim is per tensor (`trim: global` is the paper's; "tensor" stays the default so earlier
results do not change, and is left out of the record unless given); k rounds up (the reference
code keeps int(n · top_k/100) + 1 at its threshold); an exact zero sign sum is not replaced by a
majority sign. The global thresholds are exact (featcal_core.merging.order_statistics: radix selection
over a few streaming passes, never the whole task vector in memory).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from featcal_core.merging import register
from featcal_core.merging.base import MergeMethod, Place, as_compute, choice, real
from featcal_core.merging.order_statistics import gather_abs, kth_smallest_abs

log = logging.getLogger(__name__)

#: values of the `trim` hyperparameter
TRIMS = ("tensor", "global")


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


def disjoint_mean(
    tau: Callable[[int], torch.Tensor], count: int, like: torch.Tensor
) -> torch.Tensor:
    """Sign election and disjoint mean of τ_1..τ_count (steps 3–4), float64 (S).

    tau(t) returns a fresh float64 tensor of shape S (it is modified here) and is called twice per
    expert, so that only one τ_t exists at a time; `like` (S) gives shape and dtype.
    """
    votes = torch.zeros_like(like)
    for t in range(count):
        votes.add_(tau(t))
    sign = votes.sign_()  # γ ∈ {−1, 0, +1}
    total = torch.zeros_like(like)
    agreeing = torch.zeros_like(like)
    for t in range(count):
        vector = tau(t)
        agrees = (vector.sign() == sign) & (vector != 0)
        total.add_(vector.masked_fill_(~agrees, 0.0))
        agreeing.add_(agrees)
    return total.div_(agreeing.clamp_(min=1.0))


@register
class Ties(MergeMethod):
    """TIES-Merging: trim, elect sign, disjoint mean (module docstring).

    hp: `top_k` percent of entries kept per task vector, 0 < top_k <= 100 (default 20); `scale`
    λ applied to the merged task vector (any finite number; default 1.0); optional `trim`,
    "tensor" (default) or "global" (thresholds over the whole checkpoint, as in the paper).
    """

    name = "ties"
    defaults = {"top_k": 20.0, "scale": 1.0}
    optional = {"trim": "tensor"}
    takes_place = True

    def validate(self, hp: dict[str, Any]) -> None:
        real(hp, "top_k", self.name, above=0.0, at_most=100.0)
        real(hp, "scale", self.name)
        if "trim" in hp:
            choice(hp, "trim", self.name, TRIMS)

    def needs_checkpoint(self, hp: dict[str, Any]) -> bool:
        return hp.get("trim", "tensor") == "global"

    def prepare_checkpoint(
        self,
        task_vectors: Callable[[int], Iterator[torch.Tensor]],
        count: int,
        numel: int,
        hp: dict[str, Any],
    ) -> list[float | None]:
        """Each expert's global trim threshold: the k-th largest |τ_t| over all `numel` merged
        entries of the checkpoint (None: keep every entry), exact, in a few streaming passes."""
        keep = kept_count(numel, hp["top_k"]) if numel else 0
        if keep >= numel:
            return [None] * count
        thresholds: list[float | None] = []
        for t in range(count):
            thresholds.append(kth_smallest_abs(partial(task_vectors, t), numel, numel - keep + 1))
            log.info(
                "ties: expert %d of %d: global trim threshold %.6g (%d of %d entries kept)",
                t + 1,
                count,
                thresholds[-1],
                keep,
                numel,
            )
        return thresholds

    def prepare(
        self,
        task_vectors: Callable[[int], Iterator[torch.Tensor]],
        count: int,
        numel: int,
        hp: dict[str, Any],
        *,
        place: Place | None = None,
    ) -> list[float | None]:
        """Each expert's trim threshold (None: keep every entry): with `trim: global` the
        checkpoint's (place.checkpoint; without them the tensor is taken as the whole model),
        else the k-th largest |τ_t| over the whole tensor, from its magnitudes gathered in one
        float64 array and partially sorted (exact, as `trim`). `merge_tensor` (the base class's)
        runs this and `merge_chunk` on the whole tensor: θ0 + λ · disjoint mean of trimmed τ_t."""
        if self.needs_checkpoint(hp) and place is not None and place.checkpoint is not None:
            return list(place.checkpoint)
        keep = kept_count(numel, hp["top_k"]) if numel else 0
        if keep >= numel:
            return [None] * count
        thresholds: list[float | None] = []
        for t in range(count):
            magnitudes = gather_abs(task_vectors(t), numel)
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
        *,
        place: Place | None = None,
    ) -> torch.Tensor:
        """Trim (with the whole tensor's or checkpoint's thresholds), elect sign and take the
        disjoint mean of one chunk; only one trimmed task vector exists at a time."""
        theta0 = as_compute(base)

        def trimmed(t: int) -> torch.Tensor:
            tau = as_compute(experts[t]).sub_(theta0)
            threshold = prepared[t]
            if threshold is not None:
                tau.masked_fill_(tau.abs() < threshold, 0.0)
            return tau

        merged = disjoint_mean(trimmed, len(experts), theta0)
        return theta0.add_(merged, alpha=hp["scale"])
