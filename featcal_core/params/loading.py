"""Reading params.yaml (with `--set` overrides, featcal_core.params.overrides) and checking CLI flags
by the params sections' own models."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from featcal_core.params.base import KEY_SUFFIX, _fail, load_yaml
from featcal_core.params.installed import installed_hint, resolve_params
from featcal_core.params.overrides import _overridden, _short, _yaml_problem
from featcal_core.params.overrides import apply_overrides as apply_overrides
from featcal_core.params.schema import Params
from featcal_core.params.sections import FeatCalSettings

_M = TypeVar("_M", bound=BaseModel)

# -------------------------------------------------------------------------- command-line flags


def featcal_from_flags(values: Mapping[str, Any]) -> FeatCalSettings:
    """`featcal calibrate`'s flags checked by the model params.yaml's `featcal:` goes through
    (same bounds, same strict types); `values` maps field names (alpha, num_per_task, ...) to the
    parsed flag values. A problem is one FeatCalError naming the flag (e.g. --num-per-task)."""
    return settings_from_flags(FeatCalSettings, "featcal", values)


def settings_from_flags(model: type[_M], section: str, values: Mapping[str, Any]) -> _M:
    """Flags that are fields of a params section (`model`, e.g. RunSettings for --seed,
    ZooSettings for --pretrain-steps) checked by that section's own model: same bounds, same
    strict types as params.yaml. `values` maps field names to the parsed flag values (each
    field's flag is `--` + its name with `-` for `_`, as `featcal_cli.arguments.setting_flags`
    declares them). A problem is one FeatCalError naming the flag and the params key."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        at = (first.get("ctx") or {}).get(KEY_SUFFIX) or ""  # a model-level check names its key
        key = str(first["loc"][0]) if first["loc"] else at.split(".")[0]
        _fail(
            f"--{key.replace('_', '-')} {_short(values.get(key))}: {first['msg']} "
            f"(as {section}.{key} in params.yaml)"
        )


# --------------------------------------------------------------------------------------- loading

#: the largest params file read, in bytes (the shipped ones are under 10 KB)
MAX_PARAMS_BYTES = 4 * 2**20


def read_params_text(path: str | Path, name: str) -> str:
    """The UTF-8 text of the params file at `path`, read only when it is a regular file of at most
    `MAX_PARAMS_BYTES` (a device, a pipe or a larger file is one FeatCalError line starting with
    `name`). Raises OSError (IsADirectoryError for a folder) and UnicodeDecodeError as reading
    does."""
    limit = f"{MAX_PARAMS_BYTES // 2**20} MiB"
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO opens at once
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(info.st_mode):
            _fail(
                f"{name}: is not a regular file (a {_file_kind(info.st_mode)}); featcal reads "
                f"params only from a YAML file of at most {limit}; save the params to a file and "
                "pass its path"
            )
        data = handle.read(MAX_PARAMS_BYTES + 1)
    if len(data) > MAX_PARAMS_BYTES:
        _fail(
            f"{name}: is {max(info.st_size, len(data))} bytes, over the {limit} limit of a "
            "params file; pass the params YAML file (a few KB), not a data file"
        )
    return data.decode("utf-8")


def _file_kind(mode: int) -> str:
    """What a file that is no regular file is, in words."""
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISFIFO(mode):
        return "pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def load_params(path: str | Path, overrides: Iterable[str] = ()) -> Params:
    """Read, override and validate a params file; any problem is one FeatCalError line. A bare
    name without .yaml that is no file names a params file that ships with featcal
    (featcal_core.params.installed: `load_params("paper-clip-vit-b32")`)."""
    path = resolve_params(path)
    name = str(path)
    try:
        text = read_params_text(path, name)
    except FileNotFoundError:
        _fail(
            f"{name}: file not found; pass its path, or start from an example: {installed_hint()}"
        )
    except IsADirectoryError:
        _fail(f"{name}: is a directory, not a params file; pass the YAML file")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"{name}: cannot be read ({exc})")
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        _fail(f"{name}: not valid YAML ({_yaml_problem(exc)}); fix the syntax")
    if data is None:
        _fail(f"{name}: is empty; expected a mapping with models:, tasks: and other sections")
    if not isinstance(data, dict):
        _fail(
            f"{name}: expected a mapping of sections (models:, tasks:, ...) at the top level, "
            f"got a {type(data).__name__}"
        )
    overrides = [overrides] if isinstance(overrides, str) else list(overrides)
    params = _overridden(Params, data, overrides, name)
    params._user_set = tuple(overrides)
    return params
