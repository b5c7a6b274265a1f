"""Splitting a source's rows into the train, validation and test `datasets.DatasetDict`.

Split rules, the same for every source and deterministic for a given seed:
- texts are stripped, empty ones dropped; identical texts (identical image bytes) are kept once,
  and dropped altogether when their copies disagree on the label, so no row is in two splits;
- the test split is the official one, a held-out spatial half (textures) or a seeded 20 % carve
  (group-wise where rows share a movie); it is used for nothing else;
- validation is carved from the training data only (15 %, group-wise likewise);
- caps: train <= `max_train` (default 4000), validation <= 1000, test <= 2000, each a seeded,
  class-stratified subsample.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
TRAIN_CAP = 4000
VALIDATION_CAP = 1000
TEST_CAP = 2000
TEST_FRACTION = 0.2
VALIDATION_FRACTION = 0.15


@dataclass
class Rows:
    """Rows of one source before splitting.

    values: list[str] (text) or uint8 array (N, H, W) (image); labels: int64 (N,);
    groups: (N,) ids that must stay in one split, or None; test/validation: bool (N,) masks of
    fixed splits, or None to carve them; balance: subsample every split to its rarest class.
    """

    values: Any
    labels: np.ndarray
    names: Sequence[str]
    groups: np.ndarray | None = None
    test: np.ndarray | None = None
    validation: np.ndarray | None = None
    balance: bool = False


def _dedup(keys: Sequence[Any], labels: np.ndarray) -> np.ndarray:
    """Indices of the first copy of every key; keys whose copies disagree on the label are dropped."""
    first: dict[Any, int] = {}
    conflict: set[Any] = set()
    for i, key in enumerate(keys):
        j = first.setdefault(key, i)
        if j != i and labels[j] != labels[i]:
            conflict.add(key)
    keep = np.array(sorted(i for k, i in first.items() if k not in conflict), dtype=np.int64)
    if len(keep) < len(keys):
        logger.info(
            "dropped %d duplicate rows (%d keys with conflicting labels)",
            len(keys) - len(keep),
            len(conflict),
        )
    return keep


def _carve(
    idx: np.ndarray,
    fraction: float,
    labels: np.ndarray,
    groups: np.ndarray | None,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Split `idx` into (carved, rest) with about `fraction` of the rows carved.

    Stratified by class, or by whole groups (shuffled, taken until the fraction is reached).
    """
    if groups is not None:
        uniq, inverse, counts = np.unique(groups[idx], return_inverse=True, return_counts=True)
        order = rng.permutation(len(uniq))
        taken = order[: int(np.searchsorted(np.cumsum(counts[order]), fraction * len(idx))) + 1]
        mask = np.isin(inverse, taken)
        return idx[mask], idx[~mask]
    carved = []
    for c in np.unique(labels[idx]):
        members = rng.permutation(idx[labels[idx] == c])
        n = int(round(fraction * len(members)))
        carved.append(members[: max(n, 1) if len(members) > 1 else 0])
    out = np.concatenate(carved) if carved else np.zeros(0, np.int64)
    return out, np.setdiff1d(idx, out)


def _subsample(idx: np.ndarray, n: int, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """At most `n` of `idx`, class proportions kept (largest-remainder allocation)."""
    if len(idx) <= n:
        return idx
    classes, counts = np.unique(labels[idx], return_counts=True)
    quota = counts * n / len(idx)
    take = np.floor(quota).astype(np.int64)
    take[np.argsort(-(quota - take), kind="stable")[: n - int(take.sum())]] += 1
    parts = [rng.permutation(idx[labels[idx] == c])[:k] for c, k in zip(classes, take, strict=True)]
    return np.concatenate(parts)


def _balance(idx: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Every class subsampled to the rarest one's count."""
    classes, counts = np.unique(labels[idx], return_counts=True)
    if len(classes) == 0:
        return idx
    m = int(counts.min())
    return np.concatenate([rng.permutation(idx[labels[idx] == c])[:m] for c in classes])


def split_indices(rows: Rows, seed: int, max_train: int | None) -> dict[str, np.ndarray]:
    """Row indices per split (each shuffled), following the module's split rules."""
    rng = np.random.default_rng(seed)
    labels = rows.labels
    every = np.arange(len(labels))
    if rows.test is not None:
        test, pool = every[rows.test], every[~rows.test]
    else:
        test, pool = _carve(every, TEST_FRACTION, labels, rows.groups, rng)
    if rows.validation is not None:
        validation = every[rows.validation]
        train = np.setdiff1d(pool, validation)
    else:
        validation, train = _carve(pool, VALIDATION_FRACTION, labels, rows.groups, rng)
    parts = {"train": train, "validation": validation, "test": test}
    if rows.balance:
        parts = {k: _balance(v, labels, rng) for k, v in parts.items()}
    caps = {"train": TRAIN_CAP if max_train is None else max_train}
    caps |= {"validation": VALIDATION_CAP, "test": TEST_CAP}
    return {
        k: rng.permutation(_subsample(np.sort(v), caps[k], labels, rng)) for k, v in parts.items()
    }


def build_dataset(source: str, modality: str, description: str, rows: Rows, seed: int, max_train):
    """The DatasetDict of `rows` split by `split_indices`."""
    import datasets
    from PIL import Image

    if modality == "image":
        keys = [bytes(v.tobytes()) for v in rows.values]
    else:
        keys = list(rows.values)
    keep = _dedup(keys, rows.labels)
    rows = Rows(
        values=rows.values[keep] if modality == "image" else [rows.values[i] for i in keep],
        labels=rows.labels[keep],
        names=rows.names,
        groups=None if rows.groups is None else rows.groups[keep],
        test=None if rows.test is None else rows.test[keep],
        validation=None if rows.validation is None else rows.validation[keep],
        balance=rows.balance,
    )
    column = "image" if modality == "image" else "text"
    features = datasets.Features(
        {
            column: datasets.Image(mode="L") if modality == "image" else datasets.Value("string"),
            "label": datasets.ClassLabel(names=list(rows.names)),
        }
    )
    out = {}
    for split, idx in split_indices(rows, seed, max_train).items():
        if modality == "image":
            values = [Image.fromarray(rows.values[i], mode="L") for i in idx]
        else:
            values = [rows.values[i] for i in idx]
        info = datasets.DatasetInfo(description=description, features=features)
        out[split] = datasets.Dataset.from_dict(
            {column: values, "label": rows.labels[idx].tolist()}, features=features, info=info
        )
    result = datasets.DatasetDict(out)
    logger.info(
        "source %s (seed %d): %s",
        source,
        seed,
        ", ".join(f"{k} {v.num_rows}" for k, v in result.items()),
    )
    return result
