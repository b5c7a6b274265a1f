"""Params as YAML (`dump`), as flat MLflow params (`flatten`), and the model folder the params
name that holds a path (`model_folder_holding`: an exported file never lands in one)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
)

from featcal_core.params.base import _MAX_FLAT_LIST_CHARS
from featcal_core.params.models import ModelRef
from featcal_core.params.schema import Params
from featcal_core.params.tasks import DataSource


def _plain(value: Any) -> Any:
    """A JSON-like tree of the params, models written as in YAML."""
    if isinstance(value, ModelRef):
        return value.to_yaml()
    if isinstance(value, DataSource):  # only the keys that are set: hub/config or path
        return {
            key: item for key, item in value.model_dump(mode="json").items() if item is not None
        }
    if isinstance(value, BaseModel):
        return {field: _plain(getattr(value, field)) for field in type(value).model_fields}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def dump(params: Params) -> str:
    """The full configuration (defaults filled in) as YAML; `load_params` reads it back unchanged."""
    return yaml.safe_dump(_plain(params), sort_keys=False, allow_unicode=True, width=100)


def flatten(params: Params) -> dict[str, str | int | float | bool]:
    """Dotted keys and scalar values for MLflow params, e.g. {"featcal.alpha": 0.25}.

    Only the values that are set: a None value, an empty mapping and an empty list give no key.
    Models give `<key>` (the reference) and `<key>.trust_remote_code` (open_clip ones also
    `<key>.format` and those of `.file`, `.open_clip_config`, `.trust_pickle` that are set);
    lists are JSON text (long ones: a count and a sha256 prefix).
    """
    out: dict[str, str | int | float | bool] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, ModelRef):
            out[prefix] = value.ref
            out[f"{prefix}.trust_remote_code"] = value.trust_remote_code
            if value.format != "hf":  # open_clip options (an hf reference has none)
                for key in ("format", "file", "open_clip_config", "trust_pickle"):
                    if getattr(value, key) is not None:
                        out[f"{prefix}.{key}"] = getattr(value, key)
        elif isinstance(value, BaseModel):
            for field in type(value).model_fields:
                visit(f"{prefix}.{field}" if prefix else field, getattr(value, field))
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(f"{prefix}.{key}", item)
        elif value is None or (isinstance(value, (list, tuple)) and not value):
            return  # not set
        elif isinstance(value, (list, tuple)):
            text = json.dumps(_plain(value), ensure_ascii=False)
            if len(text) > _MAX_FLAT_LIST_CHARS:
                digest = hashlib.sha256(text.encode()).hexdigest()[:12]
                text = f"<{len(value)} items, sha256 {digest}>"
            out[prefix] = text
        elif isinstance(value, (str, int, float, bool)):
            out[prefix] = value
        else:
            out[prefix] = str(value)

    visit("", params)
    return out


def model_folder_holding(path: str | Path, params: Params) -> tuple[Path, str] | None:
    """(folder, how the params name it) of the model folder the params name that holds `path`
    (its folder resolved, the file itself not followed: a link is replaced, never written
    through): a local base or expert, a Hub model's snapshot or folder in the Hub cache, or the
    zoo's folder; None when no such folder holds it."""
    place = Path(os.path.realpath(Path(path).expanduser().parent)) / Path(path).name
    folders = []
    if params.models is not None:
        folders += [(folder, f"{key} ({ref.ref})") for key, ref, folder in params.models.folders()]
    zoo = params.zoo_settings
    if zoo is not None:
        folders.append((zoo.path.resolve(), f"zoo.dir ({zoo.path})"))
    for folder, named in folders:
        if folder in place.parents:
            snapshots = folder / "snapshots"
            if snapshots in place.parents and place.parents[0] != snapshots:  # one snapshot
                inner = place.relative_to(snapshots).parts[0]
                return snapshots / inner, named
            return folder, named
    return None
