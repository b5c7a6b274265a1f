"""How a written model's tensors are split into safetensors files: `plan_layout`, `write_layout`.

Every model folder featcal writes (merged, calibrated, repaired) holds its tensors in files of at
most `max_shard_size` bytes of tensor data, as transformers' `save_pretrained` splits them: one
`model.safetensors` when they fit, else `model-00001-of-0000N.safetensors`, ... filled in the
source's tensor order (a tensor larger than the limit alone in its file) plus
`model.safetensors.index.json` (`{"metadata": {"total_size": bytes}, "weight_map": {tensor:
file}}`). A source (the base of a merge, the merged model of a calibration) whose every file fits
keeps its own files, their tensor order and metadata, and its index, as they are. The default
limit is transformers 5.x's `save_pretrained` default, 50GB.

Files are written one tensor at a time (`write_streaming`), into the folder the guarded writer
hands out (`featcal_core.io.outputs.guarded_directory`), whose marker then lists every shard and
the index.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from featcal_core.io.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint
from featcal_core.io.safetensors_io import write_streaming
from featcal_core.io.shard_size import parse_shard_size

#: a shard's name, as transformers names them
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"


Entries = list[tuple[str, str, tuple[int, ...]]]


@dataclass(frozen=True)
class Layout:
    """The weight files to write: file → its (tensor, safetensors dtype, shape) in order, each
    file's metadata, and the index (`copy_index`: the source's, copied as it is; else `index`,
    written; neither: a single file)."""

    files: dict[str, Entries]
    metadata: dict[str, dict[str, str]]
    index: dict | None = None
    copy_index: Path | None = None

    @property
    def names(self) -> set[str]:
        """The weight files (and index) this layout writes."""
        written = set(self.files)
        return written | {INDEX_NAME} if self.index or self.copy_index else written


def plan_layout(source: Checkpoint, max_shard_size: int | str | None = None) -> Layout:
    """The files to write `source`'s tensors (names, dtypes, shapes as it stores them) into,
    with at most `max_shard_size` bytes of tensor data per file (see the module's doc)."""
    limit = parse_shard_size(max_shard_size)
    sizes = {
        file: [(name, entry.end - entry.start) for name, entry in source.entries[file].items()]
        for file in source.files
    }
    entries = {
        file: [(name, entry.dtype, entry.shape) for name, entry in source.entries[file].items()]
        for file in source.files
    }
    if all(len(tensors) <= 1 or sum(n for _, n in tensors) <= limit for tensors in sizes.values()):
        own = source.directory / INDEX_NAME
        return Layout(
            entries,
            {file: dict(source.file_metadata.get(file) or {}) for file in source.files},
            copy_index=own if own.is_file() else None,
        )
    groups: list[Entries] = [[]]
    used = 0
    total = 0
    for file in source.files:
        for entry, (_, nbytes) in zip(entries[file], sizes[file], strict=True):
            total += nbytes
            if groups[-1] and used + nbytes > limit:
                groups.append([])
                used = 0
            groups[-1].append(entry)
            used += nbytes
    metadata: dict[str, str] = {}
    for file in source.files:
        for key, value in (source.file_metadata.get(file) or {}).items():
            metadata.setdefault(key, value)
    metadata.setdefault("format", "pt")  # what transformers' loader looks for
    if len(groups) == 1:
        return Layout({SINGLE_NAME: groups[0]}, {SINGLE_NAME: metadata})
    names = [SHARD_NAME.format(index=i + 1, count=len(groups)) for i in range(len(groups))]
    index = {
        "metadata": {"total_size": total},
        "weight_map": {
            name: file for file, group in zip(names, groups, strict=True) for name, _, _ in group
        },
    }
    return Layout(
        dict(zip(names, groups, strict=True)),
        dict.fromkeys(names, metadata),
        index=index,
    )


def write_layout(
    layout: Layout,
    out_dir: Path,
    fetch: Callable[[str], torch.Tensor | Iterable[torch.Tensor]],
) -> None:
    """Write every file of `layout` into `out_dir` (fetch(name): the tensor, or its row chunks;
    see `write_streaming`), then its index."""
    for file, entries in layout.files.items():
        write_streaming(out_dir / file, entries, fetch, layout.metadata.get(file) or None)
    if layout.copy_index is not None:
        shutil.copy2(layout.copy_index, out_dir / INDEX_NAME)
    elif layout.index is not None:
        text = json.dumps(layout.index, indent=2, sort_keys=True) + "\n"
        (out_dir / INDEX_NAME).write_text(text, encoding="utf-8")
