"""The params.yaml reference, derived from the schema (docs/params.md is this module's output;
tests/test_params.py fails when the two differ).

    .venv/bin/python -m featcal_core.params.reference > docs/params.md
"""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from featcal_core.params.models import ModelRef, ModelsSpec
from featcal_core.params.repair import CompareSettings, RepairSettings, Variant
from featcal_core.params.schema import Params
from featcal_core.params.sections import HarnessSettings
from featcal_core.params.selection import SelectSettings
from featcal_core.params.tasks import DataSource, TaskSpec

#: (heading, key prefix, model) of each table, in the order of the page
TABLES = [
    ("Sections", "", Params),
    ("`run:`", "run.", None),
    ("`merge:`", "merge.", None),
    ("`featcal:`", "featcal.", None),
    ("`repair:`", "repair.", RepairSettings),
    ("`evaluation:`", "evaluation.", None),
    ("`evaluation.harness:`", "evaluation.harness.", HarnessSettings),
    ("`tracking:`", "tracking.", None),
    ("`zoo:`", "zoo.", None),
    ("`select:`", "select.", SelectSettings),
    ("`compare:`", "compare.", CompareSettings),
    ("a variant or candidate (`compare.variants[]`, `select.candidates[]`)", "", Variant),
    ("`models:`", "models.", ModelsSpec),
    ("a model reference (`models.base`, `models.experts.<task>`)", "", ModelRef),
    ("`tasks.<task>:`", "tasks.<task>.", TaskSpec),
    ("a data source (`tasks.<task>.calibration`, `.evaluation`)", "", DataSource),
]


def _type(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if origin is not None:
        inner = ", ".join(_type(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(info) -> str:
    if info.default is not PydanticUndefined:
        return "null" if info.default is None else f"`{info.default!r}`"
    factory = info.default_factory
    if factory is not None:
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return "(section defaults)"
        return f"`{factory()!r}`"
    return "required"


def _table(prefix: str, model: type[BaseModel]) -> list[str]:
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        description = (info.description or "").replace("|", "\\|")
        lines.append(
            f"| `{prefix}{name}` | {_type(info.annotation)} | {_default(info)} | {description} |"
        )
    return lines


def markdown() -> str:
    """The whole reference page."""
    sections = {f"{name}.": _section_model(info) for name, info in Params.model_fields.items()}
    out = [
        "# params.yaml reference",
        "",
        "Generated from the schema (`featcal_core/params/`) by "
        "`python -m featcal_core.params.reference`; do not edit by hand. `featcal calibrate`'s "
        "flags are the `featcal:` fields (and `run.seed`) with the same defaults "
        "(`featcal calibrate --help`). Back to the [README](../README.md).",
    ]
    for heading, prefix, model in TABLES:
        table_model = model or sections[prefix]
        assert table_model is not None  # a None in TABLES stands for a section of Params
        out += ["", f"## {heading}", ""] + _table(prefix, table_model)
    return "\n".join(out) + "\n"


def _section_model(info) -> type[BaseModel] | None:
    for candidate in (info.annotation, *typing.get_args(info.annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


if __name__ == "__main__":
    print(markdown(), end="")
