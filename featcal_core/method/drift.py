"""What a block's outputs are checked and measured by: finite values, and the drift to the expert.

Drift of task t at block i: mean ‖student − expert‖² per weighted token, where student and expert
are the block outputs (B, S, d) and the mask (B, S) says which tokens count: every real token, or
only the pooled one in the last block of a pooled model (`drift_token_mask`). Sums are in float64.
"""

from __future__ import annotations

import torch

from featcal_core.errors import FeatCalError
from featcal_core.finite import all_finite
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
) -> tuple[float, float]:
    """(Σ mask·‖s − e‖², Σ mask) over tokens, in float64."""
    sq = (student.to(torch.float64) - expert.to(torch.float64)).pow(2).sum(-1)
    mask = mask.to(torch.float64)
    return float((sq * mask).sum()), float(mask.sum())


def mean_drift(sq_sum: float, tok_sum: float, task: str, when: str, found: Fallbacks) -> float:
    """sq_sum / tok_sum; 0 with a "no_tokens" entry in `found` when no token carries weight."""
    if tok_sum > 0:
        return sq_sum / tok_sum
    found.add("no_tokens", f"no weighted tokens for the drift {when}; reported as 0", task=task)
    return 0.0


def check_finite(tensor: torch.Tensor, what: str) -> None:
    """Refuse NaN or Inf in a block output or a solved parameter (`what` names it)."""
    if not all_finite(tensor):
        raise FeatCalError(
            f"NaN or Inf in the {what}; check that checkpoint's weights and its dtype's range "
            "(try float32 weights)"
        )
