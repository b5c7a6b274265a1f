"""Weight averaging (model soup): θ = (1/T) · Σ_t θ_t. The base is not used."""

from __future__ import annotations

from typing import Any

import torch

from featcal_core.merging import register
from featcal_core.merging.base import MergeMethod, as_compute


@register
class Average(MergeMethod):
    """Plain mean of the experts' weights; no hyperparameters."""

    name = "average"
    defaults: dict[str, Any] = {}

    def merge_tensor(  # type: ignore[override]  # no `place`: takes_place is False
        self, base: torch.Tensor, experts: list[torch.Tensor], hp: dict[str, Any]
    ) -> torch.Tensor:
        """base (S, ignored), experts T × (S) → mean over experts, float64 (S)."""
        total = torch.zeros(base.shape, dtype=torch.float64)
        for expert in experts:
            total.add_(as_compute(expert))
        return total.div_(len(experts))
