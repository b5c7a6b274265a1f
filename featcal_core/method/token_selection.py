"""Which tokens of a batch feed the statistics, and with what weight, decided on the host.

A module's input (B, S, d) is flattened to its tokens of non-zero weight ω (`arch.token_weights`:
padding 0; in a pooled model's last block, 0.01 off the pooled token for most modules). Deciding
that from the device's masks would read the device into Python twice per module and batch (are
all tokens kept? are all weights 1?) and once more to size a boolean selection. The masks live on
the host, so `TokenPlan` decides there, once per task and weighting: per batch a `Selection` with
the kept token positions and their weights (None when all are kept, or all are 1), queued to the
device. Shapes: masks (n, S) over the task's n rows; batches of `batch_size` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from featcal_core.method.transfers import to_device


@dataclass(frozen=True)
class Selection:
    """The tokens of one batch that one module input keeps."""

    index: torch.Tensor | None  # (N,) positions in the flattened (B·S) tokens; None: all
    weights: torch.Tensor | None  # (N,) float64 ω of the kept tokens; None: all are 1

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, S, d) → the kept tokens (N, d)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        return flat if self.index is None else flat.index_select(0, self.index)


def pooled_input(arch, name: str, last: bool) -> bool:
    """Whether `name`'s input in this block is weighted towards the pooled token."""
    return last and arch.pooled_position is not None and arch.is_pooled_module(name)


class TokenPlan:
    """Per batch and module of one task's pass over one block: its `Selection`.

    mask: the task's token weights mask (n, S) on the host (0/1); context_mask: the encoder's
    mask (n, Sc) for decoder modules that read the context (None without a decoder)."""

    def __init__(
        self,
        arch,
        last: bool,
        mask: torch.Tensor,
        context_mask: torch.Tensor | None,
        batch_size: int,
        device: torch.device,
    ):
        self.arch = arch
        self.last = last
        self.masks = {False: mask.cpu(), True: None if context_mask is None else context_mask.cpu()}
        self.batch_size = batch_size
        self.device = device
        # (reads the context, pooled) → ω (n, S) and per batch (all kept, all kept are 1)
        self._weights: dict[tuple[bool, bool], tuple[torch.Tensor, list[tuple[bool, bool]]]] = {}
        self._batch: dict[tuple[bool, bool], Selection] = {}
        self._number = -1

    def _kind(self, name: str) -> tuple[bool, bool]:
        return bool(self.arch.reads_context(name)), pooled_input(self.arch, name, self.last)

    def _rows(self, kind: tuple[bool, bool], name: str):
        """ω (n, S) of the modules of `kind` (`name` is one) and per batch (all kept, all 1)."""
        found = self._weights.get(kind)
        if found is None:
            mask = self.masks[kind[0]]
            if mask is None:
                raise ValueError(f"{name} reads the encoder's context, but there is none")
            # token_weights acts row by row: the whole task's rows at once equal its batches'
            weights = self.arch.token_weights(name, self.last, mask)
            kept = (weights > 0).flatten(1).all(1).tolist()
            # every kept weight is 1 (padding's 0s aside)
            ones = ((weights <= 0) | (weights == 1)).flatten(1).all(1).tolist()
            flags = [
                (
                    all(kept[start : start + self.batch_size]),
                    all(ones[start : start + self.batch_size]),
                )
                for start in range(0, weights.shape[0], self.batch_size)
            ]
            found = self._weights[kind] = (weights, flags)
        return found

    def select(self, number: int, name: str) -> Selection:
        """Module `name`'s selection in batch `number` (0-based)."""
        if number != self._number:
            self._batch, self._number = {}, number
        kind = self._kind(name)
        selection = self._batch.get(kind)
        if selection is None:
            weights, flags = self._rows(kind, name)
            all_kept, all_ones = flags[number]
            start = number * self.batch_size
            rows = weights[start : start + self.batch_size].reshape(-1)
            index = None
            if not all_kept:
                index = torch.nonzero(rows > 0).squeeze(1)
                rows = rows[index]
                index = to_device(index, self.device)
            w = None if all_ones else to_device(rows.to(torch.float64), self.device)
            selection = self._batch[kind] = Selection(index, w)
        return selection
