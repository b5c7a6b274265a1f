"""`InputBatches`: the preprocessed batches of one set of rows, shared by every model evaluated or
scored on it, so that each row is decoded and preprocessed once rather than once per model (a
task's rows go through three to five models in the evaluate step, eight in the demo's select
step). On the offline vision zoo the tower's forward pass still dominates: the demo's evaluation
step went from 41 s to 34 s with it, its scoring of 8 models did not measurably change.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

#: default budget of kept batches (MiB): beyond it batches are made again on each use
DEFAULT_BUDGET_MB = 512


class InputBatches:
    """Batches of model inputs ({name: CPU tensor}) by key, kept up to `budget_mb` MiB.

    Use one per set of rows and preprocessing (a task's heads share theirs); the key names the
    batch within that set (its rows: source, split, first row, batch size). A batch that does not
    fit in what is left of the budget is returned without being kept; `InputBatches(0)` keeps
    nothing (each batch is made on each use)."""

    def __init__(self, budget_mb: float = DEFAULT_BUDGET_MB):
        self.budget_bytes = int(budget_mb * 1024 * 1024)
        self.kept_bytes = 0
        self._kept: dict[Hashable, dict[str, torch.Tensor]] = {}
        #: batches made (misses) and batches served from memory (hits)
        self.made = 0
        self.reused = 0

    def get(self, key: Hashable, make: Callable[[], dict[str, torch.Tensor]]):
        """The batch under `key`: the kept one, else `make()` (kept while it fits)."""
        found = self._kept.get(key)
        if found is not None:
            self.reused += 1
            return found
        found = make()
        self.made += 1
        size = sum(t.numel() * t.element_size() for t in found.values())
        if self.kept_bytes + size <= self.budget_bytes:
            self._kept[key] = found
            self.kept_bytes += size
        return found
