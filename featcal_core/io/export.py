"""Write the calibrated model: the merged checkpoint's layout with calibrated tensors swapped in.

Shard names, tensor names, dtypes and the index are the merged model's; every tensor is copied one at
a time (streaming writer), taking calibrated tensors from the per-block result files.
"""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from pathlib import Path

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import INDEX_NAME, Checkpoint
from featcal_core.io.safetensors_io import Reader, write_streaming

#: files a model directory needs to turn raw inputs into model inputs
PREPROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "spiece.model",
    "sentencepiece*",
)


def export_checkpoint(
    merged: Checkpoint,
    replaced: dict[str, Path],
    out_dir: Path,
    extra_sources: tuple[Path, ...] = (),
) -> None:
    """Write `merged` into `out_dir` with each key of `replaced` read from the file it maps to.

    Non-weight files (config.json, processor and tokenizer files) are copied from the merged
    directory, then from `extra_sources` (e.g. the base) where the merged one lacks them.
    """
    readers: dict[Path, Reader] = {}
    for shard in merged.files:
        keys = [k for k, info in merged.tensors.items() if info.file == shard]
        entries = [(k, merged.tensors[k].dtype, merged.tensors[k].shape) for k in keys]
        with ExitStack() as stack:
            source = stack.enter_context(merged.reader(shard))

            def fetch(key: str, source=source) -> torch.Tensor:
                if key in replaced:
                    path = replaced[key]
                    if path not in readers:
                        readers[path] = Reader(path)  # parses the header once
                    with readers[path] as block:
                        return block[key]
                tensor = source[key]
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise FeatCalError(
                        f"tensor {key!r} in merged model {merged.directory} contains NaN or Inf; "
                        "fix or re-create the merged checkpoint"
                    )
                return tensor

            write_streaming(out_dir / shard, entries, fetch, merged.file_metadata.get(shard))
    weight_names = set(merged.files) | {INDEX_NAME}
    for path in sorted(merged.directory.iterdir()):
        if path.is_file() and path.name not in weight_names:
            shutil.copy2(path, out_dir / path.name)
    for directory in extra_sources:
        for path in sorted(directory.iterdir()):
            wanted = any(path.match(pattern) for pattern in PREPROCESSOR_FILES)
            if path.is_file() and wanted and not (out_dir / path.name).exists():
                shutil.copy2(path, out_dir / path.name)
    if (merged.directory / INDEX_NAME).is_file():
        shutil.copy2(merged.directory / INDEX_NAME, out_dir / INDEX_NAME)
