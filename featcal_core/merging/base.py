"""What a merge method is: a rule that turns the base tensor and the experts' tensors of one
parameter into the merged tensor. Methods see one tensor name at a time, so a merge streams through
a checkpoint tensor by tensor.

Large tensors are merged in row chunks (featcal_core.merging.run): a method first gets
`prepare(task_vectors, ...)`, which may stream over each expert's task vector τ_t = θ_t − θ0 of
the whole tensor (chunk by chunk) to compute per-tensor statistics (TIES: its trim thresholds),
then `merge_chunk` for each chunk of entries with that result. A method whose rule is not entry
by entry given such statistics sets `chunkable = False` and always gets whole tensors. Either
way `merge_tensor` on the whole tensor gives the same values as the chunks, bit for bit.

Shapes: `base` and every expert tensor have the same shape S (any rank, scalars included); the
result has shape S too. Methods compute in float64 and return a floating tensor; the caller checks
it and casts it to the base tensor's dtype.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from featcal_core.errors import FeatCalError

#: dtype methods compute and accumulate in
COMPUTE_DTYPE = torch.float64


def flag(key: str) -> str:
    """The command-line flag of a hyperparameter, e.g. "top_k" → "--top-k"."""
    return "--" + key.replace("_", "-")


class MergeMethod(ABC):
    """One merge rule. Subclasses set `name` and `defaults`, implement `merge_tensor`, may extend
    `validate`, and register themselves with `@featcal_core.merging.register`."""

    #: registry name, e.g. "ties"
    name: str = ""
    #: every hyperparameter the method takes, with its default value
    defaults: dict[str, Any] = {}
    #: True when `merge_chunk` can merge any subset of entries given `prepare`'s result
    chunkable: bool = True

    def check(self, hp: dict[str, Any] | None) -> dict[str, Any]:
        """`hp` with the defaults filled in and each value validated (a new dict).

        Raises FeatCalError naming the offending key (and its flag) for an unknown key or a bad
        value.
        """
        hp = {} if hp is None else hp
        if not isinstance(hp, dict):
            raise FeatCalError(
                f"hyperparameters of merge method {self.name!r} must be a dict, got "
                f"{type(hp).__name__}"
            )
        for key in hp:
            if key not in self.defaults:
                takes = ", ".join(sorted(self.defaults)) or "no hyperparameters"
                raise FeatCalError(
                    f"hyperparameter {key!r} ({flag(str(key))}) is not used by merge method "
                    f"{self.name!r}; it takes: {takes}"
                )
        filled = {**self.defaults, **hp}
        self.validate(filled)
        return filled

    def validate(self, hp: dict[str, Any]) -> None:
        """Check (and normalise, in place) the filled-in hyperparameters; the default accepts all."""
        return

    @abstractmethod
    def merge_tensor(
        self, base: torch.Tensor, experts: list[torch.Tensor], hp: dict[str, Any]
    ) -> torch.Tensor:
        """The merged tensor (shape S, floating, at least float32) from `base` (shape S) and one
        tensor per expert (each shape S, any floating dtype). `hp` has passed `check`."""

    def prepare(
        self,
        task_vectors: Callable[[int], Iterator[torch.Tensor]],
        count: int,
        numel: int,
        hp: dict[str, Any],
    ) -> Any:
        """Per-tensor statistics for `merge_chunk`: task_vectors(t) yields expert t's task vector
        τ_t (float64) in chunks covering the tensor's `numel` entries in order; `count` experts.
        The default needs none (None)."""
        return None

    def merge_chunk(
        self, base: torch.Tensor, experts: list[torch.Tensor], hp: dict[str, Any], prepared: Any
    ) -> torch.Tensor:
        """The merged entries of one chunk (same shape as `base`); `prepared` is `prepare`'s
        result for the whole tensor. The default applies `merge_tensor` to the chunk, which is
        right for rules that act entry by entry (Task Arithmetic, averaging)."""
        return self.merge_tensor(base, experts, hp)

    def __repr__(self) -> str:
        return f"<merge method {self.name!r}>"


def real(
    hp: dict[str, Any],
    key: str,
    method: str,
    *,
    above: float | None = None,
    at_most: float | None = None,
) -> float:
    """hp[key] as a finite float with `above < value <= at_most` (bounds optional); stores it back.

    Raises FeatCalError naming the key, its flag, the bad value and the accepted range.
    """
    value = hp[key]
    where = f"hyperparameter {key!r} ({flag(key)}) of merge method {method!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FeatCalError(f"{where} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise FeatCalError(f"{where} must be finite, got {value!r}")
    low = "" if above is None else f"> {above:g}"
    high = "" if at_most is None else f"<= {at_most:g}"
    wanted = " and ".join(part for part in (low, high) if part)
    if (above is not None and number <= above) or (at_most is not None and number > at_most):
        raise FeatCalError(f"{where} must be {wanted}, got {value!r}")
    hp[key] = number
    return number


def as_compute(tensor: torch.Tensor) -> torch.Tensor:
    """A private float64 copy of `tensor` (always a copy, so methods may work on it in place)."""
    return tensor.to(COMPUTE_DTYPE, copy=True)
