"""TSV-M (Gargiulo et al. 2025, "Task Singular Vectors: Reducing Task Interference in Model
Merging", CVPR): per weight matrix, keep each task's top singular vectors, decorrelate, add.

For base θ0 and experts θ_1..θ_T, per 2-D tensor (m × n, r = min(m, n)):

1. τ_t = θ_t − θ0 = U_t Σ_t V_tᵀ (thin SVD);
2. keep each task's top k = ⌊r / T⌋ singular triplets (the 1/T share of the spectrum);
3. concatenate U = [U_1,:k … U_T,:k] (m × Tk), σ = [σ_1,:k … σ_T,:k] and V = [V_1,:k … V_T,:k]
   (n × Tk);
4. decorrelate: replace U and V by their nearest matrices with orthonormal columns (orthogonal
   Procrustes: the polar factor P Qᵀ of U = P S Qᵀ), as the authors' code does;
5. θ = θ0 + α · U⊥ diag(σ) V⊥ᵀ.

Every other tensor (biases, norms, scalars, convolution kernels) gets θ0 + α · mean_t τ_t, as in
the authors' code (AntoAndGar/task_singular_vectors, compute_and_sum_svd_mem_reduction: the
running mean of the task vectors of every non-2-D parameter).

Differences: k = r // T exactly (the code computes int(r · (1/T))); singular triplets with σ = 0
are left out of step 3 (they add nothing to τ_t and their vectors are arbitrary, but would bend
the others' orthogonalisation); the code's zero-padded r-column U gives the same result whenever
the kept columns are independent.

Default: scale α = 1.0, the TSV-M setting (FusionBench's TaskSingularVectorMerging config,
alpha: 1; the authors' evaluation can also pick α on validation data).

`chunkable = False`: the SVDs need each matrix whole (a row chunk's SVD is not the matrix's), so
TSV-M always gets whole tensors; peak memory per matrix is a few float64 copies of it per expert.
"""

from __future__ import annotations

from typing import Any

import torch

from featcal_core.merging import register
from featcal_core.merging.base import MergeMethod, as_compute, real


def polar(matrix: torch.Tensor) -> torch.Tensor:
    """The nearest matrix to `matrix` (p × q) with orthonormal columns (p >= q) or rows (p < q):
    P Qᵀ from its thin SVD P S Qᵀ (orthogonal Procrustes), same shape."""
    left, _, right = torch.linalg.svd(matrix, full_matrices=False)
    return left @ right


def task_sum(base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """Σ_t (θ_t − θ0), float64 (S)."""
    theta0 = as_compute(base)
    total = torch.zeros_like(theta0)
    for expert in experts:
        total.add_(as_compute(expert).sub_(theta0))
    return total


def mean_task_vector(base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """mean_t (θ_t − θ0), float64 (S)."""
    return task_sum(base, experts).div_(len(experts))


def tsv_update(base: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor:
    """The TSV-M update U⊥ diag(σ) V⊥ᵀ of one matrix: base (m × n), experts T × (m × n) →
    float64 (m × n)."""
    theta0 = as_compute(base)
    keep = min(theta0.shape) // len(experts)
    lefts, values, rights = [], [], []
    for expert in experts:
        left, sigma, right = torch.linalg.svd(as_compute(expert).sub_(theta0), full_matrices=False)
        nonzero = sigma[:keep] > 0
        lefts.append(left[:, :keep][:, nonzero])
        values.append(sigma[:keep][nonzero])
        rights.append(right[:keep][nonzero])
    sigma = torch.cat(values)
    if sigma.numel() == 0:
        return torch.zeros_like(theta0)
    return (polar(torch.cat(lefts, dim=1)) * sigma) @ polar(torch.cat(rights, dim=0))


@register
class TaskSingularVectorMerge(MergeMethod):
    """TSV-M: per matrix, each task's top ⌊r/T⌋ singular vectors, orthogonalised, added with
    scale α; other tensors: θ0 + α · mean τ_t (module docstring).

    hp: `scale` α (any finite number; default 1.0).
    """

    name = "tsv_m"
    defaults = {"scale": 1.0}
    chunkable = False

    def validate(self, hp: dict[str, Any]) -> None:
        real(hp, "scale", self.name)

    def merge_tensor(  # type: ignore[override]  # no `place`: takes_place is False
        self, base: torch.Tensor, experts: list[torch.Tensor], hp: dict[str, Any]
    ) -> torch.Tensor:
        """base (S), experts T × (S) → θ0 + α · update, float64 (S)."""
        if base.dim() == 2:
            update = tsv_update(base, experts)
        else:
            update = mean_task_vector(base, experts)
        return as_compute(base).add_(update, alpha=hp["scale"])
