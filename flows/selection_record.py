"""The `select` step's record (selection.json) and what it keys on: the key of the settings a
choice was made for, each candidate's params (its own overrides under the user's `--set`), and
the params of a recorded winner. Pure params work: no step runs here (featcal.flows.selection
runs the step)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from featcal_core.errors import FeatCalError
from featcal_core.params import Params
from featcal_core.params.repair import Variant, layered
from featcal_core.provenance.records import RESULTS_LAYOUT

FORMAT = "featcal-selection-v1"
#: what the choice depends on besides select: (a candidate overrides these)
_KEYED = {
    "run": {"seed"},
    "models": True,
    "tasks": True,
    "merge": True,
    "featcal": True,
    "repair": True,
}  # dvc.yaml's select stage: the same params


def selection_key(params: Params) -> str:
    """sha256 of what the choice depends on: select:, the sections its candidates override and
    the user's `--set` overrides that every candidate takes."""
    data = params.model_dump(mode="json", include={**_KEYED, "select": True})
    data["user_set"] = layered([], params.user_set)[0]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def candidate_overrides(params: Params, candidate: Variant) -> tuple[list[str], list[str]]:
    """(the overrides that make `candidate`'s params: its own, then the user's `--set` ones of
    the keys a candidate may set, which win; its own overrides that the user's replace)."""
    return layered(candidate.set, params.user_set)


def candidate_params(params: Params, name: str, overrides: list[str]) -> Params:
    """Candidate `name`'s params: `params` with `overrides` (`candidate_overrides`' first),
    repaired in candidates/<name>."""
    results = Path(params.run.results_dir) / RESULTS_LAYOUT["candidates"] / name
    bare = params.model_copy(update={"select": None})
    return bare.with_overrides([*overrides, f"run.results_dir={results}"])


def ineligible(params: Params, candidates: dict[str, Params]) -> dict[str, str]:
    """{candidate: why it may not win}: a repair that adds a module per task, unless
    select.allow_task_modules (a winner is one checkpoint)."""
    from featcal_core.repair.registry import get as get_repair

    if params.select is None or params.select.allow_task_modules:
        return {}
    return {
        name: f"{c.repair_method} adds a module per task; select.allow_task_modules: true "
        "lets it win"
        for name, c in candidates.items()
        if get_repair(c.repair_method).output == "task_modules"
    }


def check_candidates(params: Params) -> None:
    """Every candidate's overrides applied and validated, and one candidate at least that may
    win (before any work)."""
    from featcal_core.repair.registry import available
    from featcal_core.repair.registry import get as get_repair

    if params.select is None:
        return
    candidates = {}
    for candidate in params.select.candidates:
        try:
            candidates[candidate.name] = candidate_params(
                params, candidate.name, candidate_overrides(params, candidate)[0]
            )
        except FeatCalError as exc:
            raise FeatCalError(f"select.candidates {candidate.name!r}: {exc}") from None
    barred = ineligible(params, candidates)
    if len(barred) == len(candidates):
        single = [n for n in available() if get_repair(n).output != "task_modules"]
        repairs = sorted({candidates[n].repair_method for n in barred})
        raise FeatCalError(
            f"select.candidates: none may win (each repairs with {' or '.join(repairs)}, which "
            "adds a module per task, and a winner is one checkpoint); add a candidate whose "
            f"repair.method is {', '.join(single[:-1])} or {single[-1]}, or set "
            "select.allow_task_modules: true"
        )


def chosen(params: Params, record: dict | None) -> Params | None:
    """`params` with the record's winner applied (select: cleared), when the record is this
    params' current choice; None otherwise."""
    if record is None or record.get("format") != FORMAT:
        return None
    if record.get("key") != selection_key(params) or record.get("winner") is None:
        return None
    bare = params.model_copy(update={"select": None})
    return bare.with_overrides(record["set"])
