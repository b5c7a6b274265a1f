"""The run configuration (`params.yaml`): schema, loading, validation and command-line overrides.

    params = load_params("params.yaml", ["featcal.alpha=0.3", "tasks.mnist.calibration.split=train"])
    mlflow.log_params(flatten(params))
    key_material = params.calibration_settings()

Every bad input ends in one `FeatCalError` whose single line names the file, the dotted key path and
the fix. Loading is import-light: pydantic and PyYAML only, no torch.

Unknown keys are errors at every level (`extra="forbid"`). Relative paths (local models, local data,
`run.results_dir`) are relative to the working directory the pipeline runs in (the project root),
not to the params file.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from featcal_core.data.source import DataSource as CoreDataSource
from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import check_target
from featcal_core.method.hyperparameters import BOUNDS, DEFAULTS
from featcal_core.names import name_problem

_SOURCE_FIELDS = (
    "hub", "config", "path", "split", "image_column", "text_column", "label_column",
)  # fmt: skip

__all__ = [
    "DataSource",
    "EvaluationSettings",
    "FeatCalSettings",
    "MergeSettings",
    "ModelRef",
    "ModelsSpec",
    "Params",
    "RunSettings",
    "TaskSpec",
    "TrackingSettings",
    "dump",
    "flatten",
    "load_params",
]


# Hub ids: letters, digits, "-", "_", "."; starting with a letter or digit; at most 96 characters.
_HUB_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_MODEL_RE = re.compile(rf"^(?P<repo>{_HUB_PART}/{_HUB_PART})(?:@(?P<rev>[A-Za-z0-9._/-]+))?$")
_HUB_DATASET_RE = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")
_LOCAL_PREFIXES = ("/", "./", "../", "~")
_OPEN_CLIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # featcal_core.open_clip.importer
_MAX_FLAT_LIST_CHARS = 500  # longer lists are logged as a count and a digest (MLflow value limits)
_AT = "featcal_key_suffix"  # context key of our own errors: the key below the error's location


def _fail(message: str) -> typing.NoReturn:
    raise FeatCalError(" ".join(message.split("\n")))


def _error(message: str, at: str = "") -> PydanticCustomError:
    """A validation error; `at` is a dotted key below the validated object (e.g. 'dask_address')."""
    return PydanticCustomError("featcal", message, {_AT: at})


#: strict types: no bool-as-number, no float-as-int, no string-as-number; floats finite
StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def _yaml_number(value: Any) -> Any:
    """PyYAML (YAML 1.1) reads `1e-6` (no dot) as a string: take such strings as numbers."""
    if isinstance(value, str) and _NUMBER_RE.match(value.strip()):
        return float(value)
    return value


FiniteFloat = Annotated[float, BeforeValidator(_yaml_number), Strict(), Field(allow_inf_nan=False)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_default=True)


# --------------------------------------------------------------------------------------- models


class ModelRef(_Section):
    """A model: a Hugging Face Hub id `owner/name[@revision]` or a local `save_pretrained` directory.

    Written either as a plain string or as a mapping `{ref: ..., trust_remote_code: true}`.
    The string is local when it starts with "/", "./", "../" or "~", or when it names an existing
    directory (relative to the working directory); otherwise it must be a Hub id. Prefix a local
    path with "./" to make it local even before it exists (e.g. before `dvc pull`).

    `format: open_clip` marks an open_clip checkpoint (a Hub repository in open_clip's layout, a
    local directory, or, locally, the weight file itself), imported into a featcal checkpoint by
    the download step: `file` names the weight file (default `open_clip_model.safetensors`, else
    `open_clip_pytorch_model.bin`), `open_clip_config` a local open_clip_config.json (default: the
    one beside the weights, else, for experts, the base's), and `trust_pickle: true` allows
    unpickling a whole pickled module (only for files you trust: unpickling can run code).
    """

    ref: str = Field(description="Hub id `owner/name[@revision]` or a local directory")
    trust_remote_code: StrictBool = Field(
        False,
        description="allow the model's own code from the Hub (transformers trust_remote_code)",
    )
    format: Literal["hf", "open_clip"] = Field(
        "hf",
        description="hf: a transformers/featcal checkpoint directory; open_clip: an open_clip "
        "checkpoint, imported by the download step",
    )
    file: str | None = Field(
        None,
        description="open_clip only: the weight file in the repository or directory (default "
        "open_clip_model.safetensors, else open_clip_pytorch_model.bin)",
    )
    open_clip_config: str | None = Field(
        None,
        description="open_clip only: a local open_clip_config.json (default: the one beside the "
        "weights, else, for experts, the base's)",
    )
    trust_pickle: StrictBool = Field(
        False,
        description="open_clip only: allow unpickling a whole pickled module (runs code from the "
        "file; only for files you trust)",
    )
    _kind: Literal["hub", "local"] = PrivateAttr("hub")
    _repo_id: str | None = PrivateAttr(None)
    _revision: str | None = PrivateAttr(None)
    _path: Path | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"ref": value}
        return value

    @model_validator(mode="after")
    def _parse(self) -> ModelRef:
        ref = self.ref.strip()
        if not ref:
            raise _error("empty model reference; give a Hub id owner/name[@revision] or ./a/dir")
        self._check_format()
        path = Path(ref).expanduser()
        if (
            ref.startswith(_LOCAL_PREFIXES)
            or path.is_dir()
            or (self.format == "open_clip" and path.is_file())
        ):
            self._kind, self._path = "local", path
            if self.file is not None and path.suffix.lower() in _OPEN_CLIP_SUFFIXES:
                raise _error(
                    f"ref {ref!r} already names the weight file; remove file: or point ref at "
                    "the directory",
                    "file",
                )
            return self
        match = _HUB_MODEL_RE.match(ref)
        if not match or "--" in match["repo"] or ".." in match["repo"]:
            raise _error(
                f"{ref!r} is neither a local directory nor a Hub id owner/name[@revision]; "
                "start local paths with ./ or / (they need not exist yet)"
            )
        self._kind, self._repo_id, self._revision = "hub", match["repo"], match["rev"]
        return self

    def _check_format(self) -> None:
        if self.format != "open_clip":
            for key in ("file", "open_clip_config", "trust_pickle"):
                if getattr(self, key) not in (None, False):
                    raise _error(
                        f"{key} is only for open_clip checkpoints; add format: open_clip or "
                        f"remove {key}",
                        key,
                    )
            return
        if self.trust_remote_code:
            raise _error(
                "open_clip checkpoints run no model code from the Hub; remove trust_remote_code "
                "(trust_pickle: true is what allows pickled modules)",
                "trust_remote_code",
            )
        if self.file is not None:
            file = self.file.strip()
            parts = Path(file).parts
            if not file or Path(file).is_absolute() or ".." in parts or file.startswith("~"):
                raise _error(
                    f"file {self.file!r} must be a relative path inside the repository or "
                    "directory (e.g. open_clip_model.safetensors); put a local file in ref instead",
                    "file",
                )
            if Path(file).suffix.lower() not in _OPEN_CLIP_SUFFIXES:
                raise _error(
                    f"file {self.file!r} is not an open_clip weight file; give a "
                    f"{', '.join(_OPEN_CLIP_SUFFIXES)} file",
                    "file",
                )
        if self.open_clip_config is not None and not self.open_clip_config.strip():
            raise _error("empty open_clip_config; give the path of an open_clip_config.json",
                         "open_clip_config")  # fmt: skip

    @property
    def kind(self) -> Literal["hub", "local"]:
        """ "hub" or "local"."""
        return self._kind

    @property
    def repo_id(self) -> str | None:
        """`owner/name` for a Hub model, else None."""
        return self._repo_id

    @property
    def revision(self) -> str | None:
        """The `@revision` of a Hub model (branch, tag or commit), None for the default branch."""
        return self._revision

    @property
    def path(self) -> Path | None:
        """The directory of a local model ("~" expanded, relative paths kept relative), else None."""
        return self._path

    def options(self) -> dict[str, Any]:
        """The keys besides `ref` that differ from their defaults, as written in YAML."""
        defaults = {"trust_remote_code": False, "format": "hf", "file": None,
                    "open_clip_config": None, "trust_pickle": False}  # fmt: skip
        return {
            key: getattr(self, key)
            for key, default in defaults.items()
            if getattr(self, key) != default
        }

    def to_yaml(self) -> str | dict[str, Any]:
        """The plain string unless another key (trust_remote_code, format, ...) is set."""
        options = self.options()
        if options:
            return {"ref": self.ref, **options}
        return self.ref


class ModelsSpec(_Section):
    """The base model and one fine-tuned expert per task."""

    base: ModelRef = Field(description="the pre-trained model the experts were fine-tuned from")
    experts: dict[str, ModelRef] = Field(
        min_length=1, description="task name -> fine-tuned expert (at least one)"
    )
    hub_cache: str | None = Field(
        None,
        description="Hugging Face cache folder for Hub references (null: HF_HOME/HF_HUB_CACHE's); "
        "the offline zoo publishes its models into such a folder",
    )
    hub_offline: StrictBool = Field(
        False, description="resolve Hub references from the cache only (as HF_HUB_OFFLINE=1)"
    )

    @field_validator("experts")
    @classmethod
    def _task_names(cls, experts: dict[str, ModelRef]) -> dict[str, ModelRef]:
        _check_task_names(experts)
        return experts


# ---------------------------------------------------------------------------------------- tasks


class DataSource(_Section):
    """A dataset split: a Hub dataset (`hub:` + `split:`) or a local `save_to_disk` directory (`path:`)."""

    hub: str | None = Field(None, description="Hub dataset id, e.g. tanganke/mnist")
    config: str | None = Field(None, description="Hub dataset configuration name (hub only)")
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
            if self.split is None:
                raise _error("a Hub dataset needs a split: (e.g. split: train)", "split")
        elif self.config is not None:
            raise _error("config: is only for Hub datasets; remove it", "config")
        if self.path is not None and not self.path.strip():
            raise _error("empty path; give a save_to_disk directory", "path")
        return self

    def core(self) -> CoreDataSource:
        """The same source as featcal_core's plain DataSource."""
        return CoreDataSource(**{name: getattr(self, name) for name in _SOURCE_FIELDS})

    @property
    def kind(self) -> Literal["hub", "local"]:
        return self.core().kind

    def identity(self) -> tuple[Any, ...]:
        """What identifies the rows: (hub, config, split) or (normalised path, split)."""
        return self.core().identity()

    def describe(self) -> str:
        return self.core().describe()


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
    class_names: list[str] | None = Field(
        None, min_length=1, description="CLIP zero-shot class names (default: the label feature's)"
    )
    templates: list[Template] | None = Field(
        None, min_length=1, description='CLIP zero-shot prompts, each with "{}" for the class name'
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

    @model_validator(mode="after")
    def _held_out(self) -> TaskSpec:
        if self.calibration.identity() == self.evaluation.identity():
            raise _error(
                f"calibration and evaluation use the same data ({self.calibration.describe()}); "
                "calibration must come from train data (e.g. split: train) so evaluation stays held out",
                "calibration",
            )
        return self


# ------------------------------------------------------------------------------------- sections


class RunSettings(_Section):
    """Run identity and outputs."""

    name: str = Field("featcal", min_length=1, description="run name (MLflow run, results folder)")
    results_dir: str = Field("data/results", min_length=1, description="where results are written")
    seed: StrictInt = Field(
        0, ge=0, description="seed of the calibration sample and other randomness"
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem is not None:
            raise _error(f"run name {problem} (reports/<name>/)")
        return name

    @field_validator("results_dir")
    @classmethod
    def _safe_results_dir(cls, results_dir: str) -> str:
        try:
            check_target(results_dir, flag="run.results_dir")
        except FeatCalError as exc:
            raise _error(str(exc)) from None
        return results_dir


class MergeSettings(_Section):
    """How the experts are merged before calibration (methods: featcal_core.merging)."""

    method: str = Field("task_arithmetic", description="merging method (featcal_core.merging)")
    hyperparameters: dict[str, FiniteFloat] = Field(
        default_factory=dict,
        description="method hyperparameters, e.g. scale (task_arithmetic, ties), top_k (ties); "
        "when omitted: {scale: 0.3} for task_arithmetic, else {} (the method's own defaults)",
    )

    @model_validator(mode="after")
    def _default_hyperparameters(self) -> MergeSettings:
        # {scale: 0.3} suits task arithmetic only: average takes no hyperparameters, and TIES has
        # its own default scale, so other methods start from featcal_core.merging's defaults.
        if "hyperparameters" not in self.model_fields_set and self.method == "task_arithmetic":
            self.hyperparameters = {"scale": 0.3}
        from featcal_core.merging import get  # the registry: its methods check their own values

        try:
            get(self.method).check(dict(self.hyperparameters))
        except FeatCalError as exc:
            at = "method" if "unknown merge method" in str(exc) else "hyperparameters"
            raise _error(str(exc), at) from None
        return self


#: the featcal fields that determine the calibrated model (in every block's cache key)
_CALIBRATION_FIELDS = ("alpha", "rho", "lam", "eps", "num_per_task", "max_length", "pooling",
                       "token_weighting")  # fmt: skip


def _method_field(name: str, description: str) -> Any:
    """A FeatCal hyperparameter's field: default and bounds from featcal_core.method.hyperparameters."""
    low, high = BOUNDS[name]
    where = f"[{low:g}, {high:g}]" if high is not None else f"≥ {low:g}"
    return Field(DEFAULTS[name], ge=low, le=high, description=f"{description}, in {where}")


class FeatCalSettings(_Section):
    """FeatCal hyperparameters and how the calibration runs (see featcal_core.method.block.FeatCalParams)."""

    enabled: StrictBool = Field(
        True, description="calibrate the merged model (false: evaluate merge only)"
    )
    alpha: FiniteFloat = _method_field("alpha", "teacher interpolation α")
    rho: FiniteFloat = _method_field("rho", "anchor blend ρ (ρ > 1 extrapolates past the merge)")
    lam: FiniteFloat = _method_field("lam", "ridge weight λ")
    eps: FiniteFloat = _method_field("eps", "jitter ε")
    num_per_task: StrictInt = Field(
        256, ge=1, description="calibration inputs per task (seeded sample)"
    )
    batch_size: StrictInt = Field(16, ge=1, description="calibration batch size")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="where calibration runs")
    max_length: StrictInt = Field(128, ge=1, description="token limit for text models")
    pooling: Literal["cls", "mean"] | None = Field(
        None, description="output pooling; null: the architecture's default"
    )
    token_weighting: Literal["all", "answer"] = Field(
        "all",
        description="causal LMs: weigh every real token (all) or only the positions predicting "
        "the calibration set's `target` tokens (answer)",
    )
    heads: StrictBool = Field(
        False,
        description="also refit each task's classification head on the calibration inputs "
        "(head calibration, beyond the paper; for experts with their own linear heads)",
    )
    head_lam: FiniteFloat = Field(0.05, ge=0.0, description="ridge weight λ of head calibration")
    runner: Literal["local", "dask"] = Field("local", description="Prefect task runner")
    dask_address: str | None = Field(
        None, description="scheduler address for runner dask; null: a local Dask cluster"
    )
    dask_workers: StrictInt = Field(2, ge=1, description="workers of the local Dask cluster")

    @model_validator(mode="after")
    def _dask_only(self) -> FeatCalSettings:
        if self.dask_address is not None and self.runner != "dask":
            raise _error(
                f"dask_address is only used with runner: dask (runner is {self.runner!r}); "
                "set runner: dask or remove dask_address",
                "dask_address",
            )
        return self

    def core_params(self):
        """The hyperparameters as `featcal_core.FeatCalParams` (imports torch)."""
        from featcal_core.method.block import FeatCalParams

        return FeatCalParams(alpha=self.alpha, rho=self.rho, lam=self.lam, eps=self.eps)


class EvaluationSettings(_Section):
    """Evaluation of the base, experts, merged and calibrated models."""

    enabled: StrictBool = Field(True, description="evaluate the models")
    batch_size: StrictInt = Field(64, ge=1, description="evaluation batch size")
    max_examples_per_task: StrictInt | None = Field(
        None, ge=1, description="evaluate on the first N examples per task; null: all"
    )


class TrackingSettings(_Section):
    """MLflow tracking."""

    enabled: StrictBool = Field(True, description="log params, metrics and artifacts to MLflow")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; null: the local sqlite store inside the project"
    )
    experiment: str = Field("featcal", min_length=1, description="MLflow experiment name")


ZOO_PRESETS = ("vision", "text")


class ZooSettings(_Section):
    """The offline model zoo (featcal_core.zoo): build or reuse it, then take models and tasks
    from it. With `zoo:` set, `models:` and `tasks:` are left out of the params file."""

    preset: Literal["vision", "text"] = Field("vision", description="which zoo to build")
    dir: str | None = Field(None, description="where the zoo lives; null: data/zoo/<preset>")
    seed: StrictInt = Field(0, ge=0, description="seed of the zoo's data splits and training")
    evaluation_split: Literal["test", "validation"] = Field(
        "test",
        description="split the evaluate step scores (validation: for choosing hyperparameters)",
    )
    datasets: dict[str, str] | None = Field(
        None,
        description="your own tasks instead of the preset's: task -> save_to_disk DatasetDict "
        "(train/test splits, image or text + label); the preset gives modality and training",
    )
    name: str | None = Field(None, description="zoo name (Hub ids featcal-zoo/<name>-...)")
    base: str | None = Field(None, description="model to fine-tune from; null: preset default")
    pretrain_steps: StrictInt | None = Field(
        None, ge=1, description="vision base pretraining steps"
    )
    expert_steps: StrictInt | None = Field(None, ge=1, description="fine-tuning steps per expert")

    @field_validator("datasets")
    @classmethod
    def _dataset_names(cls, datasets: dict[str, str] | None) -> dict[str, str] | None:
        if datasets is not None:
            _check_task_names(datasets)
        return datasets

    @field_validator("name")
    @classmethod
    def _zoo_name(cls, name: str | None) -> str | None:
        problem = None if name is None else name_problem(name)
        if problem is not None:
            raise _error(f"zoo name {problem}")
        return name

    @property
    def path(self) -> Path:
        return Path(self.dir or f"data/zoo/{self.name or self.preset}").expanduser()

    def spec(self):
        """The featcal_core.zoo.build.ZooSpec these settings describe."""
        import dataclasses

        from featcal_core.zoo.build import PRESETS

        spec = PRESETS[self.preset].with_seed(self.seed)
        changes: dict[str, Any] = {"name": self.name or spec.name}
        if self.datasets is not None:
            changes.update(tasks=dict(self.datasets), optional=(), max_train=None)
        for key in ("base", "pretrain_steps", "expert_steps"):
            if getattr(self, key) is not None:
                changes[key] = getattr(self, key)
        return dataclasses.replace(spec, **changes)


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
    evaluation: EvaluationSettings = Field(
        default_factory=EvaluationSettings, description="evaluation"
    )
    tracking: TrackingSettings = Field(default_factory=TrackingSettings, description="MLflow")

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
        return self

    def with_zoo(self, manifest: Mapping[str, Any]) -> Params:
        """These params with `models:` and `tasks:` taken from a built zoo's manifest."""
        from featcal_core.zoo.build import zoo_models_and_tasks

        if self.zoo is None:
            return self
        models, tasks = zoo_models_and_tasks(manifest, self.zoo.path, self.zoo.evaluation_split)
        data = self.model_dump(mode="json", exclude={"zoo", "models", "tasks"})
        resolved = Params.model_validate({**data, "models": models, "tasks": tasks})
        resolved._zoo = self.zoo
        return resolved

    _zoo: ZooSettings | None = PrivateAttr(None)

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


def _check_task_names(mapping: Mapping[str, Any]) -> None:
    for task in mapping:
        problem = name_problem(task)
        if problem is not None:
            raise _error(f"task name {problem}", task)


# -------------------------------------------------------------------------- command-line flags


def featcal_from_flags(values: Mapping[str, Any]) -> FeatCalSettings:
    """`featcal calibrate`'s flags checked by the model params.yaml's `featcal:` goes through
    (same bounds, same strict types); `values` maps field names (alpha, num_per_task, ...) to the
    parsed flag values. A problem is one FeatCalError naming the flag (e.g. --num-per-task)."""
    try:
        return FeatCalSettings.model_validate(dict(values))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        key = str(first["loc"][0]) if first["loc"] else ""
        flag = "--" + key.replace("_", "-") if key else "(flags)"
        value = f" {_short(first.get('input'))}" if key else ""
        _fail(f"{flag}{value}: {first['msg']} (the bound of featcal.{key} in params.yaml)")


# ------------------------------------------------------------------------------- loading, errors


def load_params(path: str | Path, overrides: Iterable[str] = ()) -> Params:
    """Read, override and validate a params file; any problem is one FeatCalError line."""
    path = Path(path)
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        _fail(f"{name}: file not found; create it (see flows/params_example.yaml) or pass its path")
    except IsADirectoryError:
        _fail(f"{name}: is a directory, not a params file; pass the YAML file")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"{name}: cannot be read ({exc})")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        _fail(f"{name}: not valid YAML ({_yaml_problem(exc)}); fix the syntax")
    if data is None:
        _fail(f"{name}: is empty; expected a mapping with models:, tasks: and other sections")
    if not isinstance(data, dict):
        _fail(
            f"{name}: expected a mapping of sections (models:, tasks:, ...) at the top level, "
            f"got a {type(data).__name__}"
        )
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    for override in overrides:
        _apply_override(data, override, name)
    try:
        return Params.model_validate(data)
    except ValidationError as exc:
        _fail(_format_validation_error(exc, name, overrides))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem


def _format_validation_error(exc: ValidationError, name: str, overrides: list[str]) -> str:
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    ctx = first.get("ctx") or {}
    kind = first["type"]
    if kind == "featcal":
        at = ctx.get(_AT) or ""
        loc = loc + tuple(at.split(".")) if at else loc
        message = first["msg"]
    elif kind == "extra_forbidden":
        allowed = _known_keys(loc[:-1])
        message = "unknown key" + (f"; known keys: {', '.join(allowed)}" if allowed else "")
    elif kind == "missing":
        message = "missing; this key is required"
    else:
        message = f"{first['msg']} (got {_short(first.get('input'))})"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = _key_path(loc)
    for override in reversed(overrides):  # the last override of a key wins, so name that one
        key = override.partition("=")[0].strip()
        if where and (_under(where, key) or _under(key, where)):
            more += f" (set by override {override!r})"
            break
    return f"{name}: {where or '(top level)'}: {message}{more}"


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "[")


def _key_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------- schema navigation


def _candidates(annotation: Any) -> list[Any]:
    """The non-None alternatives of an annotation (unwrapping Annotated, Optional and unions)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _candidates(typing.get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [c for arg in typing.get_args(annotation) for c in _candidates(arg)]
    if annotation is type(None):
        return []
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _child(annotation: Any, key: str) -> list[Any]:
    """The annotations found under `key` of a value of type `annotation` (empty: no such key)."""
    found = []
    for candidate in _candidates(annotation):
        if _is_model(candidate) and key in candidate.model_fields:
            found.append(candidate.model_fields[key].annotation)
        elif typing.get_origin(candidate) is dict:
            found.append(typing.get_args(candidate)[1])
    return found


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    annotations: list[Any] = [Params]
    for part in loc:
        if isinstance(part, int):
            annotations = [
                a for ann in annotations for c in _candidates(ann) for a in typing.get_args(c)[:1]
            ]
        else:
            annotations = [a for ann in annotations for a in _child(ann, part)]
    keys = [
        key
        for ann in annotations
        for c in _candidates(ann)
        if _is_model(c)
        for key in c.model_fields
    ]
    return sorted(set(keys))


# ------------------------------------------------------------------------------------ overrides


def _apply_override(data: dict[str, Any], override: str, name: str) -> None:
    """Set `key.path=value` in the raw mapping; the value is parsed as YAML."""
    key, sep, text = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not part for part in parts):
        _fail(f"override {override!r}: expected KEY.PATH=VALUE, e.g. featcal.alpha=0.3")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        _fail(f"override {override!r}: value is not valid YAML ({_yaml_problem(exc)})")

    annotations: list[Any] = [Params]
    node: dict[str, Any] = data
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth]) or "the top level"
        children = [a for ann in annotations for a in _child(ann, part)]
        if not children and depth and not _known_keys(tuple(parts[:depth])):
            _fail(f"override {override!r}: {here} takes a value, not keys; set {here}=VALUE")
        if not children:
            known = _known_keys(tuple(parts[:depth]))
            hint = f"; known keys of {here}: {', '.join(known)}" if known else ""
            _fail(f"override {override!r}: {key} is not a key of the params schema{hint}")
        if depth == len(parts) - 1:
            node[part] = _leaf_value(children, value, text.strip())
            return
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif isinstance(child, str) and any(
            c is ModelRef for ann in children for c in _candidates(ann)
        ):
            child = node[part] = {"ref": child}  # a model written as a string gains a key
        elif not isinstance(child, dict):
            _fail(
                f"override {override!r}: {'.'.join(parts[: depth + 1])} in {name} is "
                f"{_short(child)}, not a mapping; set it whole instead"
            )
        node, annotations = child, children


def _leaf_value(annotations: list[Any], value: Any, text: str) -> Any:
    """Keep the raw text where the key takes strings only and YAML read something else (`1`, `yes`)."""
    if value is None or isinstance(value, str):
        return value
    leaves = [c for ann in annotations for c in _candidates(ann)]
    if leaves and all(c is str for c in leaves):
        return text
    return value


# ------------------------------------------------------------------------------- flatten, dump


def _plain(value: Any) -> Any:
    """A JSON-like tree of the params, models written as in YAML."""
    if isinstance(value, ModelRef):
        return value.to_yaml()
    if isinstance(value, DataSource):  # only the keys that are set: hub/config or path
        return {
            key: item for key, item in value.model_dump(mode="json").items() if item is not None
        }
    if isinstance(value, BaseModel):
        return {field: _plain(getattr(value, field)) for field in type(value).model_fields}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def dump(params: Params) -> str:
    """The full configuration (defaults filled in) as YAML; `load_params` reads it back unchanged."""
    return yaml.safe_dump(_plain(params), sort_keys=False, allow_unicode=True, width=100)


def flatten(params: Params) -> dict[str, str | int | float | bool]:
    """Dotted keys and scalar values for MLflow params, e.g. {"featcal.alpha": 0.25}.

    Models give `<key>` (the reference) and `<key>.trust_remote_code` (open_clip ones also
    `<key>.format`, `.file`, `.open_clip_config`, `.trust_pickle`); None is "null"; lists are
    JSON text (long ones: a count and a sha256 prefix); an empty mapping is "{}".
    """
    out: dict[str, str | int | float | bool] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, ModelRef):
            out[prefix] = value.ref
            out[f"{prefix}.trust_remote_code"] = value.trust_remote_code
            if value.format != "hf":  # open_clip options (hf references log as before)
                for key in ("format", "file", "open_clip_config", "trust_pickle"):
                    item = getattr(value, key)
                    out[f"{prefix}.{key}"] = "null" if item is None else item
        elif isinstance(value, BaseModel):
            for field in type(value).model_fields:
                visit(f"{prefix}.{field}" if prefix else field, getattr(value, field))
        elif isinstance(value, dict):
            if not value:
                out[prefix] = "{}"
            for key, item in value.items():
                visit(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            text = json.dumps(_plain(value), ensure_ascii=False)
            if len(text) > _MAX_FLAT_LIST_CHARS:
                digest = hashlib.sha256(text.encode()).hexdigest()[:12]
                text = f"<{len(value)} items, sha256 {digest}>"
            out[prefix] = text
        elif value is None:
            out[prefix] = "null"
        elif isinstance(value, (str, int, float, bool)):
            out[prefix] = value
        else:
            out[prefix] = str(value)

    visit("", params)
    return out
