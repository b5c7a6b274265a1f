"""RegMean's closed form for the Linear modules sharing one input (Jin et al., ICLR 2023), float64.

For tasks t with input Gram G_t (d_in × d_in) and expert weights W_t (d_out × d_in):

    G̃_t = α·G_t + (1 − α)·diag(G_t)          (off-diagonal entries scaled by α)
    Wᵀ  = (Σ_t G̃_t)⁻¹ · Σ_t G̃_t W_tᵀ         (d_in × d_out)
    b   = (1/T) Σ_t b_t                        (biases: the plain mean, as the reference code)

With α = 1 this W minimises Σ_t ‖X_t Wᵀ − X_t W_tᵀ‖² where G_t = X_tᵀX_t. Σ G̃_t is solved by
Cholesky; only when it is singular (α = 1 with fewer tokens than d_in, an input channel that is
always 0) a small relative ridge λ = `RIDGE` · mean(diag Σ G̃_t) is added, pulling the directions
the data leaves free towards an anchor weight (the merged model's), and the fallback is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from featcal_core.errors import FeatCalError
from featcal_core.method.solvers import DTYPE, SOLVE_COLUMNS, Fallbacks, ensure_fallbacks

#: relative ridge of the singular-Gram fallback: λ = RIDGE · mean of Σ G̃_t's diagonal
RIDGE = 1e-6


def reduce_off_diagonal_(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """G̃ = α·G + (1 − α)·diag(G), in place on `gram` (d, d); returns it."""
    diagonal = gram.diagonal().clone()
    gram.mul_(alpha)
    gram.diagonal().copy_(diagonal)
    return gram


class RegMeanSums:
    """Running Σ_t G̃_t (d_in, d_in), Σ_t G̃_t W_tᵀ (d_in, d_out) per module and Σ_t b_t, float64.

    modules: name → (d_out, has_bias) of every Linear reading this input. Memory: d_in² +
    d_in·Σ d_out float64 numbers, plus one d_in² factor while solving.
    """

    def __init__(self, d_in: int, modules: dict[str, tuple[int, bool]], device=None):
        self.d_in = d_in
        self.device = torch.device(device or "cpu")
        self.modules = dict(modules)
        self.lhs: torch.Tensor | None = torch.zeros(d_in, d_in, dtype=DTYPE, device=self.device)
        self.rhs = {
            n: torch.zeros(d_in, d_out, dtype=DTYPE, device=self.device)
            for n, (d_out, _) in self.modules.items()
        }
        self.bias_sum = {
            n: torch.zeros(d_out, dtype=DTYPE, device=self.device)
            for n, (d_out, has_bias) in self.modules.items()
            if has_bias
        }
        self.num_tasks = 0

    def add_task(
        self,
        gram: torch.Tensor,
        params: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
        alpha: float,
    ) -> None:
        """Add one task: its Gram G_t (d_in, d_in; consumed: reduced in place) and its experts'
        (W_t (d_out, d_in), b_t (d_out) or None) for every module."""
        if gram.shape != (self.d_in, self.d_in):
            raise ValueError(f"Gram of shape {tuple(gram.shape)}, expected {self.d_in}²")
        gram = reduce_off_diagonal_(gram.to(self.device, DTYPE), alpha)
        assert self.lhs is not None  # not yet consumed by solve
        self.lhs.add_(gram)
        for name, rhs in self.rhs.items():
            weight, bias = params[name]
            for start in range(0, weight.shape[0], SOLVE_COLUMNS):  # rows of W_t, in float64
                rows = weight[start : start + SOLVE_COLUMNS].to(self.device, DTYPE)
                rhs[:, start : start + rows.shape[0]].addmm_(gram, rows.T)
            if name in self.bias_sum:
                if bias is None:
                    raise ValueError(
                        f"module {name} has a bias but task {self.num_tasks} gave none"
                    )
                self.bias_sum[name].add_(bias.to(self.device, DTYPE))
        self.num_tasks += 1

    def solve(
        self,
        anchors: Callable[[str], torch.Tensor] | None = None,
        fallbacks: Fallbacks | None = None,
        what: str = "",
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """{name: (W (d_out, d_in), b (d_out) or None)} in float64; consumes the sums.

        anchors: name → the weight (d_out, d_in) that the ridge fallback pulls free directions
        towards (None: zero). A fallback is recorded in `fallbacks` (kind "ridge"); `what` names
        the place in messages (e.g. "block 3")."""
        if self.num_tasks == 0:
            raise ValueError("no task was added to these RegMean sums")
        names = tuple(self.modules)
        assert self.lhs is not None  # not yet consumed by solve
        if not bool(torch.isfinite(self.lhs).all()):
            raise FeatCalError(
                f"{what}: NaN or Inf in the input Gram of {', '.join(names)}; check the experts' "
                "weights and the calibration inputs"
            )
        factor, info = torch.linalg.cholesky_ex(self.lhs)
        lam = 0.0
        if int(info) != 0:
            del factor
            scale = float(self.lhs.diagonal().mean())
            lam = RIDGE * scale if scale > 0 else RIDGE
            reason = (
                f"Σ G̃_t is singular (Cholesky failed at column {int(info)}); solved with a ridge "
                f"λ = {lam:.3g} ({RIDGE:g} × mean diagonal) towards the merged weight"
            )
            ensure_fallbacks(fallbacks).add("ridge", reason, names, "weight")
            self.lhs.diagonal().add_(lam)
            factor, info = torch.linalg.cholesky_ex(self.lhs)
            if int(info) != 0:
                raise FeatCalError(
                    f"{what}: the input Gram of {', '.join(names)} stays singular with a ridge "
                    f"λ = {lam:.3g}; check the calibration inputs"
                )
        self.lhs = None
        out = {}
        for name in names:
            rhs = self.rhs.pop(name)
            if lam > 0 and anchors is not None:
                rhs.add_(anchors(name).to(self.device, DTYPE).T, alpha=lam)
            for start in range(0, rhs.shape[1], SOLVE_COLUMNS):
                part = rhs[:, start : start + SOLVE_COLUMNS]
                part.copy_(torch.cholesky_solve(part, factor))
            bias = self.bias_sum.pop(name, None)
            out[name] = (rhs.T.contiguous(), None if bias is None else bias / self.num_tasks)
        return out


def regmean_weight(
    grams: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    alpha: float,
    anchor: torch.Tensor | None = None,
    fallbacks: Fallbacks | None = None,
) -> torch.Tensor:
    """W (d_out, d_in) = ((Σ G̃_t)⁻¹ Σ G̃_t W_tᵀ)ᵀ for one Linear: grams G_t (d_in, d_in), weights
    W_t (d_out, d_in), one per task, float64 (the Grams are not changed)."""
    if not grams or len(grams) != len(weights):
        raise ValueError("give one Gram and one weight per task (at least one task)")
    sums = RegMeanSums(grams[0].shape[0], {"w": (weights[0].shape[0], False)}, grams[0].device)
    for gram, weight in zip(grams, weights, strict=True):
        sums.add_task(gram.to(DTYPE, copy=True), {"w": (weight, None)}, alpha)
    return sums.solve(None if anchor is None else (lambda _: anchor), fallbacks)["w"][0]
