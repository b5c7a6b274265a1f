"""The two hidden-state streams per task (student and expert), in memory or spilled to disk.

Each stream of task t is one tensor (n_t, S_t, d) in the model dtype. With a spill directory each
stream lives in its own safetensors file and batches are read as slices, so only one task's new
stream is held in memory while it is being produced.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

STUDENT = "student"
EXPERT = "expert"


class HiddenStreams:
    def __init__(self, spill_dir: Path | None = None):
        self.spill_dir = spill_dir
        self._memory: dict[tuple[str, str], torch.Tensor] = {}
        self._lengths: dict[tuple[str, str], int] = {}
        if spill_dir is not None:
            spill_dir.mkdir(parents=True, exist_ok=True)

    def _path(self, kind: str, task: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in task)
        return self.spill_dir / f"{kind}-{safe}.safetensors"

    def put(self, kind: str, task: str, tensor: torch.Tensor) -> None:
        """Replace stream (kind, task) with `tensor` (n, S, d)."""
        tensor = tensor.detach().to("cpu").contiguous()
        self._lengths[(kind, task)] = tensor.shape[0]
        if self.spill_dir is None:
            self._memory[(kind, task)] = tensor
            return
        path = self._path(kind, task)
        tmp = path.with_suffix(".tmp")
        save_file({"h": tensor}, str(tmp))
        os.replace(tmp, path)

    def batches(self, kind: str, task: str, batch_size: int) -> Iterator[torch.Tensor]:
        """Consecutive batches (≤ batch_size, S, d) of stream (kind, task)."""
        length = self._lengths[(kind, task)]
        if self.spill_dir is None:
            stream = self._memory[(kind, task)]
            for start in range(0, length, batch_size):
                yield stream[start : start + batch_size]
            return
        with safe_open(str(self._path(kind, task)), framework="pt") as handle:
            piece = handle.get_slice("h")
            for start in range(0, length, batch_size):
                yield piece[start : start + batch_size]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._memory.values())
