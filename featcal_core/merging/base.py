"""What a merge method is: a rule that turns the base tensor and the experts' tensors of one
parameter into the merged tensor. Methods see one tensor name at a time, so a merge streams through
a checkpoint tensor by tensor.

Large tensors are merged in row chunks (featcal_core.merging.run): a method first gets
`prepare(task_vectors, ...)`, which may stream over each expert's task vector τ_t = θ_t − θ0 of
the whole tensor (chunk by chunk) to compute per-tensor statistics (TIES: its trim thresholds),
then `merge_chunk` for each chunk of entries with that result. A method whose rule is not entry
by entry given such statistics sets `chunkable = False` and always gets whole tensors. Either
way `merge_tensor` on the whole tensor gives the same values as the chunks, bit for bit.

A method that needs to know where its entries sit (DARE: a random mask that must not depend on
the chunking) sets `takes_place = True`: run.py then passes a keyword-only `place` (a `Place`:
the tensor's name and the flat index of the chunk's first entry) to `merge_tensor`, `prepare`
and `merge_chunk`. A method whose statistics span the whole checkpoint (TIES with `trim: global`)
answers True from `needs_checkpoint(hp)`: run.py then calls `prepare_checkpoint` once, streaming
each expert's task vector over every merged tensor, and hands its result on as `place.checkpoint`.

Shapes: `base` and every expert tensor have the same shape S (any rank, scalars included); the
result has shape S too. Methods compute in float64 and return a floating tensor; the caller checks
it and casts it to the base tensor's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from featcal_core.errors import FeatCalError

#: dtype methods compute and accumulate in
COMPUTE_DTYPE = torch.float64


def flag(key: str) -> str:
    """The command-line flag of a hyperparameter, e.g. "top_k" → "--top-k"."""
    return "--" + key.replace("_", "-")


class HyperparameterError(FeatCalError):
    """A bad merge hyperparameter `key`. The message names the key and, in parentheses, where it
    was given: by default its flag (`flag(key)`); `named(where)` is the message naming `where`
    instead (the CLI: the flag the user typed, `--hp drop_rate=2`; the params schema: nothing,
    its error names the key path)."""

    def __init__(self, key: str, text: str) -> None:
        self.key, self.text = str(key), text
        super().__init__(self.named(flag(self.key)))

    def named(self, where: str | None) -> str:
        """The message with `where` (None: no parenthesis) as what names the key."""
        at = f" ({where})" if where else ""
        return f"hyperparameter {self.key!r}{at} {self.text}"


@dataclass(frozen=True)
class Place:
    """Where the entries being merged sit: tensor `name` (the base checkpoint's), `offset` (the
    flat, row-major index of the first entry within the whole tensor; 0 for a whole tensor) and
    `checkpoint` (`prepare_checkpoint`'s result, or None)."""

    name: str
    offset: int = 0
    checkpoint: Any = None


class MergeMethod:
    """One merge rule. Subclasses set `name` and `defaults`, implement `merge_tensor` (or
    `prepare` and `merge_chunk`, which the default `merge_tensor` runs on the whole tensor), may
    extend `validate`, and register themselves with `@featcal_core.merging.register`."""

    #: registry name, e.g. "ties"
    name: str = ""
    #: every hyperparameter the method takes, with its default value
    defaults: dict[str, Any] = {}
    #: hyperparameters also taken but filled in only when given (their default applies when
    #: absent): options added after results were recorded, so that earlier records (and the
    #: cache keys built from them) stay as they were
    optional: dict[str, Any] = {}
    #: True when `merge_chunk` can merge any subset of entries given `prepare`'s result
    chunkable: bool = True
    #: True when `merge_tensor`, `prepare` and `merge_chunk` take the keyword-only `place`
    takes_place: bool = False

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
            if key not in self.defaults and key not in self.optional:
                takes = ", ".join(sorted({*self.defaults, *self.optional})) or "no hyperparameters"
                raise HyperparameterError(
                    key, f"is not used by merge method {self.name!r}; it takes: {takes}"
                )
        filled = {**self.defaults, **hp}
        self.validate(filled)
        return filled

    def validate(self, hp: dict[str, Any]) -> None:
        """Check (and normalise, in place) the filled-in hyperparameters; the default accepts all."""
        return

    def merge_tensor(
        self,
        base: torch.Tensor,
        experts: list[torch.Tensor],
        hp: dict[str, Any],
        *,
        place: Place | None = None,
    ) -> torch.Tensor:
        """The merged tensor (shape S, floating, at least float32) from `base` (shape S) and one
        tensor per expert (each shape S, any floating dtype). `hp` has passed `check`.

        The default, for a method that implements `prepare` and `merge_chunk` (TIES, Model
        Breadcrumbs), runs them on the whole tensor: `prepare` over each expert's task vector in
        one chunk, then `merge_chunk` (each passed `place` on when given). A method whose rule
        acts entry by entry overrides this instead and keeps the default `merge_chunk`."""
        if type(self).merge_chunk is MergeMethod.merge_chunk:
            raise NotImplementedError(
                f"{type(self).__qualname__} implements neither merge_tensor nor merge_chunk"
            )

        def task_vector(t: int) -> Iterator[torch.Tensor]:
            yield as_compute(experts[t]).sub_(as_compute(base))

        where = {} if place is None else {"place": place}
        prepared = self.prepare(task_vector, len(experts), base.numel(), hp, **where)
        return self.merge_chunk(base, experts, hp, prepared, **where)

    def needs_checkpoint(self, hp: dict[str, Any]) -> bool:
        """True when `prepare_checkpoint` must run before merging with `hp` (default False)."""
        return False

    def prepare_checkpoint(
        self,
        task_vectors: Callable[[int], Iterator[torch.Tensor]],
        count: int,
        numel: int,
        hp: dict[str, Any],
    ) -> Any:
        """Checkpoint-level statistics, passed on as `place.checkpoint`: task_vectors(t) yields
        expert t's task vector τ_t (float64) in chunks covering all `numel` entries of every
        merged tensor, each call a fresh stream (a method may make several passes). None by
        default."""
        return None

    def prepare(
        self,
        task_vectors: Callable[[int], Iterator[torch.Tensor]],
        count: int,
        numel: int,
        hp: dict[str, Any],
        *,
        place: Place | None = None,
    ) -> Any:
        """Per-tensor statistics for `merge_chunk`: task_vectors(t) yields expert t's task vector
        τ_t (float64) in chunks covering the tensor's `numel` entries in order; `count` experts.
        The default needs none (None)."""
        return None

    def merge_chunk(
        self,
        base: torch.Tensor,
        experts: list[torch.Tensor],
        hp: dict[str, Any],
        prepared: Any,
        *,
        place: Place | None = None,
    ) -> torch.Tensor:
        """The merged entries of one chunk (same shape as `base`); `prepared` is `prepare`'s
        result for the whole tensor. The default applies `merge_tensor` to the chunk (passing
        `place` on when given), which is right for rules that act entry by entry (Task
        Arithmetic, averaging, DARE)."""
        if place is None:
            return self.merge_tensor(base, experts, hp)
        return self.merge_tensor(base, experts, hp, place=place)

    def __repr__(self) -> str:
        return f"<merge method {self.name!r}>"


def _bad(key: str, method: str, problem: str) -> HyperparameterError:
    return HyperparameterError(key, f"of merge method {method!r} {problem}")


def real(
    hp: dict[str, Any],
    key: str,
    method: str,
    *,
    above: float | None = None,
    at_most: float | None = None,
    at_least: float | None = None,
    below: float | None = None,
) -> float:
    """hp[key] as a finite float within the given bounds (`above < value`, `value <= at_most`,
    `at_least <= value`, `value < below`; each optional); stores it back.

    Raises FeatCalError naming the key, its flag, the bad value and the accepted range.
    """
    value = hp[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(key, method, f"must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise _bad(key, method, f"must be finite, got {value!r}")
    bounds = [
        (above, ">", lambda b: number > b),
        (at_least, ">=", lambda b: number >= b),
        (at_most, "<=", lambda b: number <= b),
        (below, "<", lambda b: number < b),
    ]
    given = [(bound, sign, ok) for bound, sign, ok in bounds if bound is not None]
    if not all(ok(bound) for bound, _, ok in given):
        wanted = " and ".join(f"{sign} {bound:g}" for bound, sign, _ in given)
        raise _bad(key, method, f"must be {wanted}, got {value!r}")
    hp[key] = number
    return number


def integer(hp: dict[str, Any], key: str, method: str) -> int:
    """hp[key] as an int (a whole float such as 3.0, as params.yaml gives numbers, is accepted);
    stores it back. Raises FeatCalError naming the key, its flag and the bad value."""
    value = hp[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(key, method, f"must be a whole number, got {hp[key]!r}")
    hp[key] = value
    return value


def choice(hp: dict[str, Any], key: str, method: str, options: tuple[str, ...]) -> str:
    """hp[key], which must be one of `options`. Raises FeatCalError naming the key, its flag,
    the bad value and the options."""
    value = hp[key]
    if not isinstance(value, str) or value not in options:
        wanted = ", ".join(repr(option) for option in options)
        raise _bad(key, method, f"must be one of {wanted}, got {value!r}")
    return value


def as_compute(tensor: torch.Tensor) -> torch.Tensor:
    """A private float64 copy of `tensor` (always a copy, so methods may work on it in place)."""
    return tensor.to(COMPUTE_DTYPE, copy=True)
