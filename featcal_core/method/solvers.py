"""FeatCal's closed-form solutions (docs/featcal.md, "Closed forms"), all in float64.

Symbols: d_in/d_out are a Linear's input/output widths, d a norm's width. λ is the ridge weight,
ε the jitter, a(p) = ρ·p_merged + (1 − ρ)·p_base the anchor of a parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from featcal_core.errors import FeatCalError

log = logging.getLogger(__name__)

DTYPE = torch.float64
#: right-hand-side columns solved at a time against a Cholesky factor (bounds the solver's copies)
SOLVE_COLUMNS = 512


class Fallbacks:
    """Every place a solve fell back or clamped a value, as JSON-able entries (a block summary's
    "fallbacks"); each `add` also logs one WARNING, prefixed with `where` (e.g. "block 3")."""

    def __init__(self, where: str = ""):
        self.where = where
        self.entries: list[dict] = []

    def add(
        self,
        kind: str,
        reason: str,
        modules: Sequence[str | None] = (None,),
        parameter: str | None = None,
        task: str | None = None,
        count: int = 1,
    ) -> None:
        """Record one entry per module (one log line for all): kind, module, parameter, task,
        count (affected channels, else 1) and reason."""
        names = ", ".join(m + (f".{parameter}" if parameter else "") for m in modules if m)
        parts = [self.where, f"task {task!r}" if task is not None else "", names, reason]
        log.warning("FeatCal fallback (%s): %s", kind, ": ".join(p for p in parts if p))
        for module in modules:
            self.entries.append(
                {
                    "kind": kind,
                    "module": module,
                    "parameter": parameter,
                    "task": task,
                    "count": int(count),
                    "reason": reason,
                }
            )


def anchor(merged: torch.Tensor, base: torch.Tensor, rho: float) -> torch.Tensor:
    """a(p) = ρ·merged + (1 − ρ)·base, in float64 (any shape; one float64 copy at a time)."""
    return merged.to(DTYPE, copy=True).mul_(rho).add_(base.to(DTYPE), alpha=1.0 - rho)


def ensure_fallbacks(fallbacks: Fallbacks | None) -> Fallbacks:
    """`fallbacks`, or one that only logs (a direct call of a solver still warns)."""
    return Fallbacks() if fallbacks is None else fallbacks


class SPDSystem:
    """A factored symmetric positive (semi)definite matrix A (d × d), to solve A·X = B repeatedly.

    Cholesky first; if it fails (singular A, e.g. λ = 0 with too few tokens) solves fall back to
    least squares, which returns the minimum-norm solution: `fallback` then holds the reason, and
    the fallback is logged and recorded in `fallbacks` (kind "lstsq", one entry per module).
    """

    def __init__(
        self,
        lhs: torch.Tensor,
        positive_definite: bool = False,
        *,
        fallbacks: Fallbacks | None = None,
        modules: Sequence[str | None] = (None,),
    ):
        """Factor `lhs` (symmetric, owned by this object). positive_definite: A is known to be
        positive definite (a ridge λ > 0 on its diagonal), so it is factored in place: LAPACK
        works on its column-major view and writes L (L·Lᵀ = A) over it, with no copy of A.
        Otherwise the factor is a new matrix and A is kept for the least-squares fallback.
        modules: the Linear modules whose weights this system solves (named in the record)."""
        self.fallback: str | None = None
        self.factor: torch.Tensor | None
        self.matrix: torch.Tensor | None  # A, kept for the least-squares fallback
        if not positive_definite:
            factor, info = torch.linalg.cholesky_ex(lhs)
            self.factor, self.matrix = (factor, None) if int(info) == 0 else (None, lhs)
            if self.factor is None:
                self.fallback = (
                    f"Cholesky failed at column {int(info)} (λ = 0 and a singular or indefinite "
                    "system); solved by least squares (minimum-norm solution)"
                )
                ensure_fallbacks(fallbacks).add("lstsq", self.fallback, modules, "weight")
            return
        info = torch.empty((), dtype=torch.int32, device=lhs.device)
        view = lhs.mT
        torch.linalg.cholesky_ex(view, upper=True, out=(view, info))
        if int(info) != 0:
            raise FeatCalError(
                f"the ridge system is not positive definite (Cholesky failed at column "
                f"{int(info)}): the statistics hold NaN/Inf or λ is too small for them; raise λ"
            )
        self.factor, self.matrix = lhs, None

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        """X with A·X = rhs (d × k); with a factor, two triangular solves per SOLVE_COLUMNS
        columns, written over `rhs` (so the solver never copies the whole right-hand side or
        the factor). The least-squares fallback runs on the CPU (gelsd, the SVD driver that
        handles rank-deficient A; CUDA offers only gels, which assumes full rank)."""
        if self.factor is None:
            assert self.matrix is not None  # kept when the factorisation failed
            solution = torch.linalg.lstsq(self.matrix.cpu(), rhs.cpu(), driver="gelsd").solution
            return solution.to(rhs.device)
        for start in range(0, rhs.shape[1], SOLVE_COLUMNS):
            part = rhs[:, start : start + SOLVE_COLUMNS]
            y = torch.linalg.solve_triangular(self.factor, part, upper=False)
            part.copy_(torch.linalg.solve_triangular(self.factor.mT, y, upper=True))
        return rhs


def ridge_system(
    gram: torch.Tensor,
    lam: float,
    eps: float,
    in_place: bool = False,
    *,
    fallbacks: Fallbacks | None = None,
    modules: Sequence[str | None] = (None,),
) -> SPDSystem:
    """The factored left-hand side Σ s_t C_t + (λ + ε) I of the Linear weight equation
    (fallbacks, modules: see `SPDSystem`)."""
    lhs = gram if in_place else gram.clone()
    lhs.diagonal().add_(lam + eps)
    return SPDSystem(lhs, positive_definite=lam > 0, fallbacks=fallbacks, modules=modules)


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
        rhs.add_(anchor_weight.to(DTYPE).T, alpha=lam)
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
    *,
    fallbacks: Fallbacks | None = None,
    module: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel 2×2 solve for LayerNorm (γ, β), each of shape (d).

    [Σe + λ, Σm; Σm, T + λ] [γ; β] = [Σ(e_t γ_t + m_t β_t) + λ a(γ); Σ(m_t γ_t + β_t) + λ a(β)],
    with the determinant clamped at ε (recorded in `fallbacks` as "clamped_determinant").
    """
    a11 = e_sum + lam
    a12 = m_sum
    a22 = torch.full_like(e_sum, float(num_tasks) + lam)
    r1 = rhs_gamma.clone()
    r2 = rhs_beta.clone()
    if lam > 0:
        assert anchor_gamma is not None and anchor_beta is not None  # λ > 0: anchored
        r1 += lam * anchor_gamma.to(DTYPE)
        r2 += lam * anchor_beta.to(DTYPE)
    det = a11 * a22 - a12 * a12
    clamped = det.abs() < eps
    count = int(clamped.sum())
    if count:
        reason = (
            f"|det| < ε = {eps:g} in {count} of {det.numel()} channels of the 2×2 (γ, β) "
            "system; the determinant was clamped to ε"
        )
        ensure_fallbacks(fallbacks).add(
            "clamped_determinant", reason, (module,), "weight,bias", count=count
        )
    det = torch.where(clamped, torch.full_like(det, eps), det)
    gamma = (a22 * r1 - a12 * r2) / det
    beta = (a11 * r2 - a12 * r1) / det
    return gamma, beta


def solve_rmsnorm(
    e_sum: torch.Tensor,
    rhs_gamma: torch.Tensor,
    lam: float,
    eps: float,
    anchor_gamma: torch.Tensor | None,
    *,
    fallbacks: Fallbacks | None = None,
    module: str | None = None,
) -> torch.Tensor:
    """Scale-only norm (RMSNorm / T5LayerNorm): γ = (Σ e_t γ_t + λ a(γ)) / (Σ e_t + λ), per channel,
    the denominator clamped at ε (recorded in `fallbacks` as "clamped_denominator")."""
    numerator = rhs_gamma.clone()
    if lam > 0:
        assert anchor_gamma is not None  # λ > 0: anchored
        numerator += lam * anchor_gamma.to(DTYPE)
    denominator = e_sum + lam
    count = int((denominator < eps).sum())
    if count:
        reason = (
            f"Σ e_t + λ < ε = {eps:g} in {count} of {denominator.numel()} channels; the "
            "denominator was clamped to ε"
        )
        ensure_fallbacks(fallbacks).add(
            "clamped_denominator", reason, (module,), "weight", count=count
        )
    return numerator / torch.clamp(denominator, min=eps)
