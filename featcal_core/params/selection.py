"""`select:` the choice of settings among candidates (merge × repair × hyperparameters), made
before the run by scoring each candidate on inputs that neither calibration nor evaluation sees.

Label-free (`score: agreement` or `drift`): part of each task's *unlabeled* calibration source,
disjoint from its calibration set (`holdout_per_task` rows), is held out; each candidate's
repaired model is scored there against the task's expert: the fraction of inputs where the
model's prediction (under the task's head) equals the expert's own (`agreement`, higher wins), or
the relative squared distance between the features the head reads (`drift`, lower wins), or the
KL divergence of its class probabilities from the expert's (`kl`, lower wins). With
labelled validation data (`score: validation`: each task's `validation:` source; the zoo's
validation split), the candidates' mean validation accuracy decides instead.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from featcal_core.params.base import StrictBool, StrictInt, _error, _Section
from featcal_core.params.repair import Variant, unique_names

#: held-out inputs per task (benchmarks/selection_holdout.py: 128 ranked the zoos' variants at
#: least as well as 32, at little cost for classification towers)
HOLDOUT_PER_TASK = 128


class SelectSettings(_Section):
    """The candidates `featcal run` chooses among before it merges, and how it scores them."""

    score: Literal["agreement", "drift", "kl", "validation"] = Field(
        "agreement", description="agreement | drift | kl (label-free) | validation (labelled)"
    )
    holdout_per_task: StrictInt = Field(
        HOLDOUT_PER_TASK,
        ge=1,
        description="unlabeled inputs per task held out of calibration for scoring",
    )
    candidates: list[Variant] = Field(
        ..., min_length=2, description="the candidates (as compare: variants), in order"
    )
    allow_task_modules: StrictBool = Field(
        False,
        description="let a candidate whose repair adds a module per task (surgery) win; by "
        "default such candidates are scored and shown but the winner is one checkpoint",
    )

    @field_validator("candidates")
    @classmethod
    def _unique(cls, candidates: list[Variant]) -> list[Variant]:
        problem = unique_names(candidates)
        if problem is not None:
            raise _error(problem)
        for candidate in candidates:
            if candidate.sets("featcal.heads"):
                raise _error(
                    f"candidate {candidate.name!r}: a candidate may not set featcal.heads (each "
                    "candidate is scored under the tasks' own heads, so refit heads cannot change "
                    "the choice); set featcal.heads in the params file: the winner then refits them"
                )
            if candidate.sets("featcal.num_per_task"):
                raise _error(
                    f"candidate {candidate.name!r}: a candidate may not change "
                    "featcal.num_per_task (the calibration sets are drawn before the choice and "
                    "the winner runs on them); set it in the params file's featcal: section, or "
                    "compare the counts with `featcal compare`"
                )
        return candidates
