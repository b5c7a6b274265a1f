"""A linear classification head stored next to a tower checkpoint (vision experts, text-paper
experts).

Such an expert is a plain tower directory (`CLIPVisionModel`, `BertModel`); its classifier lives
beside it in two files:

    classifier.safetensors  weight (num_classes, hidden) and bias (num_classes), float32
    classifier.json         {"format": "featcal-linear-head", "version": 1,
                             "features": "pooler_output", "num_classes": C, "labels": [...]}

logits (B, C) = features (B, hidden) @ weight.T + bias, where `features` names the tower output
the head reads: `pooler_output`, or `mean_pooling` (the mean of `last_hidden_state` over the real
tokens, as sentence-transformers pool a text model such as all-MiniLM-L6-v2; `pooled` computes
both). Each file is written to a temporary name in the same directory and renamed into place
with os.replace.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import atomic_file

WEIGHTS_NAME = "classifier.safetensors"
CONFIG_NAME = "classifier.json"
FORMAT = "featcal-linear-head"
VERSION = 1
#: the tower outputs a head may read (clip_image_embeds: refit CLIP zero-shot heads)
FEATURES = ("pooler_output", "mean_pooling", "clip_image_embeds")


@dataclass
class LinearHead:
    """weight (num_classes, hidden) and bias (num_classes), float32, on the CPU; labels: the
    class names in class-index order; features: the tower output the head reads."""

    weight: torch.Tensor
    bias: torch.Tensor
    labels: list[str]
    features: str = "pooler_output"

    @property
    def num_classes(self) -> int:
        return int(self.weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """logits (B, num_classes) of features (B, hidden)."""
        return features.float() @ self.weight.T + self.bias


def pooled(output: Any, attention_mask: torch.Tensor | None, features: str) -> torch.Tensor:
    """The head's input (B, hidden) from a tower's output: its `pooler_output`, or for
    "mean_pooling" the mean of `last_hidden_state` (B, S, hidden) over the tokens whose
    attention_mask (B, S) is 1 (every token when the mask is None)."""
    if features == "pooler_output":
        return output.pooler_output
    if features != "mean_pooling":
        raise FeatCalError(f"pooled: features {features!r} is not pooler_output or mean_pooling")
    hidden = output.last_hidden_state
    if attention_mask is None:
        return hidden.mean(dim=1)
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


def has_linear_head(directory: str | Path) -> bool:
    """True when either head file is present in `directory` (a half-present head then fails
    loudly in load_linear_head instead of being silently ignored)."""
    directory = Path(directory)
    return (directory / WEIGHTS_NAME).is_file() or (directory / CONFIG_NAME).is_file()


def save_linear_head(
    directory: str | Path,
    weight: torch.Tensor,
    bias: torch.Tensor,
    labels: Sequence[str],
    *,
    features: str = "pooler_output",
) -> None:
    """Write classifier.safetensors and classifier.json into `directory` (created if missing).

    weight (num_classes, hidden), bias (num_classes), labels: num_classes distinct class names.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    labels = [str(label) for label in labels]
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise FeatCalError(
            f"save_linear_head({directory}): weight must be a 2-D tensor (num_classes, hidden), "
            f"got {_shape(weight)}; pass the nn.Linear weight"
        )
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
        raise FeatCalError(
            f"save_linear_head({directory}): bias must have shape ({weight.shape[0]},) to match "
            f"weight {tuple(weight.shape)}, got {_shape(bias)}; pass the nn.Linear bias"
        )
    if len(labels) != weight.shape[0]:
        raise FeatCalError(
            f"save_linear_head({directory}): {len(labels)} labels for {weight.shape[0]} classes; "
            "pass one name per row of weight"
        )
    if len(set(labels)) != len(labels):
        raise FeatCalError(
            f"save_linear_head({directory}): the labels are not distinct ({labels}); pass unique "
            "class names"
        )
    if features not in FEATURES:
        raise FeatCalError(
            f"save_linear_head({directory}): unknown features {features!r}; use one of {FEATURES}"
        )
    if not weight.is_floating_point() or not bias.is_floating_point():
        raise FeatCalError(
            f"save_linear_head({directory}): weight and bias must be floating point, got "
            f"{weight.dtype} and {bias.dtype}"
        )
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        "weight": weight.detach().to("cpu", torch.float32).contiguous().clone(),
        "bias": bias.detach().to("cpu", torch.float32).contiguous().clone(),
    }
    config = {
        "format": FORMAT,
        "version": VERSION,
        "features": features,
        "num_classes": int(weight.shape[0]),
        "labels": labels,
    }
    _atomic_write(directory / WEIGHTS_NAME, lambda path: save_file(tensors, str(path)))
    _atomic_write(
        directory / CONFIG_NAME,
        lambda path: path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8"),
    )


def load_linear_head(directory: str | Path, *, hidden_size: int | None = None) -> LinearHead:
    """The head stored in `directory`; hidden_size, when given, must match weight's columns."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    weights_path, config_path = directory / WEIGHTS_NAME, directory / CONFIG_NAME
    for path, other in ((weights_path, config_path), (config_path, weights_path)):
        if not path.is_file():
            raise FeatCalError(
                f"{path} is missing (found {other.name}: {other.is_file()}); write the head with "
                "featcal_core.evaluation.linear_head.save_linear_head"
            )
    config = _read_config(config_path)
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise FeatCalError(
            f"{weights_path} is not a readable safetensors file ({exc}); rewrite it with "
            "save_linear_head"
        ) from exc
    if set(tensors) != {"weight", "bias"}:
        raise FeatCalError(
            f"{weights_path} holds tensors {sorted(tensors)}, expected exactly 'weight' and "
            "'bias'; rewrite it with save_linear_head"
        )
    weight, bias = tensors["weight"], tensors["bias"]
    if not weight.is_floating_point() or not bias.is_floating_point():
        raise FeatCalError(
            f"{weights_path}: weight and bias must be float32, got {weight.dtype} and "
            f"{bias.dtype}; rewrite it with save_linear_head"
        )
    if weight.ndim != 2 or tuple(bias.shape) != (weight.shape[0],):
        raise FeatCalError(
            f"{weights_path}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} are not "
            "(num_classes, hidden) and (num_classes,); rewrite it with save_linear_head"
        )
    if weight.shape[0] != config["num_classes"]:
        raise FeatCalError(
            f"{weights_path} has {weight.shape[0]} classes but {config_path.name} says "
            f"num_classes {config['num_classes']}; rewrite both with save_linear_head"
        )
    if hidden_size is not None and weight.shape[1] != hidden_size:
        raise FeatCalError(
            f"{weights_path}: the head reads {weight.shape[1]} features but the tower has "
            f"hidden size {hidden_size}; pair the head with the tower it was trained on"
        )
    return LinearHead(
        weight=weight.float().contiguous(),
        bias=bias.float().contiguous(),
        labels=list(config["labels"]),
        features=config["features"],
    )


def _read_config(path: Path) -> dict:
    fix = "rewrite it with featcal_core.evaluation.linear_head.save_linear_head"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeatCalError(f"{path} is not readable JSON ({exc}); {fix}") from exc
    if not isinstance(config, dict):
        raise FeatCalError(f"{path} is not a JSON object; {fix}")
    if config.get("format") != FORMAT:
        raise FeatCalError(
            f"{path}: format is {config.get('format')!r}, expected {FORMAT!r}; {fix}"
        )
    if config.get("version") != VERSION:
        raise FeatCalError(
            f"{path}: version {config.get('version')!r} is not supported (expected {VERSION}); "
            f"{fix}"
        )
    if config.get("features") not in FEATURES:
        raise FeatCalError(
            f"{path}: unknown features {config.get('features')!r}, expected one of {FEATURES}; "
            f"{fix}"
        )
    num_classes = config.get("num_classes")
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise FeatCalError(
            f"{path}: num_classes must be a positive integer, got {num_classes!r}; {fix}"
        )
    labels = config.get("labels")
    if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
        raise FeatCalError(f"{path}: labels must be a list of class-name strings; {fix}")
    if len(labels) != num_classes:
        raise FeatCalError(f"{path}: {len(labels)} labels but num_classes {num_classes}; {fix}")
    return config


def _atomic_write(target: Path, write) -> None:
    """Call write(temporary path) beside `target`, then rename the result onto `target` (the
    guarded writer's `atomic_file`)."""
    with atomic_file(target, "linear head file") as temporary:
        write(temporary)


def _shape(value: object) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__
