"""The model pool of one calibration: base, merged and one expert per task, checked to agree.

Opening reads only headers, config.json and tokenizer files; `check` compares every model's
architecture, vocabulary (featcal_core.io.vocabulary: vocab size, tokenizer, added tokens), the
names and shapes of the tensors FeatCal reads (stem and blocks) and its structure
(featcal_core.io.structure: config fields, tensor names the base lacks) against the base.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from featcal_core.architectures import Architecture, detect
from featcal_core.errors import FeatCalError
from featcal_core.io.adapters import open_expert
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.safetensors_io import DTYPES
from featcal_core.io.structure import check_same_structure
from featcal_core.io.vocabulary import check_same_vocabulary


@dataclass
class ModelSet:
    arch: Architecture
    base: Checkpoint
    merged: Checkpoint
    experts: dict[str, Checkpoint]
    prefixes: dict[int, str]  # id(checkpoint) → key prefix of the tower in that checkpoint

    @classmethod
    def open(
        cls,
        base: str | Path,
        merged: str | Path,
        experts: dict[str, str | Path],
        pooling: str | None = None,
    ) -> ModelSet:
        base_ckpt = Checkpoint(base, "base model")
        arch = detect(base_ckpt.config, str(base_ckpt.directory / "config.json"), pooling)
        merged_ckpt = Checkpoint(merged, "merged model")
        expert_ckpts = {
            task: open_expert(path, f"expert {task!r}", base_ckpt) for task, path in experts.items()
        }
        models = cls(arch, base_ckpt, merged_ckpt, expert_ckpts, {})
        models.check()
        return models

    def all(self) -> list[Checkpoint]:
        return [self.base, self.merged, *self.experts.values()]

    def prefix(self, checkpoint: Checkpoint) -> str:
        return self.prefixes[id(checkpoint)]

    def tower(self, checkpoint: Checkpoint) -> dict[str, tuple[int, ...]]:
        """Canonical name → shape of every floating-point stem and block tensor of `checkpoint`."""
        prefix = self.prefix(checkpoint)
        out = {}
        for key, info in checkpoint.tensors.items():
            if key.startswith(prefix) and self.arch.owns(key[len(prefix) :]):
                if not DTYPES[info.dtype].is_floating_point:
                    continue  # buffers (e.g. BERT's position_ids in older checkpoints): not weights
                out[key[len(prefix) :]] = info.shape
        return out

    def check(self) -> None:
        for checkpoint in self.all():
            source = str(checkpoint.directory / "config.json")
            other = detect(checkpoint.config, source)
            if other.name != self.arch.name:
                raise FeatCalError(
                    f"{source}: {checkpoint.role} is a {other.name} model but the base is "
                    f"{self.arch.name}; all models must share the base's architecture"
                )
            self.prefixes[id(checkpoint)] = self.arch.resolve_prefix(checkpoint)
        reference = self.tower(self.base)
        if not reference:
            raise FeatCalError(
                f"base model {self.base.directory} holds no {self.arch.name} tensors"
            )
        for checkpoint in self.all()[1:]:
            check_same_vocabulary(self.base, checkpoint)
            tower = self.tower(checkpoint)
            missing = sorted(set(reference) - set(tower))
            if missing:
                raise FeatCalError(
                    f"{checkpoint.role} {checkpoint.directory} lacks tensor "
                    f"{self.prefix(checkpoint) + missing[0]!r} ({len(missing)} missing); "
                    "use a complete checkpoint of the base's architecture"
                )
            for name, shape in reference.items():
                if tower[name] != shape:
                    raise FeatCalError(
                        f"{checkpoint.role} {checkpoint.directory}: tensor "
                        f"{self.prefix(checkpoint) + name!r} has shape {list(tower[name])}, the base "
                        f"has {list(shape)}; experts and merged model must match the base's shapes"
                    )
            check_same_structure(self.base, checkpoint)

    def key(self, checkpoint: Checkpoint, canonical: str) -> str:
        return self.prefix(checkpoint) + canonical

    def read(self, checkpoint: Checkpoint, canonical: list[str]) -> dict[str, torch.Tensor]:
        """Read canonical names from `checkpoint`; returned dict is keyed by canonical name."""
        keys = [self.key(checkpoint, name) for name in canonical]
        tensors = checkpoint.read(keys)
        return {name: tensors[key] for name, key in zip(canonical, keys, strict=True)}

    def compute_dtype(self) -> torch.dtype:
        """The merged model's dtype (of its tower's probe tensor)."""
        info = self.merged.tensors[self.key(self.merged, self.arch.probe_key)]
        return DTYPES[info.dtype]
