"""What a block's outputs are checked and measured by: finite values, and the drift to the expert.

Drift of task t at block i: mean ‖student − expert‖² per weighted token, where student and expert
are the block outputs (B, S, d) and the mask (B, S) says which tokens count: every real token, or
only the pooled one in the last block of a pooled model (`drift_token_mask`). Sums are in float64.

Per batch, both stay on the tensors' device (`FiniteChecks`, `DriftSums`): a task's pass reads
them into Python once, at its end, so a GPU is not made to wait after every batch.
"""

from __future__ import annotations

import torch

from featcal_core.errors import FeatCalError
from featcal_core.finite import all_finite, finite_flag
from featcal_core.method.solvers import Fallbacks


def drift_token_mask(mask: torch.Tensor, last: bool, pooled_position: int | None) -> torch.Tensor:
    """Tokens the drift is measured on: all real tokens; only the pooled one in the last block
    of a pooled model (the only output that matters there)."""
    if not last or pooled_position is None:
        return mask
    only = torch.zeros_like(mask)
    only[:, pooled_position] = mask[:, pooled_position]
    return only


def drift_sums(
    student: torch.Tensor, expert: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ mask·‖s − e‖², Σ mask) over tokens: float64 scalars on the tensors' device."""
    sq = (student.to(torch.float64) - expert.to(torch.float64)).pow(2).sum(-1)
    mask = mask.to(torch.float64)
    return (sq * mask).sum(), mask.sum()


class DriftSums:
    """A task's drift sums over its batches, kept on the device until `totals`."""

    def __init__(self) -> None:
        self._sq: torch.Tensor | float = 0.0
        self._tokens: torch.Tensor | float = 0.0

    def add(self, student: torch.Tensor, expert: torch.Tensor, mask: torch.Tensor) -> None:
        sq, tokens = drift_sums(student, expert, mask)
        self._sq = self._sq + sq
        self._tokens = self._tokens + tokens

    def totals(self) -> tuple[float, float]:
        """(Σ mask·‖s − e‖², Σ mask) over every batch added."""
        return float(self._sq), float(self._tokens)


def mean_drift(sq_sum: float, tok_sum: float, task: str, when: str, found: Fallbacks) -> float:
    """sq_sum / tok_sum; 0 with a "no_tokens" entry in `found` when no token carries weight."""
    if tok_sum > 0:
        return sq_sum / tok_sum
    found.add("no_tokens", f"no weighted tokens for the drift {when}; reported as 0", task=task)
    return 0.0


def _not_finite(what: str) -> FeatCalError:
    return FeatCalError(
        f"NaN or Inf in the {what}; check that checkpoint's weights and its dtype's range "
        "(try float32 weights)"
    )


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """Refuse NaN or Inf in a block output or a solved parameter (`what` names it)."""
    if not all_finite(tensor):
        raise _not_finite(what)


class FiniteChecks:
    """`check_finite` for many tensors with one read of the device: `add` queues a check,
    `raise_first` raises for the first tensor added (in order) that held NaN or Inf."""

    def __init__(self) -> None:
        self._flags: list[torch.Tensor] = []
        self._what: list[str] = []

    def add(self, tensor: torch.Tensor, what: str) -> None:
        if not tensor.is_floating_point() or tensor.numel() == 0:
            return
        self._flags.append(finite_flag(tensor))
        self._what.append(what)

    def raise_first(self) -> None:
        """Raise the FeatCalError of the first non-finite tensor added; forget every check."""
        flags, what = self._flags, self._what
        self._flags, self._what = [], []
        if not flags:
            return
        ok = torch.stack(flags).cpu().tolist()
        for good, name in zip(ok, what, strict=True):
            if not good:
                raise _not_finite(name)
