"""Model Breadcrumbs (Davari & Belilovsky 2024, "Model Breadcrumbs: Scaling Multi-Task Model
Merging with Sparse Masks"): mask both tails of each task vector's magnitudes, then add.

For base θ0 and experts θ_1..θ_T, per tensor of n entries:

1. τ_t = θ_t − θ0;
2. mask: keep k = floor(density · n) entries of each τ_t after removing the r = floor(gamma · n)
   largest-magnitude outliers and the b = n − k − r smallest; when b < 0 fewer outliers are
   removed (r = n − k, b = 0) so that `density` is what is kept (mergekit's rule). By value:
   keep lo <= |τ_t| <= hi with lo the (b+1)-th smallest |τ_t| (no bound when b = 0) and hi the
   (n − r)-th smallest (no bound when r = 0); entries tied at a threshold are all kept; k = 0
   keeps none;
3. θ = θ0 + s · Σ_t masked τ_t (Task Arithmetic).

Defaults: density 0.15, gamma 0.006, scale 0.2: the setting the authors' hyperparameter search
starts from (rezazzr/breadcrumbs, find_best_hyperparam.py, "middle_keep": beta = fraction kept
0.15, gamma = fraction of outliers removed 0.006, alpha 0.2); the names are mergekit's (its
`breadcrumbs` takes density and gamma, gamma defaulting to 0.01). The masks are per tensor
("per layer", as in the paper and mergekit); the authors' code ranks within each row of the last
dimension instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from featcal_core.merging import register
from featcal_core.merging.base import MergeMethod, as_compute, real
from featcal_core.merging.order_statistics import gather_abs


def band_counts(numel: int, density: float, gamma: float) -> tuple[int, int, int]:
    """(kept k, bottom removed b, top removed r) of a tensor with `numel` entries."""
    kept = int(density * numel)
    top = int(gamma * numel)
    bottom = numel - kept - top
    if bottom < 0:
        top += bottom
        bottom = 0
    return kept, bottom, top


@register
class Breadcrumbs(MergeMethod):
    """Model Breadcrumbs: two-tailed magnitude mask per task vector and tensor, then Task
    Arithmetic (module docstring).

    hp: `density` fraction kept, 0 < density <= 1 (default 0.15); `gamma` fraction of largest
    entries removed, 0 <= gamma < 1 (default 0.006); `scale` s (default 0.2).
    """

    name = "breadcrumbs"
    defaults = {"density": 0.15, "gamma": 0.006, "scale": 0.2}

    def validate(self, hp: dict[str, Any]) -> None:
        real(hp, "density", self.name, above=0.0, at_most=1.0)
        real(hp, "gamma", self.name, at_least=0.0, below=1.0)
        real(hp, "scale", self.name)

    def prepare(  # type: ignore[override]  # no `place`: takes_place is False
        self,
        task_vectors: Callable[[int], Iterator[torch.Tensor]],
        count: int,
        numel: int,
        hp: dict[str, Any],
    ) -> list[tuple[float, float]]:
        """Each expert's band (lo, hi) of kept magnitudes over the whole tensor, exact (its
        magnitudes gathered in one float64 array and partially sorted). `merge_tensor` (the base
        class's) runs this and `merge_chunk` on the whole tensor: θ0 + s · Σ_t masked τ_t."""
        kept, bottom, top = band_counts(numel, hp["density"], hp["gamma"])
        if kept == 0:
            return [(math.inf, math.inf)] * count  # nothing kept
        if bottom == 0 and top == 0:
            return [(0.0, math.inf)] * count  # everything kept
        bands = []
        for t in range(count):
            magnitudes = gather_abs(task_vectors(t), numel)
            magnitudes.partition([bottom, numel - top - 1])
            low = float(magnitudes[bottom]) if bottom else 0.0
            high = float(magnitudes[numel - top - 1]) if top else math.inf
            bands.append((low, high))
            del magnitudes
        return bands

    def merge_chunk(  # type: ignore[override]  # no `place`: takes_place is False
        self,
        base: torch.Tensor,
        experts: list[torch.Tensor],
        hp: dict[str, Any],
        prepared: list[tuple[float, float]],
    ) -> torch.Tensor:
        """θ0 + s · Σ_t τ_t masked to its band, for one chunk (same shape as `base`)."""
        theta0 = as_compute(base)
        total = torch.zeros_like(theta0)
        for t, expert in enumerate(experts):
            tau = as_compute(expert).sub_(theta0)
            low, high = prepared[t]
            magnitude = tau.abs()
            total.add_(tau.masked_fill_((magnitude < low) | (magnitude > high), 0.0))
        return theta0.add_(total, alpha=hp["scale"])
