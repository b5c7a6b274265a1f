"""What the trained repairs (Representation Surgery, AdaMerging) read, checked and loaded in one
place: the heads they fit to, the calibration inputs they train on, the checks of their shared
hyperparameters, and the guard on their output folder.

`load_trained_inputs` runs every check before any heavy work, so a bad value is named while
`out` is still as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from featcal_core.data.calibration_data import CalibrationSet, load_calibration_set
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.head import Head
from featcal_core.io.adapters import open_expert
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.outputs import check_output
from featcal_core.method.calibration import check_tasks, resolve_device
from featcal_core.method.settings import Settings


def check_positive_integers(values: Mapping[str, object]) -> None:
    """FeatCalError naming the first of {flag: value} that is not a positive integer."""
    for flag, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FeatCalError(f"{flag} must be a positive integer (got {value!r})")


def check_learning_rate(lr: object) -> None:
    """FeatCalError unless `lr` (--lr) is a finite positive number."""
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not 0 < lr < float("inf"):
        raise FeatCalError(f"--lr must be a positive number (got {lr!r})")


def task_heads(
    experts: Mapping[str, str | Path],
    heads: Mapping[str, Head] | None,
    tokenizer_dir: str | Path | None,
    method: str,
) -> dict[str, Head]:
    """{task: head}: the given one, else the expert's own classifier (ExpertHead); errors name
    `method`, the repair that needs the heads."""
    if heads is not None:
        extra = sorted(set(heads) - set(experts))
        if extra:
            raise FeatCalError(
                f"heads: task {extra[0]!r} has no expert; give heads only for the experts' tasks"
            )
    from featcal_core.evaluation.expert_head import ExpertHead

    out = {}
    for task, expert in experts.items():
        if heads is not None and task in heads:
            out[task] = heads[task]
            continue
        try:
            head = ExpertHead(expert, tokenizer_dir=tokenizer_dir)
        except FeatCalError as exc:  # e.g. no `architectures`: name the task
            raise FeatCalError(f"task {task!r}: {exc}") from exc
        try:
            head.require_head()
        except FeatCalError as exc:
            raise FeatCalError(
                f"task {task!r}: expert {expert} has no classification head, so there is no head "
                f"input for {method} to act on; save classifier.safetensors beside the tower or "
                f"pass heads={{{task!r}: ZeroShotHead(...)}}"
            ) from exc
        out[task] = head
    return out


@dataclass
class TrainedInputs:
    """A trained repair's inputs, checked: `inputs` are the paths `out` may not overwrite."""

    device: torch.device
    merged: Checkpoint
    experts: dict[str, Checkpoint]
    heads: dict[str, Head]
    sets: dict[str, CalibrationSet]
    inputs: tuple[str | Path, ...]

    def describe(self, **more: Checkpoint) -> dict:
        """The record's "inputs": `more` (e.g. base=...), merged, experts, calibration sets."""
        return {
            **{name: checkpoint.describe() for name, checkpoint in more.items()},
            "merged": self.merged.describe(),
            "experts": {t: c.describe() for t, c in self.experts.items()},
            "calibration": {t: s.describe() for t, s in self.sets.items()},
        }


def load_trained_inputs(
    method: str,
    merged: str | Path,
    experts: Mapping[str, str | Path],
    calibration_sets: Mapping[str, str | Path],
    out: str | Path,
    *,
    heads: Mapping[str, Head] | None,
    tokenizer_dir: str | Path | None,
    settings: Settings,
    seed: object,
    overwrite: bool,
    more_inputs: tuple[str | Path, ...] = (),
) -> TrainedInputs:
    """Check tasks, seed and `out` (against every input, `more_inputs` first), then open the
    checkpoints, resolve the heads and draw each task's calibration rows as FeatCal draws them
    (settings.num_per_task, settings.seed). Errors name `method`."""
    check_tasks(dict(experts), dict(calibration_sets))
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise FeatCalError(f"{method} seed must be an integer (got {seed!r})")
    inputs = (*more_inputs, merged, *experts.values(), *calibration_sets.values())
    check_output(out, overwrite=overwrite, inputs=inputs)
    device = resolve_device(settings.device)
    merged_ckpt = Checkpoint(merged, role="merged model")
    expert_ckpts = {
        t: open_expert(p, f"expert {t!r}", None, reader=method) for t, p in experts.items()
    }
    found = task_heads(experts, heads, tokenizer_dir, method)
    return TrainedInputs(
        device=device,
        merged=merged_ckpt,
        experts=expert_ckpts,
        heads=found,
        sets={
            task: load_calibration_set(
                task, path, found[task].modality, settings.num_per_task, settings.seed
            )
            for task, path in calibration_sets.items()
        },
        inputs=inputs,
    )
