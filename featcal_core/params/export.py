"""Params as YAML (`dump`), as flat MLflow params (`flatten`), and where an exported params file
may go (`check_export_out`: never inside an input the params name, `input_folder_holding`, nor
inside a folder featcal wrote)."""

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

from featcal_core.errors import FeatCalError
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


def _place(path: str | Path) -> Path:
    """`path` with its folder resolved, the file itself not followed (a link is replaced, never
    written through)."""
    return Path(os.path.realpath(Path(path).expanduser().parent)) / Path(path).name


def model_folder_holding(path: str | Path, params: Params) -> tuple[Path, str] | None:
    """(folder, how the params name it) of the model folder the params name that holds `path`
    (`_place`): a local base or expert, a Hub model's snapshot or folder in the Hub cache, or the
    zoo's folder; None when no such folder holds it."""
    place = _place(path)
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


def input_folder_holding(path: str | Path, params: Params) -> tuple[Path, str, str] | None:
    """(folder, how the params name it, what it is) of an input the params name that is or holds
    `path` (`_place`): a model folder (`model_folder_holding`), a local dataset
    (`tasks.<t>.calibration/evaluation/validation.path`) or lm-eval's task folder
    (`evaluation.harness.include_path`); None when none is or holds it."""
    found = model_folder_holding(path, params)
    if found is not None:
        return found[0], found[1], "model folder"
    place = _place(path)
    inputs: list[tuple[str, str, str]] = []
    for task, spec in (params.tasks or {}).items():
        for role in ("calibration", "evaluation", "validation"):
            source = getattr(spec, role)
            if source is not None and source.path is not None:
                inputs.append((source.path, f"tasks.{task}.{role}.path", "dataset"))
    harness = params.evaluation.harness
    if harness is not None and harness.include_path:
        inputs.append((harness.include_path, "evaluation.harness.include_path", "task folder"))
    for where, key, kind in inputs:
        folder = Path(where).expanduser().resolve()
        if place == folder or folder in place.parents:
            return folder, f"{key} ({where})", kind
    return None


def check_export_out(out: str | Path, params: Params) -> None:
    """Refuse (one FeatCalError line, `--overwrite` or not) an exported params file at `out`
    that lies inside an input the params name (`input_folder_holding`) or inside a folder
    featcal wrote (a marked results folder, model or cache: its marker lists the files that
    lineage verifies)."""
    from featcal_core.io.markers import MARKER, read_marker
    from featcal_core.io.outputs import owner_of

    found = input_folder_holding(out, params)
    if found is not None:
        folder, named, kind = found
        raise FeatCalError(
            f"--out {out} lies inside the {kind} {folder}, which the params name as {named}; "
            "featcal never writes into an input the params read, --overwrite included; choose "
            "another --out (left untouched)"
        )
    owner = owner_of(out) or owner_of(_place(out))
    if owner is not None:
        root = (read_marker(owner) or {}).get("kind")
        what = f"featcal {root} folder" if root else "folder featcal wrote"
        raise FeatCalError(
            f"--out {out} lies inside the {what} {owner} (its {MARKER} records the files "
            "`featcal lineage` verifies); params export never writes there, --overwrite "
            "included; write params.yaml elsewhere, e.g. the project root (left untouched)"
        )
