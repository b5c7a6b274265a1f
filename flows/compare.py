"""`featcal compare`: variants (merge × repair × hyperparameters, the params file's `compare:`
section) side by side, in one Prefect flow.

The download and the calibration sets run once, in the params' results folder, and every variant
uses them (drawn with the largest `featcal.num_per_task` of the params and the variants: a variant
asking for fewer calibrates on its own seeded sample of that set). Each distinct merge runs once
(a `merge` task in `<results>/merges/<key>/`), however many variants use it. Each variant's repair
(FeatCal, resumable; RegMean; Surgery; AdaMerging; or none), and with `featcal.heads` its refit
heads, runs as a Prefect subflow `featcal-variant` in `<results>/variants/<name>/` (Surgery: its
per-task modules, evaluated on the variant's merge), with its wall time and its own peak RSS.
One evaluation then scores the experts, every merge and every repaired model, and the comparison
(featcal_core.report.compare) goes to `reports/<run.name>-compare/`: variants × tasks, means,
gap closed against the params file's own merge (`merged`), cost columns, accuracy against cost;
its compare.json names the results folder and lock digest compared on (`featcal lineage` traces it).
MLflow: one parent run `<run.name>-compare`, one child run per variant with its metrics, params and
overrides. Any variant is reproducible alone: `featcal run --set ...` (or `dvc exp run -S ...`)
with the variant's overrides.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from featcal.flows.environment import command_api, configure
from featcal.flows.environment import project_root as working_project
from featcal.flows.run_tags import flow_params, lineage_tags, params_digest
from featcal.flows.selection import exhausted_tasks, score_held_out
from featcal.flows.steps import Steps
from featcal.flows.variants import (
    evaluation_rows,
    merge_key,
    repair,
    row_of,
    run_merges,
    shared_steps,
)
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.selection import LABEL_FREE
from featcal_core.params import Params, load_params
from featcal_core.params.repair import Variant, layered, override_key
from featcal_core.provenance.records import REPORTS_ROOT
from featcal_core.repair.registry import get as get_repair

configure()  # before prefect is imported
from prefect import flow  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

log = logging.getLogger(__name__)

#: the reference merge's evaluation row (the params file's own merge); gap closed is against it
REFERENCE = "merged"
#: evaluation rows that a variant may not be named after
RESERVED = ("base", "expert", REFERENCE)


def _variant(params: Params, name: str) -> Variant:
    (variant,) = [v for v in params.compare.variants if v.name == name]
    return variant


def variant_set(params: Params, name: str) -> list[str]:
    """Variant `name`'s overrides of `params`: its own, then the user's `--set` ones of the keys
    a variant may set, which win (featcal_core.params.repair.layered)."""
    return layered(_variant(params, name).set, params.user_set)[0]


def variant_params(params: Params, name: str) -> Params:
    """Variant `name`'s params: `params` (the user's overrides applied) with `variant_set`,
    repaired in `<results>/variants/<name>`."""
    results = Path(params.run.results_dir) / "variants" / name
    return params.with_overrides([*variant_set(params, name), f"run.results_dir={results}"])


def load_compare(
    params_path: str, overrides: list[str], params: Params | None = None
) -> tuple[Params, dict[str, Params]]:
    """The params (`params`: as the caller already read and validated them from `params_path`
    and `overrides`) and every variant's params, all validated (before any work)."""
    if params is None:
        params = load_params(params_path, overrides)
    if params.compare is None:
        raise FeatCalError(
            f"{params_path} has no compare: section; add compare: {{variants: [{{name: ..., "
            "set: [merge.method=ties, repair.method=regmean, ...]}]}} (see docs/compare.md)"
        )
    variants = {}
    for variant in params.compare.variants:
        if variant.name in RESERVED:
            raise FeatCalError(
                f"{params_path}: compare.variants: the name {variant.name!r} is "
                f"reserved ({', '.join(RESERVED)}); rename the variant"
            )
        try:
            variants[variant.name] = variant_params(params, variant.name)
        except FeatCalError as exc:
            raise FeatCalError(f"compare variant {variant.name!r}: {exc}") from None
        chosen = variants[variant.name]
        repair = get_repair(chosen.repair_method)
        if (
            chosen.featcal.heads
            and repair.output == "task_modules"
            and any(override_key(o) == "featcal.heads" for o in variant_set(params, variant.name))
        ):
            raise FeatCalError(
                f"compare variant {variant.name!r}: featcal.heads=true has no effect with "
                f"repair.method {repair.name} (its modules feed the tasks' own heads); drop "
                "featcal.heads from the variant or choose another repair"
            )
    return params, variants


def compare_name(params: Params) -> str:
    """`<run.name>-compare` (the report folder, the MLflow parent run); a run name that already
    ends in `-compare` is used as it is."""
    name = params.run.name
    return name if name.endswith("-compare") else f"{name}-compare"


def compare_run_name() -> str:
    parameters = flow_run.parameters
    params = flow_params(parameters)
    return f"{compare_name(params)}-{params_digest(params)[:8]}"


@flow(name="featcal-variant", flow_run_name="{name}")
def variant_flow(
    name: str, params_path: str, overrides: list[str], merged: str, params: Any = None
) -> dict:
    """One variant's repair into `<results>/variants/<name>/calibrated`; returns its path and
    cost (seconds, peak RSS of the repair in MiB). `params`: the compare's validated `Params`
    (typed Any for Prefect's parameter model), else read from `params_path` and `overrides`."""
    base_params = flow_params(
        {"params_path": params_path, "overrides": overrides, "params": params}
    )
    params = variant_params(base_params, name)
    shared = Steps(base_params)
    steps = shared_steps(shared, params, Path(merged))
    steps.in_flow = True
    with steps.session(f"featcal compare ({name})"):
        # heads only where the variant (or the user's --set) sets featcal.heads: the params
        # file's own setting is `featcal run`'s, and compare's rows stay the models' own unless
        # asked
        heads = any(override_key(o) == "featcal.heads" for o in variant_set(base_params, name))
        return repair(steps, heads=heads)


@flow(name="featcal-compare", flow_run_name=compare_run_name)
def featcal_compare(
    params_path: str = "params.yaml", overrides: list[str] | None = None, params: Any = None
) -> dict:
    """Every variant of the params file's `compare:` section (module docstring); returns the
    summary: the comparison rows, the merges (with how often each ran), report and MLflow ids.
    `params`: the validated `Params` of `params_path` and `overrides` (the file is then not read
    again; typed Any for Prefect's parameter model)."""
    given = params if isinstance(params, Params) else None
    params, variants = load_compare(params_path, overrides or [], given)
    steps = Steps(params, in_flow=True)
    with steps.session("featcal compare"):
        return _compare(
            params_path, list(overrides or []), params, steps, shared_count(params, variants)
        )


def run_compare(
    params_path: str | Path, overrides: list[str] | None = None, params: Params | None = None
) -> dict:
    """Validate the params (`params`: already validated by the caller) and every variant, take
    the run lock, then run `featcal_compare`. The params file is read once."""
    params, variants = load_compare(str(params_path), list(overrides or []), params)
    for variant in variants.values():  # every variant's folder, before any variant runs
        Steps(variant).check_session()
    with Steps(params).session("featcal compare"), command_api():
        return featcal_compare(str(Path(params_path).resolve()), list(overrides or []), params)


def shared_count(params: Params, variants: dict[str, Params]) -> int:
    """Rows per task of the shared calibration sets: the largest `featcal.num_per_task` of the
    params and its variants (a variant asking for fewer takes its own seeded sample of them)."""
    return max(p.featcal.num_per_task for p in [params, *variants.values()])


def _compare(
    params_path: str, overrides: list[str], params: Params, steps: Steps, count: int | None = None
) -> dict:
    from featcal.tasks.evaluate import evaluate_models, evaluation_inputs
    from featcal.tracking.log import log_artifacts, log_datasets, log_metrics, log_tags
    from featcal.tracking.runs import parent_run, step_run

    root = working_project()
    tags = {
        "prefect_flow_run_id": flow_run.get_id(),
        "params_digest": params_digest(params),
        "featcal.compare": "true",
    }
    with parent_run(params, run_name=compare_name(params), tags=tags, project_root=root) as run:
        if params.zoo is not None:
            with step_run("zoo"):
                steps.zoo()
        with step_run("download-experts"):
            lock = steps.download()
        log_tags(lineage_tags(lock))
        with step_run("calibration-sets"):
            sets = steps.calibration_sets(count)
        log_datasets(
            {
                "name": f"calibration/{t}",
                "context": "calibration",
                "sha256": r["digest"],
                "path": steps.paths["calibration_sets"] / t,
            }
            for t, r in sets.items()
        )
        _, variants = load_compare(params_path, overrides, params)  # after the zoo step
        merges = run_merges(
            steps, [(REFERENCE, params)] + [(None, v) for v in variants.values()], step_run
        )
        costs, children = {}, {}
        for name, variant in variants.items():
            key = merge_key(variant.merge)
            with step_run(name, tags={"featcal.variant": name}) as child:
                costs[name] = variant_flow(
                    name, params_path, overrides, str(merges[key]["path"]), params
                )
            children[name] = child.info.run_id if child is not None else None
        models, surgeries, refit = evaluation_rows(variants, merges, costs)
        base, experts = steps.models()
        with step_run("score-held-out"):
            label_free = _label_free(steps, params, variants, merges, costs, base)
        with step_run("evaluate"):
            evaluation = steps.call(
                evaluate_models,
                steps.params,
                base,
                experts,
                models,
                str(steps.paths["root"]),
                refit,
                surgeries,
            )
        log_datasets(evaluation_inputs(steps.params, str(steps.paths["root"])))
        rows = _rows(evaluation, variants, merges, costs, label_free)
        summary = _report(params, rows, merges, evaluation, run, lock, steps.paths["root"])
        for row in rows:
            log_metrics(_variant_metrics(row), run_id=children[row["name"]])
        log_artifacts(list(summary["files"].values()), artifact_path="compare")
    _artifact(params, summary)
    return summary


def _label_free(steps, params, variants, merges, costs, base) -> dict | None:
    """Each variant's label-free scores (agreement, drift, kl) on held-out unlabeled inputs
    (flows.selection.score_held_out; `select.holdout_per_task` of them per task, else its
    default); None for causal LMs, which have no classification head."""
    from featcal_core.evaluation.language_model import generation_kind
    from featcal_core.params.selection import HOLDOUT_PER_TASK

    if generation_kind(base) is not None:
        return None
    exhausted = exhausted_tasks(steps)
    if exhausted:
        log.warning(
            "no label-free scores: the calibration sets of %s hold every row of their "
            "sources, so none is left to hold out (a variant's featcal.num_per_task "
            "larger than a source)",
            ", ".join(f"{t} ({n} rows)" for t, n in exhausted.items()),
        )
        return None
    holdout = params.select.holdout_per_task if params.select is not None else HOLDOUT_PER_TASK
    return score_held_out(steps, variants, merges, costs, holdout)[1]


def _rows(
    evaluation: dict,
    variants: dict[str, Params],
    merges: dict,
    costs: dict,
    label_free: dict | None = None,
) -> list[dict]:
    from featcal_core.report.compare import comparison_rows

    described = []
    for name, variant in variants.items():
        merge = merges[merge_key(variant.merge)]
        cost = costs[name]
        peaks = [p for p in (merge["peak_rss_mb"], cost["peak_rss_mb"]) if p is not None]
        described.append(
            {
                "name": name,
                "row": row_of(name, variant, merges, costs),
                "merge": {"method": merge["method"], "hyperparameters": merge["hyperparameters"]},
                "repair": variant.repair_method,
                "set": variant_set(variant, name),
                "cost": {
                    "merge_seconds": merge["seconds"],
                    "repair_seconds": cost["repair_seconds"],
                    "peak_rss_mb": max(peaks) if peaks else None,
                },
                "label_free": (label_free or {}).get(name),
                "curve": curve_key(variant),
                "num_per_task": variant.featcal.num_per_task,
                "merge_row": merge["row"],
            }
        )
    return comparison_rows(evaluation, described, REFERENCE)


def curve_key(variant: Params) -> str:
    """What a variant shares with the others of its sample-efficiency curve: sha256 of every
    setting a variant may change (featcal_core.params.repair.VARIANT_KEYS: its merge, its repair
    and the repair's settings, FeatCal's settings) but `featcal.num_per_task`; the rest of a
    compare's params is the same for every variant."""
    key = {
        "merge": variant.merge.model_dump(mode="json"),
        "repair": variant.repair_method,
        "repair_settings": variant.repair.model_dump(mode="json"),
        "featcal": variant.featcal.model_dump(mode="json", exclude={"num_per_task"}),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _report(
    params: Params,
    rows: list[dict],
    merges: dict,
    evaluation: dict,
    run,
    lock: dict,
    results: Path,
) -> dict:
    """Write reports/<run.name>-compare/; its compare.json names the results folder (relative to
    the report folder) and the lock digest it compared on, which `featcal lineage` traces."""
    from featcal_core.report.compare import write_comparison

    out = REPORTS_ROOT / compare_name(params)
    record = {
        "run": params.run.name,
        "results_dir": os.path.relpath(Path(results).resolve(), out.resolve()),
        "lock_digest": lock.get("lock_digest"),
        "merges": {
            key: {
                "row": m["row"],
                "method": m["method"],
                "seconds": m["seconds"],
                "path": str(m["path"]),
            }
            for key, m in merges.items()
        },
        "evaluation": evaluation,
        "mlflow_run_id": run.info.run_id if run is not None else None,
        "prefect_flow_run_id": str(flow_run.get_id()),
    }
    files = write_comparison(
        out, run_name=params.run.name, rows=rows, reference=REFERENCE, record=record
    )
    log.info("comparison of %d variants: %s", len(rows), files["compare.md"])
    return {
        "variants": rows,
        "merges": record["merges"],
        "files": files,
        "report": str(files["compare.md"]),
        "mlflow_run_id": record["mlflow_run_id"],
        "prefect_flow_run_id": record["prefect_flow_run_id"],
    }


def _variant_metrics(row: dict) -> dict[str, float]:
    metrics = {}
    for task, values in row["tasks"].items():
        metrics.update({f"{k}/{task}": v for k, v in values.items() if v is not None})
    metrics.update({f"{k}_mean": v for k, v in row["mean"].items() if v is not None})
    metrics.update({k: v for k, v in row["cost"].items() if v is not None})
    scores = row.get("label_free") or {}
    metrics.update({f"label_free/{k}": scores[k] for k in LABEL_FREE if k in scores})
    return metrics


def _artifact(params: Params, summary: dict) -> None:
    from prefect.artifacts import create_markdown_artifact

    key = "featcal-compare-" + "".join(c if c.isalnum() else "-" for c in params.run.name.lower())
    create_markdown_artifact(
        markdown=Path(summary["report"]).read_text(),
        key=key[:100].strip("-"),
        description=f"featcal compare {params.run.name}",
    )
