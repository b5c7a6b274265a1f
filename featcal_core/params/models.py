"""`models:` — the base model and one expert per task (Hub ids or local folders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from featcal_core.params.base import (
    _HUB_MODEL_RE,
    _LOCAL_PREFIXES,
    _OPEN_CLIP_SUFFIXES,
    StrictBool,
    _check_task_names,
    _error,
    _Section,
)


class ModelRef(_Section):
    """A model: a Hugging Face Hub id `owner/name[@revision]` or a local `save_pretrained` directory.

    Written either as a plain string or as a mapping `{ref: ..., trust_remote_code: true}`.
    The string is local when it starts with "/", "./", "../" or "~", or when it names an existing
    directory (relative to the working directory); otherwise it must be a Hub id. Prefix a local
    path with "./" to make it local even before it exists (e.g. before `dvc pull`).

    `format: open_clip` marks an open_clip checkpoint (a Hub repository in open_clip's layout, a
    local directory, or, locally, the weight file itself), imported into a featcal checkpoint by
    the download step: `file` names the weight file (default `open_clip_model.safetensors`, else
    `open_clip_pytorch_model.bin`), `open_clip_config` a local open_clip_config.json (default: the
    one beside the weights, else, for experts, the base's), and `trust_pickle: true` allows
    unpickling a whole pickled module (only for files you trust: unpickling can run code).
    """

    ref: str = Field(description="Hub id `owner/name[@revision]` or a local directory")
    trust_remote_code: StrictBool = Field(
        False,
        description="allow the model's own code from the Hub (transformers trust_remote_code)",
    )
    format: Literal["hf", "open_clip"] = Field(
        "hf",
        description="hf: a transformers/featcal checkpoint directory; open_clip: an open_clip "
        "checkpoint, imported by the download step",
    )
    file: str | None = Field(
        None,
        description="open_clip only: the weight file in the repository or directory (default "
        "open_clip_model.safetensors, else open_clip_pytorch_model.bin)",
    )
    open_clip_config: str | None = Field(
        None,
        description="open_clip only: a local open_clip_config.json (default: the one beside the "
        "weights, else, for experts, the base's)",
    )
    trust_pickle: StrictBool = Field(
        False,
        description="open_clip only: allow unpickling a whole pickled module (runs code from the "
        "file; only for files you trust)",
    )
    _kind: Literal["hub", "local"] = PrivateAttr("hub")
    _repo_id: str | None = PrivateAttr(None)
    _revision: str | None = PrivateAttr(None)
    _path: Path | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"ref": value}
        return value

    @model_validator(mode="after")
    def _parse(self) -> ModelRef:
        ref = self.ref.strip()
        if not ref:
            raise _error("empty model reference; give a Hub id owner/name[@revision] or ./a/dir")
        self._check_format()
        path = Path(ref).expanduser()
        if (
            ref.startswith(_LOCAL_PREFIXES)
            or path.is_dir()
            or (self.format == "open_clip" and path.is_file())
        ):
            self._kind, self._path = "local", path
            if self.file is not None and path.suffix.lower() in _OPEN_CLIP_SUFFIXES:
                raise _error(
                    f"ref {ref!r} already names the weight file; remove file: or point ref at "
                    "the directory",
                    "file",
                )
            return self
        match = _HUB_MODEL_RE.match(ref)
        if not match or "--" in match["repo"] or ".." in match["repo"]:
            raise _error(
                f"{ref!r} is neither a local directory nor a Hub id owner/name[@revision]; "
                "start local paths with ./ or / (they need not exist yet)"
            )
        self._kind, self._repo_id, self._revision = "hub", match["repo"], match["rev"]
        return self

    def _check_format(self) -> None:
        if self.format != "open_clip":
            for key in ("file", "open_clip_config", "trust_pickle"):
                if getattr(self, key) not in (None, False):
                    raise _error(
                        f"{key} is only for open_clip checkpoints; add format: open_clip or "
                        f"remove {key}",
                        key,
                    )
            return
        if self.trust_remote_code:
            raise _error(
                "open_clip checkpoints run no model code from the Hub; remove trust_remote_code "
                "(trust_pickle: true is what allows pickled modules)",
                "trust_remote_code",
            )
        if self.file is not None:
            file = self.file.strip()
            parts = Path(file).parts
            if not file or Path(file).is_absolute() or ".." in parts or file.startswith("~"):
                raise _error(
                    f"file {self.file!r} must be a relative path inside the repository or "
                    "directory (e.g. open_clip_model.safetensors); put a local file in ref instead",
                    "file",
                )
            if Path(file).suffix.lower() not in _OPEN_CLIP_SUFFIXES:
                raise _error(
                    f"file {self.file!r} is not an open_clip weight file; give a "
                    f"{', '.join(_OPEN_CLIP_SUFFIXES)} file",
                    "file",
                )
        if self.open_clip_config is not None and not self.open_clip_config.strip():
            raise _error(
                "empty open_clip_config; give the path of an open_clip_config.json",
                "open_clip_config",
            )

    @property
    def kind(self) -> Literal["hub", "local"]:
        """ "hub" or "local"."""
        return self._kind

    @property
    def repo_id(self) -> str | None:
        """`owner/name` for a Hub model, else None."""
        return self._repo_id

    @property
    def revision(self) -> str | None:
        """The `@revision` of a Hub model (branch, tag or commit), None for the default branch."""
        return self._revision

    @property
    def path(self) -> Path | None:
        """The directory of a local model ("~" expanded, relative paths kept relative), else None."""
        return self._path

    def options(self) -> dict[str, Any]:
        """The keys besides `ref` that differ from their defaults, as written in YAML."""
        defaults = {
            "trust_remote_code": False,
            "format": "hf",
            "file": None,
            "open_clip_config": None,
            "trust_pickle": False,
        }
        return {
            key: getattr(self, key)
            for key, default in defaults.items()
            if getattr(self, key) != default
        }

    def to_yaml(self) -> str | dict[str, Any]:
        """The plain string unless another key (trust_remote_code, format, ...) is set."""
        options = self.options()
        if options:
            return {"ref": self.ref, **options}
        return self.ref


class ModelsSpec(_Section):
    """The base model and one fine-tuned expert per task."""

    base: ModelRef = Field(description="the pre-trained model the experts were fine-tuned from")
    experts: dict[str, ModelRef] = Field(
        min_length=1, description="task name -> fine-tuned expert (at least one)"
    )
    hub_cache: str | None = Field(
        None,
        description="Hugging Face cache folder for Hub references (null: HF_HOME/HF_HUB_CACHE's); "
        "the offline zoo publishes its models into such a folder",
    )
    hub_offline: StrictBool = Field(
        False, description="resolve Hub references from the cache only (as HF_HUB_OFFLINE=1)"
    )

    @field_validator("experts")
    @classmethod
    def _task_names(cls, experts: dict[str, ModelRef]) -> dict[str, ModelRef]:
        _check_task_names(experts)
        return experts

    def folders(self) -> list[tuple[str, ModelRef, Path]]:
        """(key, model, folder on this machine) of the base and every expert, resolved: a local
        model's folder (an open_clip weight file's folder), or a Hub model's folder in the Hub
        cache (`hub_cache`, else huggingface_hub's), which holds its snapshots."""
        cache = None
        found = []
        roles = [("models.base", self.base)]
        roles += [(f"models.experts.{task}", ref) for task, ref in self.experts.items()]
        for key, ref in roles:
            if ref.path is not None:
                path = ref.path.expanduser().resolve()
                found.append((key, ref, path.parent if path.is_file() else path))
                continue
            if cache is None:
                from huggingface_hub import constants

                cache = Path(self.hub_cache or constants.HF_HUB_CACHE).expanduser().resolve()
            assert ref.repo_id is not None  # a model that is not local is a Hub model
            found.append((key, ref, cache / f"models--{ref.repo_id.replace('/', '--')}"))
        return found
