"""`--set` overrides of a params document, and its validation errors as one line naming the key.

The schema is walked from the document's root model (`Params`), so an unknown key is named with
the keys known at that level.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar, Union

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)

from featcal_core.params.base import KEY_SUFFIX, _fail, load_yaml
from featcal_core.params.models import ModelRef

_M = TypeVar("_M", bound=BaseModel)


# ---------------------------------------------------------------------------- applying overrides


def apply_overrides(document: _M, overrides: Iterable[str], name: str = "params") -> _M:
    """`document` (a `Params`) with `--set`-style overrides applied and validated again (one
    FeatCalError line on a problem, naming `name`)."""
    return _overridden(type(document), document.model_dump(mode="json"), list(overrides), name)


def _overridden(model: type[_M], data: dict[str, Any], overrides: list[str], name: str) -> _M:
    """The document `data` (modified in place) with `overrides` applied, validated by `model`."""
    for override in overrides:
        _apply_override(data, override, name, model)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        _fail(_format_validation_error(exc, name, overrides, model))


# ---------------------------------------------------------------------------------------- errors


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem


def _format_validation_error(
    exc: ValidationError, name: str, overrides: list[str], root: type[BaseModel]
) -> str:
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = tuple(first["loc"])
    ctx = first.get("ctx") or {}
    kind = first["type"]
    if kind == "featcal":
        at = ctx.get(KEY_SUFFIX) or ""
        loc = loc + tuple(at.split(".")) if at else loc
        message = first["msg"]
    elif kind == "extra_forbidden":
        allowed = _known_keys(loc[:-1], root)
        message = "unknown key" + (f"; known keys: {', '.join(allowed)}" if allowed else "")
    elif kind == "missing":
        message = "missing; this key is required"
    else:
        message = f"{first['msg']} (got {_short(first.get('input'))})"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = _key_path(loc)
    for override in reversed(overrides):  # the last override of a key wins, so name that one
        key = override.partition("=")[0].strip()
        if where and (_under(where, key) or _under(key, where)):
            more += f" (set by override {override!r})"
            break
    return f"{name}: {where or '(top level)'}: {message}{more}"


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".") or path.startswith(prefix + "[")


def _key_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]" or (isinstance(part, str) and ("[" in part or "(" in part)):
            continue  # a dict key's own check, or a union member's tag (`function-after[...]`)
        else:
            out += f".{part}" if out else str(part)
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------- schema navigation


def _candidates(annotation: Any) -> list[Any]:
    """The non-None alternatives of an annotation (unwrapping Annotated, Optional and unions)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _candidates(typing.get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [c for arg in typing.get_args(annotation) for c in _candidates(arg)]
    if annotation is type(None):
        return []
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _child(annotation: Any, key: str) -> list[Any]:
    """The annotations found under `key` of a value of type `annotation` (empty: no such key)."""
    found = []
    for candidate in _candidates(annotation):
        if _is_model(candidate) and key in candidate.model_fields:
            found.append(candidate.model_fields[key].annotation)
        elif typing.get_origin(candidate) is dict:
            found.append(typing.get_args(candidate)[1])
    return found


def _known_keys(loc: tuple[Any, ...], root: type[BaseModel]) -> list[str]:
    """The keys of the mapping at `loc` in a document of `root` (empty: no mapping there)."""
    annotations: list[Any] = [root]
    for part in loc:
        if isinstance(part, int):
            annotations = [
                a for ann in annotations for c in _candidates(ann) for a in typing.get_args(c)[:1]
            ]
        else:
            annotations = [a for ann in annotations for a in _child(ann, part)]
    keys = [
        key
        for ann in annotations
        for c in _candidates(ann)
        if _is_model(c)
        for key in c.model_fields
    ]
    return sorted(set(keys))


# ------------------------------------------------------------------------------------ overrides


def _apply_override(data: dict[str, Any], override: str, name: str, root: type[BaseModel]) -> None:
    """Set `key.path=value` in the raw mapping (a document of `root`); the value is parsed as YAML."""
    key, sep, text = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not part for part in parts):
        _fail(f"override {override!r}: expected KEY.PATH=VALUE, e.g. featcal.alpha=0.3")
    try:
        value = load_yaml(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        _fail(f"override {override!r}: value is not valid YAML ({_yaml_problem(exc)})")

    annotations: list[Any] = [root]
    node: dict[str, Any] = data
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth]) or "the top level"
        children = [a for ann in annotations for a in _child(ann, part)]
        if not children and depth and not _known_keys(tuple(parts[:depth]), root):
            _fail(f"override {override!r}: {here} takes a value, not keys; set {here}=VALUE")
        if not children:
            known = _known_keys(tuple(parts[:depth]), root)
            hint = f"; known keys of {here}: {', '.join(known)}" if known else ""
            _fail(f"override {override!r}: {key} is not a key of the params schema{hint}")
        if depth == len(parts) - 1:
            node[part] = _leaf_value(children, value, text.strip())
            return
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif isinstance(child, str) and any(
            c is ModelRef for ann in children for c in _candidates(ann)
        ):
            child = node[part] = {"ref": child}  # a model written as a string gains a key
        elif not isinstance(child, dict):
            _fail(
                f"override {override!r}: {'.'.join(parts[: depth + 1])} in {name} is "
                f"{_short(child)}, not a mapping; set it whole instead"
            )
        node, annotations = child, children


def _leaf_value(annotations: list[Any], value: Any, text: str) -> Any:
    """Keep the raw text where the key takes strings only and YAML read something else (`1`, `yes`)."""
    if value is None or isinstance(value, str):
        return value
    leaves = [c for ann in annotations for c in _candidates(ann)]
    if leaves and all(c is str for c in leaves):
        return text
    return value
