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


def solve_spd(lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve lhs · X = rhs for a symmetric positive (semi)definite lhs (d × d), rhs (d × k).

    Cholesky first; if the factorisation fails (singular lhs, e.g. λ = 0 with too few tokens) fall
    back to a least-squares solve, which returns the minimum-norm solution.
    """
    factor, info = torch.linalg.cholesky_ex(lhs)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, factor)
    return torch.linalg.lstsq(lhs, rhs, driver="gelsd").solution


def solve_linear_weight(
    gram: torch.Tensor,
    cross: torch.Tensor,
    lam: float,
    eps: float,
    anchor_weight: torch.Tensor | None,
) -> torch.Tensor:
    """New Linear weight W (d_out × d_in) from (Σ s_t C_t + (λ+ε) I) Wᵀ = Σ s_t X_t W_tᵀ + λ a(W)ᵀ.

    gram: Σ s_t C_t (d_in × d_in); cross: Σ s_t X_t W_tᵀ (d_in × d_out); anchor_weight: a(W)
    (d_out × d_in), ignored when λ = 0.
    """
    d_in = gram.shape[0]
    lhs = gram + (lam + eps) * torch.eye(d_in, dtype=DTYPE, device=gram.device)
    rhs = cross.clone()
    if lam > 0:
        if anchor_weight is None:
            raise ValueError("λ > 0 needs an anchor weight")
        rhs += lam * anchor_weight.to(DTYPE).T
    return solve_spd(lhs, rhs).T.contiguous()


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
