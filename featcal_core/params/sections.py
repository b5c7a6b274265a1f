"""`run:`, `merge:`, `featcal:`, `evaluation:`, `tracking:` and `zoo:`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    Field,
    StrictStr,
    field_validator,
    model_validator,
)

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import check_target
from featcal_core.io.shard_size import DEFAULT_MAX_SHARD_SIZE, shard_size_problem
from featcal_core.method.hyperparameters import BOUNDS, DEFAULTS, FeatCalParams
from featcal_core.method.settings import RUN_SETTINGS, SETTING_DEFAULTS, Settings
from featcal_core.names import name_problem
from featcal_core.params.base import (
    FiniteFloat,
    StrictBool,
    StrictInt,
    _check_task_names,
    _error,
    _Section,
)


# Params builds the run, merge, featcal, evaluation and tracking sections with `default_factory`,
# so their defaults are `default=` keywords (type checkers take a positional default for none).
class RunSettings(_Section):
    """Run identity and outputs."""

    name: str = Field(
        default="featcal", min_length=1, description="run name (MLflow run, results folder)"
    )
    results_dir: str = Field(
        default="data/results", min_length=1, description="where results are written"
    )
    seed: StrictInt = Field(
        default=0, ge=0, description="seed of the calibration sample and other randomness"
    )
    max_shard_size: StrictStr = Field(
        default=DEFAULT_MAX_SHARD_SIZE,
        description="largest weight file (bytes of tensors) of the merged and calibrated "
        "models, as transformers writes sizes (500MB, 5GB, 2GiB; a number: bytes): a model above "
        "it is written as model-00001-of-0000N.safetensors shards with "
        "model.safetensors.index.json, and an input whose files all fit keeps its own; the "
        "default is transformers 5's save_pretrained default",
    )

    @field_validator("max_shard_size", mode="before")
    @classmethod
    def _shard_size(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # a number of bytes
        problem = shard_size_problem(value)
        if problem is not None:
            raise _error(f"{problem}, e.g. 5GB, 500MB or 2GiB")
        return value

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

    method: str = Field(
        default="task_arithmetic", description="merging method (featcal_core.merging)"
    )
    hyperparameters: dict[str, FiniteFloat | StrictStr] = Field(
        default_factory=dict,
        description="method hyperparameters (numbers, or words such as trim: global for ties), "
        "e.g. scale (task_arithmetic, ties), top_k (ties), drop_rate (dare_*); when omitted: "
        "{scale: 0.3} for task_arithmetic, else {} (the method's own defaults; "
        "`featcal merge --help` and docs/method.md list them)",
    )

    @model_validator(mode="after")
    def _default_hyperparameters(self) -> MergeSettings:
        # {scale: 0.3} suits task arithmetic only: average takes no hyperparameters, and TIES has
        # its own default scale, so other methods start from featcal_core.merging's defaults.
        if "hyperparameters" not in self.model_fields_set and self.method == "task_arithmetic":
            self.hyperparameters = {"scale": 0.3}
        from featcal_core.merging import get  # the registry: its methods check their own values
        from featcal_core.merging.base import HyperparameterError

        try:
            get(self.method).check(dict(self.hyperparameters))
        except HyperparameterError as exc:  # named by its key path, merge.hyperparameters.<key>
            raise _error(exc.named(None), f"hyperparameters.{exc.key}") from None
        except FeatCalError as exc:
            at = "method" if "unknown merge method" in str(exc) else "hyperparameters"
            raise _error(str(exc), at) from None
        return self


#: the featcal fields that determine the calibrated model (in every block's cache key)
_CALIBRATION_FIELDS = (
    "alpha",
    "rho",
    "lam",
    "eps",
    "num_per_task",
    "max_length",
    "pooling",
    "token_weighting",
)


def _method_field(name: str, description: str) -> Any:
    """A FeatCal hyperparameter's field: default and bounds from featcal_core.method.hyperparameters."""
    low, high = BOUNDS[name]
    where = f"[{low:g}, {high:g}]" if high is not None else f"≥ {low:g}"
    return Field(DEFAULTS[name], ge=low, le=high, description=f"{description}, in {where}")


def _setting_field(name: str, description: str, **bounds: Any) -> Any:
    """A calibration setting's field: its default from featcal_core.method.settings."""
    return Field(SETTING_DEFAULTS[name], description=description, **bounds)


class FeatCalSettings(_Section):
    """FeatCal hyperparameters and how the calibration runs (see featcal_core.method.hyperparameters.FeatCalParams)."""

    enabled: StrictBool = Field(
        default=True, description="calibrate the merged model (false: evaluate merge only)"
    )
    alpha: FiniteFloat = _method_field("alpha", "teacher interpolation α")
    rho: FiniteFloat = _method_field("rho", "anchor blend ρ (ρ > 1 extrapolates past the merge)")
    lam: FiniteFloat = _method_field("lam", "ridge weight λ")
    eps: FiniteFloat = _method_field("eps", "jitter ε")
    num_per_task: StrictInt = _setting_field(
        "num_per_task", "calibration inputs per task (seeded sample)", ge=1
    )
    batch_size: StrictInt = _setting_field("batch_size", "calibration batch size", ge=1)
    device: Literal["cpu", "cuda", "auto"] = _setting_field("device", "where calibration runs")
    max_length: StrictInt = _setting_field("max_length", "token limit for text models", ge=1)
    pooling: Literal["cls", "mean"] | None = _setting_field(
        "pooling", "output pooling; null: the architecture's default"
    )
    token_weighting: Literal["all", "answer"] = _setting_field(
        "token_weighting",
        "causal LMs: weigh every real token (all) or only the positions predicting the "
        "calibration set's `target` tokens (answer)",
    )
    precision: Literal["auto", "float64", "float32", "bfloat16"] = _setting_field(
        "precision",
        "dtype of the block passes and of the token products feeding the statistics "
        "(bfloat16: autocast passes and bfloat16 products, where the device has them natively; "
        "float32: each chunk's product added to the float64 sums; float64: the audit path; "
        "auto: bfloat16 on a CPU with avx512_bf16/AMX (by its flags, never timed; "
        "$FEATCAL_CPU_BFLOAT16=1/0 overrides) or a CUDA GPU of compute capability ≥ 8.0, else "
        "float32; "
        "under float32 and float64, bfloat16/float16 checkpoints run float32 passes); sums and "
        "solves are float64 whatever runs",
    )
    heads: StrictBool = Field(
        default=False,
        description="also refit each task's classification head on the calibration inputs "
        "(head calibration, beyond the paper; for experts with their own linear heads)",
    )
    head_lam: FiniteFloat = Field(
        default=0.05, ge=0.0, description="ridge weight λ of head calibration"
    )
    runner: Literal["local", "dask"] = Field(default="local", description="Prefect task runner")
    dask_address: str | None = Field(
        default=None, description="scheduler address for runner dask; null: a local Dask cluster"
    )
    dask_workers: StrictInt = Field(
        default=2, ge=1, description="workers of the local Dask cluster"
    )
    memory_budget: FiniteFloat | None = Field(
        default=None,
        ge=0.0,
        description="GiB the resumable flow may use to hold a block's statistics in memory "
        "instead of writing every task's statistics to disk and reading them back (same result); "
        "null: half of the RAM available when the block starts",
    )

    @model_validator(mode="after")
    def _dask_only(self) -> FeatCalSettings:
        if self.dask_address is not None and self.runner != "dask":
            raise _error(
                f"dask_address is only used with runner: dask (runner is {self.runner!r}); "
                "set runner: dask or remove dask_address",
                "dask_address",
            )
        return self

    def core_params(self) -> FeatCalParams:
        """The hyperparameters α, ρ, λ, ε as the core's `FeatCalParams`: the one conversion,
        used by every caller (the flows, `featcal calibrate`)."""
        return FeatCalParams(alpha=self.alpha, rho=self.rho, lam=self.lam, eps=self.eps)

    def core_settings(self, seed: int) -> Settings:
        """How the calibration runs, as the core's `Settings` (the `featcal:` run settings and
        `run.seed`): the one conversion, used by every caller."""
        return Settings(**{name: getattr(self, name) for name in RUN_SETTINGS}, seed=seed)


class HarnessSettings(_Section):
    """Causal LMs evaluated by lm-evaluation-harness (`pip install 'featcal[llm]'`) on its tasks,
    in place of featcal's own label scoring."""

    tasks: list[StrictStr] | dict[str, list[StrictStr]] = Field(
        description="lm-eval task names (its registry, or the YAMLs under include_path), e.g. "
        "[arc_easy, hellaswag]: every expert is scored on every task, and a task's expert row is "
        "the expert scoring highest there; or, by expert task, {math: [gsm8k], code: [mbpp]}: "
        "each expert on its own tasks",
    )
    num_fewshot: StrictInt | None = Field(
        default=None, ge=0, description="few-shot examples per prompt; null: each task's default"
    )
    limit: StrictInt | FiniteFloat | None = Field(
        default=None,
        description="rows per task: a count (an integer, at least 1) or a fraction of each "
        "task's rows (a number in (0, 1)); null: all",
    )
    batch_size: StrictInt | None = Field(
        default=None, ge=1, description="lm-eval's batch size; null: evaluation.batch_size"
    )
    include_path: str | None = Field(
        default=None,
        description="a folder of custom lm-eval task YAMLs (relative to the working directory); "
        "null: lm-eval's own tasks only",
    )
    apply_chat_template: StrictBool = Field(
        default=False, description="wrap each prompt in the tokenizer's chat template"
    )

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, value: list[str] | dict[str, list[str]]) -> list[str] | dict[str, list[str]]:
        names = value if isinstance(value, list) else [t for ts in value.values() for t in ts]
        if not names or (isinstance(value, dict) and not all(value.values())):
            raise _error("no lm-eval task named; name at least one")
        if any(not task.strip() for task in names):
            raise _error("an empty task name; name lm-eval tasks")
        if twice := sorted({task for task in names if names.count(task) > 1}):
            raise _error(f"{', '.join(twice)} named twice; name each task once")
        return value

    def task_names(self) -> list[str]:
        """Every lm-eval task, in the order given."""
        tasks = self.tasks
        return list(tasks) if isinstance(tasks, list) else [t for ts in tasks.values() for t in ts]

    @field_validator("limit")
    @classmethod
    def _limit(cls, value: int | float | None) -> int | float | None:
        if isinstance(value, float) and not 0 < value < 1:
            raise _error(f"{value} is neither a row count (an integer) nor a fraction in (0, 1)")
        if isinstance(value, int) and value < 1:
            raise _error(f"{value} rows: give at least 1, or null for all")
        return value


class EvaluationSettings(_Section):
    """Evaluation of the base, experts, merged and calibrated models."""

    enabled: StrictBool = Field(default=True, description="evaluate the models")
    batch_size: StrictInt = Field(default=64, ge=1, description="evaluation batch size")
    max_examples_per_task: StrictInt | None = Field(
        default=None, ge=1, description="evaluate on the first N examples per task; null: all"
    )
    precision: Literal["auto", "float32", "bfloat16"] | None = Field(
        default=None,
        description="dtype of the evaluation forwards and of select:'s held-out scoring (float32, "
        "or bfloat16 under autocast; auto: bfloat16 where the device has it natively); null: "
        "featcal.precision's choice (float64 there evaluates in float32)",
    )
    harness: HarnessSettings | None = Field(
        default=None,
        description="causal LMs: evaluate with lm-evaluation-harness on its tasks (the "
        "`evaluation.harness:` table); null: featcal's own label scoring",
    )


class TrackingSettings(_Section):
    """MLflow tracking."""

    enabled: StrictBool = Field(
        default=True, description="log params, metrics and artifacts to MLflow"
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI; null: the local sqlite store inside the project",
    )
    experiment: str = Field(default="featcal", min_length=1, description="MLflow experiment name")
    log_model: Literal["auto"] | StrictBool = Field(
        default="auto",
        description="log the calibrated checkpoint with its weights (as an MLflow Model where "
        "from_pretrained loads it): auto: when they total at most 256 MiB (above that, and with "
        "false: its model card, config and records only, and a tag with the folder's path); "
        "true: always",
    )


#: featcal_core.zoo.build.PRESETS' names (a test keeps them equal, and `featcal zoo --preset`'s)
ZooPreset = Literal["vision", "vision-paper", "text", "text-paper"]
ZOO_PRESETS: tuple[str, ...] = get_args(ZooPreset)


class ZooSettings(_Section):
    """The offline model zoo (featcal_core.zoo): build or reuse it, then take models and tasks
    from it. With `zoo:` set, `models:` and `tasks:` are left out of the params file."""

    preset: ZooPreset = Field(
        "vision",
        description="which zoo to build (vision-paper, text-paper: experts with frozen "
        "base-fitted heads and small task vectors, the paper's regime)",
    )
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
