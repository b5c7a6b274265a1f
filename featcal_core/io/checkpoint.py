"""Lazy, per-tensor access to Hugging Face `save_pretrained` directories (safetensors only).

A `Checkpoint` reads only headers when opened: tensor names, shapes, dtypes and which shard holds
each. Opening refuses a folder that is not one consistent checkpoint: an index naming a shard
outside the folder or a tensor its shard does not hold, an index beside a `model.safetensors` it
does not name alone (transformers loads the single file), a tensor stored twice, a shard whose
header is malformed or truncated or whose tensors overlap, leave the file or leave bytes unowned
(`read_header`). featcal_core.io.structure compares a checkpoint with its base. Tensors are read
on demand with `read(names)`, which copies exactly the requested tensors' bytes with plain file
reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from featcal_core.errors import FeatCalError
from featcal_core.finite import all_finite
from featcal_core.io.outputs import sha256_file
from featcal_core.io.safetensors_io import (
    DTYPES,
    Entry,
    Reader,
    SafetensorsFormatError,
    read_header,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: a file named by its content's hash: a blob of the Hugging Face cache or DVC's cache
_CACHE_BLOB = re.compile(r"[0-9a-f]{30,64}")


@dataclass(frozen=True)
class TensorInfo:
    """Header entry of one stored tensor."""

    file: str  # shard file name, relative to the checkpoint directory
    dtype: str  # safetensors dtype string, e.g. "F32", "BF16"
    shape: tuple[int, ...]


class Checkpoint:
    """A `save_pretrained` directory: config.json plus one or many safetensors shards."""

    def __init__(self, directory: str | Path, role: str = "model"):
        self.directory = Path(directory)
        self.role = role
        if not self.directory.is_dir():
            raise FeatCalError(
                f"{role} directory {self.directory} does not exist; pass a save_pretrained directory"
            )
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise FeatCalError(
                f"{config_path} is missing; {role} must be a Hugging Face save_pretrained directory"
            )
        try:
            self.config: dict = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FeatCalError(
                f"{config_path} is not valid JSON ({exc}); re-save the {role}"
            ) from exc
        self.weight_map: dict[str, str] | None = None  # the index's, when there is one
        self.files = self._weight_files()
        self.tensors: dict[str, TensorInfo] = {}
        self.entries: dict[str, dict[str, Entry]] = {}  # shard → its header entries
        self.file_metadata: dict[str, dict[str, str]] = {}
        for name in self.files:
            self._read_header(name)
        listed: dict[str, str] = self.weight_map or {}
        absent = sorted(set(listed) - set(self.tensors))
        if absent:
            raise FeatCalError(
                f"{self.directory / INDEX_NAME} places tensor {absent[0]!r} in "
                f"{listed[absent[0]]!r}, which does not hold it ({len(absent)} such); "
                f"re-save the {self.role} (index and shards together)"
            )

    def _weight_files(self) -> list[str]:
        index_path = self.directory / INDEX_NAME
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise FeatCalError(
                    f"{index_path} is not a valid safetensors index ({exc}); re-save the {self.role}"
                ) from exc
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise FeatCalError(
                    f"{index_path}: weight_map is not a map of tensor names to shard file names; "
                    f"re-save the {self.role}"
                )
            self.weight_map = weight_map
            files = sorted(set(weight_map.values()))
            if files != [SINGLE_NAME] and (self.directory / SINGLE_NAME).is_file():
                # transformers' from_pretrained loads the single file, the index names others
                raise FeatCalError(
                    f"{self.role} {self.directory} holds both {SINGLE_NAME} and {INDEX_NAME} "
                    f"(which names {', '.join(files[:3])}{', ...' if len(files) > 3 else ''}); "
                    "transformers would load the single file, featcal the index: remove one of them "
                    f"({SINGLE_NAME}, or the index with its shards)"
                )
            for name in files:
                self._check_shard_name(index_path, name)
                if not (self.directory / name).is_file():
                    raise FeatCalError(
                        f"{self.directory / name} is listed in {index_path} but missing; "
                        f"copy the missing shard or re-save the {self.role}"
                    )
            return files
        if (self.directory / SINGLE_NAME).is_file():
            return [SINGLE_NAME]
        found = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if len(found) == 1:
            return found
        raise FeatCalError(
            f"{self.directory} holds no {SINGLE_NAME} or {INDEX_NAME}; save the {self.role} with "
            "save_pretrained(..., safe_serialization=True) (pickled .bin weights are not read)"
        )

    def _check_shard_name(self, index_path: Path, name: str) -> None:
        """A shard an index names lies in this folder: a relative name without `..`, no linked
        folder on the way out, and the file itself in the folder or a link into a
        content-addressed cache (the Hugging Face cache's blobs/, DVC's cache)."""
        fix = (
            f"an index names shard files of its own folder: copy the shard into {self.directory} "
            f"and list it by its file name, or re-save the {self.role} with save_pretrained"
        )
        relative = PurePosixPath(name)
        if not name or relative.is_absolute() or ".." in relative.parts:
            raise FeatCalError(
                f"{index_path} names shard {name!r}, outside {self.directory}; {fix}"
            )
        root = self.directory.resolve()
        path = self.directory / name
        folder = path.parent.resolve()
        if folder != root and root not in folder.parents:
            raise FeatCalError(
                f"{index_path} names shard {name!r}, whose folder is a link to {folder}, outside "
                f"{self.directory}; {fix}"
            )
        if path.is_symlink():
            target = path.resolve()
            if root not in target.parents and not _CACHE_BLOB.fullmatch(target.name):
                raise FeatCalError(
                    f"{index_path} names shard {name!r}, a link to {target}, outside "
                    f"{self.directory}; {fix}"
                )

    def _read_header(self, name: str) -> None:
        path = self.directory / name
        try:
            entries, metadata = read_header(path)
        except (OSError, SafetensorsFormatError) as exc:
            raise FeatCalError(
                f"{path} is not a readable safetensors file ({exc}); re-download or re-save it"
            ) from exc
        self.entries[name] = entries
        self.file_metadata[name] = metadata
        listed: dict[str, str] = self.weight_map or {}
        for key, entry in entries.items():
            if key in self.tensors:
                raise FeatCalError(
                    f"tensor {key!r} is stored twice in {self.role} {self.directory}, in "
                    f"{self.tensors[key].file} and {name}; re-save the {self.role}"
                )
            if listed.get(key, name) != name:
                raise FeatCalError(
                    f"{path} holds tensor {key!r}, which {self.directory / INDEX_NAME} places "
                    f"in {listed[key]!r}; re-save the {self.role} (index and shards together)"
                )
            self.tensors[key] = TensorInfo(name, entry.dtype, entry.shape)

    def reader(self, file: str) -> Reader:
        """A `Reader` over one shard (use as a context manager)."""
        return Reader(self.directory / file, self.entries[file])

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, names: list[str], check_finite: bool = True) -> dict[str, torch.Tensor]:
        """Read the named tensors (each shard opened once, then closed)."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name not in self.tensors:
                raise FeatCalError(
                    f"tensor {name!r} is missing from {self.role} {self.directory}; the checkpoint "
                    "is incomplete or of another architecture"
                )
            by_file.setdefault(self.tensors[name].file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, keys in by_file.items():
            try:
                with self.reader(file) as shard:
                    for key in keys:
                        out[key] = shard[key]
            except (OSError, SafetensorsFormatError) as exc:
                raise FeatCalError(
                    f"cannot read tensors from {self.directory / file} ({exc}); re-save it"
                ) from exc
        if check_finite:
            for key, tensor in out.items():
                if not all_finite(tensor):
                    raise FeatCalError(
                        f"tensor {key!r} in {self.role} {self.directory} contains NaN or Inf; "
                        "fix or re-create that checkpoint"
                    )
        return out

    def float_dtype(self) -> torch.dtype:
        """The widest floating dtype stored (float32 when none is): what the weights compute in."""
        found = {DTYPES[info.dtype] for info in self.tensors.values() if info.dtype in DTYPES}
        floats = [dtype for dtype in found if dtype.is_floating_point]
        return max(floats, key=lambda dtype: dtype.itemsize, default=torch.float32)

    def numel(self, name: str) -> int:
        return math.prod(self.tensors[name].shape)

    def describe(self) -> dict:
        """How a record names this checkpoint: {"path": the folder, absolute; "sha256": {weight
        file (shards and their index): hex digest}}."""
        return {
            "path": str(self.directory.resolve()),
            "sha256": {p.name: sha256_file(p) for p in self.weight_paths()},
        }

    def weight_paths(self) -> list[Path]:
        paths = [self.directory / name for name in self.files]
        if (self.directory / INDEX_NAME).is_file():
            paths.append(self.directory / INDEX_NAME)
        return paths


def tree_files(directory: Path) -> list[Path]:
    """Every file below `directory`, sorted, through symlinked folders too (as the loaders read
    them), each real folder once."""
    found: list[Path] = []
    seen: set[str] = set()
    for folder, names, files in os.walk(directory, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            names[:] = []  # a link back up the tree: walked already
            continue
        seen.add(real)
        found += [Path(folder) / name for name in files]
    return sorted(path for path in found if path.is_file())


def sha256_tree(directory: Path, skip: frozenset[str] = frozenset()) -> str:
    """One digest over every file below `directory` (`tree_files`: relative paths and contents,
    sorted), but the relative paths in `skip`."""
    digest = hashlib.sha256()
    for path in tree_files(directory):
        relative = str(path.relative_to(directory))
        if relative not in skip:
            digest.update(relative.encode())
            digest.update(bytes.fromhex(sha256_file(path)))
    return digest.hexdigest()
