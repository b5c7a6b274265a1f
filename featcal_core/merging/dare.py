"""DARE (Yu et al. 2024, "Language Models are Super Mario: Absorbing Abilities from Homologous
Models as a Free Lunch"): Drop And REscale each task vector, then merge.

For base θ0 and experts θ_1..θ_T, per entry i of a tensor:

1. τ_t = θ_t − θ0;
2. drop: m_t,i ~ Bernoulli(1 − p) (1 keeps the entry), τ̂_t = m_t ⊙ τ_t / (1 − p), so E[τ̂_t] = τ_t;
3. merge the τ̂_t: `dare_task_arithmetic` θ = θ0 + s · Σ_t τ̂_t (Task Arithmetic);
   `dare_ties` θ = θ0 + s · disjoint mean of the τ̂_t under the elected sign (TIES steps 3–5,
   featcal_core.merging.ties; no magnitude trim, as mergekit's dare_ties).

The mask is a pure function of (seed, tensor name, expert index t, flat entry index i): entry i is
dropped when u < p, u = the top 53 bits of splitmix64(key + (i + 1) · φ64) / 2^53 with key the
first 8 bytes of BLAKE2b(seed, name, t) (a counter-based generator). So the same seed gives the
same merge on every run, and row chunks of a large tensor draw exactly the masks of the whole
tensor (merge_chunk = merge_tensor, bit for bit); the mask is not torch.bernoulli's stream.

Defaults: `drop_rate` p = 0.9, the paper's headline setting (90 % of the delta parameters dropped
without loss; the authors' script default, --weight_mask_rate in yule-BUAA/MergeLM, is 0.1);
`scale` s = 1.0 (MergeLM's --scaling_coefficient default, mergekit's lambda); `seed` 0.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from featcal_core.merging import register
from featcal_core.merging.base import MergeMethod, Place, as_compute, integer, real
from featcal_core.merging.ties import disjoint_mean

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _key(seed: int, name: str, expert: int) -> np.uint64:
    digest = hashlib.blake2b(f"dare\0{seed}\0{name}\0{expert}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def keep_mask(
    seed: int, name: str, expert: int, offset: int, count: int, drop_rate: float
) -> torch.Tensor:
    """DARE's keep mask (count,) bool of entries offset..offset+count-1 of tensor `name` for
    expert `expert` (True: kept); each entry is dropped with probability `drop_rate`."""
    z = np.arange(offset + 1, offset + count + 1, dtype=np.uint64)
    z *= _GOLDEN
    z += _key(seed, name, expert)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    z >>= np.uint64(11)  # 53 uniform bits
    threshold = np.uint64(min(2**53, int(np.ceil(drop_rate * 2.0**53))))
    return torch.from_numpy(z >= threshold)


class _Dare(MergeMethod):
    """Shared by both registry names: hyperparameters, the dropped, rescaled task vectors and the
    merge θ0 + s · (their combination); each registered subclass defines `combine`."""

    defaults = {"drop_rate": 0.9, "scale": 1.0, "seed": 0}
    takes_place = True

    def validate(self, hp: dict[str, Any]) -> None:
        real(hp, "drop_rate", self.name, at_least=0.0, below=1.0)
        real(hp, "scale", self.name)
        integer(hp, "seed", self.name)

    def dropped(
        self, theta0: torch.Tensor, expert: torch.Tensor, t: int, hp: dict[str, Any], place: Place
    ) -> torch.Tensor:
        """τ̂_t of the entries at `place`: (θ_t − θ0) ⊙ m_t / (1 − p), float64, θ0's shape."""
        tau = as_compute(expert).sub_(theta0)
        p = hp["drop_rate"]
        if p == 0.0:
            return tau
        kept = keep_mask(hp["seed"], place.name, t, place.offset, tau.numel(), p)
        tau.masked_fill_(~kept.reshape(tau.shape), 0.0)
        return tau.div_(1.0 - p)

    def merge_tensor(
        self,
        base: torch.Tensor,
        experts: list[torch.Tensor],
        hp: dict[str, Any],
        *,
        place: Place | None = None,
    ) -> torch.Tensor:
        """base (S), experts T × (S) → θ0 + s · `combine` of the τ̂_t, float64 (S). `place` names
        the tensor and its first entry's flat index (default: name "", offset 0)."""
        place = place or Place("")
        theta0 = as_compute(base)

        def tau(t: int) -> torch.Tensor:
            return self.dropped(theta0, experts[t], t, hp, place)

        return theta0.add_(self.combine(tau, len(experts), theta0), alpha=hp["scale"])

    def combine(
        self, tau: Callable[[int], torch.Tensor], count: int, like: torch.Tensor
    ) -> torch.Tensor:
        """The merged task vector (float64, `like`'s shape) of τ̂_1..τ̂_count: tau(t) returns a
        fresh τ̂_t (it may be modified)."""
        raise NotImplementedError


@register
class DareTaskArithmetic(_Dare):
    """DARE, then Task Arithmetic: θ0 + s · Σ_t τ̂_t (module docstring).

    hp: `drop_rate` p, 0 <= p < 1 (default 0.9); `scale` s (default 1.0); `seed` (default 0).
    """

    name = "dare_task_arithmetic"

    def combine(
        self, tau: Callable[[int], torch.Tensor], count: int, like: torch.Tensor
    ) -> torch.Tensor:
        """Σ_t τ̂_t."""
        total = torch.zeros_like(like)
        for t in range(count):
            total.add_(tau(t))
        return total


@register
class DareTies(_Dare):
    """DARE, then TIES' sign election and disjoint mean: θ0 + s · mean (module docstring).

    hp: `drop_rate` p, 0 <= p < 1 (default 0.9); `scale` s (default 1.0); `seed` (default 0).
    """

    name = "dare_ties"

    def combine(
        self, tau: Callable[[int], torch.Tensor], count: int, like: torch.Tensor
    ) -> torch.Tensor:
        """The disjoint mean of the τ̂_t under the elected sign (featcal_core.merging.ties)."""
        return disjoint_mean(tau, count, like)
