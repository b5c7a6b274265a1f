"""`tasks:` — each task's calibration and evaluation data, zero-shot names and prompts."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    Field,
    field_validator,
    model_validator,
)

from featcal_core.data.source import DataSource as CoreDataSource
from featcal_core.params.base import _HUB_DATASET_RE, _SOURCE_FIELDS, _error, _Section


class DataSource(_Section):
    """A dataset split: a Hub dataset (`hub:` + `split:`) or a local `save_to_disk` directory (`path:`)."""

    hub: str | None = Field(None, description="Hub dataset id, e.g. tanganke/mnist")
    config: str | None = Field(None, description="Hub dataset configuration name (hub only)")
    revision: str | None = Field(
        None,
        min_length=1,
        description="Hub dataset revision: a branch, tag or commit (hub only; default: main)",
    )
    path: str | None = Field(None, description="local datasets save_to_disk directory")
    split: str | None = Field(
        None, description="split to use; required for hub, optional for a local DatasetDict"
    )
    image_column: str | None = Field(None, description="column with the images (default: image)")
    text_column: str | None = Field(None, description="column with the texts (default: text)")
    label_column: str | None = Field(None, description="column with the labels (default: label)")

    @model_validator(mode="after")
    def _one_kind(self) -> DataSource:
        if (self.hub is None) == (self.path is None):
            raise _error(
                "give exactly one of hub: (a Hub dataset id) or path: (a save_to_disk directory)"
            )
        if self.hub is not None:
            if not _HUB_DATASET_RE.match(self.hub) or ".." in self.hub or "--" in self.hub:
                raise _error(f"{self.hub!r} is not a Hub dataset id (owner/name)", "hub")
            if "/" not in self.hub:
                raise _error(_legacy_id(self.hub), "hub")
            if self.split is None:
                raise _error("a Hub dataset needs a split: (e.g. split: train)", "split")
        elif self.config is not None:
            raise _error("config: is only for Hub datasets; remove it", "config")
        elif self.revision is not None:
            raise _error("revision: is only for Hub datasets; remove it", "revision")
        if self.path is not None and not self.path.strip():
            raise _error("empty path; give a save_to_disk directory", "path")
        return self

    def core(self) -> CoreDataSource:
        """The same source as featcal_core's plain DataSource."""
        return CoreDataSource(**{name: getattr(self, name) for name in _SOURCE_FIELDS})

    @property
    def kind(self) -> str:
        return self.core().kind

    def identity(self) -> tuple[Any, ...]:
        """What identifies the rows: (hub, config, split) or (normalised path, split)."""
        return self.core().identity()

    def describe(self) -> str:
        return self.core().describe()


#: legacy one-word Hub dataset ids and the namespaced repositories they moved to
LEGACY_DATASET_IDS = {
    "mnist": "ylecun/mnist",
    "svhn": "ufldl-stanford/svhn",
    "cifar10": "uoft-cs/cifar10",
    "cifar100": "uoft-cs/cifar100",
    "fashion_mnist": "zalando-datasets/fashion_mnist",
    "imdb": "stanfordnlp/imdb",
    "glue": "nyu-mll/glue",
}


def _legacy_id(hub: str) -> str:
    """Why a one-word dataset id is refused, and the id to use instead."""
    moved = LEGACY_DATASET_IDS.get(hub.lower())
    fix = f"use {moved!r}" if moved else "use the dataset's namespaced id (owner/name)"
    return (
        f"{hub!r} is a legacy one-word Hub dataset id, which current huggingface_hub releases "
        f"refuse (after the datasets before it have downloaded); {fix}"
    )


def _check_template(template: str) -> str:
    if "{}" not in template:
        raise _error(f"template {template!r} has no {{}} where the class name goes")
    try:
        template.format("x")
    except (IndexError, KeyError, ValueError) as exc:
        raise _error(
            f"template {template!r} must format with one class name (one {{}}; "
            f"double other braces): {exc}"
        ) from None
    return template


Template = Annotated[str, AfterValidator(_check_template)]


def _check_prompt(prompt: str) -> str:
    try:
        filled = prompt.format(text="\0")
    except (IndexError, KeyError, ValueError) as exc:
        raise _error(
            f"prompt {prompt!r} must format with {{text}} only (double other braces): {exc}"
        ) from None
    if "\0" not in filled:
        raise _error(f"prompt {prompt!r} has no {{text}} where the input goes")
    return prompt


Prompt = Annotated[str, AfterValidator(_check_prompt)]


class TaskSpec(_Section):
    """One task: where its calibration and evaluation data come from, and its zero-shot head."""

    calibration: DataSource = Field(description="unlabeled inputs for FeatCal (from train data)")
    evaluation: DataSource = Field(description="held-out labelled data for evaluation")
    validation: DataSource | None = Field(
        None, description="labelled data for `select: {score: validation}` (never the evaluation's)"
    )
    class_names: list[str] | None = Field(
        None, min_length=1, description="CLIP zero-shot class names (default: the label feature's)"
    )
    templates: list[Template] | None = Field(
        None, min_length=1, description='CLIP zero-shot prompts, each with "{}" for the class name'
    )
    prompt_set: str | None = Field(
        None,
        description="CLIP zero-shot: a named set of templates and class-name rules "
        "(featcal_core/evaluation/prompt_sets.yaml: sun397, stanford-cars, resisc45, eurosat, "
        "svhn, gtsrb, mnist, dtd); the task's own templates and class_names win",
    )
    label_words: list[str] | None = Field(
        None,
        min_length=2,
        description="causal LMs: the continuation scored for each class, in label order "
        "(default: the label feature's names)",
    )
    prompt: Prompt | None = Field(
        None,
        description='causal LMs: the prompt, with "{text}" for the input (default "{text} ->")',
    )

    @field_validator("prompt_set")
    @classmethod
    def _known_set(cls, name: str | None) -> str | None:
        from featcal_core.evaluation.prompt_sets import available

        if name is not None and name not in available():
            raise _error(f"no prompt set {name!r}; use one of {', '.join(available())}")
        return name

    @property
    def zero_shot(self) -> bool:
        """True when the task is evaluated with a CLIP zero-shot head (it names class names,
        templates or a prompt set)."""
        return any(v is not None for v in (self.class_names, self.templates, self.prompt_set))

    @model_validator(mode="after")
    def _held_out(self) -> TaskSpec:
        if self.calibration.identity() == self.evaluation.identity():
            raise _error(
                f"calibration and evaluation use the same data ({self.calibration.describe()}); "
                "calibration must come from train data (e.g. split: train) so evaluation stays held out",
                "calibration",
            )
        if self.validation is not None and self.validation.identity() == self.evaluation.identity():
            raise _error(
                f"validation and evaluation use the same data ({self.evaluation.describe()}); "
                "choosing settings on the evaluation data would report a tuned-on-test number; "
                "give a validation split carved from train",
                "validation",
            )
        return self
