"""Small text helpers shared by the lineage report and the model card."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

#: what an absent or undefined value prints as
DASH = "—"


def as_dict(value: Any) -> dict:
    """`value` as a dict (a copy), or {} when it is not a mapping."""
    return dict(value) if isinstance(value, Mapping) else {}


def value_text(value: Any) -> str:
    """One value as report text: null as a dash, booleans lower-case, JSON for containers."""
    if value is None:
        return DASH
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else DASH
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    return str(value)


def metric_text(value: Any) -> str:
    """A metric as report text: integers as is, reals to 4 decimals, undefined as a dash."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return DASH if value is None else str(value)
    if isinstance(value, numbers.Integral):
        return str(value)
    value = float(value)
    if not math.isfinite(value):
        return DASH
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.6g}"
