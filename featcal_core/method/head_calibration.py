"""Head calibration: refit a task's classification head for the merged (or calibrated) tower.

Beyond the paper (issue "embedded default"): after merging, each task's own head (a Linear on the
pooled features) sees features that drifted from the expert's. The method's Linear closed form,
applied to the head with teacher interpolation α = 1 and the expert's head as anchor, gives the
head that best reproduces the expert's logits on the calibration inputs:

    W = argmin  s E‖W z_s − W_e z_e‖² + λ‖W − W_e‖²        (weight first, uncentered)
    b = argmin  s E‖W z_s + b − (W_e z_e + b_e)‖² + λ‖b − b_e‖²   (then the bias, with the new W)

with z_s the student's features (the evaluated tower under the head), z_e the expert's, s = 1/‖C‖_F,
C = E[z_s z_sᵀ]. No labels are used. Statistics and the solve are float64; one pass over the
calibration inputs per model.

    weight, bias = calibrate_head(ExpertHead(expert_dir), expert_dir, merged_dir, rows, lam=0.05)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.accuracy import _device
from featcal_core.evaluation.head import Head
from featcal_core.method.solvers import DTYPE, ridge_system, solve_linear_bias, solve_linear_weight
from featcal_core.precision import autocast

logger = logging.getLogger(__name__)

__all__ = ["HeadStatistics", "calibrate_head", "fit_linear_head", "head_statistics"]


class HeadStatistics:
    """Running float64 sums over calibration inputs: C = E[z_s z_sᵀ] (d × d), X = E[z_s z_eᵀ]
    (d × d), μs = E[z_s], μe = E[z_e] (d); every input counts once."""

    def __init__(self, width: int):
        self.count = 0
        self.gram = torch.zeros(width, width, dtype=DTYPE)
        self.cross = torch.zeros(width, width, dtype=DTYPE)
        self.student_sum = torch.zeros(width, dtype=DTYPE)
        self.expert_sum = torch.zeros(width, dtype=DTYPE)

    def add(self, student: torch.Tensor, expert: torch.Tensor) -> None:
        """student, expert: (B, d) features of the same B inputs."""
        s, e = student.detach().to("cpu", DTYPE), expert.detach().to("cpu", DTYPE)
        if s.shape != e.shape or s.ndim != 2 or s.shape[1] != self.gram.shape[0]:
            raise FeatCalError(
                f"head calibration: student features {tuple(s.shape)} and expert features "
                f"{tuple(e.shape)} must both be (batch, {self.gram.shape[0]}); the towers differ"
            )
        if not (torch.isfinite(s).all() and torch.isfinite(e).all()):
            raise FeatCalError("head calibration: NaN or Inf in the features; check the models")
        self.count += s.shape[0]
        self.gram += s.T @ s
        self.cross += s.T @ e
        self.student_sum += s.sum(0)
        self.expert_sum += e.sum(0)


def fit_linear_head(
    stats: HeadStatistics,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lam: float,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W (classes, d), b (classes)) float64 from the method's Linear closed forms with one task,
    α = 1 and the expert head (weight, bias) as target and anchor."""
    if stats.count == 0:
        raise FeatCalError("head calibration: no calibration inputs; give at least one row")
    if lam < 0:
        raise FeatCalError(f"head calibration: λ must be ≥ 0 (got {lam})")
    n = float(stats.count)
    w_e = weight.to(DTYPE)
    b_e = torch.zeros(w_e.shape[0], dtype=DTYPE) if bias is None else bias.to(DTYPE)
    gram, cross = stats.gram / n, stats.cross / n
    scale = 1.0 / max(float(torch.linalg.matrix_norm(gram)), eps)
    system = ridge_system(scale * gram, lam, eps)
    new_weight = solve_linear_weight(system, scale * cross @ w_e.T, lam, eps, w_e)
    target = scale * (b_e + w_e @ (stats.expert_sum / n))
    new_bias = solve_linear_bias(
        new_weight, scale, target, scale * (stats.student_sum / n), lam, b_e
    )
    return new_weight, new_bias


@torch.no_grad()
def head_statistics(
    head: Head,
    expert_dir: str | Path,
    student_dir: str | Path,
    rows: list[Any],
    *,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    precision: str = "float32",
) -> tuple[HeadStatistics, torch.nn.Linear]:
    """One pass over `rows`: the statistics of the student's and the expert's head inputs, and
    the expert's own head Linear (target and anchor of `fit_linear_head`). `precision`: the
    towers' forwards in "float32" or "bfloat16" (autocast); the statistics sum in float64."""
    if not rows:
        raise FeatCalError("head calibration: no calibration inputs; give at least one row")
    target = _device(device)
    expert_features, expert_linear = head.parts(expert_dir, target)
    student_features, _ = head.parts(student_dir, target)
    stats = HeadStatistics(expert_linear.in_features)
    for start in range(0, len(rows), batch_size):
        inputs = {
            k: v.to(target) for k, v in head.preprocess(rows[start : start + batch_size]).items()
        }
        with autocast(precision, target):
            student, expert = student_features(**inputs), expert_features(**inputs)
        stats.add(student.float(), expert.float())
    return stats, expert_linear


@torch.no_grad()
def calibrate_head(
    head: Head,
    expert_dir: str | Path,
    student_dir: str | Path,
    rows: list[Any],
    *,
    lam: float = 0.05,
    eps: float = 1e-8,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    precision: str = "float32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refit `head`'s final Linear for the tower in `student_dir` on calibration `rows` (PIL
    images or strings) so that it reproduces the head on the expert's own tower (`expert_dir`).

    Returns (weight (classes, d), bias (classes)) in float32, ready for `head.with_linear`.
    """
    stats, expert_linear = head_statistics(
        head,
        expert_dir,
        student_dir,
        rows,
        batch_size=batch_size,
        device=device,
        precision=precision,
    )
    bias = expert_linear.bias.detach().cpu() if expert_linear.bias is not None else None
    weight, new_bias = fit_linear_head(stats, expert_linear.weight.detach().cpu(), bias, lam, eps)
    logger.info(
        "head calibrated for %s on %d inputs (λ=%g): ‖ΔW‖/‖W‖ = %.4f",
        student_dir,
        stats.count,
        lam,
        float((weight - expert_linear.weight.double().cpu()).norm() / expert_linear.weight.norm()),
    )
    return weight.float(), new_bias.float()


def check_expert_heads(
    experts: Mapping[str, str | Path], tokenizer_dir: str | Path | None = None
) -> None:
    """Before any work: every expert has a head to refit (FeatCalError naming the first that
    has none)."""
    from featcal_core.evaluation.expert_head import ExpertHead

    for expert in experts.values():
        ExpertHead(expert, tokenizer_dir=tokenizer_dir).require_head()


def refit_expert_heads(
    student_dir: str | Path,
    experts: Mapping[str, str | Path],
    calib: Mapping[str, str | Path],
    out_dir: str | Path,
    *,
    num_per_task: int = 256,
    seed: int = 0,
    lam: float = 0.05,
    batch_size: int = 32,
    device: str = "cpu",
    tokenizer_dir: str | Path | None = None,
    precision: str = "float32",
) -> dict[str, str]:
    """Head calibration of every expert's own head for the tower in `student_dir`, on the same
    seeded calibration sample FeatCal draws; writes `<out_dir>/<task>/classifier.{safetensors,json}`
    (featcal_core.evaluation.linear_head format). Returns {task: folder}. `tokenizer_dir`: where experts
    saved without a tokenizer take theirs (the base model)."""
    from featcal_core.data.calibration_data import load_calibration_set
    from featcal_core.evaluation.expert_head import ExpertHead
    from featcal_core.evaluation.linear_head import save_linear_head
    from featcal_core.io.outputs import guarded_directory
    from featcal_core.names import check_names

    check_names(experts, "--expert")
    written = {}
    inputs = (*experts.values(), *calib.values())  # the student: usually OUT, heads in OUT/heads
    with guarded_directory(out_dir, overwrite=True, inputs=inputs, flag="heads folder") as tmp:
        for task, expert in experts.items():
            if task not in calib:
                raise FeatCalError(
                    f"head calibration: task {task!r} has no calibration set; add one"
                )
            head = ExpertHead(expert, tokenizer_dir=tokenizer_dir)
            head.require_head()
            rows = load_calibration_set(task, calib[task], head.modality, num_per_task, seed).rows
            weight, bias = calibrate_head(
                head,
                expert,
                student_dir,
                rows,
                lam=lam,
                batch_size=batch_size,
                device=device,
                precision=precision,
            )
            save_linear_head(tmp / task, weight, bias, [str(i) for i in range(weight.shape[0])])
            written[task] = str(Path(out_dir) / task)
    return written
