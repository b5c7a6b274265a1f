"""Moving hidden states between the host and the device without waiting for the device.

On CUDA, a copy to pageable host memory waits for every kernel queued before it, and so does
every read of a device value into Python. A block pass over one task queues its batches' kernels
back to back instead: `to_device` copies host batches without a wait for the device, and
`HostRows` gathers the batch outputs (B, S, d) of one stream into one tensor (n, S, d) on the
device, copied to the host once, by `HostRows.tensor()` at the end: the pass's only wait. On
the CPU `HostRows` writes each batch into its rows of the host tensor (one copy, as `torch.cat`
of the batches would make, without holding the batches and the joined tensor at once).
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a host → CUDA copy does not wait for the device's queued work."""
    return tensor.to(device, non_blocking=device.type == "cuda")


class HostRows:
    """One stream's rows gathered batch by batch: `add` batches (B, ...) of `rows` rows in all,
    in order, all on one device (kept there until `tensor()`, which returns the (rows, ...)
    result on the host)."""

    def __init__(self, rows: int):
        self.rows = rows
        self._out: torch.Tensor | None = None
        self._next = 0

    def add(self, batch: torch.Tensor) -> None:
        stop = self._next + batch.shape[0]
        if stop > self.rows:
            raise ValueError(f"{stop} rows added to a stream of {self.rows}")
        if self._out is None:
            self._out = torch.empty(
                (self.rows, *batch.shape[1:]), dtype=batch.dtype, device=batch.device
            )
        self._out[self._next : stop].copy_(batch)
        self._next = stop

    def tensor(self) -> torch.Tensor:
        """The gathered rows on the host (one copy from the device, where they were there)."""
        if self._out is None or self._next != self.rows:
            raise ValueError(f"{self._next} of the stream's {self.rows} rows were added")
        out, self._out = self._out, None
        return out.to("cpu")
