"""Resolve the run's models to local directories, check they form one pool, and lock them.

    base = resolve_model(params.models.base, "models.base")
    experts = {t: resolve_model(r, f"models.experts.{t}") for t, r in params.models.experts.items()}
    architecture = check_pool(base, experts)
    lock = write_lock("data/models.lock.json", base, experts, {"architecture": architecture})
    problems = verify_lock(read_lock("data/models.lock.json"))

A model reference is anything with `kind` ("hub" or "local"), `repo_id`, `revision` and `path`
(attributes, e.g. `featcal_core.params.ModelRef`, or mapping keys); `ref` and `trust_remote_code` are
used when present. Local directories are used in place. Hub models are fetched with
`huggingface_hub.snapshot_download` into the Hugging Face cache (`cache_dir`, else the library's
default, which follows HF_HOME / HF_HUB_CACHE); HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) makes
it a cache-only look-up. Only configs, safetensors weights and tokenizer/processor files of the
repository's top folder are fetched; pickled weights (.bin, .pt, .pth, .ckpt) never are.

Transient failures (connection errors, timeouts, HTTP 429 and 5xx) are retried with exponential
backoff; everything else ends in one `FeatCalError` line naming the params key, the reference,
what is wrong and what to do.

open_clip references (`format: open_clip`, see featcal_core.params.ModelRef) are imported: from a Hub
repository only the open_clip config, the one weight file (`file`, default
`open_clip_model.safetensors`, else `open_clip_pytorch_model.bin`; pickles are read with
torch.load(weights_only=True) unless `trust_pickle`) and the tokenizer files are fetched; a local
directory or file is used in place. `featcal_core.open_clip.importer.import_open_clip` then writes
a featcal checkpoint to `<import_root>/<role>-<first 16 hex of the file's sha256>` (default root
data/models/open_clip), reused on later runs while its recorded source sha256 and config match.
The model's `path` is that import; `open_clip_source` records the source directory, file, config
and their sha256.

The lock file records, for the base and every expert, the reference, the resolved commit, the
local directory and the sha256 of config.json, the safetensors index and every weight shard (plus,
for open_clip references only, `open_clip_source`), and `lock_digest`: the sha256 of the lock's own
content (canonical JSON without `lock_digest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from huggingface_hub import constants as hf_constants
from huggingface_hub import model_info, snapshot_download
from huggingface_hub.errors import (
    DisabledRepoError,
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint, sha256_file
from featcal_core.io.outputs import write_file

try:  # the HTTP client of huggingface_hub 2.x; older releases use httpx or requests
    import httpx2 as _http
except ImportError:  # pragma: no cover - depends on the installed huggingface_hub
    try:
        import httpx as _http
    except ImportError:
        _http = None

__all__ = [
    "ALLOW_PATTERNS",
    "IGNORE_PATTERNS",
    "LOCK_VERSION",
    "ResolvedModel",
    "check_pool",
    "lock_digest",
    "models_from_lock",
    "read_lock",
    "resolve_model",
    "verify_lock",
    "write_lock",
]

log = logging.getLogger(__name__)

#: files fetched from a Hub repository: configs, safetensors weights, tokenizer/processor files
ALLOW_PATTERNS = (
    "*.json",
    "*.safetensors",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "tokenizer*",
    "vocab*",
    "merges*",
)
#: never fetched: sub-folders (ONNX, CoreML, other formats; Checkpoint reads the top folder only)
#: and OpenCLIP's duplicate weights (`open_clip_model.safetensors` next to `model.safetensors`)
IGNORE_PATTERNS = ("*/*", "open_clip_*")
#: extra pattern when the reference allows the model's own code (trust_remote_code)
REMOTE_CODE_PATTERNS = ("*.py",)
#: an open_clip repository's weight files, in order of preference (when `file` is not given)
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
#: small tokenizer files fetched with an open_clip checkpoint (text towers with an HF tokenizer)
OPEN_CLIP_TOKENIZER_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "vocab*", "merges*", "spiece.model",
)  # fmt: skip
#: where open_clip checkpoints are imported (relative to the working directory)
OPEN_CLIP_IMPORT_ROOT = Path("data/models/open_clip")
#: open_clip's model config file in a repository (featcal_core.open_clip.importer.CONFIG_NAME)
OPEN_CLIP_CONFIG = "open_clip_config.json"

LOCK_VERSION = 1
_LOCK_KEYS = ("version", "base", "experts", "lock_digest")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}
_MAX_BACKOFF_S = 60.0


@dataclass
class ResolvedModel:
    """One model of the pool, available on the local disk."""

    role: str  # the params key, e.g. "models.base" or "models.experts.mnist"
    reference: str  # as written in the params, e.g. "openai/clip-vit-base-patch32@main", "./m"
    kind: str  # "hub" or "local"
    path: Path  # the save_pretrained directory (a Hub snapshot, or the local dir in place)
    commit: str | None  # resolved Hub commit hash; None for local models
    files: dict[str, str] = field(default_factory=dict)  # relative name → sha256
    repo_id: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    #: open_clip references only: where the imported checkpoint came from, {"format", "path"
    #: (source directory), "file", "sha256", "config", "config_sha256", "trust_pickle"}
    open_clip_source: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {
            "role": self.role,
            "reference": self.reference,
            "kind": self.kind,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "path": str(self.path),
            "trust_remote_code": self.trust_remote_code,
            "files": dict(sorted(self.files.items())),
        }
        if self.open_clip_source is not None:  # other locks keep their exact layout
            data["open_clip_source"] = dict(self.open_clip_source)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ResolvedModel:
        return cls(
            role=data["role"],
            reference=data["reference"],
            kind=data["kind"],
            path=Path(data["path"]),
            commit=data.get("commit"),
            files=dict(data.get("files", {})),
            repo_id=data.get("repo_id"),
            revision=data.get("revision"),
            trust_remote_code=bool(data.get("trust_remote_code", False)),
            open_clip_source=(
                dict(data["open_clip_source"]) if data.get("open_clip_source") else None
            ),
        )


# ------------------------------------------------------------------------------------ resolving


def _field(ref: Any, name: str, default: Any = None) -> Any:
    if isinstance(ref, Mapping):
        return ref.get(name, default)
    return getattr(ref, name, default)


def _reference(ref: Any, kind: str, repo_id: str | None, revision: str | None, path) -> str:
    text = _field(ref, "ref")
    if isinstance(text, str) and text.strip():
        return text.strip()
    if kind == "local":
        return str(path)
    return f"{repo_id}@{revision}" if revision else str(repo_id)


def _offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    if hf_constants.HF_HUB_OFFLINE:
        return True
    return any(
        (os.environ.get(name) or "").upper() in _TRUE
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _one_line(exc: BaseException, limit: int = 240) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _is_transient(exc: BaseException | None) -> bool:
    """Worth retrying: the network or the Hub failed, not the request."""
    if exc is None or isinstance(exc, OfflineModeIsEnabled):
        return False
    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError, DisabledRepoError)):
        return False
    if isinstance(exc, HfHubHTTPError):
        status = _status(exc)
        return status is not None and (status >= 500 or status == 429)
    if isinstance(exc, LocalEntryNotFoundError):  # the Hub could not be reached, nothing cached
        return _is_transient(exc.__cause__)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if _http is not None:
        transient = tuple(
            getattr(_http, name)
            for name in ("NetworkError", "TimeoutException", "RemoteProtocolError")
            if hasattr(_http, name)
        )
        if transient and isinstance(exc, transient):
            return True
    return False


def _hub_error(exc: BaseException, role: str, reference: str, repo_id: str, offline: bool):
    """The one-line FeatCalError for a Hub failure that retrying does not fix (None: unknown)."""
    at = f"{role}: Hub model {reference!r}"
    fetch = f"`hf download {repo_id}`"
    if isinstance(exc, GatedRepoError):
        return FeatCalError(
            f"{at} is gated and this account has no access; accept its terms on "
            f"https://huggingface.co/{repo_id} and log in (`hf auth login` or HF_TOKEN)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return FeatCalError(
            f"{at}: repository {repo_id} does not exist or is private; check the id in the params "
            "or log in with an account that can read it (`hf auth login` or HF_TOKEN)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return FeatCalError(
            f"{at}: the revision does not exist in {repo_id}; give an existing branch, tag or "
            f"commit after '@' (or none for the default branch)"
        )
    if isinstance(exc, DisabledRepoError):
        return FeatCalError(f"{at}: repository {repo_id} is disabled; use another model")
    if isinstance(exc, IncompleteSnapshotError):
        return FeatCalError(
            f"{at}: the cached snapshot is incomplete and the Hub cannot be reached"
            f"{' (offline mode)' if offline else ''}; set HF_HUB_OFFLINE=0 and re-run with network "
            f"access, or complete the cache with {fetch}"
        )
    if isinstance(exc, LocalEntryNotFoundError) and offline:
        return FeatCalError(
            f"{at} is not in the local Hugging Face cache and offline mode is on "
            f"(HF_HUB_OFFLINE=1); set HF_HUB_OFFLINE=0 to download it, or pre-download it with "
            f"{fetch} (same HF_HOME/cache_dir)"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return FeatCalError(
            f"{at} could not be fetched and is not in the local cache ({_one_line(exc)}); "
            f"check the network and re-run, or pre-download it with {fetch}"
        )
    if isinstance(exc, EntryNotFoundError):
        return FeatCalError(
            f"{at}: a listed file is missing from the repository ({_one_line(exc)}); "
            "pick another revision or re-run to refresh the cached listing"
        )
    if isinstance(exc, HfHubHTTPError) and _status(exc) in (401, 403):
        return FeatCalError(
            f"{at}: access denied (HTTP {_status(exc)}); log in with `hf auth login` or set "
            "HF_TOKEN to a token that can read the repository"
        )
    if isinstance(exc, HfHubHTTPError):
        return FeatCalError(f"{at}: the Hub refused the request ({_one_line(exc)})")
    if isinstance(exc, HFValidationError):
        return FeatCalError(f"{at} is not a valid Hub id ({_one_line(exc)}); fix it in the params")
    return None


def _commit_of(snapshot: Path, repo_id: str, revision: str | None, offline: bool) -> str | None:
    """The commit a snapshot belongs to: its snapshots/<commit> folder, else the Hub's answer."""
    if snapshot.parent.name == "snapshots" and _COMMIT_RE.match(snapshot.name):
        return snapshot.name
    if revision and _COMMIT_RE.match(revision):
        return revision
    if offline:
        return None
    try:
        return model_info(repo_id, revision=revision).sha
    except Exception as exc:  # the commit is informative only; the files are hashed
        log.warning("could not look up the commit of %s: %s", repo_id, _one_line(exc))
        return None


def _download(
    role: str,
    reference: str,
    repo_id: str,
    revision: str | None,
    *,
    cache_dir: str | Path | None,
    retries: int,
    backoff: float,
    trust_remote_code: bool,
    offline: bool = False,
    allow_patterns: list[str] | None = None,
    ignore_patterns: list[str] | None = None,
) -> tuple[Path, bool]:
    """(snapshot folder, offline); allow/ignore_patterns replace the default file selection."""
    offline = offline or _offline()
    allow = list(ALLOW_PATTERNS) + (list(REMOTE_CODE_PATTERNS) if trust_remote_code else [])
    ignore = list(IGNORE_PATTERNS)
    if allow_patterns is not None:
        allow, ignore = list(allow_patterns), list(ignore_patterns or [])
    attempts = max(0, retries) + 1
    for attempt in range(1, attempts + 1):
        try:
            path = snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=allow,
                ignore_patterns=ignore,
                local_files_only=offline,
            )
            return Path(path), offline
        except Exception as exc:
            if not _is_transient(exc):
                error = _hub_error(exc, role, reference, repo_id, offline)
                if error is None:
                    raise
                raise error from exc
            if attempt == attempts:
                raise FeatCalError(
                    f"{role}: could not reach the Hugging Face Hub for {reference!r} after "
                    f"{attempts} attempt(s) ({type(exc).__name__}: {_one_line(exc)}); check the "
                    f"network (HF_ENDPOINT, proxy) and re-run, or pre-download it with "
                    f"`hf download {repo_id}` and set HF_HUB_OFFLINE=1"
                ) from exc
            delay = min(_MAX_BACKOFF_S, backoff * 2 ** (attempt - 1))
            log.warning(
                "%s: fetching %s failed (%s: %s); retry %d/%d in %.0f s",
                role,
                reference,
                type(exc).__name__,
                _one_line(exc, 120),
                attempt,
                attempts - 1,
                delay,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def _hash_files(directory: Path, role: str) -> dict[str, str]:
    """sha256 of config.json, the safetensors index and every weight shard (headers validated)."""
    checkpoint = Checkpoint(directory, role)
    paths = [directory / "config.json", *checkpoint.weight_paths()]
    return {p.relative_to(directory).as_posix(): sha256_file(p) for p in paths}


def resolve_model(
    ref: Any,
    role: str,
    *,
    cache_dir: str | Path | None = None,
    retries: int = 3,
    backoff: float = 2.0,
    offline: bool = False,
    import_root: str | Path | None = None,
    base_config: str | Path | None = None,
) -> ResolvedModel:
    """Make one model available locally and hash its files.

    ref: a `ModelRef`-like object or mapping (kind, repo_id, revision, path; optionally ref and
    trust_remote_code). role: its params key, used in messages and the lock, e.g. "models.base".
    cache_dir: the Hugging Face cache (None: huggingface_hub's default, from HF_HOME/HF_HUB_CACHE).
    retries: extra attempts after a transient failure (so `retries + 1` in all), waiting
    `backoff`, 2·`backoff`, 4·`backoff`... seconds (at most 60) in between.
    offline: read Hub models from `cache_dir` only, never the network (as HF_HUB_OFFLINE=1).
    import_root: where open_clip references are imported (None: OPEN_CLIP_IMPORT_ROOT).
    base_config: the open_clip_config.json an open_clip expert without its own uses (the base's).
    """
    if (_field(ref, "format") or "hf") == "open_clip":
        return _resolve_open_clip(
            ref,
            role,
            cache_dir=cache_dir,
            retries=retries,
            backoff=backoff,
            offline=offline,
            import_root=Path(import_root) if import_root is not None else OPEN_CLIP_IMPORT_ROOT,
            base_config=Path(base_config) if base_config is not None else None,
        )
    kind = _field(ref, "kind")
    repo_id = _field(ref, "repo_id")
    revision = _field(ref, "revision")
    local = _field(ref, "path")
    trust_remote_code = bool(_field(ref, "trust_remote_code", False))
    reference = _reference(ref, kind, repo_id, revision, local)

    if kind == "local":
        if local is None:
            raise FeatCalError(f"{role}: local model {reference!r} has no path; fix the params")
        path = Path(local).expanduser()
        if not path.is_dir():
            raise FeatCalError(
                f"{role}: local model directory {reference!r} does not exist (looked in "
                f"{path.absolute()}); fix {role} in the params, or create it first "
                "(e.g. `dvc pull`, or save_pretrained there)"
            )
        log.info("%s: using local model %s", role, path)
        files = _hash_files(path, role)
        return ResolvedModel(
            role=role,
            reference=reference,
            kind="local",
            path=path,
            commit=None,
            files=files,
            trust_remote_code=trust_remote_code,
        )

    if kind != "hub" or not repo_id:
        raise FeatCalError(
            f"{role}: model reference {reference!r} is neither kind 'local' (a path) nor 'hub' "
            "(a repo_id); give a Hub id owner/name[@revision] or a ./local directory"
        )
    log.info("%s: resolving Hub model %s", role, reference)
    snapshot, offline = _download(
        role,
        reference,
        repo_id,
        revision,
        cache_dir=cache_dir,
        retries=retries,
        backoff=backoff,
        trust_remote_code=trust_remote_code,
        offline=offline,
    )
    if snapshot.is_dir() and not any(snapshot.glob("*.safetensors")):
        raise FeatCalError(
            f"{role}: Hub model {reference!r} has no safetensors weights in its top folder "
            f"({snapshot}); pickled weights are not used: pick a repository or revision with "
            "model.safetensors (e.g. a refs/pr/N safetensors conversion)"
        )
    commit = _commit_of(snapshot, repo_id, revision, offline)
    files = _hash_files(snapshot, role)
    log.info("%s: %s at commit %s in %s", role, reference, commit or "unknown", snapshot)
    return ResolvedModel(
        role=role,
        reference=reference,
        kind="hub",
        path=snapshot,
        commit=commit,
        files=files,
        repo_id=repo_id,
        revision=revision,
        trust_remote_code=trust_remote_code,
    )


# ------------------------------------------------------------------------- open_clip references


def _open_clip_source(
    ref: Any,
    role: str,
    reference: str,
    *,
    cache_dir: str | Path | None,
    retries: int,
    backoff: float,
    offline: bool,
) -> tuple[Path, str, dict[str, Any]]:
    """(source directory, weight file name relative to it, Hub facts) of an open_clip reference;
    a Hub repository is fetched (config, the weight file, tokenizer files only)."""
    kind = _field(ref, "kind")
    repo_id = _field(ref, "repo_id")
    revision = _field(ref, "revision")
    file = _field(ref, "file")
    names = [file] if file else list(OPEN_CLIP_WEIGHTS)
    fix = f"set {role}.file to the checkpoint's file name"

    if kind == "local":
        local = _field(ref, "path")
        if local is None:
            raise FeatCalError(f"{role}: local model {reference!r} has no path; fix the params")
        path = Path(local).expanduser()
        if path.is_file():
            if file:
                raise FeatCalError(
                    f"{role}: {reference!r} is a weight file and file: {file!r} names another; "
                    f"remove {role}.file or point ref at the directory"
                )
            return path.parent, path.name, {}
        if not path.is_dir():
            raise FeatCalError(
                f"{role}: local open_clip model {reference!r} does not exist (looked in "
                f"{path.absolute()}); fix {role} in the params (a directory with "
                f"{OPEN_CLIP_WEIGHTS[0]}, or the weight file itself)"
            )
        for name in names:
            if (path / name).is_file():
                return path, name, {}
        raise FeatCalError(
            f"{role}: open_clip weight file {' or '.join(str(path / n) for n in names)} does not "
            f"exist; {fix}, or point ref at the weight file"
        )

    if kind != "hub" or not repo_id:
        raise FeatCalError(
            f"{role}: model reference {reference!r} is neither kind 'local' (a path) nor 'hub' "
            "(a repo_id); give a Hub id owner/name[@revision] or a ./local directory"
        )
    log.info("%s: resolving open_clip Hub model %s", role, reference)
    snapshot = None
    for name in names:  # one weight file only: Hub repos often hold the same weights twice
        snapshot, offline = _download(
            role,
            reference,
            repo_id,
            revision,
            cache_dir=cache_dir,
            retries=retries,
            backoff=backoff,
            trust_remote_code=False,
            offline=offline,
            allow_patterns=[OPEN_CLIP_CONFIG, name, *OPEN_CLIP_TOKENIZER_PATTERNS],
        )
        if (snapshot / name).is_file():
            commit = _commit_of(snapshot, repo_id, revision, offline)
            return snapshot, name, {"repo_id": repo_id, "revision": revision, "commit": commit}
    where = "is not in the local cache" if offline else "does not exist in the repository"
    raise FeatCalError(
        f"{role}: Hub model {reference!r}: open_clip weight file {' or '.join(names)} {where} "
        f"({snapshot}); {fix}"
        + (f", or pre-download it with `hf download {repo_id}`" if offline else "")
    )


def _open_clip_config(ref: Any, role: str, source_dir: Path, base_config: Path | None) -> Path:
    """The open_clip_config.json of an open_clip reference."""
    given = _field(ref, "open_clip_config")
    if given:
        path = Path(given).expanduser()
        if not path.is_file():
            raise FeatCalError(
                f"{role}.open_clip_config: {given!r} does not exist (looked in "
                f"{path.absolute()}); give the path of an {OPEN_CLIP_CONFIG}"
            )
        return path
    if (source_dir / OPEN_CLIP_CONFIG).is_file():
        return source_dir / OPEN_CLIP_CONFIG
    if base_config is not None:
        log.info("%s: no %s in %s; using the base's %s", role, OPEN_CLIP_CONFIG, source_dir,
                 base_config)  # fmt: skip
        return base_config
    raise FeatCalError(
        f"{role}: no {OPEN_CLIP_CONFIG} in {source_dir}; set {role}.open_clip_config to the "
        "checkpoint's open_clip config (model_cfg.vision_cfg as on the Hub)"
    )


def _reusable_import(target: Path, expected: Mapping[str, Any]) -> bool:
    """Whether `target` holds an import with exactly the config (source sha256 included) that
    importing again would write."""
    try:
        if json.loads((target / "config.json").read_text(encoding="utf-8")) != expected:
            return False
        Checkpoint(target, "open_clip import")  # weights present, headers readable
    except (OSError, ValueError, FeatCalError):
        return False
    return True


def _import_name(role: str, digest: str) -> str:
    name = role.removeprefix("models.")
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) + f"-{digest[:16]}"


def _resolve_open_clip(
    ref: Any,
    role: str,
    *,
    cache_dir: str | Path | None,
    retries: int,
    backoff: float,
    offline: bool,
    import_root: Path,
    base_config: Path | None,
) -> ResolvedModel:
    """Fetch or find an open_clip checkpoint and import it (once) into a featcal checkpoint."""
    import pickle

    from featcal_core.open_clip.importer import _model_config, featcal_config, import_open_clip

    kind = _field(ref, "kind")
    trust_pickle = bool(_field(ref, "trust_pickle", False))
    reference = _reference(
        ref, kind, _field(ref, "repo_id"), _field(ref, "revision"), _field(ref, "path")
    )
    source_dir, name, hub = _open_clip_source(
        ref, role, reference, cache_dir=cache_dir, retries=retries, backoff=backoff,
        offline=offline,
    )  # fmt: skip
    source = source_dir / name
    config_path = _open_clip_config(ref, role, source_dir, base_config)
    digest = sha256_file(source)
    record = {
        "format": "open_clip",
        "path": str(source_dir),
        "file": name,
        "sha256": digest,
        "config": str(config_path),
        "config_sha256": sha256_file(config_path),
        "trust_pickle": trust_pickle,
    }
    target = import_root / _import_name(role, digest)
    try:
        expected = featcal_config(*_model_config(source, config_path))
        expected["open_clip_source"] = {"file": source.name, "sha256": digest}
        if _reusable_import(target, expected):
            log.info("%s: reusing the import of %s in %s", role, source, target)
        else:
            import_open_clip(
                source, target, model_cfg=config_path, trust_pickle=trust_pickle,
                overwrite=target.exists(),
            )  # fmt: skip
    except FeatCalError as exc:
        message = str(exc)
        if not trust_pickle and isinstance(exc.__context__, pickle.UnpicklingError):
            what = message.split("; unpickling", 1)[0]
            raise FeatCalError(
                f"{role}: {what}; unpickling it can run arbitrary code, so it is refused. Set "
                f"{role}.trust_pickle: true only for a file you trust, or re-save it with "
                "torch.save(model.state_dict(), ...)"
            ) from exc
        raise FeatCalError(f"{role} ({reference}): {message}") from exc
    files = _hash_files(target, role)
    log.info("%s: open_clip %s is the featcal checkpoint %s", role, source, target)
    return ResolvedModel(
        role=role,
        reference=reference,
        kind=kind,
        path=target,
        commit=hub.get("commit"),
        files=files,
        repo_id=hub.get("repo_id"),
        revision=hub.get("revision"),
        open_clip_source=record,
    )


# ------------------------------------------------------------------------------------- the pool


def _label(model: ResolvedModel) -> str:
    """The params key, and the reference where the path alone does not show it."""
    if model.reference == str(model.path):
        return model.role
    return f"{model.role} ({model.reference})"


def check_pool(base: ResolvedModel, experts: Mapping[str, ResolvedModel]) -> str:
    """Check that every expert has the base's architecture and tower (tensor names and shapes).

    Reads only config.json and safetensors headers. Returns the architecture name; raises a
    FeatCalError naming the first expert that does not fit.
    """
    from featcal_core.architectures import detect
    from featcal_core.method.model_set import ModelSet

    base_ckpt = Checkpoint(base.path, _label(base))
    arch = detect(base_ckpt.config, f"{_label(base)}: {base.path / 'config.json'}")
    expert_ckpts = {task: Checkpoint(model.path, _label(model)) for task, model in experts.items()}
    # the base stands in for the merged model, which does not exist yet
    ModelSet(arch, base_ckpt, base_ckpt, expert_ckpts, {}).check()
    log.info("model pool: %s base and %d expert(s) agree", arch.name, len(expert_ckpts))
    return arch.name


# ------------------------------------------------------------------------------------- the lock


def _canonical(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def lock_digest(lock: Mapping[str, Any]) -> str:
    """sha256 of the lock's content without its `lock_digest` (canonical JSON: sorted keys)."""
    return hashlib.sha256(
        _canonical({k: v for k, v in lock.items() if k != "lock_digest"})
    ).hexdigest()


def write_lock(
    path: str | Path,
    base: ResolvedModel,
    experts: Mapping[str, ResolvedModel],
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the lock file atomically (temporary file beside it, then os.replace); return it.

    extra: more top-level entries (JSON values, e.g. {"architecture": "hf-clip-vision"}); they
    may not reuse the keys version, base, experts, lock_digest.
    """
    path = Path(path)
    clash = sorted(set(extra or {}) & set(_LOCK_KEYS))
    if clash:
        raise FeatCalError(f"write_lock: extra may not set {', '.join(clash)}; rename those keys")
    lock: dict[str, Any] = {
        "version": LOCK_VERSION,
        "base": base.to_dict(),
        "experts": {task: model.to_dict() for task, model in experts.items()},
        **dict(extra or {}),
    }
    # the JSON round trip makes the digest the one read_lock will recompute
    lock = json.loads(json.dumps(lock, ensure_ascii=False))
    lock["lock_digest"] = lock_digest(lock)
    write_file(path, json.dumps(lock, indent=2, ensure_ascii=False) + "\n", "lock file")
    log.info("wrote %s (lock_digest %s)", path, lock["lock_digest"][:12])
    return lock


def read_lock(path: str | Path) -> dict[str, Any]:
    """The lock written by `write_lock`; a FeatCalError when missing, malformed or edited."""
    path = Path(path)
    if not path.is_file():
        raise FeatCalError(f"{path} does not exist; run the download-experts step first")
    try:
        lock = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeatCalError(
            f"{path} is not valid JSON ({_one_line(exc)}); delete it and re-run download-experts"
        ) from exc
    if not isinstance(lock, dict):
        raise FeatCalError(f"{path} is not a lock object; delete it and re-run download-experts")
    missing = [key for key in _LOCK_KEYS if key not in lock]
    if missing:
        raise FeatCalError(
            f"{path} lacks {', '.join(missing)}; it is not a models lock, re-run download-experts"
        )
    if lock["version"] != LOCK_VERSION:
        raise FeatCalError(
            f"{path} has lock version {lock['version']!r}, this code reads {LOCK_VERSION}; "
            "re-run download-experts"
        )
    if lock_digest(lock) != lock["lock_digest"]:
        raise FeatCalError(
            f"{path}: lock_digest does not match the content (the file was edited); "
            "re-run download-experts to rewrite it"
        )
    return lock


def models_from_lock(lock: Mapping[str, Any]) -> tuple[ResolvedModel, dict[str, ResolvedModel]]:
    """The base and the experts (task → model) recorded in a lock."""
    base = ResolvedModel.from_dict(lock["base"])
    experts = {task: ResolvedModel.from_dict(entry) for task, entry in lock["experts"].items()}
    return base, experts


def verify_lock(lock: Mapping[str, Any]) -> list[str]:
    """Problems with a lock: a stale lock_digest, locked files that are missing or changed.

    Relative local paths are taken from the working directory. An empty list: all files match.
    """
    problems = []
    if "lock_digest" in lock and lock_digest(lock) != lock["lock_digest"]:
        problems.append("lock_digest does not match the lock's content (the lock was edited)")
    base, experts = models_from_lock(lock)
    for model in [base, *experts.values()]:
        for name, expected in sorted(model.files.items()):
            file = model.path / name
            if not file.is_file():
                problems.append(f"{model.role} ({model.reference}): {file} is missing")
                continue
            actual = sha256_file(file)
            if actual != expected:
                problems.append(
                    f"{model.role} ({model.reference}): {file} has sha256 {actual[:12]}…, the lock "
                    f"has {expected[:12]}…"
                )
        problems += _source_problems(model)
    return problems


def _source_problems(model: ResolvedModel) -> list[str]:
    """Problems with an open_clip model's recorded source file and config."""
    source = model.open_clip_source
    if not source:
        return []
    checks = []
    if source.get("path") and source.get("file"):
        checks.append((Path(source["path"]) / source["file"], source.get("sha256")))
    if source.get("config"):
        checks.append((Path(source["config"]), source.get("config_sha256")))
    problems = []
    for file, expected in checks:
        if not expected:
            continue
        if not file.is_file():
            problems.append(f"{model.role} ({model.reference}): open_clip source {file} is missing")
            continue
        actual = sha256_file(file)
        if actual != expected:
            problems.append(
                f"{model.role} ({model.reference}): open_clip source {file} has sha256 "
                f"{actual[:12]}…, the lock has {expected[:12]}…"
            )
    return problems
