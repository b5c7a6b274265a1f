"""Task Arithmetic (Ilharco et al. 2023): θ = θ0 + s · Σ_t (θ_t − θ0)."""

from __future__ import annotations

from typing import Any

import torch

from featcal_core.merging import register
from featcal_core.merging.base import MergeMethod, as_compute, real


@register
class TaskArithmetic(MergeMethod):
    """Scaled sum of the task vectors τ_t = θ_t − θ0, added to the base.

    hp: `scale` s (any finite number; default 0.3).
    """

    name = "task_arithmetic"
    defaults = {"scale": 0.3}

    def validate(self, hp: dict[str, Any]) -> None:
        real(hp, "scale", self.name)

    def merge_tensor(  # type: ignore[override]  # no `place`: takes_place is False
        self, base: torch.Tensor, experts: list[torch.Tensor], hp: dict[str, Any]
    ) -> torch.Tensor:
        """base (S), experts T × (S) → θ0 + s · Σ_t (θ_t − θ0), float64 (S)."""
        theta0 = as_compute(base)
        total = torch.zeros_like(theta0)
        for expert in experts:
            total.add_(as_compute(expert).sub_(theta0))
        return theta0.add_(total, alpha=hp["scale"])
