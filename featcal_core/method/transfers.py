"""Moving hidden states between the host and the device without waiting for the device.

On CUDA, a copy to pageable host memory waits for every kernel queued before it, and so does
every read of a device value into Python. A block pass over one task queues its batches' kernels
back to back instead: `to_device` copies host batches asynchronously (without a wait when the
host tensor is pinned), and `HostRows` gathers the batch outputs (B, S, d) of one stream into one
preallocated host tensor (n, S, d), pinned on CUDA, so each batch's copy is queued too and the
only wait is `HostRows.tensor()` at the end. On the CPU both are plain copies: `HostRows` writes
each batch into its rows (one copy, as `torch.cat` of the batches would make, without holding the
batches and the joined tensor at once).
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a host → CUDA copy is queued without waiting (pinned sources)."""
    return tensor.to(device, non_blocking=device.type == "cuda")


class HostRows:
    """One stream's rows gathered batch by batch on the host: `add` batches (B, ...) of `rows`
    rows in all, in order, from any device; `tensor()` returns the (rows, ...) result."""

    def __init__(self, rows: int, device: torch.device):
        self.rows = rows
        self.device = device
        self._out: torch.Tensor | None = None
        self._next = 0

    def add(self, batch: torch.Tensor) -> None:
        stop = self._next + batch.shape[0]
        if stop > self.rows:
            raise ValueError(f"{stop} rows added to a stream of {self.rows}")
        if self._out is None:
            self._out = torch.empty(
                (self.rows, *batch.shape[1:]),
                dtype=batch.dtype,
                pin_memory=self.device.type == "cuda",
            )
        self._out[self._next : stop].copy_(batch, non_blocking=batch.is_cuda)
        self._next = stop

    def tensor(self) -> torch.Tensor:
        """The gathered rows (after any queued copies have landed)."""
        if self._out is None or self._next != self.rows:
            raise ValueError(f"{self._next} of the stream's {self.rows} rows were added")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return self._out
