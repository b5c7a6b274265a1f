"""`ResolvedModel`: one model of the pool on the local disk, as the lock file records it; and the
fields of a model reference (a `featcal_core.params.ModelRef`-like object or a mapping)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal_core.io.checkpoint import Checkpoint, sha256_file


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

    def source(self) -> dict[str, Any]:
        """Where the model came from, as a merge record names it: a Hub model's {"kind": "hub",
        "reference", "repo_id", "revision" (None: the default branch), "commit"}; a local
        folder's {"kind": "local", "reference"} (its path is recorded beside it)."""
        if self.kind != "hub":
            return {"kind": "local", "reference": self.reference}
        return {
            "kind": "hub",
            "reference": self.reference,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
        }

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


def _hash_files(directory: Path, role: str) -> dict[str, str]:
    """sha256 of config.json, the safetensors index and every weight shard (headers validated);
    of a LoRA adapter folder: adapter_model.safetensors and adapter_config.json."""
    from featcal_core.io.adapters import expert_weight_paths, is_adapter

    if is_adapter(directory):
        paths = expert_weight_paths(directory, role)
    else:
        paths = [directory / "config.json", *Checkpoint(directory, role).weight_paths()]
    return {p.relative_to(directory).as_posix(): sha256_file(p) for p in paths}
