"""Prefect task for the evaluate step: per task, accuracy and loss of the base (zero-shot only),
the task's expert, the merged and the calibrated model, and normalized accuracy (÷ the expert's).

A task with `class_names`, `templates` or a `prompt_set` in params is evaluated with a CLIP zero-shot head built
from the base CLIPModel's text tower (class embeddings cached under `<results>/heads`); any other
task with its expert's own classification head. open_clip pools (open-clip-vision) use the
base's open_clip text tower (featcal_core.open_clip.zero_shot; the base's source comes from the
results' models.lock.json), also for tasks without class_names/templates (class names: the label
feature's; open_clip experts are bare vision towers without a head). Causal LMs (hf-llama) are
scored by the likeliest label continuation (`label_words` after `prompt`,
featcal_core.evaluation.language_model), with the base as a row too, plus the perplexity of the evaluation
texts. Classification towers run in `evaluation.precision` (null: `featcal.precision`'s choice;
`forward_precision`), recorded in each row (`precision`, `precision_requested`, `precision_reason`,
`precision_execution`); causal LMs are scored in float32. With `evaluation.harness`, causal LMs
are scored by lm-evaluation-harness instead (featcal_core.evaluation.harness): one table entry
per lm-eval task, its forwards in `forward_precision`'s precision.
Evaluation data never feeds calibration: the params refuse a task whose evaluation source
is its calibration source.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from featcal_core.data.source import as_data_source
from featcal_core.data.source_rows import dataset_commit, open_source
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.accuracy import _device, evaluate_linears
from featcal_core.evaluation.expert_head import ExpertHead
from featcal_core.evaluation.input_batches import InputBatches
from featcal_core.evaluation.language_model import (
    DEFAULT_TEMPLATE,
    evaluate_lm_dataset,
    generation_kind,
)
from featcal_core.evaluation.linear_head import load_linear_head
from featcal_core.evaluation.prompt_sets import zero_shot_prompts
from featcal_core.evaluation.result_cache import (
    check_outside,
    classification_keys,
    label_scoring_key,
    reuse_or_evaluate,
    store_path,
)
from featcal_core.evaluation.zero_shot_head import ZeroShotHead
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.outputs import guarded_directory, verify_output
from featcal_core.log_detail import DETAIL
from featcal_core.precision import Precision, resolve_forwards
from featcal_core.provenance.identity import device_identity, sources_digest
from featcal_core.provenance.records import EVALUATION_SOURCE, LOCK
from featcal_core.report.figures import task_normalized

log = logging.getLogger(__name__)


def _data_folder(task_name: str, source: Any, data_root: Path) -> Path:
    """The save_to_disk directory of a task's evaluation rows (Hub splits: below `data_root`)."""
    if source.hub is None:
        return Path(source.path).expanduser()
    return data_root / task_name


def _evaluation_data(task_name: str, source: Any, data_root: Path) -> tuple[Path, str | None]:
    """(save_to_disk directory, split) of a task's evaluation rows. Hub splits are saved once,
    with EVALUATION_SOURCE (the source, its identity, its commit where known), and saved again
    when the folder does not verify or the params name another source (id, config, split,
    revision)."""
    target = _data_folder(task_name, source, data_root)
    if source.hub is None:
        return target, source.split
    core = as_data_source(source, f"tasks.{task_name}.evaluation")
    identity = list(core.identity())
    record = target / EVALUATION_SOURCE
    saved = (
        json.loads(record.read_text()).get("identity")
        if verify_output(target) is None and record.is_file()
        else None
    )
    if saved != identity:  # missing, partial, changed, or another source: saved (again)
        with guarded_directory(
            target, overwrite=True, flag=f"tasks.{task_name} evaluation data"
        ) as tmp:
            open_source(source, key=f"tasks.{task_name}.evaluation").save_to_disk(str(tmp))
            (tmp / EVALUATION_SOURCE).write_text(
                json.dumps(
                    {
                        "source": source.describe(),
                        "identity": identity,
                        "commit": dataset_commit(core),
                    },
                    indent=2,
                )
                + "\n"
            )
    return target, None


def forward_precision(params: Any, base: str, requested: str | None = None) -> Precision:
    """The precision of the forwards that only read a head's features (evaluation, held-out
    scoring; head calibration passes `featcal.precision` as `requested`) on `featcal.device`
    for checkpoints like `base`: `evaluation.precision`, else `featcal.precision`, resolved."""
    if requested is None:
        requested = params.evaluation.precision or params.featcal.precision
    dtype = Checkpoint(base, role="base model").float_dtype()
    return resolve_forwards(requested, _device(params.featcal.device), dtype)


def task_head(
    task_name: str,
    spec: Any,
    base,
    expert,
    root: Path,
    base_source: Mapping[str, Any] | None = None,
):
    """(head, zero_shot) of one task: its expert's own classifier, or a CLIP zero-shot head
    when the task has class_names, templates or a prompt_set (open_clip pools: always, since
    their experts are bare vision towers; prompts: `zero_shot_prompts`). base_source: the base's `open_clip_source` lock record (None: read from
    `root`/models.lock.json when the pool is open_clip)."""
    data, split = _evaluation_data(task_name, spec.evaluation, root / "evaluation_data")
    open_clip = is_open_clip(Path(base))
    if not spec.zero_shot and not open_clip:
        return ExpertHead(expert, tokenizer_dir=base), False
    rows = open_source({"path": str(data), "split": split}, key=f"tasks.{task_name}.evaluation")
    label_names = (
        getattr(rows.features.get(spec.evaluation.label_column or "label"), "names", None) or None
    )
    names, templates = zero_shot_prompts(
        label_names,
        class_names=spec.class_names,
        templates=spec.templates,
        prompt_set=spec.prompt_set,
        key=f"tasks.{task_name}",
    )
    if open_clip:
        from featcal_core.open_clip.zero_shot import OpenCLIPZeroShotHead

        source = base_source if base_source is not None else _base_source(root, Path(base))
        head = OpenCLIPZeroShotHead.from_source_record(
            source, base, names, templates, root / "heads"
        )
        return head, True
    return ZeroShotHead(base, names, templates, root / "heads"), True


def is_open_clip(base: Path) -> bool:
    from featcal_core.open_clip.architecture import MODEL_TYPE

    try:
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the heads report the unreadable base themselves
    return isinstance(config, dict) and config.get("model_type") == MODEL_TYPE


def _base_source(root: Path, base: Path) -> dict[str, Any]:
    """The base's `open_clip_source` from the results' lock (the base's open_clip checkpoint,
    whose text tower gives the class embeddings)."""
    from featcal_core.provenance.lock import read_lock

    lock_path = root / LOCK
    if not lock_path.is_file():
        raise FeatCalError(
            f"{lock_path} does not exist: zero-shot evaluation of an open_clip pool needs the "
            "base's open_clip checkpoint it records; run `featcal download` first"
        )
    entry = read_lock(lock_path)["base"]
    if Path(entry["path"]).resolve() != base.resolve():
        raise FeatCalError(
            f"{lock_path} locks base {entry['path']}, not {base}; re-run `featcal download`"
        )
    source = entry.get("open_clip_source")
    if not source:
        raise FeatCalError(
            f"models.base: {base} is an open_clip vision tower without its open_clip checkpoint, "
            "whose text tower zero-shot evaluation needs; give models.base as the open_clip "
            "checkpoint with format: open_clip"
        )
    return dict(source)


def evaluation_inputs(params: Any, results_dir: str) -> list[dict[str, Any]]:
    """Each task's evaluation set as an MLflow dataset input (featcal.tracking.log.log_datasets): name
    `evaluation/<task>`, its save_to_disk folder, split and the sha256 over its files."""
    from featcal_core.io.checkpoint import sha256_tree

    found: list[dict[str, Any]] = []
    if params.evaluation.harness is not None:  # lm-eval reads its own tasks' data
        return found
    for task_name, spec in params.tasks.items():
        data, split = _evaluation_data(
            task_name, spec.evaluation, Path(results_dir) / "evaluation_data"
        )
        found.append(
            {
                "name": f"evaluation/{task_name}",
                "context": "evaluation",
                "path": str(data),
                "split": split,
                "sha256": sha256_tree(data),
            }
        )
    return found


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_models(
    params: Any,
    base: str,
    experts: dict[str, str],
    models: dict[str, str],
    results_dir: str,
    refit_heads: dict[str, dict[str, str]] | None = None,
    surgeries: dict[str, tuple[str, str]] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """{task: {model name: {"accuracy", "loss", "examples", "normalized"}}}.

    `models` maps a name ("merged", "calibrated") to a checkpoint directory; each task also gets
    "expert" (its own expert) and, for zero-shot tasks, "base". `refit_heads` ({model name:
    {task: head folder}}, from head calibration) adds a "<model>_heads" row per model: its tower
    under the refit head. `surgeries` ({row: (checkpoint, surgery folder)}, Representation
    Surgery) adds each row: that checkpoint with the task's surgery module before its head.
    """
    settings = params.evaluation
    if settings.harness is not None:
        return _evaluate_harness(params, base, experts, models)
    root = Path(results_dir)
    check_outside(
        {
            "models.base": base,
            **{f"expert {task!r}": path for task, path in experts.items()},
            **{f"model {name!r}": path for name, path in models.items()},
            **{
                f"{name} head of {task!r}": path
                for name, heads in (refit_heads or {}).items()
                for task, path in heads.items()
            },
            **{
                f"{name} {kind}": path
                for name, pair in (surgeries or {}).items()
                for kind, path in zip(("checkpoint", "surgery folder"), pair, strict=True)
            },
            **{
                f"evaluation set of {task!r}": _data_folder(
                    task, spec.evaluation, root / "evaluation_data"
                )
                for task, spec in params.tasks.items()
            },
        }
    )
    table: dict[str, dict[str, dict[str, float]]] = {}
    reused_rows: list[str] = []  # task/row names taken from the evaluation store
    language_model = generation_kind(base) is not None
    chosen = None if language_model else forward_precision(params, base)
    if chosen is not None:
        log.info("evaluation forwards in %s (%s)", chosen.name, chosen.reason, extra=DETAIL)
    for task_name, spec in params.tasks.items():
        source = spec.evaluation
        data, split = _evaluation_data(task_name, source, root / "evaluation_data")
        if language_model:
            table[task_name] = _evaluate_lm(
                params,
                task_name,
                spec,
                data,
                split,
                base,
                {"expert": experts[task_name], **models},
                reused_rows,
            )
            continue
        head, zero_shot = task_head(task_name, spec, Path(base), Path(experts[task_name]), root)
        # one tower pass per group: (checkpoint, head, {row: None (the head's own Linear) or a
        # refit Linear (weight, bias)}); a model's refit-head row shares its tower's pass
        groups = {
            name: (directory, head, {name: None})
            for name, directory in {"expert": experts[task_name], **models}.items()
        }
        if zero_shot:
            groups = {"base": (base, head, {"base": None}), **groups}
        order = list(groups)
        for name, heads in (refit_heads or {}).items():
            if task_name in heads:
                refit = load_linear_head(heads[task_name])
                groups[name][2][f"{name}_heads"] = (refit.weight, refit.bias)
                order.append(f"{name}_heads")
        for name, (directory, folder) in (surgeries or {}).items():
            from featcal_core.repair.surgery_module import SurgeryHead, load_surgery

            surgery = SurgeryHead(head, load_surgery(Path(folder) / task_name))
            groups[name] = (directory, surgery, {name: None})
            order.append(name)
        found: dict[str, dict] = {}
        reused: list[str] = []
        batches = InputBatches()  # the task's rows preprocessed once for all its models
        stored_as = {
            "image_column": source.image_column,
            "text_column": source.text_column,
            "label_column": source.label_column,
            "max_examples": settings.max_examples_per_task,
            "batch_size": settings.batch_size,
            "precision": chosen.name,
            "device": device_identity(_device(params.featcal.device)),
            "tasks": sources_digest({"tasks/evaluate.py": Path(__file__)}),
        }
        for directory, model_head, linears in groups.values():
            evaluate = partial(
                evaluate_linears,
                directory,
                model_head,
                data,
                split,
                linears,
                batch_size=settings.batch_size,
                max_examples=settings.max_examples_per_task,
                image_column=source.image_column,
                text_column=source.text_column,
                label_column=source.label_column,
                device=params.featcal.device,
                progress=sys.stderr.isatty(),  # a bar per model on a terminal
                batches=batches,
                precision=chosen.name,
            )
            key_of = partial(classification_keys, directory, model_head, data, split, linears)
            rows, from_store = reuse_or_evaluate(
                key_of(stored_as), evaluate, partial(key_of, stored_as)
            )
            found.update(rows)
            reused += list(rows) if from_store else []
        _log_reused(task_name, reused)
        reused_rows += [f"{task_name}/{name}" for name in reused if name in order]
        row = {name: {**found[name], **chosen.record()} for name in order}
        table[task_name] = _normalize(task_name, row)
    _log_store(table, len(reused_rows))
    return table


def _normalize(task_name: str, row: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Add normalized accuracy (÷ the expert's; featcal_core.report.figures.task_normalized) to
    every model's result, null where the expert scores 0 (no reference: the summary figures leave
    the task out of the normalized average); log the row."""
    expert_accuracy = row["expert"]["accuracy"]
    for result in row.values():
        result["normalized"] = task_normalized(result["accuracy"], expert_accuracy)
    log.info(
        "evaluate %s: %s",
        task_name,
        ", ".join(f"{n} {r['accuracy']:.4f}" for n, r in row.items()),
        extra=DETAIL,
    )
    return row


def _evaluate_harness(params, base: str, experts: dict[str, str], models: dict[str, str]):
    """{lm-eval task: {row: result}} of `evaluation.harness` (featcal_core.evaluation.harness):
    the base, the experts, and `models`, each loaded once, in `forward_precision`'s precision on
    featcal.device; normalized ÷ the task's expert row."""
    from featcal_core.evaluation.harness import (
        HarnessRun,
        expert_assignment,
        harness_table,
        require_lm_eval,
    )

    harness = params.evaluation.harness
    require_lm_eval()
    if generation_kind(base) != "causal":
        raise FeatCalError(
            f"evaluation.harness scores causal LMs; models.base {base} is none; remove "
            "evaluation.harness"
        )
    chosen = forward_precision(params, base)
    log.info("lm-eval forwards in %s (%s)", chosen.name, chosen.reason, extra=DETAIL)
    run = HarnessRun(
        tasks=tuple(harness.task_names()),
        num_fewshot=harness.num_fewshot,
        limit=harness.limit,
        batch_size=harness.batch_size or params.evaluation.batch_size,
        include_path=harness.include_path,
        apply_chat_template=harness.apply_chat_template,
        device=params.featcal.device,
        precision=chosen.name,
        offline=params.models is not None and params.models.hub_offline,
    )
    assignment = expert_assignment(harness.tasks, list(experts))
    table = harness_table(base, experts, models, run, assignment)
    return {
        task: _normalize(task, {row: {**r, **chosen.record()} for row, r in rows.items()})
        for task, rows in table.items()
    }


def _evaluate_lm(
    params,
    task_name,
    spec,
    data: Path,
    split,
    base: str,
    models: dict[str, str],
    reused_rows: list[str],
):
    """One task of a causal LM: label-continuation accuracy/loss and perplexity per model; the
    rows taken from the evaluation store are added to `reused_rows`."""
    source = spec.evaluation
    words = spec.label_words
    if words is None:
        rows = open_source({"path": str(data), "split": split}, key=f"tasks.{task_name}.evaluation")
        label = source.label_column or "label"
        names = getattr(rows.features[label], "names", None)
        if not names:
            raise FeatCalError(
                f"tasks.{task_name}.label_words: the evaluation set's {label!r} column has no "
                "class names; set label_words (the continuation scored for each class)"
            )
        words = list(names)
    row = {}
    reused: list[str] = []
    stored_as = {
        "split": split,
        "label_words": list(words),
        "prompt": spec.prompt or DEFAULT_TEMPLATE,
        "text_column": source.text_column or "text",
        "label_column": source.label_column or "label",
        "max_examples": params.evaluation.max_examples_per_task,
        "batch_size": params.evaluation.batch_size,
        "device": device_identity(_device(params.featcal.device)),
        "tasks": sources_digest({"tasks/evaluate.py": Path(__file__)}),
    }
    for name, directory in {"base": base, **models}.items():
        score = partial(
            evaluate_lm_dataset,
            directory,
            base,
            data,
            split,
            words,
            spec.prompt or DEFAULT_TEMPLATE,
            text_column=source.text_column or "text",
            label_column=source.label_column or "label",
            max_examples=params.evaluation.max_examples_per_task,
            batch_size=params.evaluation.batch_size,
            device=params.featcal.device,
        )
        key = label_scoring_key(directory, base, data, stored_as)
        found, from_store = reuse_or_evaluate({"row": key}, lambda score=score: {"row": score()})
        row[name] = found["row"]
        reused += [name] if from_store else []
        row[name].update(
            precision="float32",
            precision_requested=params.evaluation.precision or params.featcal.precision,
            precision_reason="causal LMs are scored in float32",
            precision_execution="native",
        )
    _log_reused(task_name, reused)
    reused_rows += [f"{task_name}/{name}" for name in reused]
    return _normalize(task_name, row)


def _log_reused(task_name: str, names: list[str]) -> None:
    if names:
        log.info(
            "evaluate %s: %s reused from the evaluation store",
            task_name,
            ", ".join(names),
            extra=DETAIL,
        )


def _log_store(table: Mapping[str, Mapping[str, Any]], reused: int) -> None:
    """One line when rows came from the evaluation store: how many, and where it is."""
    if reused:
        log.info(
            "evaluation: %d of %d rows reused from the evaluation store %s (same model files, "
            "evaluation rows, settings and code; FEATCAL_EVALUATION_CACHE=off evaluates all)",
            reused,
            sum(len(row) for row in table.values()),
            store_path(),
        )
