"""Loading the evaluated checkpoint's tower tensors into a head's model.

`_load_tower` copies the tower of the checkpoint being evaluated (base, expert, merged or
calibrated) into the tower tensors of a head's model, checking the family, every name and every
shape, so that an incompatible tower fails with a clear error instead of a silent mismatch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from featcal_core.architectures import detect
from featcal_core.architectures.base import Architecture
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.safetensors_io import DTYPES

logger = logging.getLogger(__name__)


def _tower_prefix(arch: Architecture, names: Any, what: str) -> str:
    return arch.find_prefix(names, what)


def _load_tower(
    targets: dict[str, torch.Tensor],
    model_dir: str | Path,
    arch: Architecture,
    *,
    head: str,
    optional: tuple[str, ...] = (),
) -> list[str]:
    """Copy the tower tensors of the checkpoint in `model_dir` into `targets` (canonical name →
    parameter tensor, modified in place). Every target must be found with the same shape, except
    names under `optional`, which then keep their values. Returns the replaced names."""
    checkpoint = Checkpoint(model_dir, role="evaluated model")
    source = detect(checkpoint.config, source=str(checkpoint.directory / "config.json"))
    if source.name != arch.name:
        raise FeatCalError(
            f"evaluated model {checkpoint.directory} is a {source.name} checkpoint but the "
            f"{head} needs a {arch.name} tower; pass a checkpoint of the head's family"
        )
    prefix = arch.resolve_prefix(checkpoint)
    replaced: list[str] = []
    for name, target in targets.items():
        key = prefix + name
        if key not in checkpoint:
            if name.startswith(optional):
                logger.info("%s has no %r; the head's own tensor is kept", model_dir, key)
                continue
            raise FeatCalError(
                f"evaluated model {checkpoint.directory} has no tower tensor {key!r} that the "
                f"{head} needs; the tower is incompatible with the head (another depth or "
                "architecture)"
            )
        shape = checkpoint.tensors[key].shape
        if tuple(shape) != tuple(target.shape):
            raise FeatCalError(
                f"evaluated model {checkpoint.directory}: tensor {key!r} has shape {tuple(shape)}, "
                f"the {head} expects {tuple(target.shape)}; the tower is incompatible with the head"
            )
        replaced.append(name)
    extra = sorted(
        key
        for key in checkpoint.tensors
        if key.startswith(prefix)
        and arch.owns(key[len(prefix) :])
        and key[len(prefix) :] not in targets
        and DTYPES[checkpoint.tensors[key].dtype].is_floating_point  # not buffers (position_ids)
    )
    if extra:
        raise FeatCalError(
            f"evaluated model {checkpoint.directory} has tower tensor {extra[0]!r} (and "
            f"{len(extra) - 1} more) that the {head} lacks; the tower is incompatible with the head "
            "(another depth or architecture)"
        )
    tensors = checkpoint.read([prefix + name for name in replaced])
    with torch.no_grad():
        for name in replaced:
            targets[name].copy_(tensors[prefix + name].to(targets[name].dtype))
    return replaced
