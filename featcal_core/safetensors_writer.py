"""Write a safetensors file one tensor at a time, so a shard never has to sit in memory whole.

The header (names, dtypes, shapes, byte offsets) is known up front from the source checkpoint's
header; tensors are then fetched and written in header order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for a safetensors dtype string ("F32" → torch.float32)."""
    return _TORCH_DTYPES[name]


def write_streaming(
    path: Path,
    entries: list[tuple[str, str, tuple[int, ...]]],
    fetch: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write `entries` (name, safetensors dtype, shape) to `path`, calling fetch(name) per tensor.

    Each fetched tensor must have exactly the declared dtype and shape.
    """
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * _DTYPE_BYTES[dtype]
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
            tensor = fetch(name)
            if tensor.dtype != _TORCH_DTYPES.get(dtype) or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name}: expected {dtype}{list(shape)}, got {tensor.dtype}")
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            handle.write(flat.view(torch.uint8).numpy().tobytes())
