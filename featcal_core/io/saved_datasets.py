"""The files a `datasets.save_to_disk` folder reads, confined to that folder.

A split's `state.json` lists its data files (`_data_files`), which `datasets.load_from_disk` joins
to the split's folder; a DatasetDict's `dataset_dict.json` lists its splits, each a folder below
it. featcal's digests of a dataset folder (the evaluation store's key, lineage, the records)
cover the files below the folder, so every name these files hold must stay there: a relative
name without `..`, no link leading out of the folder. `check_saved_dataset` refuses any other.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from featcal_core.errors import FeatCalError

__all__ = ["check_saved_dataset", "data_file_names"]

_FIX = "re-save the dataset with save_to_disk"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable: the loader reports it


def data_file_names(folder: str | Path) -> list[str]:
    """The data file names the `state.json` of `folder` lists (none when it has no readable
    one)."""
    state = _read_json(Path(folder) / "state.json")
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list):
        return []
    return [
        entry["filename"]
        for entry in files
        if isinstance(entry, dict) and isinstance(entry.get("filename"), str)
    ]


def _outside(name: str) -> bool:
    relative = PurePosixPath(name)
    return not name or relative.is_absolute() or ".." in relative.parts


def _check_split(folder: Path, where: str) -> None:
    state_file = folder / "state.json"
    root = folder.resolve()
    for name in data_file_names(folder):
        if _outside(name):
            problem = f"outside {folder}"
        else:
            target = (folder / name).resolve()
            if root in target.parents:
                continue
            problem = f"a link to {target}, outside {folder}"
        raise FeatCalError(
            f"{where}: {state_file} names data file {name!r}, {problem}; a split reads only "
            f"files of its own folder: {_FIX}"
        )


def check_saved_dataset(path: str | Path, where: str) -> None:
    """Refuse a save_to_disk folder (a Dataset, or a DatasetDict of them) whose `state.json` names
    a data file, or whose `dataset_dict.json` names a split, outside its folder; `where` starts
    the message (the argument or params key)."""
    path = Path(path)
    if (path / "state.json").is_file():
        _check_split(path, where)
    index = path / "dataset_dict.json"
    if not index.is_file():
        return
    listed = _read_json(index)
    splits = listed.get("splits") if isinstance(listed, dict) else None
    for split in splits if isinstance(splits, list) else []:
        if not isinstance(split, str):
            continue  # the loader reports it
        if _outside(split) or len(PurePosixPath(split).parts) != 1:
            raise FeatCalError(
                f"{where}: {index} names split {split!r}, which is not a folder of {path}; {_FIX}"
            )
        if (path / split / "state.json").is_file():
            _check_split(path / split, where)
