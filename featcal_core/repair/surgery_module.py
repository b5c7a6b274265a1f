"""Representation Surgery's module (Yang et al., ICML 2024), its files, and a head applying it.

One module per task, on the feature z the task's head reads (`Head.parts`' features, (N, d)):

    ẑ = z − W_up · ReLU(W_down · z)        W_down (r, d), W_up (d, r), no biases

A task's folder holds

    surgery.safetensors  down_proj.weight (r, d) and up_proj.weight (d, r), float32
    surgery.json         {"format": "featcal-surgery", "version": 1, "task", "rank", "dim", ...}

`load_surgery(folder)` reads them back; `SurgeryHead(head, module)` is `head` with the module
between its features and its final Linear, for `featcal_core.evaluation.accuracy.evaluate`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.head import Head
from featcal_core.io.outputs import atomic_file, write_json

__all__ = [
    "SURGERY_CONFIG",
    "SURGERY_WEIGHTS",
    "SurgeryHead",
    "SurgeryModule",
    "load_surgery",
    "save_surgery",
]

SURGERY_WEIGHTS = "surgery.safetensors"
SURGERY_CONFIG = "surgery.json"
FORMAT = "featcal-surgery"
VERSION = 1
KEYS = ("down_proj.weight", "up_proj.weight")


class SurgeryModule(nn.Module):
    """ẑ = z − W_up·ReLU(W_down·z): forward(z (N, d)) → ẑ (N, d), in the module's dtype."""

    #: the saved surgery config, on a module read back by `load_surgery`
    config: dict[str, Any]

    def __init__(self, dim: int, rank: int):
        super().__init__()
        if not (isinstance(dim, int) and isinstance(rank, int) and dim >= 1 and rank >= 1):
            raise FeatCalError(
                f"surgery module: dim and rank must be positive integers "
                f"(got dim={dim!r}, rank={rank!r})"
            )
        # no init here (it would draw from the global generator): `reset_parameters` or a load
        self.down_proj = nn.utils.skip_init(nn.Linear, dim, rank, bias=False)
        self.up_proj = nn.utils.skip_init(nn.Linear, rank, dim, bias=False)

    @property
    def dim(self) -> int:
        return int(self.down_proj.in_features)

    @property
    def rank(self) -> int:
        return int(self.down_proj.out_features)

    def reset_parameters(self, generator: torch.Generator) -> SurgeryModule:
        """The authors' init: W_down as nn.Linear's default (Kaiming-uniform, a = √5), W_up = 0,
        so that ẑ = z before training."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.down_proj.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.up_proj.weight)
        return self

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = z.to(self.down_proj.weight.dtype)
        return z - self.up_proj(torch.relu(self.down_proj(z)))


def save_surgery(folder: str | Path, module: SurgeryModule, config: dict[str, Any]) -> None:
    """Write `module`'s weights (float32) and `config` (plus format, version, rank, dim) into
    `folder` (created if missing), each file atomically."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tensors = {
        k: v.detach().to("cpu", torch.float32).contiguous() for k, v in module.state_dict().items()
    }
    with atomic_file(folder / SURGERY_WEIGHTS, "surgery weights") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    full = {"format": FORMAT, "version": VERSION, "rank": module.rank, "dim": module.dim, **config}
    write_json(folder / SURGERY_CONFIG, full, "surgery config")


def _config(folder: Path) -> dict[str, Any]:
    path = folder / SURGERY_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FeatCalError(f"{path} is not readable JSON ({exc}); re-run train_surgery") from exc
    found = config.get("format") if isinstance(config, dict) else None
    if found != FORMAT:
        raise FeatCalError(
            f"{path}: format is {found!r}, not {FORMAT!r}; pass a folder written by train_surgery"
        )
    if config.get("version") != VERSION:
        raise FeatCalError(
            f"{path}: version {config.get('version')!r} is not supported (this "
            f"featcal reads version {VERSION}); re-run train_surgery"
        )
    for key in ("rank", "dim"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise FeatCalError(
                f"{path}: {key} must be a positive integer (got {value!r}); re-run train_surgery"
            )
    return config


def load_surgery(folder: str | Path) -> SurgeryModule:
    """The module saved in `folder` (eval mode, float32, CPU); its config as `.config`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in (SURGERY_CONFIG, SURGERY_WEIGHTS):
        if not (folder / name).is_file():
            raise FeatCalError(
                f"surgery folder {folder}: {name} is missing; pass a task folder "
                "written by train_surgery (OUT/<task>)"
            )
    config = _config(folder)
    path = folder / SURGERY_WEIGHTS
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise FeatCalError(
            f"{path} is not a readable safetensors file ({exc}); re-run train_surgery"
        ) from exc
    module = SurgeryModule(config["dim"], config["rank"])
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != expected:
        raise FeatCalError(
            f"{path} holds {got}, {SURGERY_CONFIG} (rank {config['rank']}, dim "
            f"{config['dim']}) needs {expected}; re-run train_surgery"
        )
    if not all(t.is_floating_point() and torch.isfinite(t).all() for t in tensors.values()):
        raise FeatCalError(f"{path}: NaN, Inf or non-float weights; re-run train_surgery")
    module.load_state_dict({k: v.float() for k, v in tensors.items()})
    module.config = config
    return module.eval()


class _SurgeryFeatures(nn.Module):
    def __init__(self, features: nn.Module, surgery: SurgeryModule):
        super().__init__()
        self.features = features
        self.surgery = surgery

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.surgery(self.features(**inputs).float())


class SurgeryHead(Head):
    """`head` with a surgery module between its features (B, d) and its final Linear; preprocessing,
    classes and any `with_linear` override are `head`'s."""

    def __init__(self, head: Head, surgery: SurgeryModule):
        self.head = head
        self.surgery = surgery
        self.modality = head.modality
        self.linear_override = head.linear_override

    @property
    def num_classes(self) -> int:
        return self.head.num_classes

    @property
    def labels(self) -> list[str]:
        return self.head.labels

    def preprocess(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        return self.head.preprocess(rows)

    def describe(self) -> str:
        return f"{self.head.describe()} with surgery (rank {self.surgery.rank})"

    def own_identity(self) -> dict[str, Any] | None:
        """The wrapped head's identity and the surgery module's values."""
        from featcal_core.provenance.identity import tensors_digest

        inner = self.head.identity()
        if inner is None:
            return None
        state = self.surgery.state_dict()
        return {"inner": inner, "surgery": [sorted(state), tensors_digest(list(state.values()))]}

    def parts(self, model_dir: str | Path, device: torch.device) -> tuple[nn.Module, nn.Linear]:
        features, linear = self.head.parts(model_dir, device)
        if linear.in_features != self.surgery.dim:
            raise FeatCalError(
                f"{self.describe()}: the surgery module has width {self.surgery.dim} but the head "
                f"reads {linear.in_features} features; use the module trained for this head"
            )
        surgery = SurgeryModule(self.surgery.dim, self.surgery.rank)
        surgery.load_state_dict(self.surgery.state_dict())
        return _SurgeryFeatures(features, surgery).to(device).eval(), linear
