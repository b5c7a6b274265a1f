"""Resolve the run's models to local directories and check they form one pool.

    base = resolve_model(params.models.base, "models.base")
    experts = {t: resolve_model(r, f"models.experts.{t}") for t, r in params.models.experts.items()}
    architecture = check_pool(base, experts)

(featcal_core.provenance.lock then locks them: `write_lock`, `read_lock`, `verify_lock`.)

A model reference is anything with `kind` ("hub" or "local"), `repo_id`, `revision` and `path`
(attributes, e.g. `featcal_core.params.ModelRef`, or mapping keys); `ref` and `trust_remote_code` are
used when present. Local directories are used in place. Hub models are fetched by
featcal_core.provenance.hub with `huggingface_hub.snapshot_download` into the Hugging Face cache
(`cache_dir`, else the library's default, which follows HF_HOME / HF_HUB_CACHE); HF_HUB_OFFLINE=1
(or TRANSFORMERS_OFFLINE=1) makes it a cache-only look-up. Only configs, safetensors weights,
tokenizer/processor files and README.md of the repository's top folder are fetched; pickled
weights (.bin, .pt, .pth, .ckpt) never are.

Transient failures (connection errors, timeouts, HTTP 429 and 5xx) are retried with exponential
backoff; everything else ends in one `FeatCalError` line naming the params key, the reference,
what is wrong and what to do.

open_clip references (`format: open_clip`, see featcal_core.params.ModelRef) are handed to
featcal_core.open_clip.references, which fetches or finds the open_clip checkpoint (through the
same Hub download) and imports it into a featcal checkpoint.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import constants as hf_constants

from featcal_core.errors import FeatCalError
from featcal_core.io.adapters import open_expert
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.open_clip.references import OPEN_CLIP_IMPORT_ROOT, resolve_open_clip
from featcal_core.provenance.hub import (
    ALLOW_PATTERNS,
    IGNORE_PATTERNS,
    _commit_of,
    _download,
    _status,
)
from featcal_core.provenance.resolved import ResolvedModel, _field, _hash_files, _reference

__all__ = [
    "ALLOW_PATTERNS",
    "IGNORE_PATTERNS",
    "ResolvedModel",
    "check_pool",
    "resolve_model",
]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ resolving


#: the Hub account whose pull requests convert a repository's pickled weights to safetensors
CONVERSION_BOT = "SFconvertbot"


def _conversion_revision(
    repo_id: str,
    cache_dir: str | Path | None,
    offline: bool,
    failures: list[str] | None = None,
) -> tuple[str, str] | None:
    """("refs/pr/N", how it was found) of a safetensors conversion of `repo_id`, or None.
    Online: the Hub's open pull request by CONVERSION_BOT (the newest, when several). Offline,
    or when the Hub does not answer: a cached refs/pr/N whose snapshot holds *.safetensors (the
    highest N). A failed look-up on the Hub is appended to `failures` (why, in a few words)."""
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
                )
                if d.is_pull_request and d.author == CONVERSION_BOT
            ]
            if numbers:
                return (
                    f"refs/pr/{max(numbers)}",
                    f"open pull request #{max(numbers)} by {CONVERSION_BOT}",
                )
        except Exception as exc:  # the look-up is a convenience; the cache may still have one
            why = _failure(exc)
            log.warning("could not list the pull requests of %s on the Hub (%s)", repo_id, why)
            if failures is not None:
                failures.append(why)
    storage = Path(cache_dir or hf_constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    cached = []
    for ref in (storage / "refs" / "refs" / "pr").glob("*"):  # revision refs/pr/N's ref file
        commit = ref.read_text().strip() if ref.is_file() else ""
        if ref.name.isdigit() and any((storage / "snapshots" / commit).glob("*.safetensors")):
            cached.append(int(ref.name))
    if cached:
        return f"refs/pr/{max(cached)}", "a pull request cached with safetensors weights"
    return None


_URL_RE = re.compile(r"\s*(for url:?)?\s*<?https?://\S+", re.IGNORECASE)


def _failure(exc: BaseException) -> str:
    """Why a Hub request failed, in a few words and whole: the HTTP status and its reason, else
    the error's first line without URLs (a cut URL helps no one)."""
    status = _status(exc)
    if status is not None:
        reason = getattr(getattr(exc, "response", None), "reason_phrase", "") or ""
        return f"HTTP {status}{' ' + reason if reason else ''}"
    lines = str(exc).strip().splitlines()
    text = " ".join(_URL_RE.sub("", lines[0] if lines else "").split()).strip(" :,;")
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def conversion_fix(repo_id: str) -> str:
    """What to give when `repo_id` holds pickled weights only on its default branch and its
    safetensors conversion is not found by itself: the conversion pull request's revision."""
    return (
        f"give the revision of its safetensors conversion pull request: {repo_id}@refs/pr/N, "
        f"N the number of the pull request by {CONVERSION_BOT} that adds model.safetensors "
        f"(listed on {hf_constants.ENDPOINT}/{repo_id}/discussions)"
    )


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
    failures: list[str] = []
    if snapshot.is_dir() and not any(snapshot.glob("*.safetensors")) and revision is None:
        # as transformers does: the default branch holds pickled weights only; the Hub's
        # safetensors conversion bot's pull request holds the same weights as safetensors
        converted = _conversion_revision(repo_id, cache_dir, offline, failures)
        if converted is not None:
            revision, found = converted
            log.warning(
                "%s: %s has no safetensors weights on its default branch; using the "
                "safetensors conversion %s (%s)",
                role,
                reference,
                revision,
                found,
            )
            snapshot, offline = _download(
                role,
                f"{repo_id}@{revision}",
                repo_id,
                revision,
                cache_dir=cache_dir,
                retries=retries,
                backoff=backoff,
                trust_remote_code=trust_remote_code,
                offline=offline,
            )
    if snapshot.is_dir() and not any(snapshot.glob("*.safetensors")) and revision is None:
        if failures:  # the Hub did not list its pull requests: the user names the conversion
            raise FeatCalError(
                f"{role}: Hub model {reference!r} has no safetensors weights on its default "
                f"branch and the look-up of its safetensors conversion failed ({failures[0]}); "
                f"{conversion_fix(repo_id)}"
            )
        raise FeatCalError(
            f"{role}: Hub model {reference!r} has no safetensors weights in its top folder "
            f"({snapshot}), and no safetensors conversion (an open pull request by "
            f"{CONVERSION_BOT}) was found{' in the cache (offline)' if offline else ''}; pickled "
            f"weights are not used: if it has one, {conversion_fix(repo_id)}; else pick another "
            "repository"
        )
    if snapshot.is_dir() and not any(snapshot.glob("*.safetensors")):  # at a given revision
        raise FeatCalError(
            f"{role}: Hub model {reference!r} has no safetensors weights in its top folder at "
            f"{revision} ({snapshot}); pickled weights are not used: pick a revision with "
            "model.safetensors (owner/name@refs/pr/N, where pull request N converts it) or "
            "another repository"
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
    expert_ckpts = {
        task: open_expert(model.path, _label(model), base_ckpt) for task, model in experts.items()
    }
    # the base stands in for the merged model, which does not exist yet
    ModelSet(arch, base_ckpt, base_ckpt, expert_ckpts, {}).check()
    log.info("model pool: %s base and %d expert(s) agree", arch.name, len(expert_ckpts))
    return arch.name
