"""The on-disk cache of zero-shot class embeddings: its key, reading and atomic writing.

One safetensors file per key; the key is a sha256 over a version string, the files the
embeddings derive from (weights, tokenizer or config), the model's configuration as canonical
JSON where one is given, the class names and the templates. Shared
by the CLIP (`featcal_core.evaluation.zero_shot_head`) and open_clip
(`featcal_core.open_clip.zero_shot`) zero-shot heads.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import sha256_file
from featcal_core.io.outputs import atomic_file

logger = logging.getLogger(__name__)

__all__ = ["embedding_cache_key", "read_embedding_cache", "write_embedding_cache"]


def embedding_cache_key(
    version: str,
    files: Sequence[Path],
    class_names: Sequence[str],
    templates: Sequence[str],
    config: Mapping[str, Any] | None = None,
) -> str:
    """Key of a class-embedding cache: sha256 over `version`, each file's name and sha256,
    `config`, the class names and the templates (as JSON with sorted keys: the same content gives
    the same key whatever its layout in the file)."""
    digest = hashlib.sha256(version.encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + bytes.fromhex(sha256_file(path)))
    payload: dict[str, Any] = {"class_names": list(class_names), "templates": list(templates)}
    if config is not None:
        payload["config"] = dict(config)
    digest.update(json.dumps(payload, ensure_ascii=False, sort_keys=True).encode())
    return digest.hexdigest()


def read_embedding_cache(path: Path | None, num_classes: int) -> dict[str, torch.Tensor] | None:
    """The tensors of a class-embedding cache file (float32), or None when there is none, it is
    unreadable or its `class_embeddings` is not (num_classes, d)."""
    if path is None or not path.is_file():
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        tensor = tensors["class_embeddings"]
    except (OSError, KeyError, SafetensorError) as exc:
        logger.warning("ignoring unreadable class-embedding cache %s (%s)", path, exc)
        return None
    if tensor.ndim != 2 or tensor.shape[0] != num_classes:
        logger.warning("ignoring class-embedding cache %s of shape %s", path, tuple(tensor.shape))
        return None
    logger.info("class embeddings read from %s", path)
    return {name: value.float() for name, value in tensors.items()}


def write_embedding_cache(
    path: Path | None, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write a class-embedding cache file atomically (temporary file, then rename); None: no
    cache."""
    if path is None:
        return
    from safetensors.torch import save_file

    try:
        out = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        with atomic_file(path, "class-embedding cache") as tmp:  # whole files only, for readers
            save_file(out, str(tmp), metadata=metadata)
    except (OSError, FeatCalError) as exc:
        raise FeatCalError(
            f"cannot write the class-embedding cache {path} ({exc}); pass a writable cache_dir"
        ) from exc
    logger.info("class embeddings written to %s", path)
