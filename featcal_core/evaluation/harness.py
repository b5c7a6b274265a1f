"""Causal LMs scored by lm-evaluation-harness (`lm-eval` 0.4, the optional extra `featcal[llm]`)
on its tasks, for `evaluation.harness` (featcal_core.params.sections.HarnessSettings).

    run = HarnessRun(tasks=["arc_easy"], batch_size=8, device="cuda", precision="bfloat16")
    rows = score_model("results/merged", "base/", run)  # {"arc_easy": {"accuracy": 0.71, ...}}
    table = harness_table(base, experts, {"merged": ..., "calibrated": ...}, run)

Each model is loaded once (`featcal_core.evaluation.language_model.load_causal_lm`: a folder, or
a LoRA adapter over the base; float32 weights on `device`, forwards in `precision`: float32, or
bfloat16 under autocast) with the base's tokenizer, and handed to lm-eval's `HFLM`; lm-eval's
`simple_evaluate` then runs every task that model is scored on (its own prompts, few-shot
examples, seeds and metrics). A task's result is its primary metric: the first of the task's
`metric_list` that lm-eval reports (for a group: the first metric of its aggregate), under its
first filter (`exact_match (strict-match)` for a filtered one); with its standard error and the
number of rows scored. Each result goes into the evaluation table as featcal's other evaluations
do: {"accuracy" (the primary metric's value, a fraction), "metric", "stderr", "examples",
"task_rows" (rows the task holds), "num_fewshot", "evaluator"}.

Which expert is scored where: `tasks` as a list scores every expert on every task, and a task's
"expert" row is the expert scoring highest there (`expert_task` names it); `tasks` as a mapping
{expert task: [lm-eval tasks]} scores each expert on its own tasks only.

lm-eval is imported only here, inside the functions: the import costs seconds. When the run is
offline (`models.hub_offline`, or HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set), datasets and the Hub
client read their caches only while lm-eval runs; otherwise lm-eval fetches its datasets as it
does on its own. A local task names its data as `dataset_path: json` with
`dataset_kwargs: {data_files: ...}`, which never needs the network.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.harness_index import known_names, task_manager

log = logging.getLogger(__name__)

#: the one line a params file that asks for the harness gets without lm-eval
MISSING = "evaluation.harness needs lm-eval: pip install 'featcal[llm]'"
#: the result keys that are no metric (`results[task]` of simple_evaluate)
_NOT_METRICS = {"alias", "name", "sample_len", "samples"}

__all__ = [
    "MISSING",
    "HarnessRun",
    "available",
    "check_settings",
    "expert_assignment",
    "harness_table",
    "require_lm_eval",
    "score_model",
    "task_manager",
    "task_results",
]


def available() -> bool:
    """Whether lm-eval is installed (found, not imported)."""
    return importlib.util.find_spec("lm_eval") is not None


def require_lm_eval() -> None:
    """Raise FeatCalError(MISSING) when lm-eval is not installed."""
    if not available():
        raise FeatCalError(MISSING)


@dataclass(frozen=True)
class HarnessRun:
    """How every model is scored: lm-eval's task names and options (`evaluation.harness`), and
    featcal's device and forward precision."""

    tasks: tuple[str, ...]
    num_fewshot: int | None = None
    limit: int | float | None = None  # rows per task, or a fraction of them in (0, 1)
    batch_size: int = 8
    include_path: str | None = None  # a folder of task YAMLs
    apply_chat_template: bool = False
    device: str = "cpu"  # "auto" | "cpu" | "cuda" | "cuda:N"
    precision: str = "float32"  # "float32" | "bfloat16" (autocast)
    offline: bool = False  # read datasets and the Hub from their caches only


def expert_assignment(
    tasks: Sequence[str] | Mapping[str, Sequence[str]], experts: Sequence[str]
) -> dict[str, list[str]]:
    """{expert task: the lm-eval tasks its expert is scored on}: every task for each expert
    (`tasks` a list), or the mapping's (its keys must be expert tasks)."""
    if not isinstance(tasks, Mapping):
        return {expert: list(tasks) for expert in experts}
    for expert in tasks:
        if expert not in experts:
            raise FeatCalError(
                f"evaluation.harness.tasks.{expert}: {expert!r} is no expert task (the tasks: "
                f"{', '.join(experts)}); key the mapping by expert task, or give a list"
            )
    return {expert: list(tasks.get(expert, ())) for expert in experts}


# ------------------------------------------------------------------------------------ lm-eval


def check_settings(settings: Any, experts: Sequence[str] | None) -> list[tuple[str, str]]:
    """[(params key, what is wrong; the fix)] of `evaluation.harness` (`settings`) before any
    work: lm-eval installed, include_path a folder, the mapping keyed by expert tasks (`experts`;
    None: not known yet), every task known to lm-eval."""
    if not available():
        return [("evaluation.harness", MISSING.removeprefix("evaluation.harness "))]
    problems = []
    include = settings.include_path
    if include is not None and not Path(include).expanduser().is_dir():
        problems.append(
            (
                "evaluation.harness.include_path",
                f"{include} is not a folder (looked in {Path(include).expanduser().absolute()}); "
                "point at the folder of your task YAMLs (relative to the working directory)",
            )
        )
        return problems
    if experts is not None:
        try:
            expert_assignment(settings.tasks, experts)
        except FeatCalError as exc:
            key, _, text = str(exc).partition(": ")
            problems.append((key, text))
    names = settings.task_names()
    known = known_names(names, include)
    unknown = [name for name in names if name not in known]
    if unknown:
        where = f" nor under {include}" if include else ""
        problems.append(
            (
                "evaluation.harness.tasks",
                f"lm-eval knows no task {', '.join(map(repr, unknown))} (not in its registry"
                f"{where}); `lm-eval ls tasks` lists its tasks; a task of your own goes in a "
                "YAML under evaluation.harness.include_path",
            )
        )
    return problems


@contextlib.contextmanager
def _offline(offline: bool) -> Iterator[None]:
    """While lm-eval runs: datasets and huggingface_hub read their caches only (`offline`)."""
    if not offline:
        yield
        return
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    environment = {name: os.environ.get(name) for name in names}
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    os.environ.update(dict.fromkeys(names, "1"))
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
        for name, value in environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _Handover(logging.Filter):
    """Drops lm-eval's warnings that a loaded model was passed in: featcal always passes one."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not text.startswith(("`pretrained` model kwarg", "Passed an already-initialized"))


#: the lm-eval loggers that warn about a loaded model passed in
_HANDOVER_LOGGERS = ("lm_eval.models.huggingface", "lm_eval.evaluator")


@contextlib.contextmanager
def _quiet_handover() -> Iterator[None]:
    handover = _Handover()
    loggers = [logging.getLogger(name) for name in _HANDOVER_LOGGERS]
    for logger in loggers:
        logger.addFilter(handover)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(handover)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _primary(name: str, found: Mapping[str, Any], config: Mapping[str, Any] | None):
    """(metric label, value, stderr) of a task's (or group's) primary metric in lm-eval's
    `results[name]` (keys "metric,filter"): the first of the task's metric_list reported, else
    the first metric reported; under the first filter it has."""
    keys = [
        key
        for key in found
        if "," in key and key not in _NOT_METRICS and "_stderr," not in key
        if _number(found[key]) is not None
    ]
    if not keys:
        raise FeatCalError(
            f"evaluation.harness.tasks: lm-eval reported no number for {name!r} (a tag of "
            "several tasks has no score of its own): name its tasks, or a group with an aggregate"
        )
    wanted = [
        m.get("metric") for m in (config or {}).get("metric_list") or () if isinstance(m, dict)
    ]
    metrics = [key.partition(",")[0] for key in keys]
    chosen = next((m for m in wanted if m in metrics), metrics[0])
    key = keys[metrics.index(chosen)]
    metric, _, kind = key.partition(",")
    stderr = _number(found.get(f"{metric}_stderr,{kind}"))
    label = metric if kind == "none" else f"{metric} ({kind})"
    return label, float(found[key]), stderr


def _rows(name: str, results: Mapping[str, Any], field: str) -> int | None:
    """The rows of `name` counted in lm-eval's `n-samples` (`field`: "effective" (scored) or
    "original" (the task's)), summed over a group's tasks."""
    counts = results.get("n-samples") or {}
    if name in counts:
        value = counts[name].get(field)
        return int(value) if isinstance(value, int) else None
    parts = (results.get("group_subtasks") or {}).get(name)
    if not parts:
        return None
    found = [_rows(part, results, field) for part in parts]
    return None if any(v is None for v in found) else sum(v for v in found if v is not None)


def task_results(results: Mapping[str, Any], tasks: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{task: {"accuracy", "metric", "stderr", "examples", "task_rows", "num_fewshot",
    "evaluator"}} from simple_evaluate's answer (see the module doc)."""
    from lm_eval import __version__

    out = {}
    for name in tasks:
        found = (results.get("results") or {}).get(name)
        if found is None:
            raise FeatCalError(
                f"evaluation.harness.tasks: lm-eval returned no result for {name!r}; name a "
                "task or a group with an aggregate score"
            )
        config = (results.get("configs") or {}).get(name)
        metric, value, stderr = _primary(name, found, config)
        shots = (results.get("n-shot") or {}).get(name)
        out[name] = {
            "accuracy": value,
            "metric": metric,
            "stderr": stderr,
            "examples": _rows(name, results, "effective"),
            "task_rows": _rows(name, results, "original"),
            "num_fewshot": shots if isinstance(shots, int) else None,
            "evaluator": f"lm-eval {__version__}",
        }
    return out


@torch.no_grad()
def score_model(
    model_dir: str | Path, base: str | Path, run: HarnessRun, tasks: Sequence[str] | None = None
) -> dict[str, dict[str, Any]]:
    """{task: result} of one model (a folder, or a LoRA adapter over `base`) on `tasks` (default:
    all of `run.tasks`), loaded once, with the base's tokenizer (see the module doc)."""
    require_lm_eval()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from featcal_core.architectures.base import load_tokenizer
    from featcal_core.evaluation.accuracy import _device
    from featcal_core.evaluation.language_model import load_causal_lm
    from featcal_core.precision import autocast

    names = list(tasks if tasks is not None else run.tasks)
    if not names:
        return {}
    device = _device(run.device)
    model = load_causal_lm(model_dir, device, "causal", base=base)
    tokenizer = load_tokenizer(base, "base model")
    manager = task_manager(names, run.include_path)
    log.info("lm-eval: %s on %s", model_dir, ", ".join(names))
    with _quiet_handover(), _offline(run.offline), autocast(run.precision, device):
        lm = HFLM(
            pretrained=model, backend="causal", tokenizer=tokenizer, batch_size=run.batch_size
        )
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=run.num_fewshot,
            limit=run.limit,
            task_manager=manager,
            apply_chat_template=run.apply_chat_template,
            log_samples=False,
        )
    del lm, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if results is None:  # lm-eval answers None on a process that is not rank 0
        raise FeatCalError("lm-eval returned no results; run featcal in a single process")
    return task_results(results, names)


def harness_table(
    base: str | Path,
    experts: Mapping[str, str | Path],
    models: Mapping[str, str | Path],
    run: HarnessRun,
    assignment: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, dict[str, dict[str, Any]]]:
    """{lm-eval task: {row: result}}: the rows "base", "expert" (with `expert_task`) and each of
    `models` ({row: folder}, e.g. "merged", "calibrated"), each model loaded once.
    `assignment`: {expert task: its lm-eval tasks} (`expert_assignment`; default: every task)."""
    names = list(run.tasks)
    assignment = assignment or {expert: names for expert in experts}
    table: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in names}
    for row, folder in {"base": base, **models}.items():
        for name, result in score_model(folder, base, run).items():
            table[name][row] = result
    experts_rows: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in names}
    for expert, folder in experts.items():
        for name, result in score_model(folder, base, run, assignment.get(expert, ())).items():
            experts_rows[name][expert] = {**result, "expert_task": expert}
    for name, found in experts_rows.items():
        if found:  # the expert scoring highest on the task (one, for a mapping)
            best = max(found.values(), key=lambda r: r["accuracy"])
            table[name] = {"base": table[name]["base"], "expert": best, **table[name]}
    return table
