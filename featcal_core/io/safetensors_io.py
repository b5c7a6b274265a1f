"""safetensors files read and written one tensor at a time with plain file I/O.

Reading copies exactly one tensor's bytes (no memory map), so the resident set grows by the tensors
being used and not by the pages of a whole shard. Writing lays out the header first (names, dtypes,
shapes, offsets known up front) and then appends tensors in order, so a shard never sits in memory
whole. Format: 8-byte little-endian header length, JSON header, then the raw little-endian data.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 2**20


class SafetensorsFormatError(ValueError):
    """The file is not a (complete) safetensors file; the message says what is wrong."""


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def read_header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """(name → Entry, metadata) of a safetensors file, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise SafetensorsFormatError(f"only {size} bytes, no header")
        header_len = int.from_bytes(prefix, "little")
        if header_len > min(size - 8, _MAX_HEADER):
            raise SafetensorsFormatError(f"header length {header_len} exceeds the file size {size}")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsFormatError(f"header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsFormatError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + header_len
    entries = {}
    for name, info in header.items():
        try:
            dtype, shape = info["dtype"], tuple(int(n) for n in info["shape"])
            start, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsFormatError(f"bad header entry for {name!r}") from exc
        if dtype not in DTYPES:
            raise SafetensorsFormatError(f"{name!r} has unsupported dtype {dtype}")
        if min(shape, default=0) < 0 or start < 0:
            raise SafetensorsFormatError(f"{name!r} has a negative shape or offset")
        if end - start != math.prod(shape) * DTYPES[dtype].itemsize:
            raise SafetensorsFormatError(f"{name!r} has inconsistent offsets")
        entries[name] = Entry(dtype, shape, base + start, base + end)
    _check_layout(entries, base, size)
    return entries, dict(metadata)


def _check_layout(entries: dict[str, Entry], base: int, size: int) -> None:
    """The tensors tile the data section end to end, as the safetensors library requires: no
    two share a byte, none lies beyond the file, and no byte between or after them is unowned."""
    data = size - base
    position, previous = 0, None
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].start, item[1].end)):
        start, end = entry.start - base, entry.end - base
        if previous is not None and start < position:
            first = entries[previous]
            raise SafetensorsFormatError(
                f"tensors {previous!r} (data bytes {first.start - base}-{first.end - base}) and "
                f"{name!r} (data bytes {start}-{end}) overlap"
            )
        if start > position:
            after = f"tensor {previous!r}" if previous is not None else "the header"
            raise SafetensorsFormatError(
                f"data bytes {position}-{start} between {after} and tensor {name!r} belong to no "
                "tensor (the format lays tensors end to end)"
            )
        if end > data:
            raise SafetensorsFormatError(
                f"truncated or out of bounds: tensor {name!r} ends at data byte {end}, the data "
                f"section holds {data} ({size} bytes in all)"
            )
        position, previous = end, name
    if position < data:
        raise SafetensorsFormatError(
            f"{data - position} data bytes after the last tensor belong to no tensor (the format "
            "lays tensors end to end)"
        )


def read_tensor(fd: int, entry: Entry) -> torch.Tensor:
    """One tensor from an open file descriptor (a private copy of its bytes)."""
    return _read_bytes(fd, entry, entry.start, entry.end, entry.shape)


def read_rows(fd: int, entry: Entry, start: int, stop: int) -> torch.Tensor:
    """Rows start..stop-1 (along dim 0) of a tensor of rank ≥ 1, shape (stop - start, *rest)."""
    if not entry.shape or not 0 <= start <= stop <= entry.shape[0]:
        raise ValueError(f"rows {start}:{stop} of a tensor of shape {list(entry.shape)}")
    row_bytes = math.prod(entry.shape[1:]) * entry.torch_dtype.itemsize
    shape = (stop - start, *entry.shape[1:])
    return _read_bytes(
        fd, entry, entry.start + start * row_bytes, entry.start + stop * row_bytes, shape
    )


def _read_bytes(fd: int, entry: Entry, begin: int, end: int, shape) -> torch.Tensor:
    nbytes = end - begin
    if nbytes == 0:
        return torch.empty(shape, dtype=entry.torch_dtype)
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], begin + done)
        if got <= 0:
            raise SafetensorsFormatError("unexpected end of file")
        done += got
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(entry.torch_dtype).reshape(shape)


class Reader:
    """Open safetensors file for reading tensors one by one: `with Reader(path) as r: r[name]`."""

    def __init__(self, path: Path, entries: dict[str, Entry] | None = None):
        self.path = path
        self.entries = entries if entries is not None else read_header(path)[0]
        self._fd: int | None = None

    def __enter__(self) -> Reader:
        self._fd = os.open(self.path, os.O_RDONLY)
        return self

    def __exit__(self, *exc) -> None:
        assert self._fd is not None  # opened by __enter__
        os.close(self._fd)
        self._fd = None

    def __getitem__(self, name: str) -> torch.Tensor:
        assert self._fd is not None  # used inside `with` (opened by __enter__)
        return read_tensor(self._fd, self.entries[name])

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start..stop-1 of tensor `name` (see `read_rows`)."""
        assert self._fd is not None  # used inside `with` (opened by __enter__)
        return read_rows(self._fd, self.entries[name], start, stop)


def write_streaming(
    path: Path,
    entries: list[tuple[str, str, tuple[int, ...]]],
    fetch: Callable[[str], torch.Tensor | Iterable[torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `entries` (name, safetensors dtype, shape) to `path`, calling fetch(name) per tensor.

    fetch returns the tensor, with exactly the declared dtype and shape, or an iterable of chunks
    of the declared dtype (e.g. row blocks) whose entries, in order, are the tensor's in row-major
    order; chunks are written as they come, so a large tensor never sits in memory whole.
    """
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(len(encoded).to_bytes(8, "little"))
        handle.write(encoded)
        for name, dtype, shape in entries:
            fetched = fetch(name)
            if isinstance(fetched, torch.Tensor):
                if fetched.dtype != DTYPES[dtype] or tuple(fetched.shape) != tuple(shape):
                    raise ValueError(
                        f"{name}: expected {dtype}{list(shape)}, got {fetched.dtype}"
                        f"{list(fetched.shape)}"
                    )
                fetched = (fetched,)
            written = 0
            for chunk in fetched:
                if chunk.dtype != DTYPES[dtype]:
                    raise ValueError(f"{name}: expected {dtype} chunks, got {chunk.dtype}")
                flat = chunk.detach().to("cpu").contiguous().reshape(-1)
                handle.write(flat.view(torch.uint8).numpy().data)  # the bytes, as a memoryview
                written += flat.numel()
            if written != math.prod(shape):
                raise ValueError(f"{name}: wrote {written} entries, expected {math.prod(shape)}")


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata=None) -> None:
    """Write a dict of tensors (convenience over `write_streaming`)."""
    entries = [(k, NAMES[v.dtype], tuple(v.shape)) for k, v in tensors.items()]
    write_streaming(path, entries, tensors.__getitem__, metadata)
