"""Per-channel sums for FeatCal's norm calibration (LayerNorm γ, β; RMS norm γ), float64.

One `NormStats` per norm module of a block: per task, `add` accumulates the weighted sums of the
normalised student inputs z (N, d); `task_contribution` closes the task with expert t's affine
parameters; `merge` adds contributions in task order (here or from another process) and `solve`
returns the closed-form (γ, β) (featcal_core/method/solvers.py).
"""

from __future__ import annotations

import torch

from featcal_core.method.solvers import DTYPE, Fallbacks, solve_layernorm, solve_rmsnorm


class NormStats:
    """Running per-channel sums for one LayerNorm (γ, β) or scale-only RMS norm (γ) of width d."""

    def __init__(self, d: int, norm_eps: float, rms: bool, has_bias: bool, device: torch.device):
        self.d = d
        self.norm_eps = norm_eps
        self.rms = rms
        self.has_bias = has_bias
        zeros = lambda: torch.zeros(d, dtype=DTYPE, device=device)  # noqa: E731
        self.e_sum, self.m_sum, self.rhs_gamma, self.rhs_beta = zeros(), zeros(), zeros(), zeros()
        self.num_tasks = 0
        self._reset_task()

    def _reset_task(self) -> None:
        self._task_weight: torch.Tensor | float = 0.0  # Σ ω, on the device
        self._task_z: torch.Tensor | None = None
        self._task_z2: torch.Tensor | None = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """z = norm_without_affine(x) in float64 with the merged module's eps; x is (N, d)."""
        x = x.to(DTYPE)
        if self.rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.norm_eps)

    def add(self, x_s: torch.Tensor, w: torch.Tensor | None) -> None:
        """Add one batch (N, d) of task t's student inputs (w None: all weights 1)."""
        z = self.normalize(x_s)
        if w is None:
            w = torch.ones(z.shape[0], dtype=DTYPE, device=z.device)
        w = w.to(DTYPE)
        z_sum = w @ z
        z2_sum = w @ (z * z)
        self._task_z = z_sum if self._task_z is None else self._task_z + z_sum
        self._task_z2 = z2_sum if self._task_z2 is None else self._task_z2 + z2_sum
        self._task_weight = self._task_weight + w.sum()  # read when the task closes

    def task_contribution(
        self, gamma_t: torch.Tensor, beta_t: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """Close the current task with expert t's affine parameters (γ_t, β_t): its terms
        `e` (E_t[z²]), `m` (E_t[z]), `rhs_gamma`, `rhs_beta`, float64 (d,)."""
        total = float(self._task_weight)
        if total <= 0 or self._task_z is None:
            raise ValueError("a task contributed no weighted tokens to a norm")
        assert self._task_z2 is not None  # set together with _task_z
        m_t = self._task_z / total
        e_t = self._task_z2 / total
        gamma_t = gamma_t.to(DTYPE)
        beta_t = torch.zeros_like(gamma_t) if beta_t is None else beta_t.to(DTYPE)
        if self.rms:
            rhs_gamma, rhs_beta = e_t * gamma_t, torch.zeros_like(gamma_t)
        else:
            rhs_gamma, rhs_beta = e_t * gamma_t + m_t * beta_t, m_t * gamma_t + beta_t
        self._reset_task()
        return {"e": e_t, "m": m_t, "rhs_gamma": rhs_gamma, "rhs_beta": rhs_beta}

    def merge(self, contribution: dict[str, torch.Tensor]) -> None:
        """Add one task's terms (from `task_contribution`, here or in another process)."""
        device = self.e_sum.device
        self.e_sum += contribution["e"].to(device, DTYPE)
        self.m_sum += contribution["m"].to(device, DTYPE)
        self.rhs_gamma += contribution["rhs_gamma"].to(device, DTYPE)
        self.rhs_beta += contribution["rhs_beta"].to(device, DTYPE)
        self.num_tasks += 1

    def end_task(self, gamma_t: torch.Tensor, beta_t: torch.Tensor | None) -> None:
        """Fold the current task with expert t's affine parameters (γ_t, β_t)."""
        self.merge(self.task_contribution(gamma_t, beta_t))

    def solve(
        self,
        lam: float,
        eps: float,
        anchor_gamma: torch.Tensor | None,
        anchor_beta: torch.Tensor | None,
        fallbacks: Fallbacks | None = None,
        module: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(γ, β) in float64 (β None for a scale-only norm); clamps are recorded in `fallbacks`
        under `module`."""
        if self.rms or not self.has_bias:
            return solve_rmsnorm(
                self.e_sum,
                self.rhs_gamma,
                lam,
                eps,
                anchor_gamma,
                fallbacks=fallbacks,
                module=module,
            ), None
        return solve_layernorm(
            self.e_sum,
            self.m_sum,
            self.rhs_gamma,
            self.rhs_beta,
            self.num_tasks,
            lam,
            eps,
            anchor_gamma,
            anchor_beta,
            fallbacks=fallbacks,
            module=module,
        )
