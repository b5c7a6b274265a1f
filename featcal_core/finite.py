"""`all_finite`: whether a tensor holds no NaN and no ±Inf, in two reductions (`finite_flag`: the
same answer left on the tensor's device, for callers that read many at once).

`torch.isfinite(t).all()` writes a bool tensor as large as `t` first (10.7 ms on 1600 × 3072
float32 here); the smallest and largest entries answer the same question without it (0.5 ms):
NaN propagates through both, +Inf is the largest, −Inf the smallest.
"""

from __future__ import annotations

import torch


def finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A bool scalar on a real floating tensor's device: True when it has no NaN or Inf (not read
    into Python, so no wait for a GPU)."""
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low) & torch.isfinite(high)


def all_finite(tensor: torch.Tensor) -> bool:
    """True when `tensor` has no NaN or Inf (always for integer, bool and empty tensors)."""
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return True
    if tensor.is_complex():
        return bool(torch.isfinite(tensor).all())
    return bool(finite_flag(tensor))
