"""Refit task heads that travel with a checkpoint: every task's linear head (head calibration)
in two files inside the checkpoint folder, beside its weights.

    heads.safetensors  "<task>.weight" (num_classes, hidden) and "<task>.bias" (num_classes),
                       float32, for every task
    heads.json         {"format": "featcal-task-heads", "version": 1,
                        "tasks": {task: {"features": "pooler_output" | "clip_image_embeds",
                                         "num_classes": C, "id2label": {"0": name, ...}}}}

logits (B, C) = features (B, hidden) @ weight.T + bias; `id2label` keeps each class's name (as
transformers' configs do). Both files go through the guarded writer (`atomic_file`): written
beside, renamed into place, and added to the folder's marker so the checkpoint still verifies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.linear_head import LinearHead
from featcal_core.io.outputs import atomic_file, write_json

WEIGHTS_NAME = "heads.safetensors"
CONFIG_NAME = "heads.json"
FORMAT = "featcal-task-heads"
VERSION = 1


def save_task_heads(directory: str | Path, heads: Mapping[str, LinearHead]) -> list[Path]:
    """Write `heads` (task → LinearHead) into the checkpoint folder `directory`; returns the two
    paths. Raises FeatCalError for no heads or a task name with a '.'."""
    directory = Path(directory)
    if not heads:
        raise FeatCalError(f"save_task_heads({directory}): no heads to write")
    tensors: dict[str, torch.Tensor] = {}
    tasks = {}
    for task, head in heads.items():
        if "." in task:
            raise FeatCalError(f"save_task_heads: task name {task!r} may not hold a '.'")
        tensors[f"{task}.weight"] = head.weight.detach().float().cpu().contiguous()
        tensors[f"{task}.bias"] = head.bias.detach().float().cpu().contiguous()
        tasks[task] = {
            "features": head.features,
            "num_classes": head.num_classes,
            "id2label": {str(i): label for i, label in enumerate(head.labels)},
        }
    with atomic_file(directory / WEIGHTS_NAME, flag="refit heads") as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    write_json(
        directory / CONFIG_NAME,
        {"format": FORMAT, "version": VERSION, "tasks": tasks},
        flag="refit heads",
    )
    return [directory / WEIGHTS_NAME, directory / CONFIG_NAME]


def has_task_heads(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_NAME).is_file()


def load_task_heads(directory: str | Path) -> dict[str, LinearHead]:
    """task → LinearHead from a checkpoint folder's heads.safetensors / heads.json; FeatCalError
    naming the file when either is missing or does not match the other."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    try:
        config = json.loads(config_path.read_text())
        tensors = load_file(str(weights_path))
    except (OSError, ValueError) as exc:
        raise FeatCalError(
            f"{directory}: cannot read its refit heads ({exc}); run the head "
            "calibration again (`featcal run` with featcal.heads)"
        ) from exc
    if config.get("format") != FORMAT:
        raise FeatCalError(f"{config_path} is not a {FORMAT} file")
    heads = {}
    for task, info in config["tasks"].items():
        try:
            weight, bias = tensors[f"{task}.weight"], tensors[f"{task}.bias"]
        except KeyError as exc:
            raise FeatCalError(f"{weights_path} has no tensor {exc} for task {task!r}") from None
        labels = [info["id2label"][str(i)] for i in range(int(info["num_classes"]))]
        heads[task] = LinearHead(weight, bias, labels, info["features"])
    return heads
