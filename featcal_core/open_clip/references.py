"""open_clip model references (`format: open_clip`, see featcal_core.params.ModelRef): find or
fetch the open_clip checkpoint and import it into a featcal checkpoint.

`featcal_core.provenance.resolve.resolve_model` hands such references to `resolve_open_clip`.
From a Hub repository only the open_clip config, the one weight file (`file`, default
`open_clip_model.safetensors`, else `open_clip_pytorch_model.bin`; pickles are read with
torch.load(weights_only=True) unless `trust_pickle`) and the tokenizer files are fetched; a local
directory or file is used in place. `featcal_core.open_clip.importer.import_open_clip` then writes
a featcal checkpoint to `<import_root>/<role>-<first 16 hex of the file's sha256>` (default root
data/models/open_clip), reused on later runs while its recorded source sha256 and config match.
The model's `path` is that import; `open_clip_source` records the source directory, file, config
and their sha256 (kept in the lock file, featcal_core.provenance.lock).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint, sha256_file
from featcal_core.provenance.hub import _commit_of, _download
from featcal_core.provenance.resolved import ResolvedModel, _field, _hash_files, _reference

__all__ = [
    "OPEN_CLIP_CONFIG",
    "OPEN_CLIP_IMPORT_ROOT",
    "OPEN_CLIP_TOKENIZER_PATTERNS",
    "OPEN_CLIP_WEIGHTS",
    "resolve_open_clip",
]

log = logging.getLogger(__name__)

#: an open_clip repository's weight files, in order of preference (when `file` is not given)
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
#: small tokenizer files fetched with an open_clip checkpoint (text towers with an HF tokenizer)
OPEN_CLIP_TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges*",
    "spiece.model",
)
#: where open_clip checkpoints are imported (relative to the working directory)
OPEN_CLIP_IMPORT_ROOT = Path("data/models/open_clip")
#: open_clip's model config file in a repository (featcal_core.open_clip.importer.CONFIG_NAME)
OPEN_CLIP_CONFIG = "open_clip_config.json"


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
        log.info(
            "%s: no %s in %s; using the base's %s", role, OPEN_CLIP_CONFIG, source_dir, base_config
        )
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


def resolve_open_clip(
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
        ref,
        role,
        reference,
        cache_dir=cache_dir,
        retries=retries,
        backoff=backoff,
        offline=offline,
    )
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
                source,
                target,
                model_cfg=config_path,
                trust_pickle=trust_pickle,
                overwrite=target.exists(),
            )
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
