"""One task's contribution to one block's statistics, as a value that travels between processes.

`TaskStatistics` holds, for task t and block i, the float64 tensors its statistics pass gives
(see statistics.py): per Linear group (labelled by its first module's name) the contribution of
`LinearInputStats` (Gram (d_in, d_in), cross terms, means, ...) and per norm module the contribution
of `NormStats` ((d,) per-channel sums), plus the group layout and the drift before calibration.
`save` writes it as one safetensors file; `StoredStatistics` reads such a file lazily, one group's
tensors at a time (folding a block's tasks then holds one group of one task, not a whole task).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import atomic_file
from featcal_core.io.safetensors_io import Reader, read_header, save_tensors


@dataclass
class TaskStatistics:
    """Task t's contribution to block i's statistics (float64 tensors, see statistics.py), as
    `BlockRunner.task_statistics` computes it; `save`/`load` carry it between processes."""

    task: str
    index: int
    linear: dict[str, dict[str, torch.Tensor]]  # group label → `LinearInputStats` contribution
    layout: dict[str, dict]  # group label → {"d_in", "tokens", "modules": {name: (d_out, bias)}}
    norms: dict[str, dict[str, torch.Tensor]]  # norm module → `NormStats` contribution
    drift_before: float  # mean ‖merged − expert‖² of the block output (see BlockResult)
    fallbacks: list[dict] = field(default_factory=list)  # found in this task's pass (JSON-able)

    _META = "featcal_task_statistics"

    def save(self, path: Path) -> None:
        """One safetensors file, written to a temporary name and renamed."""
        tensors = {
            f"linear/{g}/{k}": v.contiguous() for g, c in self.linear.items() for k, v in c.items()
        }
        tensors.update(
            {f"norm/{n}/{k}": v.contiguous() for n, c in self.norms.items() for k, v in c.items()}
        )
        meta = {
            "task": self.task,
            "index": self.index,
            "layout": self.layout,
            "drift_before": self.drift_before,
            "fallbacks": self.fallbacks,
        }
        with atomic_file(path, "task statistics") as tmp:
            save_tensors(tmp, tensors, {self._META: json.dumps(meta)})

    @classmethod
    def load(cls, path: Path) -> TaskStatistics:
        """Every tensor of a saved file (see `StoredStatistics` to read groups on demand)."""
        stored = StoredStatistics(path)
        linear: dict[str, dict[str, torch.Tensor]] = {}
        norms: dict[str, dict[str, torch.Tensor]] = {}
        with Reader(path, stored.entries) as reader:
            for key in stored.entries:
                kind, owner, name = key.split("/", 2)
                (linear if kind == "linear" else norms).setdefault(owner, {})[name] = reader[key]
        return cls(
            stored.task,
            stored.index,
            linear,
            stored.layout,
            norms,
            stored.drift_before,
            stored.fallbacks,
        )


class StoredStatistics:
    """A saved `TaskStatistics` read lazily: its metadata at once, one group's tensors on demand
    (so folding a block's tasks holds one group of one task at a time, not a whole task)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries, metadata = read_header(path)
        if TaskStatistics._META not in metadata:
            raise FeatCalError(f"{path} holds no FeatCal task statistics; recompute the block")
        meta = json.loads(metadata[TaskStatistics._META])
        self.task, self.index = meta["task"], meta["index"]
        self.drift_before = meta["drift_before"]
        self.fallbacks = meta.get("fallbacks", [])
        self.layout = {
            g: {**v, "modules": {m: tuple(d) for m, d in v["modules"].items()}}
            for g, v in meta["layout"].items()
        }

    def group(self, kind: str, owner: str) -> Mapping[str, torch.Tensor]:
        """The contribution of one Linear group (kind "linear") or norm (kind "norm"), each
        tensor read from the file when it is looked up (folding holds one at a time)."""
        return _LazyGroup(self, f"{kind}/{owner}/")


class _LazyGroup(Mapping):
    """key → tensor of one group of a `StoredStatistics` file, read on each lookup."""

    def __init__(self, stored: StoredStatistics, prefix: str):
        self._stored, self._prefix = stored, prefix
        self._keys = [k[len(prefix) :] for k in stored.entries if k.startswith(prefix)]

    def __getitem__(self, key: str) -> torch.Tensor:
        entries = self._stored.entries
        with Reader(self._stored.path, entries) as reader:
            return reader[self._prefix + key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
