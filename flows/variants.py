"""Variants of one run (merge × repair × hyperparameters) that share its download and
calibration sets: `featcal compare`'s variants and `select:`'s candidates.

Each distinct merge runs once, in `<results>/merges/<key>/`; each variant's repair runs in its
own results folder and reads that merge. Costs: wall seconds and the step's own peak RSS (MiB).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from featcal.flows.steps import Steps
from featcal_core.memory import peak_rss_bytes, reset_peak_rss
from featcal_core.params import Params
from featcal_core.repair.registry import get as get_repair

_MIB = 1024 * 1024


def merge_key(merge) -> str:
    """12 hex digits naming a merge: method and its filled-in hyperparameters."""
    from featcal_core.merging import get

    spec = {
        "method": merge.method,
        "hyperparameters": get(merge.method).check(dict(merge.hyperparameters)),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def shared_steps(steps: Steps, params: Params, merged: Path) -> Steps:
    """Steps of `params` that read `steps`' lock and calibration sets and the merge `merged`."""
    found = Steps(params, in_flow=steps.in_flow)
    found.paths.update(
        lock=steps.paths["lock"], calibration_sets=steps.paths["calibration_sets"], merged=merged
    )
    return found


def run_merges(steps: Steps, sources: list[tuple[str | None, Params]], step_run) -> dict:
    """Run each distinct merge of `sources` ((row name or None, params)) once, in order;
    {merge key: {"row", "path", "method", "hyperparameters", "seconds", "peak_rss_mb"}}. A
    source's row name names its merge's evaluation row (None: `merge-<method>-<key>`)."""
    merges: dict[str, dict[str, Any]] = {}
    for row, source in sources:
        key = merge_key(source.merge)
        if key in merges:
            continue
        method = source.merge.method
        row = row or f"merge-{method}-{key[:6]}"
        path = steps.paths["merges"] / key
        reset_peak_rss()
        started = time.perf_counter()
        with step_run(f"merge {row}"):
            record = shared_steps(steps, source, path).merge()
        merges[key] = {
            "row": row,
            "path": path,
            "method": method,
            "hyperparameters": record["hyperparameters"],
            "seconds": time.perf_counter() - started,
            "peak_rss_mb": peak_rss_bytes() / _MIB,
        }
    return merges


def repair(steps: Steps, heads: bool = False) -> dict:
    """`steps`' repair (repair.method) of its merge into its calibrated folder; {"path" (None:
    no repair), "repair_seconds", "peak_rss_mb", "heads"}. heads: with featcal.heads true, also refit
    the task heads on the repaired model (on the merge when there is no repair; not for a repair
    of per-task modules, which feed the tasks' own heads), as `featcal run` does: "heads" {task: folder},
    else None. The seconds and the peak RSS cover both; a reused one-go repair counts the cost
    recorded when it ran (Steps.reused_cost)."""
    output = steps.repair.output
    reset_peak_rss()
    started = time.perf_counter()
    if output != "none":
        steps.calibrate()
    repaired = time.perf_counter()
    refit = None
    if heads and steps.params.featcal.heads and output != "task_modules":
        refit = steps.heads("merged" if output == "none" else "calibrated")
    seconds = time.perf_counter() - started
    path = None if output == "none" else str(steps.paths["calibrated"])
    peak = peak_rss_bytes() / _MIB if path is not None or refit else None
    reused = steps.reused_cost
    if reused is not None:  # what the repair cost when it ran, not what reusing it took
        seconds = float(reused["seconds"]) + time.perf_counter() - repaired
        if reused.get("peak_rss_mb") is not None:
            peak = max(peak or 0.0, float(reused["peak_rss_mb"]))
    return {"path": path, "repair_seconds": seconds, "peak_rss_mb": peak, "heads": refit}


def model_row(name: str, variant: Params, merges: dict, costs: dict) -> str:
    """The evaluation row of variant `name`'s model: its own, or its merge's (no repair)."""
    return name if costs[name]["path"] else merges[merge_key(variant.merge)]["row"]


def evaluation_rows(variants: dict[str, Params], merges: dict, costs: dict):
    """(models, surgeries, refit heads) for evaluate_models / score_candidates: each repaired
    variant's checkpoint under its name, each merge under its row, each Surgery variant as (its
    merge, its modules), and {model row: {task: refit head folder}} of the variants that refit
    heads (their rows: `<model row>_heads`)."""
    models = {merge["row"]: str(merge["path"]) for merge in merges.values()}
    surgeries, refit = {}, {}
    for name, cost in costs.items():
        if get_repair(variants[name].repair_method).output == "task_modules":
            surgeries[name] = (str(merges[merge_key(variants[name].merge)]["path"]), cost["path"])
        elif cost["path"] is not None:
            models[name] = cost["path"]
        if cost.get("heads"):
            refit[model_row(name, variants[name], merges, costs)] = cost["heads"]
    return models, surgeries, refit


def row_of(name: str, variant: Params, merges: dict, costs: dict) -> str:
    """The evaluation row that holds variant `name`: its model's row, under its refit heads
    (`<row>_heads`) when it refit them."""
    row = model_row(name, variant, merges, costs)
    return f"{row}_heads" if costs[name].get("heads") else row
