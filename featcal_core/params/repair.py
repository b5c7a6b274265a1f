"""`repair:` (which repair runs on the merged model) and `compare:` (variants that `featcal
compare` runs side by side)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import Field, create_model, field_validator

from featcal_core.names import name_problem
from featcal_core.params.base import FiniteFloat, StrictBool, StrictInt, _error, _Section
from featcal_core.repair.registry import Option
from featcal_core.repair.registry import available as available_repairs
from featcal_core.repair.registry import get as get_repair

#: params a variant may change: what comes after the shared download and calibration sets
VARIANT_KEYS = (
    "merge.",
    "repair.",
    "featcal.alpha",
    "featcal.rho",
    "featcal.lam",
    "featcal.eps",
    "featcal.precision",
    "featcal.num_per_task",
    "featcal.heads",
)


def _option_field(option: Option) -> tuple[Any, Any]:
    """A `repair:` field (annotation, Field) from a registry option: its type, default, bounds
    and help, defined once in the repair's module."""
    annotation = {bool: StrictBool, int: StrictInt}.get(option.kind, FiniteFloat)
    return annotation, Field(
        option.default, ge=option.ge, gt=option.gt, le=option.le, description=option.help
    )


def _known_repair(method: str) -> str:
    if method not in available_repairs():
        raise _error(f"unknown repair {method!r}; one of: {' | '.join(available_repairs())}")
    return method


#: every registered repair's params options as `repair:` fields: key → (annotation, Field)
_OPTION_FIELDS: dict[str, Any] = {
    option.key: _option_field(option)
    for name in available_repairs()
    for option in get_repair(name).params_options()
}

#: the `repair:` section: `method` (any registered repair: featcal_core.repair.registry) and every
#: registered repair's params options, built from the registry so each is defined once
_RepairSettings = create_model(
    "RepairSettings",
    __base__=_Section,
    __doc__="""What repairs the merged model (featcal_core.repair.registry): `featcal` (the
    featcal: section; `featcal.enabled: false` turns every repair off), `regmean` (RegMean, Jin et
    al. 2023: each block Linear from the experts' input Grams on the same calibration sets),
    `surgery` (Representation Surgery, Yang et al. 2024: a small per-task module on the merged
    model's features, trained on the same unlabeled calibration inputs to match each expert's),
    `adamerging` (AdaMerging, Yang et al. 2024: one Task Arithmetic coefficient per task and tower
    tensor, learnt by minimising the entropy of each task's predictions on the same unlabeled
    calibration inputs) or `none` (evaluate the merge only). The repaired model is the
    pipeline's `calibrated` row (with surgery: the merged checkpoint under each task's module,
    kept in `calibrated/<task>/`).""",
    __validators__={"_method": field_validator("method")(_known_repair)},
    method=(str, Field("featcal", description=" | ".join(available_repairs()))),
    **_OPTION_FIELDS,
)

if TYPE_CHECKING:

    class RepairSettings(_Section):
        """`repair:` as type checkers see it: `method` and any registered repair's option."""

        method: str

        def __init__(self, **data: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

else:
    RepairSettings = _RepairSettings


def override_key(override: str) -> str:
    """The key of a KEY=VALUE override ("featcal.alpha=0.5" → "featcal.alpha")."""
    return override.partition("=")[0].strip()


def is_variant_key(key: str) -> bool:
    """Whether a variant (or a select: candidate) may set `key` (VARIANT_KEYS)."""
    return any(key.startswith(p) if p.endswith(".") else key == p for p in VARIANT_KEYS)


def keys_overlap(first: str, second: str) -> bool:
    """Whether setting one key changes the other: equal, or one holds the other
    ("merge.hyperparameters" and "merge.hyperparameters.scale")."""
    return first == second or first.startswith(second + ".") or second.startswith(first + ".")


def layered(own: list[str], user: Iterable[str]) -> tuple[list[str], list[str]]:
    """A variant's (or candidate's) overrides under the user's `--set` ones: (the overrides that
    make its params: its own, less those a user's key covers whole, then the user's of the keys a
    variant may set, which therefore win; its own overrides that the user's replace in whole or
    in part)."""
    mine = [o for o in user if is_variant_key(override_key(o))]
    keys = [override_key(o) for o in mine]

    def covered(key: str) -> bool:
        return any(key == k or key.startswith(k + ".") for k in keys)

    replaced = [o for o in own if any(keys_overlap(override_key(o), k) for k in keys)]
    return [*(o for o in own if not covered(override_key(o))), *mine], replaced


class Variant(_Section):
    """One variant of `featcal compare`: a name and `--set` style overrides of the params."""

    name: str = Field(..., description="variant name (MLflow child run, results folder)")
    set: list[str] = Field(
        default_factory=list,
        description="overrides KEY=VALUE of merge.*, repair.* and featcal.alpha/rho/lam/eps/"
        "precision/num_per_task/heads (e.g. merge.method=ties, repair.method=regmean; the shared "
        "calibration sets hold the largest num_per_task, a smaller one takes a seeded sample); "
        "merge.hyperparameters={scale: 0.3} replaces the mapping whole",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem is not None:
            raise _error(f"variant name {problem}")
        return name

    def sets(self, key: str) -> bool:
        """Whether one of this variant's own overrides sets `key` (whatever the value)."""
        return any(override_key(override) == key for override in self.set)

    @field_validator("set")
    @classmethod
    def _variant_keys(cls, overrides: list[str]) -> list[str]:
        for override in overrides:
            if not is_variant_key(override_key(override)):
                raise _error(
                    f"{override!r}: a variant may set only merge.*, repair.* and "
                    "featcal.alpha/rho/lam/eps/precision/num_per_task/heads (the download and "
                    "calibration sets are shared by all variants); put other settings in the "
                    "params file"
                )
        return overrides


class CompareSettings(_Section):
    """The variants `featcal compare` runs (merge × repair × hyperparameters), sharing one
    download and one set of calibration sets, each distinct merge run once."""

    variants: list[Variant] = Field(..., min_length=1, description="the variants, in order")

    @field_validator("variants")
    @classmethod
    def _unique(cls, variants: list[Variant]) -> list[Variant]:
        problem = unique_names(variants)
        if problem is not None:
            raise _error(problem)
        return variants


def unique_names(variants: list[Variant]) -> str | None:
    """The problem with the variants' names (one appears twice), or None."""
    seen: set[str] = set()
    for variant in variants:
        if variant.name in seen:
            return f"variant name {variant.name!r} appears twice; names must differ"
        seen.add(variant.name)
    return None
