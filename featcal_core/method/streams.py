"""The two hidden-state streams per task (student and expert), in memory or on disk.

Each stream of task t is one tensor (n_t, S_t, d) in the passes' dtype (precision.pass_dtype).
On disk each stream is one safetensors file (`<kind>-<task>.safetensors`) and batches are read as
row ranges, so only the stream being produced is held in memory. A directory of streams is also
the persisted state between two blocks (see featcal_core.method.calibration).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from featcal_core.io.outputs import atomic_file
from featcal_core.io.safetensors_io import Entry, read_header, read_tensor, save_tensors

STUDENT = "student"
EXPERT = "expert"
# encoder-decoder models (T5): the decoder stems (until the first decoder block) and the decoder's
# context (each model's encoder output after its final norm, from the first decoder block on)
STUDENT_DECODER = "student_decoder"
EXPERT_DECODER = "expert_decoder"
STUDENT_CONTEXT = "student_context"
EXPERT_CONTEXT = "expert_context"


def decoder_mask_key(task: str) -> str:
    """Key of a task's decoder token mask beside its (encoder) mask in a masks dict."""
    return f"decoder:{task}"


def weight_mask_key(task: str) -> str:
    """Key of a task's token-weight mask (0/1, e.g. answer tokens only) in a masks dict, present
    only when it differs from the token mask (which then still masks attention)."""
    return f"weights:{task}"


_KEY = "h"


def stream_file_name(kind: str, task: str) -> str:
    """File name of a stream: readable task name plus a short digest (distinct for any names)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in task)[:60]
    digest = hashlib.sha1(task.encode()).hexdigest()[:8]
    return f"{kind}-{safe}-{digest}.safetensors"


class HiddenStreams:
    """Streams keyed by (kind, task): in memory (directory None) or one file each in `directory`."""

    def __init__(self, directory: Path | None = None):
        self.directory = directory
        self._memory: dict[tuple[str, str], torch.Tensor] = {}
        self._headers: dict[tuple[str, str], Entry] = {}
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def path(self, kind: str, task: str) -> Path:
        assert self.directory is not None  # only streams on disk have files
        return self.directory / stream_file_name(kind, task)

    def put(self, kind: str, task: str, tensor: torch.Tensor) -> None:
        """Replace stream (kind, task) with `tensor` (n, S, d); on disk via a temporary file."""
        tensor = tensor.detach().to("cpu").contiguous()
        if self.directory is None:
            self._memory[(kind, task)] = tensor
            return
        with atomic_file(self.path(kind, task), "hidden-state stream") as tmp:
            save_tensors(tmp, {_KEY: tensor})
        self._headers.pop((kind, task), None)

    def _entry(self, kind: str, task: str) -> Entry:
        entry = self._headers.get((kind, task))
        if entry is None:
            entry = self._headers[(kind, task)] = read_header(self.path(kind, task))[0][_KEY]
        return entry

    def batches(self, kind: str, task: str, batch_size: int) -> Iterator[torch.Tensor]:
        """Consecutive batches (≤ batch_size, S, d) of stream (kind, task)."""
        if self.directory is None:
            stream = self._memory[(kind, task)]
            for start in range(0, stream.shape[0], batch_size):
                yield stream[start : start + batch_size]
            return
        entry = self._entry(kind, task)
        rows = entry.shape[0]
        row_bytes = (entry.end - entry.start) // max(rows, 1)
        fd = os.open(self.path(kind, task), os.O_RDONLY)
        try:
            for start in range(0, rows, batch_size):
                stop = min(start + batch_size, rows)
                part = Entry(
                    entry.dtype,
                    (stop - start, *entry.shape[1:]),
                    entry.start + start * row_bytes,
                    entry.start + stop * row_bytes,
                )
                yield read_tensor(fd, part)
        finally:
            os.close(fd)
