"""Content identities: what a reuse decision compares (the evaluation store, a repair's
output). Digests of a model folder's files, of tensors' values, of the code that runs, and a
name for the device that runs it.
"""

from __future__ import annotations

import hashlib
import os
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


def _files(root: Path) -> list[Path]:
    """Every file below `root`, through symlinked folders too (as the loaders read them), each
    real folder once."""
    found, seen = [], set()
    for folder, names, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            names[:] = []  # a link back up the tree: walked already
            continue
        seen.add(real)
        found += [Path(folder) / name for name in files]
    return sorted(path for path in found if path.is_file())


def content_digest(directory: str | Path) -> str:
    """sha256 over the relative paths and contents of every file below `directory` (through
    symlinks) but NOT_CONTENT: what a model folder (or an evaluation set) holds."""
    root = Path(directory)
    digest = hashlib.sha256()
    for path in _files(root):
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


#: the libraries whose versions enter `code_identity` (what featcal's results run on)
LIBRARIES = (
    "torch",
    "torchvision",
    "transformers",
    "tokenizers",
    "safetensors",
    "datasets",
    "pillow",
    "numpy",
    "peft",
    "open_clip_torch",
)


@cache
def code_identity() -> dict[str, str]:
    """featcal_core's sources, the versions of LIBRARIES and torch's CUDA and cuDNN builds."""
    from importlib.metadata import PackageNotFoundError, version

    import featcal_core
    from featcal_core.version import featcal_version

    found = {"featcal": featcal_version(), "featcal_core": sources_digest(featcal_core.__file__)}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    found["cuda"] = str(torch.version.cuda)
    found["cudnn"] = str(
        torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    )
    return found


def sources_digest(anchor: str | Path) -> str:
    """sha256 over the Python, YAML and JSON files below the folder of `anchor` (a package's
    `__file__`, or a module's: its package folder)."""
    package = Path(anchor).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".yaml", ".json") and path.is_file():
            digest.update(str(path.relative_to(package)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


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
    """What runs the computation: the GPU's name with the process's TF32 switches, or the CPU's
    model and torch's thread count; with torch's float32 matmul precision."""
    matmul = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        return f"cuda:{torch.cuda.get_device_name(device)}:tf32={tf32}:matmul={matmul}"
    return f"{device.type}:{_cpu()}:threads={torch.get_num_threads()}:matmul={matmul}"
