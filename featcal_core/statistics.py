"""Token-weighted, uncentered statistics for FeatCal, accumulated in float64.

One accumulator per *input* of a block: the Linear modules that read the same tensor with the same
token weights (q, k and v, say) share one Gram matrix. Per-task sums live only while that task's
pass over the block runs; `end_task` folds them, scaled by s_t = 1 / max(‖C_t‖_F, ε), into running
sums, so memory is O(d_in²) per input whatever the number of tasks T.

Shapes: x_s, x_e are (N, d_in) token vectors (student / expert inputs); w is (N,) token weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from featcal_core.solvers import (
    DTYPE,
    solve_layernorm,
    solve_linear_bias,
    solve_linear_weight,
    solve_rmsnorm,
)


@dataclass
class LinearTarget:
    """One Linear module fed by a `LinearInputStats`: its expert weight for the current task."""

    d_out: int
    has_bias: bool
    cross: torch.Tensor = field(init=False)  # Σ_t s_t X_t W_tᵀ, (d_in × d_out)
    target_sum: torch.Tensor = field(init=False)  # Σ_t s_t (b_t + W_t μt_t), (d_out)
    _task_cross: torch.Tensor | None = None
    _task_target: torch.Tensor | None = None


class LinearInputStats:
    """Running sums for the Linear modules sharing one input (width d_in)."""

    def __init__(self, d_in: int, modules: dict[str, tuple[int, bool]], device: torch.device):
        self.d_in = d_in
        self.device = device
        self.gram = torch.zeros(d_in, d_in, dtype=DTYPE, device=device)  # Σ s_t C_t
        self.student_mean_sum = torch.zeros(d_in, dtype=DTYPE, device=device)  # Σ s_t μs_t
        self.scale_sum = 0.0  # Σ s_t
        self.num_tasks = 0
        self.targets: dict[str, LinearTarget] = {}
        for name, (d_out, has_bias) in modules.items():
            target = LinearTarget(d_out, has_bias)
            target.cross = torch.zeros(d_in, d_out, dtype=DTYPE, device=device)
            target.target_sum = torch.zeros(d_out, dtype=DTYPE, device=device)
            self.targets[name] = target
        self._reset_task()

    def _reset_task(self) -> None:
        self._task_weight = 0.0
        self._task_gram = None
        self._task_student = None
        for target in self.targets.values():
            target._task_cross = None
            target._task_target = None

    def add(
        self,
        x_s: torch.Tensor,
        x_e: torch.Tensor,
        w: torch.Tensor,
        alpha: float,
        expert_params: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
    ) -> None:
        """Add one batch of task t's tokens. expert_params: name → (W_t (d_out × d_in), b_t or None)."""
        x_s = x_s.to(DTYPE)
        w = w.to(DTYPE)
        x_t = alpha * x_e.to(DTYPE) + (1.0 - alpha) * x_s
        xw = x_s * w[:, None]
        gram = xw.T @ x_s
        student = xw.sum(0)
        self._task_gram = gram if self._task_gram is None else self._task_gram + gram
        self._task_student = student if self._task_student is None else self._task_student + student
        self._task_weight += float(w.sum())
        for name, target in self.targets.items():
            weight_t, bias_t = expert_params[name]
            y = x_t @ weight_t.to(DTYPE).T  # W_t x_t, (N × d_out)
            cross = xw.T @ y
            tgt = (y * w[:, None]).sum(0)
            if bias_t is not None:
                tgt = tgt + float(w.sum()) * bias_t.to(DTYPE)
            target._task_cross = cross if target._task_cross is None else target._task_cross + cross
            target._task_target = tgt if target._task_target is None else target._task_target + tgt

    def end_task(self, eps: float) -> float:
        """Fold the current task into the running sums; returns its scale s_t."""
        total = self._task_weight
        if total <= 0 or self._task_gram is None:
            raise ValueError("a task contributed no weighted tokens to a Linear input")
        c_t = self._task_gram / total
        s_t = 1.0 / max(float(torch.linalg.matrix_norm(c_t)), eps)
        self.gram += s_t * c_t
        self.student_mean_sum += (s_t / total) * self._task_student
        self.scale_sum += s_t
        self.num_tasks += 1
        for target in self.targets.values():
            target.cross += (s_t / total) * target._task_cross
            target.target_sum += (s_t / total) * target._task_target
        self._reset_task()
        return s_t

    def solve(
        self,
        name: str,
        lam: float,
        eps: float,
        anchor_weight: torch.Tensor | None,
        anchor_bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Closed-form (W, b) for module `name`, float64; b is None for a bias-free Linear."""
        target = self.targets[name]
        weight = solve_linear_weight(self.gram, target.cross, lam, eps, anchor_weight)
        bias = None
        if target.has_bias:
            bias = solve_linear_bias(
                weight, self.scale_sum, target.target_sum, self.student_mean_sum, lam, anchor_bias
            )
        return weight, bias


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
        self._task_weight = 0.0
        self._task_z = None
        self._task_z2 = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """z = norm_without_affine(x) in float64 with the merged module's eps; x is (N, d)."""
        x = x.to(DTYPE)
        if self.rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt(var + self.norm_eps)

    def add(self, x_s: torch.Tensor, w: torch.Tensor) -> None:
        z = self.normalize(x_s)
        w = w.to(DTYPE)[:, None]
        z_sum = (w * z).sum(0)
        z2_sum = (w * z * z).sum(0)
        self._task_z = z_sum if self._task_z is None else self._task_z + z_sum
        self._task_z2 = z2_sum if self._task_z2 is None else self._task_z2 + z2_sum
        self._task_weight += float(w.sum())

    def end_task(self, gamma_t: torch.Tensor, beta_t: torch.Tensor | None) -> None:
        """Fold the current task with expert t's affine parameters (γ_t, β_t)."""
        total = self._task_weight
        if total <= 0 or self._task_z is None:
            raise ValueError("a task contributed no weighted tokens to a norm")
        m_t = self._task_z / total
        e_t = self._task_z2 / total
        gamma_t = gamma_t.to(DTYPE)
        beta_t = torch.zeros_like(gamma_t) if beta_t is None else beta_t.to(DTYPE)
        self.e_sum += e_t
        self.m_sum += m_t
        if self.rms:
            self.rhs_gamma += e_t * gamma_t
        else:
            self.rhs_gamma += e_t * gamma_t + m_t * beta_t
            self.rhs_beta += m_t * gamma_t + beta_t
        self.num_tasks += 1
        self._reset_task()

    def solve(
        self,
        lam: float,
        eps: float,
        anchor_gamma: torch.Tensor | None,
        anchor_beta: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.rms or not self.has_bias:
            return solve_rmsnorm(self.e_sum, self.rhs_gamma, lam, eps, anchor_gamma), None
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
        )
