"""Shared pieces of the params schema: strict types, the error helpers, name checks."""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
)
from pydantic_core import PydanticCustomError

from featcal_core.errors import FeatCalError
from featcal_core.names import name_problem

_SOURCE_FIELDS = (
    "hub",
    "config",
    "revision",
    "path",
    "split",
    "image_column",
    "text_column",
    "label_column",
)


# Hub ids: letters, digits, "-", "_", "."; starting with a letter or digit; at most 96 characters.
_HUB_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HUB_MODEL_RE = re.compile(rf"^(?P<repo>{_HUB_PART}/{_HUB_PART})(?:@(?P<rev>[A-Za-z0-9._/-]+))?$")
_HUB_DATASET_RE = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")
_LOCAL_PREFIXES = ("/", "./", "../", "~")
_OPEN_CLIP_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # featcal_core.open_clip.importer
_MAX_FLAT_LIST_CHARS = 500  # longer lists are logged as a count and a digest (MLflow value limits)
KEY_SUFFIX = (
    "featcal_key_suffix"  # context key of our own errors: the key below the error's location
)


def _fail(message: str) -> typing.NoReturn:
    raise FeatCalError(" ".join(message.split("\n")))


def _error(message: str, at: str = "") -> PydanticCustomError:
    """A validation error; `at` is a dotted key below the validated object (e.g. 'dask_address')."""
    return PydanticCustomError("featcal", message, {KEY_SUFFIX: at})


#: strict types: no bool-as-number, no float-as-int, no string-as-number; floats finite
StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
#: a number as YAML 1.2 and Python write it: 1e-3, 1E3, -2e-1, .5, +1.5 (no nan, no inf)
_NUMBER_RE = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_INTEGER_RE = re.compile(r"^[+-]?\d+$")
#: the other numbers YAML 1.2's core schema reads: hexadecimal, octal, infinity and not-a-number
_YAML12_OTHER_RE = re.compile(
    r"^([+-]?(0x[0-9a-fA-F]+|0o[0-7]+)|[+-]?\.(inf|Inf|INF)|\.(nan|NaN|NAN))$"
)


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading plain scalars by YAML 1.2's core schema, as params.yaml,
    `--set` and the number flags are read: booleans are `true` / `false` only (`yes`, `no`,
    `on`, `off` are text, as in YAML 1.2 and for DVC's `-S`), numbers are as YAML 1.2 and Python
    write them (`1e-3` is a float, `010` is 10; `1_000` and `1:30` are text). A quoted value is
    text: `'0.5'` is not a number."""


#: the most digits an integer in params or on the command line may have (Python refuses to read
#: more than 4300 decimal digits; no setting needs more than a few)
MAX_DIGITS = 100


def _integer(text: str, base: int = 10) -> int:
    """`text` read as an integer, refused (yaml.YAMLError: the value is not one featcal reads)
    beyond MAX_DIGITS digits."""
    if len(text.lstrip("+-")) > MAX_DIGITS:
        raise yaml.YAMLError(f"an integer of {len(text)} characters (at most {MAX_DIGITS} digits)")
    return int(text, base)


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    lowered = text.lower()
    base = 16 if "0x" in lowered else 8 if "0o" in lowered else 10
    return _integer(lowered.replace("0o", "") if base == 8 else lowered, base)


Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if not tag.endswith((":bool", ":int", ":float"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    list("-+0123456789"),
)
Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)
Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _yaml12_int)


def load_yaml(text: str) -> Any:
    """`text` read as YAML by `Yaml12Loader` (params files, `--set` values, flags)."""
    return yaml.load(text, Loader=Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


def _yaml_number(value: Any) -> Any:
    """PyYAML (YAML 1.1) reads `1e-6` (no dot) as a string: take such strings as numbers."""
    if isinstance(value, str) and _NUMBER_RE.match(value.strip()):
        return float(value)
    return value


def read_value(text: str) -> Any:
    """A VALUE given on the command line (`--hp KEY=VALUE`, a number flag) read by the one rule
    params.yaml's values follow: YAML 1.2 (`Yaml12Loader`: `0.3`, `20`, `1e-3`, `true`, `global`).
    `nan` and `inf` stay text;
    `.nan` / `.inf` are YAML's non-finite floats, refused wherever a finite number is wanted.
    An empty text is "". Raises yaml.YAMLError on a value that is not YAML."""
    stripped = text.strip()
    if not stripped:
        return ""
    if _NUMBER_RE.match(stripped):  # as YAML 1.2 and Python read it (`010` is 10, not 8)
        return _integer(stripped) if _INTEGER_RE.match(stripped) else float(stripped)
    value = load_yaml(text)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not _YAML12_OTHER_RE.match(stripped):
            return stripped  # YAML 1.1 alone reads `1:30` or `1_000` as a number: text here
    return _yaml_number(value)


#: a finite number; a string (a quoted `'0.5'` included) is not one
FiniteFloat = Annotated[float, Strict(), Field(allow_inf_nan=False)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_default=True)


def _check_task_names(mapping: Mapping[str, Any]) -> None:
    for task in mapping:
        problem = name_problem(task)
        if problem is not None:
            raise _error(f"task name {problem}", task)
