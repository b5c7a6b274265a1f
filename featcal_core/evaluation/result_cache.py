"""Evaluation rows kept across runs, keyed by everything that produced them.

A row (one model's accuracy, loss and counts on one task's evaluation set) is stored under a
sha256 of: the model's checkpoint files, the head's identity (`Head.identity`), the evaluation
rows' files and split, the settings the caller passes (columns, row limit, batch size, precision,
the device: featcal_core.provenance.identity.device_identity) and the code (`code_identity`). A
row is reused only when every part is byte for byte what it was; anything else misses, and a miss
only costs the evaluation. A reused row is the stored result, so a run's `evaluation.json` is the
same with or without the store; each row is stored signed (HMAC-SHA256 of its key and text under
a key only this user can read, `SIGNING_KEY`), and one that changed since, or that another writer
put there with its digest recomputed, is evaluated again.

Checkpoint files are all files below the folder except its model card and featcal's own records
and marker, which change with each run without changing the model (`content_digest`).

The store: `$FEATCAL_EVALUATION_CACHE` (a file path; `off` disables it), else
`$XDG_CACHE_HOME/featcal/evaluations.sqlite` (default `~/.cache/featcal/`). It never lies inside
an evaluation's inputs (`check_outside`). A stored row whose fields do not have their types
(ROW_FIELDS) is evaluated again; a store another process keeps locked is skipped
(featcal_core.io.cache_store).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import sqlite3
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.io import cache_store
from featcal_core.provenance.identity import (
    code_identity,
    content_digest,
    tensors_digest,
)

log = logging.getLogger(__name__)

VARIABLE = "FEATCAL_EVALUATION_CACHE"
#: bump when a stored row's meaning changes
_VERSION = "featcal-evaluation-row-v1"

_SCHEMA = """CREATE TABLE IF NOT EXISTS evaluation_rows (
    key TEXT PRIMARY KEY, result TEXT NOT NULL, sha256 TEXT NOT NULL)"""

Row = dict[str, Any]

#: the fields a row may hold and their types: a stored row with another field, or one of these
#: of another type, is evaluated again ("accuracy" is required)
ROW_FIELDS: dict[str, type] = {
    "accuracy": float,
    "loss": float,
    "examples": int,
    "split_rows": int,
    "perplexity": float,
    "nll": float,
    "tokens": int,
}


def store_path() -> Path | None:
    """Where the store lives (None: disabled)."""
    return cache_store.store_path(VARIABLE, "evaluations.sqlite")


def row_key(parts: Mapping[str, Any]) -> str:
    """sha256 of `parts` (JSON values) with the code's identity."""
    payload = {"version": _VERSION, "code": code_identity(), **parts}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


#: the file, in this user's featcal cache folder, holding the key that signs the store's rows
SIGNING_KEY = "evaluation-store.key"


@functools.lru_cache(maxsize=1)
def _signing_key() -> bytes | None:
    """This user's key for the store's rows (made once, mode 0600, linked into place so that
    concurrent first runs share one), or None when it cannot be had (the store is then unused).
    A row another writer put into the store, its digest recomputed, does not verify without it:
    the store holds no more authority than the user's own files."""
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "featcal"
    path = folder / SIGNING_KEY
    try:
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            draft = folder / f".{SIGNING_KEY}.{os.getpid()}-{secrets.token_hex(4)}"
            descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(secrets.token_hex(32))
            try:
                os.link(draft, path)
            except FileExistsError:
                pass  # another process made it first: theirs is the key
            finally:
                draft.unlink()
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            log.warning(
                "evaluation store: %s is not a file of this user's that only they can read; "
                "working without the store (remove it to have a new one made)",
                path,
            )
            return None
        return path.read_bytes().strip()
    except OSError as exc:
        log.debug("evaluation store: no signing key (%s); working without the store", exc)
        return None


def _sha256(key: str, text: str) -> str:
    """The row's signature: HMAC-SHA256 of its key and text under this user's key."""
    secret = _signing_key() or b""
    return hmac.new(secret, f"{key}\n{text}".encode(), hashlib.sha256).hexdigest()


def _connect() -> sqlite3.Connection | None:
    if _signing_key() is None:
        return None
    return cache_store.connect(store_path(), _SCHEMA)


def row_problem(row: Any) -> str | None:
    """Why a stored row cannot be used (None: it can): not an object, no accuracy, a field
    outside ROW_FIELDS, or a field of another type (a float field takes a finite number, an int
    field an integer; accuracy lies in [0, 1])."""
    if not isinstance(row, dict):
        return f"a {type(row).__name__}, not an object"
    if "accuracy" not in row:
        return "no accuracy"
    for name, value in row.items():
        kind = ROW_FIELDS.get(name)
        if kind is None:
            return f"unknown field {name!r}"
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            return f"{name} holds {type(value).__name__} {value!r:.40}, not {kind.__name__}"
        if not math.isfinite(value):
            return f"{name} is {value!r}"
    if not 0.0 <= row["accuracy"] <= 1.0:
        return f"accuracy {row['accuracy']!r} is outside [0, 1]"
    return None


def lookup(keys: Sequence[str]) -> dict[str, Row]:
    """{key: stored row} of the `keys` the store holds."""
    connection = _connect()
    if connection is None or not keys:
        return {}
    try:
        with connection:
            marks = ", ".join("?" * len(keys))
            found = connection.execute(
                f"SELECT key, result, sha256 FROM evaluation_rows WHERE key IN ({marks})",
                list(keys),
            ).fetchall()
    except sqlite3.Error as exc:
        cache_store.failed(store_path(), exc, "read")
        return {}
    finally:
        connection.close()
    rows: dict[str, Row] = {}
    malformed: list[str] = []
    for key, text, digest in found:
        if not hmac.compare_digest(_sha256(key, text), digest):
            continue  # changed since it was stored, or not stored by this user: evaluated again
        try:
            row = json.loads(text)
        except ValueError:
            continue
        problem = row_problem(row)
        if problem is None:
            rows[key] = row
        else:
            malformed.append(problem)
    if malformed:
        log.warning(
            "evaluation store %s: %d stored row(s) malformed (%s); evaluated again",
            store_path(),
            len(malformed),
            malformed[0],
        )
    return rows


def record(rows: Mapping[str, Row]) -> None:
    """Store each row under its key (replacing what the key held)."""
    entries = []
    for key, row in rows.items():
        try:
            text = json.dumps(row, allow_nan=False)
            entries.append((key, text, _sha256(key, text)))
        except (TypeError, ValueError):
            continue  # not plain JSON (or not finite): evaluated again next time
    connection = _connect() if entries else None
    if connection is None:
        return
    try:
        with connection:
            connection.executemany(
                "INSERT OR REPLACE INTO evaluation_rows VALUES (?, ?, ?)", entries
            )
    except sqlite3.Error as exc:
        cache_store.failed(store_path(), exc, "written")
    finally:
        connection.close()


def reuse_or_evaluate(
    keys: Mapping[str, str | None],
    evaluate: Callable[[], Mapping[str, Row]],
    keys_after: Callable[[], Mapping[str, str | None]] | None = None,
) -> tuple[dict[str, Row], bool]:
    """({name: row}, reused) for rows named in `keys` ({name: row key}; a None key: not
    storable): the stored rows when the store holds every key, else `evaluate()` (every name at
    once: they share one pass), whose rows are then stored under `keys_after()` (default
    `keys`: the keys as they read once the evaluation has written what it caches, such as a
    head's class embeddings)."""
    names = list(keys)
    wanted = [key for key in keys.values() if key is not None]
    if len(wanted) == len(names):
        stored = lookup(wanted)
        if len(stored) == len(set(wanted)):
            return {name: dict(stored[keys[name]]) for name in names}, True  # type: ignore[index]
    rows = {name: dict(row) for name, row in evaluate().items()}
    after = keys_after() if keys_after is not None else keys
    record({key: rows[name] for name, key in after.items() if key is not None and name in rows})
    return rows, False


def classification_keys(
    model_dir: str | Path,
    head: Any,
    dataset_dir: str | Path,
    split: str | None,
    linears: Mapping[str, tuple[torch.Tensor, torch.Tensor] | None],
    settings: Mapping[str, Any],
) -> dict[str, str | None]:
    """{row name: key} of `evaluate_linears`' rows (the tower in `model_dir` under `head` and each
    of `linears`, on `dataset_dir`/`split`; `settings`: columns, limits, precision, device as
    JSON values). Every key None when the store is off or the head has no identity."""
    identity = head.identity() if store_path() is not None else None
    if identity is None:
        return dict.fromkeys(linears)
    common = {
        "kind": "classification",
        # the own head alone runs as one classifier (its Linear under autocast); beside others,
        # the features go through each Linear in float32: not the same bits in bfloat16
        "pass": "classifier" if list(linears.values()) == [None] else "features",
        "model": content_digest(model_dir),
        "head": identity,
        "data": content_digest(dataset_dir),
        "split": split,
        **settings,
    }
    return {
        name: row_key({**common, "linear": None if pair is None else tensors_digest(list(pair))})
        for name, pair in linears.items()
    }


def label_scoring_key(
    model_dir: str | Path, tokenizer_dir: str | Path, dataset_dir: str | Path, settings: Mapping
) -> str | None:
    """The key of a causal LM's label-continuation row (the model in `model_dir`; the base in
    `tokenizer_dir`, whose tokenizer scores and, for a LoRA adapter folder, whose weights it
    applies to; the rows of `dataset_dir`; `settings`: split, label words, prompt, columns,
    limits, device as JSON values); None when the store is off."""
    if store_path() is None:
        return None
    return row_key(
        {
            "kind": "label-scoring",
            "model": content_digest(model_dir),
            "base": content_digest(tokenizer_dir),
            "data": content_digest(dataset_dir),
            **settings,
        }
    )


def check_outside(inputs: Mapping[str, str | Path]) -> None:
    """Refuse a store that lies inside one of `inputs` ({what it is, e.g. "expert 'alpha'":
    its folder}): writing it there would change the input (its digests, its files)."""
    path = store_path()
    if path is None:
        return
    store = path.resolve()
    for role, folder in inputs.items():
        root = Path(folder).expanduser().resolve()
        if store == root or root in store.parents:
            setting = (
                f"{VARIABLE}={os.environ[VARIABLE]}"
                if os.environ.get(VARIABLE) is not None
                else f"the default store {path} (XDG_CACHE_HOME)"
            )
            raise FeatCalError(
                f"{setting} lies inside {role} {folder}; the evaluation store is never written "
                f"into an input: point {VARIABLE} at a file outside the models and datasets "
                f"(or set {VARIABLE}=off)"
            )
