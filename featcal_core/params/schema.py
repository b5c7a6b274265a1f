"""`Params`: the whole params.yaml document, and what determines the calibrated model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from featcal_core.params.base import _check_task_names, _error, _Section
from featcal_core.params.models import ModelRef, ModelsSpec
from featcal_core.params.overrides import apply_overrides
from featcal_core.params.repair import CompareSettings, RepairSettings
from featcal_core.params.sections import (
    _CALIBRATION_FIELDS,
    EvaluationSettings,
    FeatCalSettings,
    MergeSettings,
    RunSettings,
    TrackingSettings,
    ZooSettings,
)
from featcal_core.params.selection import SelectSettings
from featcal_core.params.tasks import TaskSpec


class Params(_Section):
    """The whole run configuration (`params.yaml`)."""

    run: RunSettings = Field(default_factory=RunSettings, description="run identity and outputs")
    zoo: ZooSettings | None = Field(
        None, description="take models and tasks from the offline zoo (instead of models/tasks)"
    )
    models: ModelsSpec | None = Field(None, description="base model and task experts")
    tasks: dict[str, TaskSpec] | None = Field(
        None, description="task name -> data sources (one per expert)"
    )
    merge: MergeSettings = Field(default_factory=MergeSettings, description="merging")
    featcal: FeatCalSettings = Field(default_factory=FeatCalSettings, description="calibration")
    repair: RepairSettings = Field(
        default_factory=RepairSettings, description="which repair runs on the merged model"
    )
    evaluation: EvaluationSettings = Field(
        default_factory=EvaluationSettings, description="evaluation"
    )
    tracking: TrackingSettings = Field(default_factory=TrackingSettings, description="MLflow")
    compare: CompareSettings | None = Field(
        None, description="variants for `featcal compare` (null: none)"
    )
    select: SelectSettings | None = Field(
        None, description="candidates `featcal run` chooses among before merging (null: none)"
    )

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: dict[str, TaskSpec] | None) -> dict[str, TaskSpec] | None:
        if tasks is not None:
            _check_task_names(tasks)
        return tasks

    @model_validator(mode="after")
    def _experts_match_tasks(self) -> Params:
        if self.zoo is not None:
            if self.models is not None or self.tasks is not None:
                raise _error(
                    "give either zoo: (models and tasks come from the zoo) or models: and tasks:, "
                    "not both; remove one",
                    "models" if self.models is not None else "tasks",
                )
            return self
        for key in ("models", "tasks"):
            if getattr(self, key) is None:
                raise _error("missing; this key is required (or set zoo:)", key)
        assert self.models is not None and self.tasks is not None  # the loop above checks them
        for task in self.models.experts:
            if task not in self.tasks:
                raise _error(
                    f"expert task {task!r} (models.experts.{task}) has no entry here; "
                    f"add tasks.{task} with calibration: and evaluation: sources",
                    "tasks",
                )
        for task in self.tasks:
            if task not in self.models.experts:
                raise _error(
                    f"task {task!r} has no expert; add models.experts.{task} or remove tasks.{task}",
                    f"tasks.{task}",
                )
        if self.select is not None and self.select.score == "validation":
            for task, spec in self.tasks.items():
                if spec.validation is None:
                    raise _error(
                        "select.score validation needs labelled validation data for every task; "
                        f"add tasks.{task}.validation (a split carved from train) or use "
                        "select.score agreement (label-free)",
                        f"tasks.{task}.validation",
                    )
        return self

    def with_zoo(self, manifest: Mapping[str, Any]) -> Params:
        """These params with `models:` and `tasks:` taken from a built zoo's manifest."""
        from featcal_core.zoo.build import zoo_models_and_tasks

        if self.zoo is None:
            return self
        models, tasks = zoo_models_and_tasks(manifest, self.zoo.path, self.zoo.evaluation_split)
        for spec in tasks.values():  # the zoo's validation split, unless that is the evaluation
            if self.zoo.evaluation_split != "validation":
                spec["validation"] = {**spec["evaluation"], "split": "validation"}
        data = self.model_dump(mode="json", exclude={"zoo", "models", "tasks"})
        resolved = Params.model_validate({**data, "models": models, "tasks": tasks})
        resolved._zoo, resolved._user_set = self.zoo, self._user_set
        return resolved

    _zoo: ZooSettings | None = PrivateAttr(None)
    #: the `--set` overrides these params were loaded with, in order (see `user_set`)
    _user_set: tuple[str, ...] = PrivateAttr(())

    @property
    def user_set(self) -> tuple[str, ...]:
        """The user's `--set` overrides, in order: they win over every `select:` candidate's and
        `compare:` variant's own overrides (featcal_core.params.repair.layered)."""
        return self._user_set

    def __eq__(self, other: object) -> bool:
        """Equal settings (fields and the zoo they came from); how they were given, in the file
        or with `--set` (`user_set`), does not count."""
        if not isinstance(other, Params):
            return NotImplemented
        return self.__dict__ == other.__dict__ and self._zoo == other._zoo

    def with_overrides(self, overrides: list[str]) -> Params:
        """These params with `--set`-style overrides applied (a chosen candidate's), validated."""
        resolved = apply_overrides(self, overrides)
        resolved._zoo, resolved._user_set = self._zoo, self._user_set
        return resolved

    @property
    def repair_method(self) -> str:
        """The repair that runs: `repair.method`, or "none" when featcal.enabled is false."""
        return self.repair.method if self.featcal.enabled else "none"

    @property
    def zoo_settings(self) -> ZooSettings | None:
        """The zoo these params use (also after `with_zoo` filled in models and tasks)."""
        return self.zoo or self._zoo

    def calibration_settings(self) -> dict[str, Any]:
        """Everything that determines the calibrated model, as plain JSON data (for cache keys).

        Included: `seed` (the calibration sample), the model references (with revisions; an
        open_clip reference as a mapping with its format, file and config), the merge method and
        hyperparameters, each task's calibration source with its input columns, and FeatCal's
        alpha, rho, lam, eps, num_per_task, max_length, pooling and token_weighting.
        Left out, since they change only speed or where things run: featcal.device, batch_size,
        runner, dask_address, dask_workers, enabled, trust_remote_code and trust_pickle; also all
        of run (except seed), evaluation, tracking, the evaluation sources, class names,
        templates, label words, prompts and label columns.
        Local model or data directories enter by path only: their contents are not hashed here.
        """
        featcal = self.featcal.model_dump(include=set(_CALIBRATION_FIELDS))
        # set, or filled in from the zoo by with_zoo before any cache key is taken
        assert self.models is not None and self.tasks is not None
        return {
            "seed": self.run.seed,
            "models": {
                "base": _model_key(self.models.base),
                "experts": {
                    task: _model_key(ref) for task, ref in sorted(self.models.experts.items())
                },
            },
            "merge": self.merge.model_dump(mode="json"),
            "calibration_data": {
                task: spec.calibration.model_dump(
                    mode="json",
                    include={"hub", "config", "path", "split", "image_column", "text_column"},
                )
                for task, spec in sorted(self.tasks.items())
            },
            "featcal": dict(sorted(featcal.items())),
        }


def _model_key(ref: ModelRef) -> str | dict[str, Any]:
    """A model's part of the calibration settings: the reference, plus what selects the weights
    of an open_clip checkpoint (format, file, config)."""
    if ref.format == "hf":
        return ref.ref
    options = ref.options()
    options.pop("trust_pickle", None)  # allows loading; does not change the weights
    return {"ref": ref.ref, **options}
