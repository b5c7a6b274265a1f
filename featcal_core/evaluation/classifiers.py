"""Accuracy and cross-entropy of a model (base, expert, merged or calibrated) on a labelled set.

A *head* turns the tower of the evaluated checkpoint into class logits:

- `ExpertHead(expert_dir)`: the expert is a full classification model (`config.json`
  `architectures`, e.g. BertForSequenceClassification, CLIPForImageClassification). Its tower
  tensors are replaced by the evaluated checkpoint's (a bare tower such as BertModel or
  CLIPVisionModel, or a full model; 4.x and 5.x key layouts); its classifier stays. For BERT the
  expert's pooler stays too when the evaluated checkpoint has none.
- `ZeroShotHead(clip_dir, class_names, templates, cache_dir)`: CLIP zero-shot classification. Class
  embeddings come from the base CLIPModel's text tower and text projection (averaged over the
  templates, cached on disk); image embeddings from the evaluated vision tower, then the base's
  visual projection; logits = exp(logit_scale) · cosine similarity.

`evaluate(model_dir, head, dataset_dir, ...)` runs the model in eval mode without gradients over a
`datasets.save_to_disk` directory and returns {"accuracy", "loss", "examples"}. Inputs are
preprocessed with the processor or tokenizer saved in the expert directory (ExpertHead) or the CLIP
base directory (ZeroShotHead). All computation is in float32.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from featcal_core.architectures import detect
from featcal_core.architectures.base import (
    Architecture,
    encode_texts,
    has_tokenizer,
    load_tokenizer,
)
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint, sha256_file
from featcal_core.io.outputs import atomic_file
from featcal_core.io.safetensors_io import DTYPES

logger = logging.getLogger(__name__)

__all__ = [
    "ExpertHead",
    "Head",
    "ZeroShotHead",
    "evaluate",
    "normalized_accuracy",
]

#: tokenizer files that enter the zero-shot cache key (they change the class embeddings)
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
    "special_tokens_map.json", "added_tokens.json",
)  # fmt: skip

_CACHE_VERSION = "featcal-zeroshot-v1"


# ------------------------------------------------------------------------------------ heads


class Head(ABC):
    """A classifier head for `evaluate`: preprocessing plus a tower-to-logits module."""

    #: "image" or "text": which input column `evaluate` reads
    modality: str = ""

    @property
    @abstractmethod
    def num_classes(self) -> int: ...

    @abstractmethod
    def preprocess(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        """Model inputs for a batch of rows (PIL images / arrays, or strings)."""

    #: a replacement for the head's final Linear (set by `with_linear`; head calibration)
    linear_override: tuple[torch.Tensor, torch.Tensor] | None = None

    @abstractmethod
    def parts(self, model_dir: str | Path, device: torch.device) -> tuple[nn.Module, nn.Linear]:
        """(features, linear) in eval mode on `device`, running the tower stored in `model_dir`:
        features(**inputs) gives the head's input (B, d) float32, linear maps it to logits
        (B, classes). `linear` is the head's own, before any `with_linear` override."""

    def classifier(self, model_dir: str | Path, device: torch.device) -> nn.Module:
        """A module in eval mode on `device` whose forward(**inputs) gives logits (B, classes),
        running the tower stored in `model_dir` under this head (and its linear override)."""
        features, linear = self.parts(model_dir, device)
        if self.linear_override is not None:
            weight, bias = self.linear_override
            linear = _linear(weight, bias).to(device)
        return _FeatureClassifier(features, linear).eval()

    def with_linear(self, weight: torch.Tensor, bias: torch.Tensor) -> Head:
        """This head with its final Linear replaced by (weight (classes, d), bias (classes))."""
        if weight.ndim != 2 or bias.shape != (weight.shape[0],):
            raise FeatCalError(
                f"{self.describe()}: a replacement head needs weight (classes, d) and bias "
                f"(classes), got {tuple(weight.shape)} and {tuple(bias.shape)}"
            )
        if weight.shape[0] != self.num_classes:
            raise FeatCalError(
                f"{self.describe()}: the replacement head has {weight.shape[0]} classes, the head "
                f"{self.num_classes}; calibrate the head for this task"
            )
        clone = copy.copy(self)
        clone.linear_override = (weight.detach().float().cpu(), bias.detach().float().cpu())
        return clone

    def describe(self) -> str:
        return type(self).__name__


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight.float())
        if bias is not None:
            layer.bias.copy_(bias.float())
    return layer.eval()


class _FeatureClassifier(nn.Module):
    def __init__(self, features: nn.Module, linear: nn.Linear):
        super().__init__()
        self.features = features
        self.linear = linear

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(self.features(**inputs).float())


class _PooledOutput(nn.Module):
    """features(**inputs) = tower(**inputs).pooler_output (B, d)."""

    def __init__(self, tower: nn.Module):
        super().__init__()
        self.tower = tower

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.tower(**inputs).pooler_output


class ExpertHead(Head):
    """The classification head of a fine-tuned expert. Two kinds of expert directory:

    - a full transformers classification model (`config.json` `architectures`, e.g.
      BertForSequenceClassification): its classifier on the pooled output;
    - a bare tower (e.g. CLIPVisionModel) with a linear head beside it (`classifier.safetensors`
      + `classifier.json`, see `featcal_core.evaluation.linear_head`): that Linear on `pooler_output`.

    The tokenizer or image processor is loaded from `expert_dir`; an expert saved without
    tokenizer files uses `tokenizer_dir`'s (the base model it was fine-tuned from) when given.
    Text is truncated to `max_length` tokens (or the model's position limit, whichever is
    smaller).
    """

    def __init__(
        self,
        expert_dir: str | Path,
        max_length: int = 512,
        tokenizer_dir: str | Path | None = None,
    ):
        from featcal_core.evaluation.linear_head import has_linear_head, load_linear_head

        self.expert_dir = Path(expert_dir)
        checkpoint = Checkpoint(self.expert_dir, role="expert")  # checks dir, config, weights
        self.config = checkpoint.config
        names = self.config.get("architectures") or []
        self.arch: Architecture = detect(self.config, source=str(self.expert_dir / "config.json"))
        self.linear_file = (
            load_linear_head(self.expert_dir) if has_linear_head(expert_dir) else None
        )
        if not names:
            raise FeatCalError(
                f"{self.expert_dir / 'config.json'} has no 'architectures' entry; the expert must "
                "be a classification model saved with save_pretrained (e.g. "
                "BertForSequenceClassification) or a tower with classifier.safetensors"
            )
        self.class_name = str(names[0])
        self.modality = self.arch.modality
        self.max_length = int(max_length)
        self._num_classes: int | None = None
        self._preprocessor: Any = None
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None

    @property
    def num_classes(self) -> int:
        if self._num_classes is None:
            if self.linear_file is not None:
                self._num_classes = int(self.linear_file.weight.shape[0])
            else:
                from transformers import AutoConfig

                self._num_classes = int(AutoConfig.from_pretrained(self.expert_dir).num_labels)
        return self._num_classes

    def require_head(self) -> None:
        """FeatCalError unless the expert has a classification head to evaluate or refit: a
        linear head beside the tower, or a transformers *ForSequence/ImageClassification model."""
        if self.linear_file is None and not self.class_name.endswith("Classification"):
            raise FeatCalError(
                f"expert {self.expert_dir} has no classification head (no classifier.safetensors "
                f"beside it, and {self.class_name} is not a classification model); give experts "
                "with heads or leave out head calibration (--heads / featcal.heads)"
            )

    def describe(self) -> str:
        kind = "linear head" if self.linear_file is not None else "expert head"
        return f"{kind} {self.class_name} from {self.expert_dir}"

    def preprocess(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        if self.modality == "image":
            if self._preprocessor is None:
                self._preprocessor = _image_processor(self.expert_dir, "expert")
            return _image_inputs(self._preprocessor, rows)
        if self._preprocessor is None:
            source, role = self.expert_dir, "expert"
            if self.tokenizer_dir is not None and not has_tokenizer(self.expert_dir):
                logger.info("%s has no tokenizer files: using %s's", self.expert_dir,
                            self.tokenizer_dir)  # fmt: skip
                source, role = self.tokenizer_dir, "base model"
            self._preprocessor = _tokenizer(source, role)
        limit = min(self.max_length, int(self.config.get("max_position_embeddings") or 10**9))
        return _text_inputs(self._preprocessor, rows, limit)

    def _load_expert(self) -> nn.Module:
        import transformers

        cls = getattr(transformers, self.class_name, None)
        if cls is None or not hasattr(cls, "from_pretrained"):
            raise FeatCalError(
                f"{self.expert_dir / 'config.json'}: architectures {self.class_name!r} is not a "
                "transformers model class; save the expert with a transformers classification model"
            )
        try:
            model, info = cls.from_pretrained(
                self.expert_dir, dtype=torch.float32, output_loading_info=True
            )
        except Exception as exc:
            raise FeatCalError(
                f"expert {self.expert_dir}: cannot load {self.class_name} ({exc}); re-save the "
                "expert with save_pretrained"
            ) from exc
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            raise FeatCalError(
                f"expert {self.expert_dir} lacks {len(missing)} tensor(s) of {self.class_name}, "
                f"e.g. {missing[0]!r}; the head would be random: pass a fine-tuned classification "
                "checkpoint"
            )
        return model

    def _with_tower(self, model_dir: str | Path) -> nn.Module:
        """The expert's model with its tower tensors replaced by those in `model_dir`."""
        model = self._load_expert()
        state = model.state_dict()  # tensors share storage with the parameters
        prefix = _tower_prefix(self.arch, state, f"expert {self.expert_dir}")
        if self.linear_file is None and (
            prefix == "" or all(key.startswith(prefix) for key in state)
        ):
            raise FeatCalError(
                f"expert {self.expert_dir} ({self.class_name}) has no classification head next to "
                "its tower; pass a fine-tuned classification checkpoint (e.g. "
                "BertForSequenceClassification) or save classifier.safetensors beside the tower"
            )
        targets = {key[len(prefix) :]: state[key] for key in state if key.startswith(prefix)}
        replaced = _load_tower(
            targets,
            model_dir,
            self.arch,
            head=self.describe(),
            optional=self.arch.optional_tower_roots,  # kept from the expert when missing
        )
        logger.info(
            "evaluating %s under %s: %d tower tensors replaced, %d kept",
            model_dir,
            self.describe(),
            len(replaced),
            len(targets) - len(replaced),
        )
        return model

    def parts(self, model_dir: str | Path, device: torch.device) -> tuple[nn.Module, nn.Linear]:
        model = self._with_tower(model_dir)
        if self.linear_file is not None:
            features: nn.Module = _PooledOutput(model)
            linear = _linear(self.linear_file.weight, self.linear_file.bias)
        else:
            linear = getattr(model, "classifier", None)
            base = getattr(model, "base_model", None)
            if not isinstance(linear, nn.Linear) or base is None or base is model:
                raise FeatCalError(
                    f"expert {self.expert_dir} ({self.class_name}): its head is not one Linear on "
                    "the pooled output, so it cannot be split for head calibration; use a "
                    "BertForSequenceClassification-style expert or classifier.safetensors"
                )
            features = _PooledOutput(base)
        return features.to(device).eval(), linear.to(device).eval()

    def classifier(self, model_dir: str | Path, device: torch.device) -> nn.Module:
        if self.linear_file is None and self.linear_override is None:
            # the model's own forward: exact for any classification head, not only a Linear
            return _ExpertClassifier(self._with_tower(model_dir)).to(device).eval()
        return super().classifier(model_dir, device)


class _ExpertClassifier(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs).logits


def embedding_cache_key(
    version: str, files: Sequence[Path], class_names: Sequence[str], templates: Sequence[str]
) -> str:
    """Key of a class-embedding cache: sha256 over `version`, each file's name and sha256, the
    class names and the templates."""
    digest = hashlib.sha256(version.encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + bytes.fromhex(sha256_file(path)))
    payload = {"class_names": list(class_names), "templates": list(templates)}
    digest.update(json.dumps(payload, ensure_ascii=False).encode())
    return digest.hexdigest()


class ZeroShotHead(Head):
    """CLIP zero-shot classification with the base CLIPModel in `clip_dir`.

    class_names: one name per label id (label i is class_names[i]); templates: prompts with one
    "{}" for the class name. The class embeddings are written to `cache_dir` (None: not cached)
    as safetensors, keyed by a sha256 of the base's weight and tokenizer files, the class names and
    the templates.
    """

    modality = "image"

    def __init__(
        self,
        clip_dir: str | Path,
        class_names: Sequence[str],
        templates: Sequence[str] = ("a photo of a {}.",),
        cache_dir: str | Path | None = None,
    ):
        self.clip_dir = Path(clip_dir)
        self.base = Checkpoint(self.clip_dir, role="CLIP base")
        config = self.base.config
        if config.get("model_type") != "clip" or "text_config" not in config:
            raise FeatCalError(
                f"{self.clip_dir / 'config.json'}: zero-shot evaluation needs a full CLIPModel "
                f"(model_type 'clip' with text and vision towers), got "
                f"{config.get('architectures') or config.get('model_type')!r}; pass the base CLIPModel"
            )
        for key in ("visual_projection.weight", "logit_scale"):
            if key not in self.base:
                raise FeatCalError(
                    f"CLIP base {self.clip_dir} has no tensor {key!r}; pass a CLIPModel checkpoint "
                    "(with projections and logit_scale)"
                )
        self.class_names, self.templates = check_zero_shot_prompts(class_names, templates)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.arch: Architecture = detect(config, source=str(self.clip_dir / "config.json"))
        self._processor: Any = None
        self._key: str | None = None
        self._embeddings: torch.Tensor | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def describe(self) -> str:
        return f"zero-shot head of {self.clip_dir} ({self.num_classes} classes)"

    def preprocess(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        if self._processor is None:
            self._processor = _image_processor(self.clip_dir, "CLIP base")
        return _image_inputs(self._processor, rows)

    # ----- class embeddings -------------------------------------------------------------------
    def cache_key(self) -> str:
        """sha256 over the base's weight (and tokenizer) files, class names and templates."""
        if self._key is None:
            files = list(self.base.weight_paths())
            files += [self.clip_dir / n for n in _TOKENIZER_FILES if (self.clip_dir / n).is_file()]
            self._key = embedding_cache_key(_CACHE_VERSION, files, self.class_names,
                                            self.templates)  # fmt: skip
        return self._key

    def cache_path(self) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / f"clip-zeroshot-{self.cache_key()}.safetensors"

    def class_embeddings(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(classes, projection_dim) float32, each row L2-normalised."""
        if self._embeddings is None:
            self._embeddings = self._cached_embeddings()
        if self._embeddings is None:
            self._embeddings = self._compute_embeddings(torch.device(device))
            self._write_cache(self._embeddings)
        return self._embeddings.to(device)

    def _cached_embeddings(self) -> torch.Tensor | None:
        tensors = read_embedding_cache(self.cache_path(), self.num_classes)
        return None if tensors is None else tensors["class_embeddings"]

    def _write_cache(self, embeddings: torch.Tensor) -> None:
        metadata = {
            "clip_dir": str(self.clip_dir),
            "class_names": json.dumps(self.class_names, ensure_ascii=False),
            "templates": json.dumps(self.templates, ensure_ascii=False),
        }
        write_embedding_cache(self.cache_path(), {"class_embeddings": embeddings}, metadata)

    @torch.no_grad()
    def _compute_embeddings(self, device: torch.device, batch_size: int = 256) -> torch.Tensor:
        from transformers import CLIPModel

        try:
            model = CLIPModel.from_pretrained(self.clip_dir, dtype=torch.float32)
        except Exception as exc:
            raise FeatCalError(
                f"CLIP base {self.clip_dir}: cannot load CLIPModel ({exc}); re-save the base "
                "CLIPModel with save_pretrained"
            ) from exc
        model = model.to(device).eval()
        tokenizer = _tokenizer(self.clip_dir, "CLIP base")
        limit = int(model.config.text_config.max_position_embeddings)
        texts = [t.format(name) for name in self.class_names for t in self.templates]
        chunks = []
        for start in range(0, len(texts), batch_size):
            inputs = _text_inputs(tokenizer, texts[start : start + batch_size], limit)
            inputs = {k: v.to(device) for k, v in inputs.items() if k != "token_type_ids"}
            pooled = model.text_model(**inputs).pooler_output
            chunks.append(F.normalize(model.text_projection(pooled).float(), dim=-1))
        per_prompt = torch.cat(chunks).view(self.num_classes, len(self.templates), -1)
        embeddings = F.normalize(per_prompt.mean(dim=1), dim=-1).cpu()
        logger.info(
            "class embeddings computed: %d classes x %d templates with %s",
            self.num_classes,
            len(self.templates),
            self.clip_dir,
        )
        return embeddings

    # ----- classifier -------------------------------------------------------------------------
    def parts(self, model_dir: str | Path, device: torch.device) -> tuple[nn.Module, nn.Linear]:
        """features: the L2-normalised projected image embedding (B, projection_dim); linear:
        exp(logit_scale) · class embeddings, without bias."""
        from transformers import CLIPVisionConfig, CLIPVisionModel

        vision_config = CLIPVisionConfig.from_dict(dict(self.base.config["vision_config"]))
        vision = CLIPVisionModel(vision_config).float()
        _load_tower(dict(vision.state_dict()), model_dir, self.arch, head=self.describe())
        extra = self.base.read(["visual_projection.weight", "logit_scale"])
        projection = extra["visual_projection.weight"].float()
        if projection.shape[1] != vision_config.hidden_size:
            raise FeatCalError(
                f"CLIP base {self.clip_dir}: visual_projection.weight has shape "
                f"{tuple(projection.shape)}, its vision tower width is {vision_config.hidden_size}; "
                "re-save the base"
            )
        embeddings = self.class_embeddings(device)
        if embeddings.shape[1] != projection.shape[0]:
            raise FeatCalError(
                f"class embeddings have width {embeddings.shape[1]}, the visual projection "
                f"{projection.shape[0]}; delete the cache file {self.cache_path()}"
            )
        scale = extra["logit_scale"].float().reshape(()).exp()
        linear = _linear(scale * embeddings.cpu(), None)
        return _ZeroShotFeatures(vision, projection).to(device).eval(), linear.to(device)


class _ZeroShotFeatures(nn.Module):
    def __init__(self, vision: nn.Module, projection: torch.Tensor):
        super().__init__()
        self.vision = vision
        self.visual_projection = _linear(projection, None)

    def forward(self, pixel_values: torch.Tensor, **_: torch.Tensor) -> torch.Tensor:
        pooled = self.vision(pixel_values=pixel_values).pooler_output  # post_layernorm(CLS)
        return F.normalize(self.visual_projection(pooled), dim=-1)


def check_zero_shot_prompts(
    class_names: Sequence[str], templates: Sequence[str]
) -> tuple[list[str], list[str]]:
    """(class names, templates) as strings; a FeatCalError when either is empty or a template has
    no single "{}" for the class name."""
    names = [str(name) for name in class_names]
    if not names:
        raise FeatCalError("zero-shot head: class_names is empty; give one name per label")
    prompts = [str(t) for t in templates]
    if not prompts:
        raise FeatCalError('zero-shot head: templates is empty; give e.g. ["a photo of a {}."]')
    for template in prompts:
        try:
            ok = "{}" in template and template.format("x") is not None
        except (IndexError, KeyError, ValueError):
            ok = False
        if not ok:
            raise FeatCalError(
                f"zero-shot template {template!r} must contain one {{}} for the class name "
                "(double other braces)"
            )
    return names, prompts


def read_embedding_cache(path: Path | None, num_classes: int) -> dict[str, torch.Tensor] | None:
    """The tensors of a class-embedding cache file (float32), or None when there is none, it is
    unreadable or its `class_embeddings` is not (num_classes, d)."""
    if path is None or not path.is_file():
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        tensor = tensors["class_embeddings"]
    except (OSError, KeyError, SafetensorError) as exc:
        logger.warning("ignoring unreadable class-embedding cache %s (%s)", path, exc)
        return None
    if tensor.ndim != 2 or tensor.shape[0] != num_classes:
        logger.warning("ignoring class-embedding cache %s of shape %s", path, tuple(tensor.shape))
        return None
    logger.info("class embeddings read from %s", path)
    return {name: value.float() for name, value in tensors.items()}


def write_embedding_cache(
    path: Path | None, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write a class-embedding cache file atomically (temporary file, then rename); None: no
    cache."""
    if path is None:
        return
    from safetensors.torch import save_file

    try:
        out = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        with atomic_file(path, "class-embedding cache") as tmp:  # whole files only, for readers
            save_file(out, str(tmp), metadata=metadata)
    except (OSError, FeatCalError) as exc:
        raise FeatCalError(
            f"cannot write the class-embedding cache {path} ({exc}); pass a writable cache_dir"
        ) from exc
    logger.info("class embeddings written to %s", path)


# ------------------------------------------------------------------------------- tower loading


def _tower_prefix(arch: Architecture, names: Any, what: str) -> str:
    return arch.find_prefix(names, what)


def _load_tower(
    targets: dict[str, torch.Tensor],
    model_dir: str | Path,
    arch: Architecture,
    *,
    head: str,
    optional: tuple[str, ...] = (),
) -> list[str]:
    """Copy the tower tensors of the checkpoint in `model_dir` into `targets` (canonical name →
    parameter tensor, modified in place). Every target must be found with the same shape, except
    names under `optional`, which then keep their values. Returns the replaced names."""
    checkpoint = Checkpoint(model_dir, role="evaluated model")
    source = detect(checkpoint.config, source=str(checkpoint.directory / "config.json"))
    if source.name != arch.name:
        raise FeatCalError(
            f"evaluated model {checkpoint.directory} is a {source.name} checkpoint but the "
            f"{head} needs a {arch.name} tower; pass a checkpoint of the head's family"
        )
    prefix = arch.resolve_prefix(checkpoint)
    replaced: list[str] = []
    for name, target in targets.items():
        key = prefix + name
        if key not in checkpoint:
            if name.startswith(optional):
                logger.info("%s has no %r; the head's own tensor is kept", model_dir, key)
                continue
            raise FeatCalError(
                f"evaluated model {checkpoint.directory} has no tower tensor {key!r} that the "
                f"{head} needs; the tower is incompatible with the head (another depth or "
                "architecture)"
            )
        shape = checkpoint.tensors[key].shape
        if tuple(shape) != tuple(target.shape):
            raise FeatCalError(
                f"evaluated model {checkpoint.directory}: tensor {key!r} has shape {tuple(shape)}, "
                f"the {head} expects {tuple(target.shape)}; the tower is incompatible with the head"
            )
        replaced.append(name)
    extra = sorted(
        key
        for key in checkpoint.tensors
        if key.startswith(prefix)
        and arch.owns(key[len(prefix) :])
        and key[len(prefix) :] not in targets
        and DTYPES[checkpoint.tensors[key].dtype].is_floating_point  # not buffers (position_ids)
    )
    if extra:
        raise FeatCalError(
            f"evaluated model {checkpoint.directory} has tower tensor {extra[0]!r} (and "
            f"{len(extra) - 1} more) that the {head} lacks; the tower is incompatible with the head "
            "(another depth or architecture)"
        )
    tensors = checkpoint.read([prefix + name for name in replaced])
    with torch.no_grad():
        for name in replaced:
            targets[name].copy_(tensors[prefix + name].to(targets[name].dtype))
    return replaced


# ---------------------------------------------------------------------------- preprocessing


def _image_processor(directory: Path, role: str) -> Any:
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(directory)
    except Exception as exc:
        raise FeatCalError(
            f"{role} {directory}: cannot load the image processor ({exc}); save it there with "
            "image_processor.save_pretrained"
        ) from exc


def _tokenizer(directory: Path, role: str) -> Any:
    return load_tokenizer(directory, role)


def _image_inputs(processor: Any, rows: list[Any]) -> dict[str, torch.Tensor]:
    from PIL import Image

    images = []
    for row in rows:
        if not isinstance(row, Image.Image):
            row = Image.fromarray(np.asarray(row))
        images.append(row.convert("RGB"))
    return {"pixel_values": processor(images=images, return_tensors="pt")["pixel_values"]}


def _text_inputs(tokenizer: Any, rows: list[Any], max_length: int) -> dict[str, torch.Tensor]:
    return encode_texts(tokenizer, rows, max_length)


# ------------------------------------------------------------------------------------ data


def _load_split(dataset_dir: str | Path, split: str | None) -> Any:
    import datasets  # local import: heavy

    path = Path(dataset_dir)
    if not path.exists():
        raise FeatCalError(
            f"evaluation set {path} does not exist; pass a datasets save_to_disk directory"
        )
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise FeatCalError(
            f"evaluation set {path}: not a datasets save_to_disk directory ({exc})"
        ) from exc
    if isinstance(data, datasets.DatasetDict):
        if split is None:
            if len(data) == 1:
                return next(iter(data.values()))
            raise FeatCalError(
                f"evaluation set {path} has splits {sorted(data)}; pass split (e.g. 'test')"
            )
        if split not in data:
            raise FeatCalError(
                f"evaluation set {path} has no split {split!r} (has {sorted(data)}); pass one of them"
            )
        return data[split]
    if split is not None:
        raise FeatCalError(
            f"evaluation set {path} is a single dataset without splits, but split {split!r} was "
            "given; pass split=None or save a DatasetDict"
        )
    return data


def _check_labels(labels: list[Any], num_classes: int, where: str, column: str) -> torch.Tensor:
    try:
        values = torch.as_tensor(np.asarray(labels))
    except (TypeError, ValueError) as exc:
        raise FeatCalError(
            f"{where}: column {column!r} does not hold integer labels ({exc}); pass the label column"
        ) from exc
    if (
        values.ndim != 1
        or values.is_floating_point()
        or values.is_complex()
        or values.dtype == torch.bool
    ):
        raise FeatCalError(
            f"{where}: column {column!r} does not hold integer class ids (dtype {values.dtype}); "
            "pass the label column"
        )
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= num_classes:
        bad = low if low < 0 else high
        raise FeatCalError(
            f"{where}: label {bad} in column {column!r} is out of range for a head with "
            f"{num_classes} classes (0..{num_classes - 1}); check the label column, the class "
            "names or the expert"
        )
    return values.long()


# ------------------------------------------------------------------------------- evaluation


def _device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise FeatCalError(f"device {device!r} is not a torch device (cpu, cuda, auto)") from exc


@torch.no_grad()
def evaluate(
    model_dir: str | Path,
    head: Head,
    dataset_dir: str | Path,
    split: str | None = None,
    *,
    batch_size: int = 64,
    max_examples: int | None = None,
    image_column: str | None = "image",
    text_column: str | None = "text",
    label_column: str | None = "label",
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict[str, float | int]:
    """Evaluate the tower in `model_dir` under `head` on a labelled `save_to_disk` set.

    split: the DatasetDict split (None: the only split, or a plain Dataset); max_examples: the
    first N rows only. Returns {"accuracy": fraction correct, "loss": mean cross-entropy,
    "examples": rows evaluated}.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise FeatCalError(f"batch_size must be at least 1 (got {batch_size})")
    if max_examples is not None and max_examples < 1:
        raise FeatCalError(f"max_examples must be at least 1 or None (got {max_examples})")
    where = f"evaluation set {dataset_dir}" + (f" (split {split})" if split else "")
    data = _load_split(dataset_dir, split)
    if head.modality == "image":
        input_column = image_column or "image"
    else:
        input_column = text_column or "text"
    label_column = label_column or "label"
    for column, role in ((input_column, f"{head.modality} input"), (label_column, "label")):
        if column not in data.column_names:
            raise FeatCalError(
                f"{where}: no {role} column {column!r} (has {data.column_names}); pass the "
                f"{role.split()[-1]} column name"
            )
    if max_examples is not None and len(data) > max_examples:
        data = data.select(range(max_examples))
    if len(data) == 0:
        raise FeatCalError(f"{where} has no rows; evaluate on a non-empty set")
    labels = _check_labels(list(data[label_column]), head.num_classes, where, label_column)
    data = data.select_columns([input_column])

    target = _device(device)
    model = head.classifier(model_dir, target)
    total = len(data)
    correct = 0
    loss_sum = 0.0
    batches = range(0, total, batch_size)
    bar = tqdm(batches, desc=f"evaluate {Path(model_dir).name}", unit="batch", disable=not progress)
    for start in bar:
        rows = data[start : start + batch_size][input_column]
        inputs = {k: v.to(target) for k, v in head.preprocess(rows).items()}
        logits = model(**inputs).float()
        batch_labels = labels[start : start + len(rows)].to(target)
        loss_sum += float(F.cross_entropy(logits, batch_labels, reduction="sum"))
        correct += int((logits.argmax(dim=-1) == batch_labels).sum())
    result = {"accuracy": correct / total, "loss": loss_sum / total, "examples": total}
    logger.info(
        "%s on %s: accuracy %.4f, loss %.4f over %d examples",
        model_dir,
        where,
        result["accuracy"],
        result["loss"],
        total,
    )
    return result


def normalized_accuracy(model_acc: float, expert_acc: float) -> float:
    """Accuracy relative to the task's expert: model_acc / expert_acc."""
    if not np.isfinite(model_acc) or not np.isfinite(expert_acc):
        raise FeatCalError(
            f"normalized accuracy needs finite accuracies (got {model_acc}, {expert_acc})"
        )
    if expert_acc <= 0:
        raise FeatCalError(
            f"normalized accuracy is undefined: the expert's accuracy is {expert_acc}; check the "
            "expert's evaluation (labels, head)"
        )
    return float(model_acc) / float(expert_acc)
