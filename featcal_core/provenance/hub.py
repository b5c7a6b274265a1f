"""Fetching a model repository from the Hugging Face Hub: `snapshot_download` of the files featcal
reads, retried on transient failures, and every other failure as one `FeatCalError` line.

Only configs, safetensors weights, tokenizer/processor files and the model card (README.md: the
license a merged model's card names) of the repository's top folder are fetched
(`ALLOW_PATTERNS`); pickled weights (.bin, .pt, .pth, .ckpt) never are, unless a caller
names the files itself (an open_clip checkpoint). Offline mode, as huggingface_hub reads it
(HF_HUB_OFFLINE, else TRANSFORMERS_OFFLINE, on when 1/ON/YES/TRUE: `offline_cause`), or
`models.hub_offline`, makes a download a cache-only look-up; a message names what made it
offline. Transient failures (connection errors, timeouts, HTTP 429 and 5xx) are retried with
exponential backoff.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from types import ModuleType

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

_http: ModuleType | None
try:  # the HTTP client of huggingface_hub 2.x; older releases use httpx or requests
    import httpx2 as _http
except ImportError:  # pragma: no cover - depends on the installed huggingface_hub
    try:
        import httpx as _http
    except ImportError:
        _http = None

log = logging.getLogger(__name__)

#: files fetched from a Hub repository: configs, safetensors weights, tokenizer/processor files,
#: and the model card (its front matter states the license; never copied into an output)
ALLOW_PATTERNS = (
    "README.md",
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


#: the variables huggingface_hub reads offline mode from: the first one set decides
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline_cause() -> str | None:
    """What puts the Hub offline, as huggingface_hub parses it (the first of `OFFLINE_VARIABLES`
    set to a non-empty value decides: on for 1, ON, YES or TRUE in any case, off for anything
    else, so HF_HUB_OFFLINE=0 wins over TRANSFORMERS_OFFLINE=1): `NAME=value`, or the value
    huggingface_hub read at import; None when online."""
    for name in OFFLINE_VARIABLES:
        value = os.environ.get(name)
        if value:
            if value.upper() in _TRUE:
                return f"{name}={value}"
            break
    if hf_constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE as set when huggingface_hub was imported"
    return None


def _offline() -> bool:
    """Whether the environment puts the Hub offline (`offline_cause`)."""
    return offline_cause() is not None


def datasets_offline_cause() -> str | None:
    """What puts `datasets` offline, as it parses it: HF_DATASETS_OFFLINE, when set, decides
    (on for 1, ON, YES or TRUE), else the Hub's `offline_cause`; None when online."""
    value = os.environ.get("HF_DATASETS_OFFLINE")
    if value is not None:
        return f"HF_DATASETS_OFFLINE={value}" if value.upper() in _TRUE else None
    return offline_cause()


def _offline_why(offline: bool) -> tuple[str, str]:
    """(what made a look-up offline, how to turn that off): the environment's `offline_cause`,
    else the params' `models.hub_offline` (the caller asked for the cache only)."""
    cause = offline_cause() if offline else None
    if cause is None:
        return "models.hub_offline is true", "set models.hub_offline: false"
    if cause.startswith("TRANSFORMERS_OFFLINE="):
        return cause, "unset TRANSFORMERS_OFFLINE (or set HF_HUB_OFFLINE=0, which overrides it)"
    return cause, "set HF_HUB_OFFLINE=0"


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
    why, fix = _offline_why(offline)
    if isinstance(exc, IncompleteSnapshotError):
        if offline:
            return FeatCalError(
                f"{at}: the cached snapshot is incomplete and offline mode is on ({why}); {fix} "
                f"and re-run with network access, or complete the cache with {fetch}"
            )
        return FeatCalError(
            f"{at}: the cached snapshot is incomplete and the Hub cannot be reached; re-run "
            f"with network access, or complete the cache with {fetch}"
        )
    if isinstance(exc, LocalEntryNotFoundError) and offline:
        return FeatCalError(
            f"{at} is not in the local Hugging Face cache and offline mode is on ({why}); "
            f"{fix} to download it, or pre-download it with {fetch} (same HF_HOME/cache_dir)"
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
