"""Write the calibrated model: the merged checkpoint's tensors with calibrated tensors swapped in.

Tensor names and dtypes are the merged model's, and so are its files and index where they fit
the shard size (featcal_core.io.shards: else split anew); every tensor is copied one at a time
(streaming writer), taking calibrated tensors from the per-block result files. The model's other
files are an allow-list (`carry_files`): config.json, the generation config, tokenizer, chat
template and processor files, and nothing else of the source's repository (no README.md,
.gitattributes, LICENSE): a folder from the Hub cache and a local copy give the same output.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.safetensors_io import Reader
from featcal_core.io.shards import plan_layout, write_layout
from featcal_core.provenance.records import MERGE_RECORD

log = logging.getLogger(__name__)

#: files a model directory needs to turn raw inputs into model inputs (and outputs into text)
PREPROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "tokenizer*",
    "vocab*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "spiece.model",
    "spm.model",
    "sentencepiece*",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
)
#: what a model folder carries besides its weights: its config, generation config and the files
#: above; folders: chat templates saved beside the main one (transformers' layout)
CARRIED_FILES = ("config.json", "generation_config.json", *PREPROCESSOR_FILES)
CARRIED_FOLDERS = ("additional_chat_templates",)


def carried(path: Path) -> bool:
    """`path` (a file or folder of a model directory) is one a written model carries."""
    if path.is_dir():
        return path.name in CARRIED_FOLDERS
    return path.is_file() and any(path.match(pattern) for pattern in CARRIED_FILES)


def carry_files(
    source: Path, out_dir: Path, *, only_missing: bool = False, also: tuple[str, ...] = ()
) -> list[str]:
    """Copy `source`'s carried files and folders (`carried`, and the file names in `also`) into
    `out_dir` (`only_missing`: those `out_dir` lacks); returns the names of the other entries
    (left out). Links are followed (the Hugging Face cache links its snapshots to blobs)."""
    left_out = []
    for path in sorted(source.iterdir()):
        target = out_dir / path.name
        if not (carried(path) or (path.name in also and path.is_file())):
            left_out.append(path.name)
        elif only_missing and (target.exists() or target.is_symlink()):
            continue
        elif path.is_dir():
            shutil.copytree(path, target, symlinks=False)
        else:
            shutil.copy2(path, target)
    return left_out


def export_checkpoint(
    merged: Checkpoint,
    replaced: dict[str, Path],
    out_dir: Path,
    extra_sources: tuple[Path, ...] = (),
    max_shard_size: int | str | None = None,
) -> None:
    """Write `merged` into `out_dir` with each key of `replaced` read from the file it maps to,
    in files of at most `max_shard_size` (featcal_core.io.shards; None: its default).

    The carried files (`carry_files`: config.json, generation config, tokenizer, chat template
    and processor files) and the merge's record are copied from the merged directory, then the
    carried files of `extra_sources` (e.g. the base) that the merged one lacks.
    """
    layout = plan_layout(merged, max_shard_size)
    readers: dict[Path, Reader] = {}
    with ExitStack() as stack:
        sources: dict[str, Reader] = {}

        def fetch(key: str) -> torch.Tensor:
            if key in replaced:
                path = replaced[key]
                if path not in readers:
                    readers[path] = Reader(path)  # parses the header once
                with readers[path] as block:
                    return block[key]
            file = merged.tensors[key].file
            if file not in sources:
                sources[file] = stack.enter_context(merged.reader(file))
            tensor = sources[file][key]
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise FeatCalError(
                    f"tensor {key!r} in merged model {merged.directory} contains NaN or Inf; "
                    "fix or re-create the merged checkpoint"
                )
            return tensor

        write_layout(layout, out_dir, fetch)
    carry_files(merged.directory, out_dir, also=(MERGE_RECORD,))
    for directory in extra_sources:
        carry_files(directory, out_dir, only_missing=True)
