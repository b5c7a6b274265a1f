"""The size limit of a written model's weight files, as transformers writes it ("5GB", "500MB",
"2GiB"): `parse_shard_size` (import-light: the params schema checks `run.max_shard_size` with it).
"""

from __future__ import annotations

import re
from decimal import Decimal

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
#: the largest shard size taken, in bytes (1024TiB: far above any model's weights)
MAX_SHARD_BYTES = 2**50


def _bytes(value: int | str) -> Decimal | None:
    """The exact number of bytes `value` says (None: not a size)."""
    if isinstance(value, int):
        return Decimal(value)
    match = _SIZE.fullmatch(value)
    if match is None:
        return None
    return Decimal(match[1]) * _UNITS[(match[2] or "").upper()]


def _shown(value: object) -> str:
    """`value` as a message shows it (a long one cut in the middle)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"a {value.bit_length()}-bit number"
    if isinstance(value, str) and len(value) > 32:
        return f"{value[:16]!r}... ({len(value)} characters)"
    return repr(value)


def shard_size_problem(value: object) -> str | None:
    """Why `value` is not a shard size (None: it is one): a number of bytes, or one with a unit
    as transformers writes them (500MB, 5GB, 2GiB; KB/MB/GB/TB are powers of 1000), from one
    byte to `MAX_SHARD_BYTES`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return f"{_shown(value)} is not a size"
    size = _bytes(value)
    if size is None:
        return f"{_shown(value)} is not a size (write bytes, or a number with a unit: 500MB, 5GB)"
    if size < 1:
        return f"{_shown(value)} is below one byte"
    if size > MAX_SHARD_BYTES:
        return f"{_shown(value)} is above the largest shard size, 1024TiB"
    return None


def parse_shard_size(value: int | str | None, flag: str = "--max-shard-size") -> int:
    """`value` (None: `DEFAULT_MAX_SHARD_SIZE`) in bytes; FeatCalError naming `flag` when it is
    not a size."""
    if value is None:
        value = DEFAULT_MAX_SHARD_SIZE
    problem = shard_size_problem(value)
    if problem is not None:
        raise FeatCalError(f"{flag}: {problem}, e.g. 5GB, 500MB or 2GiB")
    size = _bytes(value)
    assert size is not None  # checked by shard_size_problem
    return int(size)
