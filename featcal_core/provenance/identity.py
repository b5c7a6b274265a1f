"""Content identities: what a reuse decision compares (the evaluation store, a repair's
output). Digests of a model folder's files, of tensors' values, of the code that runs, and a
name for the device that runs it.
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

import torch

from featcal_core.io.checkpoint import sha256_tree
from featcal_core.io.markers import MARKER
from featcal_core.io.saved_datasets import data_file_names

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
    """`sha256_tree` of `directory` but NOT_CONTENT: what a model folder (or an evaluation set)
    holds. A data file a dataset's `state.json` names is content whatever its name."""
    return sha256_tree(Path(directory), skip=NOT_CONTENT - set(data_file_names(directory)))


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

    from featcal_core.version import featcal_version

    found = {"featcal": featcal_version(), "featcal_core": sources_digest(core_sources())}
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


def core_sources() -> dict[str, Path]:
    """featcal_core's Python sources: {path in the project ("featcal_core/..."): file}."""
    import featcal_core

    root = Path(featcal_core.__file__).parent
    return {f"featcal_core/{p.relative_to(root).as_posix()}": p for p in root.rglob("*.py")}


def sources_digest(files: Mapping[str, Path]) -> str:
    """sha256 over source files ({path in the project: file}), in order of their paths: each
    path and length, then its bytes. Paths in the project, never absolute ones, so that an
    installed featcal and a checkout agree."""
    digest = hashlib.sha256()
    for name, path in sorted(files.items()):
        data = path.read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
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
