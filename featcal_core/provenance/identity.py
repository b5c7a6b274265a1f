"""Content identities: what a reuse decision compares (the evaluation store, a repair's
output). Digests of a model folder's files, of tensors' values, of the code that runs, and a
name for the device that runs it.
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from featcal_core.io.digests import sha256_file
from featcal_core.io.markers import MARKER

#: files of a checkpoint folder that do not change the model: its card, featcal's marker and
#: the records of the merge and repairs that wrote it (each run rewrites them: times, paths)
NOT_CONTENT = frozenset(
    {
        "README.md",
        MARKER,
        "featcal.json",
        "merge.json",
        "regmean.json",
        "adamerging.json",
        "repair_inputs.json",
    }
)


def content_digest(directory: str | Path) -> str:
    """sha256 over the relative paths and contents of every file below `directory` but
    NOT_CONTENT: what a model folder (or an evaluation set) holds."""
    root = Path(directory)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        if str(relative) in NOT_CONTENT:
            continue
        digest.update(str(relative).encode() + b"\0")
        digest.update(bytes.fromhex(sha256_file(path)))
    return digest.hexdigest()


def tensors_digest(tensors: Sequence[torch.Tensor | None]) -> str:
    """sha256 over the dtypes, shapes and values of `tensors` (None: a missing one)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        if tensor is None:
            digest.update(b"none\0")
            continue
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{value.dtype}{tuple(value.shape)}\0".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


@cache
def code_identity() -> dict[str, str]:
    """featcal_core's sources and the versions of the libraries its results depend on."""
    from importlib.metadata import PackageNotFoundError, version

    import featcal_core
    from featcal_core.version import featcal_version

    package = Path(featcal_core.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".yaml", ".json") and path.is_file():
            digest.update(str(path.relative_to(package)).encode() + b"\0")
            digest.update(path.read_bytes())
    found = {"featcal": featcal_version(), "featcal_core": digest.hexdigest()}
    for name in ("torch", "transformers", "datasets", "pillow", "numpy"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


@cache
def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_identity(device: torch.device) -> str:
    """What ran the forwards: the GPU's name, or the CPU's model and torch's thread count."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{_cpu()}:threads={torch.get_num_threads()}"
