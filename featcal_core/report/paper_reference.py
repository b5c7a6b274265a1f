"""The paper's reference numbers (Gu et al., FeatCal; CLIP ViT-B/32, eight tasks, Task Arithmetic
s = 0.3, the authors' demo values), shown beside a run's own when the run is that setting: the
lock's base is `openai/clip-vit-base-patch32`, its experts are the published
`tanganke/clip-vit-base-patch32_<task>` checkpoints, and the merge is Task Arithmetic 0.3.

    section = paper_section(lock, merge, evaluation)   # a report section, or None

Accuracy in percent, as the paper reports it (average over the tasks it lists).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from featcal_core.report.sections import DASH, _Section

__all__ = ["PAPER_BASE", "PAPER_CLIP", "paper_section"]

PAPER_BASE = "openai/clip-vit-base-patch32"
_EXPERT_PREFIX = "tanganke/clip-vit-base-patch32_"
#: expert task (repository suffix) → (Task Arithmetic, TA + FeatCal) accuracy, %
PAPER_CLIP = {
    "sun397": (57.0, 70.1),
    "stanford-cars": (55.7, 72.5),
    "resisc45": (64.8, 87.9),
    "eurosat": (73.3, 96.2),
    "svhn": (77.9, 95.1),
    "gtsrb": (68.5, 93.2),
    "mnist": (96.1, 98.8),
    "dtd": (47.1, 70.0),
}
#: the paper's averages: Task Arithmetic, TA + Surgery, TA + FeatCal, individual experts (≈)
PAPER_AVERAGES = {"merged": 67.5, "surgery": 77.0, "calibrated": 85.5, "expert": 90.3}


def _repo(entry: Mapping[str, Any] | None) -> str | None:
    return None if not isinstance(entry, Mapping) else entry.get("repo_id")


def _matches(lock: Mapping[str, Any] | None, merge: Mapping[str, Any] | None) -> dict[str, str]:
    """{run task: paper task} when the run is the paper's CLIP setting, else {}."""
    if not lock or _repo(lock.get("base")) != PAPER_BASE:
        return {}
    if not merge or merge.get("method") != "task_arithmetic":
        return {}
    scale = (merge.get("hyperparameters") or {}).get("scale")
    if not isinstance(scale, int | float) or not math.isclose(scale, 0.3):
        return {}
    found = {}
    for task, entry in (lock.get("experts") or {}).items():
        repo = _repo(entry) or ""
        paper_task = repo.removeprefix(_EXPERT_PREFIX)
        if not repo.startswith(_EXPERT_PREFIX) or paper_task not in PAPER_CLIP:
            return {}  # another expert: not the paper's setting
        found[str(task)] = paper_task
    return found


def _pct(value: Any) -> str:
    return DASH if not isinstance(value, int | float) else f"{100 * value:.1f}"


def paper_section(
    lock: Mapping[str, Any] | None,
    merge: Mapping[str, Any] | None,
    evaluation: Mapping[str, Mapping[str, Mapping[str, Any]]],
) -> _Section | None:
    """The paper's numbers per task beside this run's merged and calibrated accuracy, when the
    run is the paper's CLIP setting (see the module doc); None otherwise."""
    tasks = _matches(lock, merge)
    if not tasks:
        return None
    rows = []
    for task, paper_task in tasks.items():
        ta, featcal = PAPER_CLIP[paper_task]
        ours = evaluation.get(task) or {}
        rows.append(
            [
                task,
                f"{ta:.1f}",
                f"{featcal:.1f}",
                _pct((ours.get("merged") or {}).get("accuracy")),
                _pct((ours.get("calibrated") or {}).get("accuracy")),
            ]
        )
    lines = [
        "This run is the paper's CLIP setting (ViT-B/32, the published experts, Task Arithmetic "
        "0.3): its numbers beside the paper's (Gu et al., FeatCal, the authors' demo values).",
        f"Paper averages over its eight tasks: Task Arithmetic {PAPER_AVERAGES['merged']}, "
        f"+ Surgery {PAPER_AVERAGES['surgery']}, + FeatCal {PAPER_AVERAGES['calibrated']}, "
        f"experts ≈ {PAPER_AVERAGES['expert']}.",
        "Differences to expect: the paper's heads use its own per-dataset templates and class "
        "names (featcal's prompt sets word them differently), and its evaluation reads whole "
        "test splits (see the notes above for this run's).",
    ]
    headers = ["task", "paper TA", "paper TA + FeatCal", "this run: merged", "this run: calibrated"]
    return _Section("The paper's numbers", lines=lines, tables=[(headers, rows)])
