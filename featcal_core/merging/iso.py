"""Iso-C and Iso-CTS (Marczak et al. 2025, "No Task Left Behind: Isotropic Model Merging with
Common and Task-Specific Subspaces", ICML): flatten the merged matrix's singular spectrum.

For base θ0 and experts θ_1..θ_T, per 2-D tensor (m × n, r = min(m, n)), with M = Σ_t τ_t
(τ_t = θ_t − θ0) and its thin SVD M = U diag(s) Vᵀ:

- `iso_c`: θ = θ0 + α · s̄ U Vᵀ, s̄ = mean of the r singular values (an isotropic spectrum);
- `iso_cts`: the common subspace is M's top c singular directions and each task adds its own
  top p directions orthogonal to it: c0 = ⌊r · f⌋ (f = common_space_fraction),
  p = round((r − c0) / T) (Python's round, as the authors' code; lowered if T · p > r),
  c = r − T · p. For each t: τ_t projected off the common subspace, τ_t − U_c U_cᵀ τ_t, and its
  top p singular triplets. The c common and T · p task directions are stacked
  (U* m × r, V* n × r, their r singular values σ*), orthogonalised (polar factor, as for TSV-M)
  and given the isotropic spectrum: θ = θ0 + α · mean(σ*) U*⊥ V*⊥ᵀ.

Every other tensor: θ0 + α · mean_t τ_t, as in the authors' code (danielm1405/iso-merging: the
mean of the task vectors for non-2-D parameters). For a rank-deficient M (or projection), the
directions of zero singular values are whatever LAPACK's SVD returns, as in the authors' code:
deterministic, but arbitrary.

Defaults: scale α = 1.0 (FusionBench's iso_c / iso_cts configs, scaling_factor: 1.0; the paper
selects α on validation data); common_space_fraction 0.8 (the authors' config/method/iso_cts.yaml
and README).

`chunkable = False`: the SVDs need each matrix whole, so these methods always get whole tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from featcal_core.merging import register
from featcal_core.merging.base import MergeMethod, as_compute, real
from featcal_core.merging.tsv import mean_task_vector, polar, task_sum


def iso_c_update(base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """s̄ U Vᵀ of M = Σ τ_t: base (m × n), experts T × (m × n) → float64 (m × n)."""
    left, sigma, right = torch.linalg.svd(task_sum(base, experts), full_matrices=False)
    return sigma.mean() * (left @ right)


def subspace_sizes(rank: int, tasks: int, fraction: float) -> tuple[int, int]:
    """(common size c, per-task size p) with c + tasks · p = rank (module docstring)."""
    per_task = round((rank - int(rank * fraction)) / tasks)
    per_task = min(per_task, rank // tasks)
    return rank - tasks * per_task, per_task


def iso_cts_update(
    base: torch.Tensor, experts: list[torch.Tensor], fraction: float
) -> torch.Tensor:
    """mean(σ*) U*⊥ V*⊥ᵀ: base (m × n), experts T × (m × n) → float64 (m × n)."""
    theta0 = as_compute(base)
    common, per_task = subspace_sizes(min(theta0.shape), len(experts), fraction)
    left, sigma, right = torch.linalg.svd(task_sum(base, experts), full_matrices=False)
    lefts, values, rights = [left[:, :common]], [sigma[:common]], [right[:common]]
    shared = left[:, :common]
    for expert in experts:
        tau = as_compute(expert).sub_(theta0)
        tau.sub_(shared @ (shared.T @ tau))
        own_left, own_sigma, own_right = torch.linalg.svd(tau, full_matrices=False)
        lefts.append(own_left[:, :per_task])
        values.append(own_sigma[:per_task])
        rights.append(own_right[:per_task])
    level = torch.cat(values).mean()
    return level * (polar(torch.cat(lefts, dim=1)) @ polar(torch.cat(rights, dim=0)))


class _Isotropic(MergeMethod):
    """Shared by Iso-C and Iso-CTS: matrices get `update`, other tensors the mean task vector."""

    chunkable = False

    def update(self, base: torch.Tensor, experts: list[torch.Tensor], hp: dict[str, Any]):
        """The merged update of one matrix (m × n), float64."""
        raise NotImplementedError

    def merge_tensor(  # type: ignore[override]  # no `place`: takes_place is False
        self, base: torch.Tensor, experts: list[torch.Tensor], hp: dict[str, Any]
    ) -> torch.Tensor:
        """base (S), experts T × (S) → θ0 + α · update (matrices) or mean τ_t, float64 (S)."""
        if base.dim() == 2:
            update = self.update(base, experts, hp)
        else:
            update = mean_task_vector(base, experts)
        return as_compute(base).add_(update, alpha=hp["scale"])


@register
class IsoC(_Isotropic):
    """Iso-C: θ0 + α · s̄ U Vᵀ of Σ τ_t per matrix (module docstring).

    hp: `scale` α (any finite number; default 1.0).
    """

    name = "iso_c"
    defaults = {"scale": 1.0}

    def validate(self, hp: dict[str, Any]) -> None:
        real(hp, "scale", self.name)

    def update(self, base, experts, hp):
        return iso_c_update(base, experts)


@register
class IsoCTS(_Isotropic):
    """Iso-CTS: common plus task-specific subspaces, isotropic spectrum (module docstring).

    hp: `scale` α (default 1.0); `common_space_fraction` f, 0 < f <= 1 (default 0.8).
    """

    name = "iso_cts"
    defaults = {"scale": 1.0, "common_space_fraction": 0.8}

    def validate(self, hp: dict[str, Any]) -> None:
        real(hp, "scale", self.name)
        real(hp, "common_space_fraction", self.name, above=0.0, at_most=1.0)

    def update(self, base, experts, hp):
        return iso_cts_update(base, experts, hp["common_space_fraction"])
