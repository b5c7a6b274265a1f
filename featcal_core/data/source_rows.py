"""The rows of a data source, and its input column (see featcal_core.data.source.DataSource).

    data = open_source(spec.calibration, key="tasks.mnist.calibration")

A source is a `DataSource` (or the run configuration's equivalent): a local `save_to_disk`
directory (a Dataset, or a DatasetDict plus `split`) or a Hub dataset
(`datasets.load_dataset(hub, config, split=split)`). `open_rows` gives its rows (a
`datasets.Dataset` of N rows, memory-mapped for local directories) and the split they are;
`input_column` checks the column holding a modality's inputs (`datasets.Image` or strings). Every
error is one FeatCalError line naming the params key and what to fix.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal_core.data.source import DataSource, as_data_source
from featcal_core.errors import FeatCalError
from featcal_core.io.saved_datasets import check_saved_dataset

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import datasets

__all__ = ["CANONICAL_COLUMNS", "input_column", "open_rows", "open_source"]

#: modality -> the column name featcal_core.data.calibration_data expects
CANONICAL_COLUMNS = {"image": "image", "text": "text"}


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def open_source(
    source: DataSource | Mapping[str, Any],
    *,
    key: str = "data source",
    trust_remote_code: bool = False,
) -> datasets.Dataset:
    """The rows of one source as a `datasets.Dataset` (memory-mapped for local directories).

    `key` is the params key the source comes from (e.g. "tasks.mnist.calibration"); every
    error is one FeatCalError line that names it and says what to fix. An empty split is refused.
    """
    return open_rows(as_data_source(source), key, trust_remote_code)[0]


def open_rows(
    source: DataSource, key: str, trust_remote_code: bool
) -> tuple[datasets.Dataset, str | None]:
    """(rows, the split they are: the configured one, or the only split of a local DatasetDict)."""
    if source.kind == "hub":
        data, split = _open_hub(source, key, trust_remote_code), source.split
    else:
        data, split = _open_local(source, key)
    if len(data) == 0:
        raise FeatCalError(f"{key}: {source.describe()} has no rows; point it at a non-empty split")
    return data, split


def dataset_commit(source: DataSource) -> str | None:
    """The commit a Hub source's rows come from (for the records): its revision when that is a
    commit, else the Hub's answer for the revision (None offline, for local sources, or when the
    Hub does not answer: the rows' digests are recorded either way)."""
    import re

    if source.hub is None:
        return None
    if source.revision is not None and re.fullmatch(r"[0-9a-f]{40}", source.revision):
        return source.revision
    if _datasets_offline():
        return None
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(source.hub, revision=source.revision).sha
    except Exception as exc:  # informative only
        log.warning("could not look up the commit of dataset %s: %s", source.hub, _one_line(exc))
        return None


def _datasets_offline() -> bool:
    """True when `datasets` runs offline (`datasets_offline_cause`: the Hub is not asked)."""
    from featcal_core.provenance.hub import datasets_offline_cause

    return datasets_offline_cause() is not None


def _open_hub(source: DataSource, key: str, trust_remote_code: bool) -> datasets.Dataset:
    import datasets

    assert source.hub is not None  # what kind "hub" means
    try:
        data = load_hub_split(
            source.hub,
            source.config,
            source.split,
            source.revision,
            trust_remote_code=trust_remote_code,
        )
    except Exception as exc:
        from featcal_core.provenance.hub import datasets_offline_cause

        if _datasets_offline():
            raise FeatCalError(
                f"{key}: Hub dataset {source.describe()} is not in the datasets cache and "
                f"offline mode is on ({datasets_offline_cause()}); unset it to download "
                f"the dataset, or load it once online with the same HF_HOME ({type(exc).__name__}:"
                f" {_one_line(exc)})"
            ) from exc
        raise FeatCalError(
            f"{key}: cannot load Hub dataset {source.describe()} ({type(exc).__name__}: "
            f"{_one_line(exc)}); check {key}.hub, .config and .split, and the network or the "
            "Hugging Face cache (HF_DATASETS_OFFLINE)"
        ) from exc
    if not isinstance(data, datasets.Dataset):
        raise FeatCalError(
            f"{key}: Hub dataset {source.describe()} gave a {type(data).__name__}, not one split; "
            f"set {key}.split to a single split name"
        )
    return data


def load_hub_split(
    name: str,
    config: str | None,
    split: str | None,
    revision: str | None = None,
    *,
    trust_remote_code: bool = False,
) -> datasets.Dataset | datasets.DatasetDict:
    """`datasets.load_dataset(name, config, split=split, revision=revision)`, fetching only the
    split's files. `load_dataset` downloads and prepares every split of a config even when asked
    for one (svhn's 531k-row `extra` for `train`); where the dataset is data files (parquet, csv,
    image folders: a builder with per-split `data_files`), only the split's files are passed,
    with the config's features (its class names) kept; a split the builder does not list loads
    as a whole. Offline the cache answers: datasets' own, else the rows of an earlier split-only
    load (`_cached_split`)."""
    import datasets

    pinned = {} if revision is None else {"revision": revision}
    if _datasets_offline():  # nothing is downloaded: the rows come from the datasets cache
        try:
            return datasets.load_dataset(
                name, config, split=split, trust_remote_code=trust_remote_code, **pinned
            )
        except Exception:
            cached = None if split is None else _cached_split(name, config, split)
            if cached is None:
                raise
            log.info(
                "dataset %s: split %s from the datasets cache of an earlier split-only load",
                name,
                split,
            )
            return cached
    narrowed: dict[str, Any] = {}
    if split is not None:
        builder = datasets.load_dataset_builder(name, config, **pinned)
        files = getattr(builder.config, "data_files", None) or {}
        if split in files and len(files) > 1:
            narrowed = {"data_files": {split: list(files[split])}}
            if builder.info.features is not None:
                narrowed["features"] = builder.info.features
    return datasets.load_dataset(
        name, config, split=split, trust_remote_code=trust_remote_code, **pinned, **narrowed
    )


def _cached_split(name: str, config: str | None, split: str) -> datasets.Dataset | None:
    """Offline: `split` as an earlier split-only load prepared it, or None. datasets keeps such
    rows under `<HF_DATASETS_CACHE>/<owner>___<name>/<config>-<data files hash>/<version>/<hash>/`,
    which an offline `load_dataset(name, config)` does not look in; the newest such folder whose
    dataset_info.json names the config and the split is read (arrow files, features included).
    Like datasets' own offline loads, the revision is not checked."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = Path(datasets.config.HF_DATASETS_CACHE) / "___".join(parts)
    wanted = config or "default"
    newest: tuple[float, list[Path]] | None = None
    for info_file in root.glob(f"{wanted}-*/*/*/dataset_info.json"):
        try:
            info = json.loads(info_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if info.get("config_name") != wanted or split not in (info.get("splits") or {}):
            continue
        folder = info_file.parent
        files = sorted(folder.glob(f"*-{split}.arrow")) or sorted(
            folder.glob(f"*-{split}-[0-9]*-of-[0-9]*.arrow")
        )
        mtime = info_file.stat().st_mtime
        if files and (newest is None or mtime > newest[0]):
            newest = (mtime, files)
    if newest is None:
        return None
    shards = [datasets.Dataset.from_file(str(f)) for f in newest[1]]
    return shards[0] if len(shards) == 1 else datasets.concatenate_datasets(shards)


def _open_local(source: DataSource, key: str) -> tuple[datasets.Dataset, str | None]:
    import datasets

    assert source.path is not None  # a local source (as_data_source checks it)
    path = Path(os.path.expanduser(source.path))
    split = source.split
    if not path.exists():
        raise FeatCalError(
            f"{key}.path: {path} does not exist; pass a datasets save_to_disk directory "
            "(or fetch it first, e.g. dvc pull)"
        )
    check_saved_dataset(path, f"{key}.path")
    target = path
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():  # a DatasetDict: each split is a Dataset directory below it
        try:
            splits = [str(s) for s in json.loads(dict_file.read_text())["splits"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FeatCalError(
                f"{key}.path: {dict_file} is unreadable ({_one_line(exc)}); re-save the dataset"
            ) from exc
        if source.split is None:
            if len(splits) != 1:
                raise FeatCalError(
                    f"{key}.split: {path} is a DatasetDict with splits {splits}; "
                    f"set {key}.split to one of them"
                )
            split = splits[0]
        elif source.split in splits:
            split = source.split
        else:
            raise FeatCalError(
                f"{key}.split: {path} has no split {source.split!r} (available: {splits}); "
                f"set {key}.split to one of them"
            )
        target = path / split
    elif not (path / "state.json").is_file():
        raise FeatCalError(
            f"{key}.path: {path} is not a datasets save_to_disk directory (no state.json or "
            "dataset_dict.json); save the data with Dataset.save_to_disk"
        )
    state = _state(target)
    if state is not None and state.get("_data_files") == []:
        # save_to_disk of an empty split writes no data file; load_from_disk then fails
        raise FeatCalError(f"{key}: {source.describe()} has no rows; point it at a non-empty split")
    try:
        data = datasets.load_from_disk(str(target))
    except Exception as exc:
        raise FeatCalError(
            f"{key}.path: cannot load {target} ({type(exc).__name__}: {_one_line(exc)}); "
            "re-save it with Dataset.save_to_disk"
        ) from exc
    if not isinstance(data, datasets.Dataset):
        raise FeatCalError(
            f"{key}.path: {target} holds a {type(data).__name__}, not one split; "
            f"set {key}.split or point {key}.path at a Dataset directory"
        )
    if target == path and source.split is not None:
        saved = state.get("_split") if state else None
        if saved is not None and str(saved) != source.split:
            raise FeatCalError(
                f"{key}.split: {path} is a single Dataset saved as split {saved!r}, not "
                f"{source.split!r}; fix {key}.split or remove it"
            )
        split = source.split
    elif target == path:
        split = None if state is None or state.get("_split") is None else str(state["_split"])
    return data, split


def _state(directory: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((directory / "state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def input_column(
    data: datasets.Dataset, source: DataSource, key: str, modality: str, configured: str
) -> str:
    """`configured`, checked: a column of `data` holding images (datasets.Image) or strings."""
    import datasets

    available = data.column_names
    field = f"{modality}_column"
    if configured not in available:
        raise FeatCalError(
            f"{key}.{field}: no column {configured!r} in {source.describe()} "
            f"(available: {available}); set {key}.{field} to the column with the {modality}s"
        )
    feature = data.features[configured]
    if modality == "image":
        ok = isinstance(feature, datasets.Image)
    else:
        ok = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    if not ok:
        raise FeatCalError(
            f"{key}.{field}: column {configured!r} of {source.describe()} holds {feature}, not "
            f"{'images (datasets.Image)' if modality == 'image' else 'strings'}; "
            f"set {key}.{field} to the column with the {modality}s"
        )
    return configured
