"""Resolve the run's models to local directories and check they form one pool.

    base = resolve_model(params.models.base, "models.base")
    experts = {t: resolve_model(r, f"models.experts.{t}") for t, r in params.models.experts.items()}
    architecture = check_pool(base, experts)

(featcal_core.provenance.lock then locks them: `write_lock`, `read_lock`, `verify_lock`.)

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

open_clip references (`format: open_clip`, see featcal_core.params.ModelRef) are handed to
featcal_core.open_clip.references, which fetches or finds the open_clip checkpoint (through
`_download` here) and imports it into a featcal checkpoint.
"""

from __future__ import annotations

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
    "ResolvedModel",
    "check_pool",
    "resolve_model",
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


#: the Hub account whose pull requests convert a repository's pickled weights to safetensors
CONVERSION_BOT = "SFconvertbot"


def _conversion_revision(
    repo_id: str, cache_dir: str | Path | None, offline: bool
) -> tuple[str, str] | None:
    """("refs/pr/N", how it was found) of a safetensors conversion of `repo_id`, or None.
    Online: the Hub's open pull request by CONVERSION_BOT (the newest, when several). Offline,
    or when the Hub does not answer: a cached refs/pr/N whose snapshot holds *.safetensors (the
    highest N)."""
    if not offline:
        try:
            from huggingface_hub import HfApi

            numbers = [
                d.num
                for d in HfApi().get_repo_discussions(
                    repo_id,
                    author=CONVERSION_BOT,
                    discussion_type="pull_request",
                    discussion_status="open",
                )  # fmt: skip
                if d.is_pull_request and d.author == CONVERSION_BOT
            ]
            if numbers:
                return (
                    f"refs/pr/{max(numbers)}",
                    f"open pull request #{max(numbers)} by {CONVERSION_BOT}",
                )
        except Exception as exc:  # the look-up is a convenience; the cache may still have one
            log.warning("could not list the pull requests of %s: %s", repo_id, _one_line(exc))
    storage = Path(cache_dir or hf_constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    cached = []
    for ref in (storage / "refs" / "refs" / "pr").glob("*"):  # revision refs/pr/N's ref file
        commit = ref.read_text().strip() if ref.is_file() else ""
        if ref.name.isdigit() and any((storage / "snapshots" / commit).glob("*.safetensors")):
            cached.append(int(ref.name))
    if cached:
        return f"refs/pr/{max(cached)}", "a pull request cached with safetensors weights"
    return None


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
    import_root: where open_clip references are imported (None:
    featcal_core.open_clip.references.OPEN_CLIP_IMPORT_ROOT).
    base_config: the open_clip_config.json an open_clip expert without its own uses (the base's).
    """
    if (_field(ref, "format") or "hf") == "open_clip":
        # (imported here: featcal_core.open_clip.references imports this module)
        from featcal_core.open_clip.references import OPEN_CLIP_IMPORT_ROOT, resolve_open_clip

        return resolve_open_clip(
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
    if snapshot.is_dir() and not any(snapshot.glob("*.safetensors")) and revision is None:
        # as transformers does: the default branch holds pickled weights only; the Hub's
        # safetensors conversion bot's pull request holds the same weights as safetensors
        converted = _conversion_revision(repo_id, cache_dir, offline)
        if converted is not None:
            revision, found = converted
            log.warning("%s: %s has no safetensors weights on its default branch; using the "
                        "safetensors conversion %s (%s)", role, reference, revision, found)  # fmt: skip
            snapshot, offline = _download(
                role, f"{repo_id}@{revision}", repo_id, revision, cache_dir=cache_dir,
                retries=retries, backoff=backoff, trust_remote_code=trust_remote_code,
                offline=offline,
            )  # fmt: skip
    if snapshot.is_dir() and not any(snapshot.glob("*.safetensors")):
        at = f" at {revision}" if revision else ""
        raise FeatCalError(
            f"{role}: Hub model {reference!r} has no safetensors weights in its top folder{at} "
            f"({snapshot}), and no safetensors conversion (a pull request by {CONVERSION_BOT}) "
            "was found; pickled weights are not used: pick a repository or revision with "
            "model.safetensors, e.g. owner/name@refs/pr/N where pull request N converts it"
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
