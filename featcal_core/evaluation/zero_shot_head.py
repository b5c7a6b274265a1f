"""CLIP zero-shot classification (`ZeroShotHead`) and the check of its prompts.

Class embeddings come from the base CLIPModel's text tower and text projection (averaged over the
templates, cached on disk, see `featcal_core.evaluation.embedding_cache`); image embeddings from
the evaluated vision tower, then the base's visual projection; logits = exp(logit_scale) · cosine
similarity. Inputs are preprocessed with the image processor saved in the CLIP base directory.
All computation is in float32.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
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
from featcal_core.evaluation.preprocessing import (
    _image_inputs,
    _image_processor,
    _text_inputs,
    _tokenizer,
)
from featcal_core.evaluation.tower import _load_tower
from featcal_core.io.checkpoint import Checkpoint

logger = logging.getLogger(__name__)

__all__ = ["ZeroShotHead", "check_zero_shot_prompts"]

#: tokenizer files that enter the zero-shot cache key (they change the class embeddings)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)

_CACHE_VERSION = "featcal-zeroshot-v1"


class ZeroShotHead(Head):
    """CLIP zero-shot classification with the base CLIPModel in `clip_dir`.

    class_names: one name per label id (label i is class_names[i]); templates: prompts with one
    "{}" for the class name. The class embeddings are written to `cache_dir` (None: not cached)
    as safetensors, keyed by a sha256 of the base's weight and tokenizer files, its config.json
    content, the class names and the templates.
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

    @property
    def labels(self) -> list[str]:
        return list(self.class_names)

    def describe(self) -> str:
        return f"zero-shot head of {self.clip_dir} ({self.num_classes} classes)"

    def own_identity(self) -> dict[str, Any]:
        """The base's files (text tower, projections, tokenizer, image processor), the class
        names and templates, and the cached class embeddings' file when there is one."""
        from featcal_core.io.digests import sha256_file
        from featcal_core.provenance.identity import content_digest

        cached = self.cache_path()  # the class embeddings as read from there, where they are
        return {
            "base": content_digest(self.clip_dir),
            "class_names": list(self.class_names),
            "templates": list(self.templates),
            "embeddings": sha256_file(cached) if cached is not None and cached.is_file() else None,
        }

    def preprocess(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        if self._processor is None:
            self._processor = _image_processor(self.clip_dir, "CLIP base")
        return _image_inputs(self._processor, rows)

    # ----- class embeddings -------------------------------------------------------------------
    def cache_key(self) -> str:
        """sha256 over the base's weight and tokenizer files, its config.json content (the text
        tower's architecture: width, layers, activation, ...), class names and templates."""
        if self._key is None:
            files = list(self.base.weight_paths())
            files += [self.clip_dir / n for n in _TOKENIZER_FILES if (self.clip_dir / n).is_file()]
            self._key = embedding_cache_key(
                _CACHE_VERSION, files, self.class_names, self.templates, config=self.base.config
            )
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
        model = model.to(device).eval()  # type: ignore[arg-type]  # @wraps(to) loses self
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
