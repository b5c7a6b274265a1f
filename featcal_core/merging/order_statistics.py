"""Exact order statistics of magnitudes |x| over a stream of float64 chunks (no merge method).

`kth_smallest_abs(chunks, numel, rank)` finds the rank-th smallest |x| (1-based) among all entries
a stream yields, in bounded memory: radix selection on the IEEE-754 bit patterns. For
non-negative float64 values the order of the values is the order of their bit patterns read as
int64 (the sign bit is 0), so the answer's 63 remaining bits are fixed 21 at a time: each pass
streams the entries once and histograms the next 21 bits of those that share the bits fixed so
far (2^21 int64 counts, 16 MiB; the digits of small chunks are counted together). As soon as at
most `collect_limit` entries share the prefix, one more pass gathers just those and
`np.partition` finishes. Three passes at most; memory: the
histogram plus one chunk (and at most `collect_limit` gathered values). The result is exact: the
same value torch.kthvalue gives on the concatenated magnitudes.

`gather_abs(chunks, numel)` is the in-memory alternative for one tensor: all magnitudes in one
float64 array (what TIES and Breadcrumbs use per tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

#: bits fixed per histogram pass (63 = 3 × 21: the sign bit of a magnitude is always 0)
DIGIT_BITS = 21
#: gather the remaining candidates and partition them once at most this many are left
COLLECT_LIMIT = 1 << 20


def _magnitudes(chunk: torch.Tensor) -> np.ndarray:
    """|chunk| flattened, float64 (n,); -0.0 becomes +0.0 (bit pattern 0)."""
    return chunk.detach().reshape(-1).to(torch.float64).abs().numpy()


def gather_abs(chunks: Iterable[torch.Tensor], numel: int) -> np.ndarray:
    """All |x| of the stream in one float64 array (numel,); ValueError if the count differs."""
    magnitudes = np.empty(numel, dtype=np.float64)
    filled = 0
    for chunk in chunks:
        flat = _magnitudes(chunk)
        if filled + flat.size > numel:
            raise ValueError(f"the stream has more than the expected {numel} entries")
        magnitudes[filled : filled + flat.size] = flat
        filled += flat.size
    if filled != numel:
        raise ValueError(f"the stream has {filled} entries, expected {numel}")
    return magnitudes


def _bit_patterns(chunks: Iterable[torch.Tensor], numel: int) -> Iterator[np.ndarray]:
    """The int64 bit patterns of |x|, chunk by chunk (n,); ValueError if the count differs."""
    seen = 0
    for chunk in chunks:
        bits = _magnitudes(chunk).view(np.int64)
        seen += bits.size
        yield bits
    if seen != numel:
        raise ValueError(f"the stream has {seen} entries, expected {numel}")


def kth_smallest_abs(
    chunks: Callable[[], Iterable[torch.Tensor]],
    numel: int,
    rank: int,
    *,
    collect_limit: int = COLLECT_LIMIT,
) -> float:
    """The rank-th smallest |x| (1 <= rank <= numel) over the `numel` entries of the stream.

    chunks() starts a fresh pass over the entries (float tensors of any shapes); it is called
    once per pass, at most three times.
    """
    if not 1 <= rank <= numel:
        raise ValueError(f"rank {rank} is outside 1..{numel}")
    prefix = 0  # the answer's bits fixed so far, in place (lower bits 0)
    free = 63  # bits still open below the prefix
    left = numel  # entries sharing the prefix; the answer is the rank-th smallest of them
    while free > 0 and left > collect_limit:
        width = min(DIGIT_BITS, free)
        shift = free - width
        mask = (1 << width) - 1
        counts = np.zeros(1 << width, dtype=np.int64)
        pending: list[np.ndarray] = []  # digits of small chunks, counted together
        waiting = 0
        for bits in _bit_patterns(chunks(), numel):
            if free < 63:
                bits = bits[(bits >> free) == (prefix >> free)]
            pending.append((bits >> shift) & mask)
            waiting += bits.size
            if waiting >= counts.size:
                counts += np.bincount(np.concatenate(pending), minlength=counts.size)
                pending, waiting = [], 0
        if pending:
            counts += np.bincount(np.concatenate(pending), minlength=counts.size)
        cumulative = np.cumsum(counts)
        digit = int(np.searchsorted(cumulative, rank))  # first digit reaching the rank
        rank -= int(cumulative[digit - 1]) if digit else 0
        left = int(counts[digit])
        prefix |= digit << shift
        free = shift
    if free == 0:
        return float(np.array([prefix], dtype=np.int64).view(np.float64)[0])
    gathered = [bits[(bits >> free) == (prefix >> free)] for bits in _bit_patterns(chunks(), numel)]
    candidates = np.concatenate(gathered) if gathered else np.empty(0, dtype=np.int64)
    if candidates.size != left:
        raise ValueError("the stream changed between passes")
    candidates.partition(rank - 1)
    return float(candidates[rank - 1 : rank].view(np.float64)[0])
