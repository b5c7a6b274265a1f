"""The classifier head interface: a *head* turns the tower of the evaluated checkpoint into
class logits, for `featcal_core.evaluation.accuracy.evaluate` and head calibration.

`Head` gives the preprocessing of a batch of rows and the classifier, built as features (the
head's input, (B, d)) followed by one final Linear that `with_linear` can replace. The concrete
heads are `featcal_core.evaluation.expert_head.ExpertHead` and
`featcal_core.evaluation.zero_shot_head.ZeroShotHead` (and open_clip's in
`featcal_core.open_clip.zero_shot`).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal_core.errors import FeatCalError

__all__ = ["Head"]


class Head(ABC):
    """A classifier head for `evaluate`: preprocessing plus a tower-to-logits module."""

    #: "image" or "text": which input column `evaluate` reads
    modality: str = ""

    @property
    @abstractmethod
    def num_classes(self) -> int: ...

    @abstractmethod
    def preprocess(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        """Model inputs for a batch of rows (PIL images / arrays, or strings)."""

    @property
    def labels(self) -> list[str]:
        """Class names in class-index order (default: the indices as text)."""
        return [str(i) for i in range(self.num_classes)]

    #: a replacement for the head's final Linear (set by `with_linear`; head calibration)
    linear_override: tuple[torch.Tensor, torch.Tensor] | None = None

    @abstractmethod
    def parts(self, model_dir: str | Path, device: torch.device) -> tuple[nn.Module, nn.Linear]:
        """(features, linear) in eval mode on `device`, running the tower stored in `model_dir`:
        features(**inputs) gives the head's input (B, d) float32, linear maps it to logits
        (B, classes). `linear` is the head's own, before any `with_linear` override."""

    def layers(self, model_dir: str | Path, device: torch.device) -> tuple[nn.Module, nn.Linear]:
        """(features, linear) as `classifier` runs them: `parts` with the linear override."""
        features, linear = self.parts(model_dir, device)
        if self.linear_override is not None:
            weight, bias = self.linear_override
            linear = _linear(weight, bias).to(device)
        return features, linear

    def classifier(self, model_dir: str | Path, device: torch.device) -> nn.Module:
        """A module in eval mode on `device` whose forward(**inputs) gives logits (B, classes),
        running the tower stored in `model_dir` under this head (and its linear override)."""
        return _FeatureClassifier(*self.layers(model_dir, device)).eval()

    def linear_override_layer(self, device: torch.device) -> nn.Linear:
        """The replacement final Linear set by `with_linear`, on `device` (no tower loaded)."""
        if self.linear_override is None:
            raise FeatCalError(f"{self.describe()} has no replacement Linear; use layers()")
        return _linear(*self.linear_override).to(device)

    def with_linear(self, weight: torch.Tensor, bias: torch.Tensor) -> Head:
        """This head with its final Linear replaced by (weight (classes, d), bias (classes))."""
        if weight.ndim != 2 or bias.shape != (weight.shape[0],):
            raise FeatCalError(
                f"{self.describe()}: a replacement head needs weight (classes, d) and bias "
                f"(classes), got {tuple(weight.shape)} and {tuple(bias.shape)}"
            )
        if weight.shape[0] != self.num_classes:
            raise FeatCalError(
                f"{self.describe()}: the replacement head has {weight.shape[0]} classes, the head "
                f"{self.num_classes}; calibrate the head for this task"
            )
        clone = copy.copy(self)
        clone.linear_override = (weight.detach().float().cpu(), bias.detach().float().cpu())
        return clone

    def describe(self) -> str:
        return type(self).__name__

    def identity(self) -> dict[str, Any] | None:
        """What this head's logits depend on besides the tower, as JSON values: its own inputs
        (`own_identity`) and its replacement Linear's values. The key of the evaluation store
        (result_cache); None where the head cannot say, so its rows are evaluated each time."""
        from featcal_core.provenance.identity import tensors_digest

        own = self.own_identity()
        if own is None:
            return None
        override = tensors_digest(self.linear_override) if self.linear_override else None
        return {"head": type(self).__name__, **own, "linear_override": override}

    def own_identity(self) -> dict[str, Any] | None:
        """The files and settings this head reads (digests, prompts), as JSON values; None: not
        known."""
        return None


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight.float())
        if bias is not None:
            layer.bias.copy_(bias.float())
    return layer.eval()


class _FeatureClassifier(nn.Module):
    def __init__(self, features: nn.Module, linear: nn.Linear):
        super().__init__()
        self.features = features
        self.linear = linear

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(self.features(**inputs).float())
