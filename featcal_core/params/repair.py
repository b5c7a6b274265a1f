"""`repair:` (which repair runs on the merged model) and `compare:` (variants that `featcal
compare` runs side by side)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import Field, field_validator

from featcal_core.names import name_problem
from featcal_core.params.base import FiniteFloat, StrictInt, _error, _Section

#: RegMean's default α and Surgery's rank, steps and learning rate (featcal_core.repair's
#: defaults, kept equal by a test; params loading does not import the repair code)
REGMEAN_ALPHA = 0.6
SURGERY_RANK, SURGERY_STEPS, SURGERY_LR = 16, 1000, 1e-3
ADAMERGING_STEPS, ADAMERGING_LR, ADAMERGING_INIT = 500, 1e-3, 0.3

#: params a variant may change: what comes after the shared download and calibration sets
VARIANT_KEYS = ("merge.", "repair.", "featcal.alpha", "featcal.rho", "featcal.lam",
                "featcal.eps", "featcal.precision", "featcal.num_per_task",
                "featcal.heads")  # fmt: skip


#: repairs whose output is the merged checkpoint plus a module per task (no single checkpoint:
#: no `from_pretrained`, a module to apply per task at inference)
TASK_MODULE_REPAIRS = ("surgery",)


class RepairSettings(_Section):
    """What repairs the merged model. `featcal` (the featcal: section; `featcal.enabled: false`
    turns every repair off, as before), `regmean` (RegMean, Jin et al. 2023: each block Linear
    from the experts' input Grams on the same calibration sets), `surgery` (Representation
    Surgery, Yang et al. 2024: a small per-task module on the merged model's features, trained
    on the same unlabeled calibration inputs to match each expert's), `adamerging` (AdaMerging,
    Yang et al. 2024: one Task Arithmetic coefficient per task and tower tensor, learnt by
    minimising the entropy of each task's predictions on the same unlabeled calibration inputs;
    the merge: section's checkpoint is only the template of the tensors it does not learn) or
    `none` (evaluate the merge only). The repaired model is the pipeline's `calibrated` row (with
    surgery: the merged checkpoint under each task's module, kept in `calibrated/<task>/`)."""

    method: Literal["featcal", "regmean", "surgery", "adamerging", "none"] = Field(
        "featcal", description="featcal | regmean | surgery | adamerging | none"
    )
    regmean_alpha: FiniteFloat = Field(
        REGMEAN_ALPHA, ge=0.0, le=1.0,
        description="RegMean's scale of the Grams' off-diagonal entries (1: plain least squares)",
    )  # fmt: skip
    surgery_rank: StrictInt = Field(SURGERY_RANK, ge=1, description="Surgery module's rank r")
    surgery_steps: StrictInt = Field(
        SURGERY_STEPS, ge=1, description="Surgery's Adam steps per task"
    )
    surgery_lr: FiniteFloat = Field(SURGERY_LR, gt=0.0, description="Surgery's learning rate")
    adamerging_steps: StrictInt = Field(
        ADAMERGING_STEPS, ge=1, description="AdaMerging's Adam steps (all tasks per step)"
    )
    adamerging_lr: FiniteFloat = Field(
        ADAMERGING_LR, gt=0.0, description="AdaMerging's learning rate"
    )
    adamerging_init: FiniteFloat = Field(
        ADAMERGING_INIT, ge=0.0, le=1.0, description="AdaMerging's initial coefficients λ"
    )


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
