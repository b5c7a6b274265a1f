"""Zero-shot classification of open_clip vision towers with the base's own open_clip text tower.

    head = OpenCLIPZeroShotHead("laion-snapshot/", "data/models/open_clip/base-…",
                                ["cat", "dog"], ["a photo of a {}."], cache_dir="results/heads")
    evaluate("results/calibrated", head, "data/eval", "test")

The base's open_clip source (a directory in open_clip's Hub layout, `open_clip_config.json` plus
`open_clip_model.safetensors` or `open_clip_pytorch_model.bin`, or one weight file with its config
given) provides the text tower: the full model is built with
`open_clip.create_model("local-dir:<dir>")` (the config's folder; a copy of a config stored under
another name goes to a temporary folder), its weights loaded with open_clip's `load_checkpoint`
(strict; pickled whole modules only with `trust_pickle`). Each class embedding is the L2-normalised
mean over the templates of the L2-normalised `encode_text(tokenizer(template.format(name)))`, the
tokenizer being `open_clip.get_tokenizer` of the same config. The class embeddings and the base's
logit_scale are cached as safetensors in `cache_dir`, keyed by a sha256 of the weight and config
files, the class names and the templates.

Image side: open_clip's vision tower (`model.visual` built from the config) with every tensor
replaced by the evaluated featcal checkpoint's (an `open_clip_vision` checkpoint: the imported base
or an expert, or the merged or calibrated model; same keys and shapes, else a clear error);
features = the L2-normalised projected embedding `visual(pixels)` (ln_post and proj included);
logits = exp(logit_scale) · features @ class_embeddings.T. Preprocessing: the adapter's
`transform()` (open_clip's evaluation transform with the config's preprocessing). All float32.
"""

from __future__ import annotations

import copy
import json
import logging
import pickle
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from featcal_core.architectures import detect
from featcal_core.architectures.base import Architecture
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.embedding_cache import (
    embedding_cache_key,
    read_embedding_cache,
    write_embedding_cache,
)
from featcal_core.evaluation.head import Head, _linear
from featcal_core.evaluation.tower import _load_tower
from featcal_core.evaluation.zero_shot_head import check_zero_shot_prompts
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.open_clip.importer import CONFIG_NAME, PICKLE_SUFFIXES

logger = logging.getLogger(__name__)

__all__ = ["OPEN_CLIP_WEIGHTS", "OpenCLIPZeroShotHead"]

#: weight files of an open_clip directory, in order of preference
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
_ARCHITECTURE = "open-clip-vision"
_CACHE_VERSION = "featcal-open-clip-zeroshot-v1"


class OpenCLIPZeroShotHead(Head):
    """Zero-shot head of an open_clip base (text tower from `source`, the vision tower's layout
    and preprocessing from `imported_base_dir`, its featcal import).

    source: the base's open_clip directory or weight file. model_cfg: its open_clip_config.json
    when not beside the weights. trust_pickle: allow unpickling a whole pickled module.
    """

    modality = "image"

    def __init__(
        self,
        source: str | Path,
        imported_base_dir: str | Path,
        class_names: Sequence[str],
        templates: Sequence[str] = ("a photo of a {}.",),
        cache_dir: str | Path | None = None,
        *,
        model_cfg: str | Path | None = None,
        trust_pickle: bool = False,
    ):
        self.weights, self.config_path = _source_files(Path(source), model_cfg)
        self.trust_pickle = bool(trust_pickle)
        self.imported_base_dir = Path(imported_base_dir)
        base = Checkpoint(self.imported_base_dir, role="open_clip base")
        self.arch: Architecture = detect(base.config, str(self.imported_base_dir / "config.json"))
        if self.arch.name != _ARCHITECTURE:
            raise FeatCalError(
                f"{self.imported_base_dir / 'config.json'}: the open_clip zero-shot head needs an "
                f"{_ARCHITECTURE} base (featcal import-open-clip), got {self.arch.name}"
            )
        self.class_names, self.templates = check_zero_shot_prompts(class_names, templates)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._key: str | None = None
        self._cached: dict[str, torch.Tensor] | None = None
        self._visual: nn.Module | None = None  # open_clip's vision tower (its layout only)

    @classmethod
    def from_source_record(
        cls,
        record: Mapping[str, Any],
        imported_base_dir: str | Path,
        class_names: Sequence[str],
        templates: Sequence[str] = ("a photo of a {}.",),
        cache_dir: str | Path | None = None,
    ) -> OpenCLIPZeroShotHead:
        """The head for a lock's `open_clip_source` record (path, file, config, trust_pickle)."""
        missing = [key for key in ("path", "file") if not record.get(key)]
        if missing:
            raise FeatCalError(
                f"open_clip_source record {dict(record)!r} lacks {missing}; re-run the "
                "download step (featcal download) to rewrite the lock"
            )
        return cls(
            Path(record["path"]) / record["file"],
            imported_base_dir,
            class_names,
            templates,
            cache_dir,
            model_cfg=record.get("config"),
            trust_pickle=bool(record.get("trust_pickle", False)),
        )

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def labels(self) -> list[str]:
        return list(self.class_names)

    def describe(self) -> str:
        return f"open_clip zero-shot head of {self.weights} ({self.num_classes} classes)"

    def preprocess(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        inputs = self.arch.prepare_inputs(str(self.imported_base_dir), rows, 0)
        return {"pixel_values": inputs["pixel_values"]}

    # ----- class embeddings -------------------------------------------------------------------
    def cache_key(self) -> str:
        """sha256 over the base's weight and config files, class names and templates."""
        if self._key is None:
            self._key = embedding_cache_key(
                _CACHE_VERSION, (self.weights, self.config_path), self.class_names, self.templates
            )
        return self._key

    def cache_path(self) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"open-clip-zeroshot-{self.cache_key()}.safetensors"

    def class_embeddings(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(classes, embed_dim) float32, each row L2-normalised."""
        return self._tensors(device)["class_embeddings"].to(device)

    def logit_scale(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The base's logit_scale (before exp), a float32 scalar."""
        return self._tensors(device)["logit_scale"].reshape(()).to(device)

    def _tensors(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        if self._cached is None:
            cached = read_embedding_cache(self.cache_path(), self.num_classes)
            if cached is not None and "logit_scale" not in cached:
                logger.warning(
                    "ignoring class-embedding cache %s without logit_scale", self.cache_path()
                )
                cached = None
            if cached is None:
                cached = self._compute(torch.device(device))
                metadata = {
                    "open_clip_weights": str(self.weights),
                    "class_names": json.dumps(self.class_names, ensure_ascii=False),
                    "templates": json.dumps(self.templates, ensure_ascii=False),
                }
                write_embedding_cache(self.cache_path(), cached, metadata)
            self._cached = cached
        return self._cached

    @torch.no_grad()
    def _compute(self, device: torch.device, batch_size: int = 256) -> dict[str, torch.Tensor]:
        import open_clip

        model = self._model(load_weights=True)
        with _config_folder(self.config_path) as folder:
            try:
                tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
            except Exception as exc:
                raise FeatCalError(
                    f"{self.config_path}: open_clip cannot build the tokenizer "
                    f"({type(exc).__name__}: {_first_line(exc)}); put the tokenizer files "
                    "beside the config"
                ) from exc
        model = model.to(device)
        texts = [t.format(name) for name in self.class_names for t in self.templates]
        chunks = []
        for start in range(0, len(texts), batch_size):
            tokens = tokenizer(texts[start : start + batch_size]).to(device)
            chunks.append(F.normalize(model.encode_text(tokens).float(), dim=-1))
        per_prompt = torch.cat(chunks).view(self.num_classes, len(self.templates), -1)
        embeddings = F.normalize(per_prompt.mean(dim=1), dim=-1).cpu()
        logger.info(
            "class embeddings computed: %d classes x %d templates with the open_clip text tower "
            "of %s",
            self.num_classes,
            len(self.templates),
            self.weights,
        )
        scale = model.logit_scale.detach().float().reshape(()).cpu()
        self._visual = model.visual.cpu()
        return {"class_embeddings": embeddings, "logit_scale": scale}

    # ----- the open_clip model ----------------------------------------------------------------
    def _model(self, load_weights: bool) -> Any:
        """The base's open_clip model in float32 (random weights unless `load_weights`); typed Any:
        nn.Module does not declare its towers and encode_text."""
        import open_clip

        with _config_folder(self.config_path) as folder, _quiet_random_init():
            try:
                model = open_clip.create_model(
                    f"local-dir:{folder}",
                    load_weights=False,
                    pretrained_image=False,
                    pretrained_text=False,
                )
            except Exception as exc:
                raise FeatCalError(
                    f"{self.config_path}: open_clip cannot build the model "
                    f"({type(exc).__name__}: {_first_line(exc)}); pass the checkpoint's own "
                    "open_clip_config.json"
                ) from exc
        if load_weights:
            self._load_weights(model)
        return model.float().eval()

    def _load_weights(self, model: nn.Module) -> None:
        import open_clip

        try:
            open_clip.load_checkpoint(model, str(self.weights), strict=True, weights_only=True)
            return
        except pickle.UnpicklingError as exc:
            if self.weights.suffix.lower() not in PICKLE_SUFFIXES:
                raise FeatCalError(
                    f"{self.weights} is not a readable open_clip checkpoint ({_first_line(exc)})"
                ) from exc
        except Exception as exc:
            raise FeatCalError(
                f"{self.weights}: cannot load it into the open_clip model of {self.config_path} "
                f"({type(exc).__name__}: {_first_line(exc)}); zero-shot evaluation needs the "
                "base's full open_clip CLIP (image and text towers) with its own config"
            ) from exc
        self._load_pickled(model)

    def _load_pickled(self, model: nn.Module) -> None:
        if not self.trust_pickle:
            raise FeatCalError(
                f"{self.weights} is a pickled Python object, not a state dict; unpickling it can "
                "run arbitrary code, so it is refused; set trust_pickle (models.base.trust_pickle:"
                " true) only for files you trust, or re-save it with torch.save(state_dict)"
            )
        logger.warning("%s: unpickling a whole Python object (trust_pickle)", self.weights)
        try:
            loaded = torch.load(self.weights, weights_only=False, map_location="cpu")
        except Exception as exc:
            raise FeatCalError(
                f"{self.weights} could not be unpickled ({type(exc).__name__}: "
                f"{_first_line(exc)}); the classes it refers to must be importable"
            ) from exc
        inner = getattr(loaded, "model", None)
        if isinstance(inner, nn.Module) and hasattr(inner, "encode_text"):
            loaded = inner
        if not (isinstance(loaded, nn.Module) and hasattr(loaded, "encode_text")):
            raise FeatCalError(
                f"{self.weights} holds a {type(loaded).__name__} without a text tower; zero-shot "
                "evaluation needs the base's full open_clip CLIP"
            )
        try:
            model.load_state_dict(loaded.state_dict(), strict=True)
        except RuntimeError as exc:
            raise FeatCalError(
                f"{self.weights}: its model does not match {self.config_path} "
                f"({_first_line(exc)}); pass the checkpoint's own open_clip config"
            ) from exc

    # ----- classifier -------------------------------------------------------------------------
    def parts(self, model_dir: str | Path, device: torch.device) -> tuple[nn.Module, nn.Linear]:
        """features: the L2-normalised projected image embedding (B, embed_dim) of the vision
        tower in `model_dir`; linear: exp(logit_scale) · class embeddings, without bias."""
        embeddings = self.class_embeddings("cpu")
        scale = self.logit_scale("cpu").exp()
        if self._visual is None:
            self._visual = self._model(load_weights=False).visual
        visual = copy.deepcopy(self._visual).float()
        _load_tower(dict(visual.state_dict()), model_dir, self.arch, head=self.describe())
        width = getattr(visual, "output_dim", None)
        if width is not None and embeddings.shape[1] != width:
            raise FeatCalError(
                f"class embeddings have width {embeddings.shape[1]}, the vision tower's "
                f"projection {width}; delete the cache file {self.cache_path()}"
            )
        linear = _linear(scale * embeddings, None)
        return _OpenCLIPFeatures(visual).to(device).eval(), linear.to(device)


class _OpenCLIPFeatures(nn.Module):
    def __init__(self, visual: nn.Module):
        super().__init__()
        self.visual = visual

    def forward(self, pixel_values: torch.Tensor, **_: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.visual(pixel_values).float(), dim=-1)  # ln_post(CLS) @ proj


# ----------------------------------------------------------------------------------- helpers


def _source_files(source: Path, model_cfg: str | Path | None) -> tuple[Path, Path]:
    """(weight file, open_clip_config.json) of an open_clip directory or weight file."""
    if source.is_dir():
        found = [source / name for name in OPEN_CLIP_WEIGHTS if (source / name).is_file()]
        if not found:
            raise FeatCalError(
                f"open_clip base {source} has no {' or '.join(OPEN_CLIP_WEIGHTS)}; pass the "
                "weight file itself"
            )
        weights, folder = found[0], source
    elif source.is_file():
        weights, folder = source, source.parent
    else:
        raise FeatCalError(
            f"open_clip base {source} does not exist; the text tower of zero-shot evaluation "
            "comes from it (re-run the download step, featcal download)"
        )
    config = Path(model_cfg) if model_cfg is not None else folder / CONFIG_NAME
    if not config.is_file():
        raise FeatCalError(
            f"open_clip config {config} of {weights} does not exist; give the base's "
            f"{CONFIG_NAME} (models.base.open_clip_config)"
        )
    return weights, config


@contextmanager
def _config_folder(config: Path) -> Iterator[Path]:
    """A folder holding `config` as open_clip_config.json (for open_clip's `local-dir:`)."""
    if config.name == CONFIG_NAME:
        yield config.parent
        return
    folder = Path(tempfile.mkdtemp(prefix="featcal-open-clip-config-"))
    try:
        shutil.copyfile(config, folder / CONFIG_NAME)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _RandomInitFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No pretrained weights loaded")


@contextmanager
def _quiet_random_init() -> Iterator[None]:
    """Drop open_clip's "initialized randomly" warning: the weights are loaded right after, or
    (the vision tower's layout) all replaced by the evaluated checkpoint's."""
    root = logging.getLogger()
    quiet = _RandomInitFilter()
    root.addFilter(quiet)
    try:
        yield
    finally:
        root.removeFilter(quiet)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no details"
