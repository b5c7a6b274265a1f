"""FeatCal's closed-form solutions (method page, "Closed forms"), all in float64.

Symbols: d_in/d_out are a Linear's input/output widths, d a norm's width. λ is the ridge weight,
ε the jitter, a(p) = ρ·p_merged + (1 − ρ)·p_base the anchor of a parameter.
"""

from __future__ import annotations

import torch

DTYPE = torch.float64


def anchor(merged: torch.Tensor, base: torch.Tensor, rho: float) -> torch.Tensor:
    """a(p) = ρ·merged + (1 − ρ)·base, in float64 (any shape)."""
    return rho * merged.to(DTYPE) + (1.0 - rho) * base.to(DTYPE)


class SPDSystem:
    """A factored symmetric positive (semi)definite matrix A (d × d), to solve A·X = B repeatedly.

    Cholesky first; if it fails (singular A, e.g. λ = 0 with too few tokens) solves fall back to
    least squares, which returns the minimum-norm solution. With `in_place`, A's storage is reused.
    """

    def __init__(self, lhs: torch.Tensor):
        factor, info = torch.linalg.cholesky_ex(lhs)
        if int(info) == 0:
            self.factor, self.matrix = factor, None
        else:
            self.factor, self.matrix = None, lhs

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        if self.factor is not None:
            return torch.cholesky_solve(rhs, self.factor)
        return torch.linalg.lstsq(self.matrix, rhs, driver="gelsd").solution


def ridge_system(gram: torch.Tensor, lam: float, eps: float, in_place: bool = False) -> SPDSystem:
    """The factored left-hand side Σ s_t C_t + (λ + ε) I of the Linear weight equation."""
    lhs = gram if in_place else gram.clone()
    lhs.diagonal().add_(lam + eps)
    return SPDSystem(lhs)


def solve_linear_weight(
    system: SPDSystem | torch.Tensor,
    cross: torch.Tensor,
    lam: float,
    eps: float,
    anchor_weight: torch.Tensor | None,
) -> torch.Tensor:
    """New Linear weight W (d_out × d_in) from (Σ s_t C_t + (λ+ε) I) Wᵀ = Σ s_t X_t W_tᵀ + λ a(W)ᵀ.

    system: `ridge_system(Σ s_t C_t, λ, ε)` or the Gram matrix Σ s_t C_t itself (d_in × d_in);
    cross: Σ s_t X_t W_tᵀ (d_in × d_out); anchor_weight: a(W) (d_out × d_in), unused when λ = 0.
    """
    if isinstance(system, torch.Tensor):
        system = ridge_system(system, lam, eps)
    rhs = cross.clone()
    if lam > 0:
        if anchor_weight is None:
            raise ValueError("λ > 0 needs an anchor weight")
        rhs += lam * anchor_weight.to(DTYPE).T
    return system.solve(rhs).T.contiguous()


def solve_linear_bias(
    weight: torch.Tensor,
    scale_sum: float,
    target_sum: torch.Tensor,
    student_mean_sum: torch.Tensor,
    lam: float,
    anchor_bias: torch.Tensor | None,
) -> torch.Tensor:
    """New bias b (d_out) = [Σ s_t (b_t + W_t μt_t) − W Σ s_t μs_t + λ a(b)] / (Σ s_t + λ).

    weight: the *new* W (d_out × d_in); target_sum: Σ s_t (b_t + W_t μt_t) (d_out);
    student_mean_sum: Σ s_t μs_t (d_in).
    """
    numerator = target_sum - weight.to(DTYPE) @ student_mean_sum
    if lam > 0:
        if anchor_bias is None:
            raise ValueError("λ > 0 needs an anchor bias")
        numerator = numerator + lam * anchor_bias.to(DTYPE)
    return numerator / (scale_sum + lam)


def solve_layernorm(
    e_sum: torch.Tensor,
    m_sum: torch.Tensor,
    rhs_gamma: torch.Tensor,
    rhs_beta: torch.Tensor,
    num_tasks: int,
    lam: float,
    eps: float,
    anchor_gamma: torch.Tensor | None,
    anchor_beta: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel 2×2 solve for LayerNorm (γ, β), each of shape (d).

    [Σe + λ, Σm; Σm, T + λ] [γ; β] = [Σ(e_t γ_t + m_t β_t) + λ a(γ); Σ(m_t γ_t + β_t) + λ a(β)],
    with the determinant clamped at ε.
    """
    a11 = e_sum + lam
    a12 = m_sum
    a22 = torch.full_like(e_sum, float(num_tasks) + lam)
    r1 = rhs_gamma.clone()
    r2 = rhs_beta.clone()
    if lam > 0:
        r1 += lam * anchor_gamma.to(DTYPE)
        r2 += lam * anchor_beta.to(DTYPE)
    det = a11 * a22 - a12 * a12
    det = torch.where(det.abs() < eps, torch.full_like(det, eps), det)
    gamma = (a22 * r1 - a12 * r2) / det
    beta = (a11 * r2 - a12 * r1) / det
    return gamma, beta


def solve_rmsnorm(
    e_sum: torch.Tensor,
    rhs_gamma: torch.Tensor,
    lam: float,
    eps: float,
    anchor_gamma: torch.Tensor | None,
) -> torch.Tensor:
    """Scale-only norm (RMSNorm / T5LayerNorm): γ = (Σ e_t γ_t + λ a(γ)) / (Σ e_t + λ), per channel."""
    numerator = rhs_gamma.clone()
    if lam > 0:
        numerator += lam * anchor_gamma.to(DTYPE)
    return numerator / torch.clamp(e_sum + lam, min=eps)
