"""The size limit of a written model's weight files, as transformers writes it ("5GB", "500MB",
"2GiB"): `parse_shard_size` (import-light: the params schema checks `run.max_shard_size` with it).
"""

from __future__ import annotations

import re

from featcal_core.errors import FeatCalError

#: transformers 5.x `PreTrainedModel.save_pretrained(max_shard_size=...)`'s default
DEFAULT_MAX_SHARD_SIZE = "50GB"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", re.IGNORECASE)


def shard_size_problem(value: object) -> str | None:
    """Why `value` is not a shard size (None: it is one): a number of bytes, or one with a unit
    as transformers writes them (500MB, 5GB, 2GiB; KB/MB/GB/TB are powers of 1000)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return f"{value!r} is not a size"
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None:
            return f"{value!r} is not a size (write bytes, or a number with a unit: 500MB, 5GB)"
        size = float(match[1]) * _UNITS[(match[2] or "").upper()]
    else:
        size = value
    return None if size >= 1 else f"{value!r} is below one byte"


def parse_shard_size(value: int | str | None, flag: str = "--max-shard-size") -> int:
    """`value` (None: `DEFAULT_MAX_SHARD_SIZE`) in bytes; FeatCalError naming `flag` when it is
    not a size."""
    if value is None:
        value = DEFAULT_MAX_SHARD_SIZE
    problem = shard_size_problem(value)
    if problem is not None:
        raise FeatCalError(f"{flag}: {problem}, e.g. 5GB, 500MB or 2GiB")
    if isinstance(value, int):
        return value
    match = _SIZE.fullmatch(value)
    assert match is not None  # checked by shard_size_problem
    return int(float(match[1]) * _UNITS[(match[2] or "").upper()])
