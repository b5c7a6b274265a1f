"""The classification head of a fine-tuned expert (`ExpertHead`).

The expert is a full classification model (`config.json` `architectures`, e.g.
BertForSequenceClassification, CLIPForImageClassification), or a bare tower with a linear head
beside it (`featcal_core.evaluation.linear_head`). Its tower tensors are replaced by the evaluated
checkpoint's (a bare tower such as BertModel or CLIPVisionModel, or a full model; 4.x and 5.x key
layouts); its classifier stays. For BERT the expert's pooler stays too when the evaluated
checkpoint has none. Inputs are preprocessed with the processor or tokenizer saved in the expert
directory. All computation is in float32.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal_core.architectures import detect
from featcal_core.architectures.base import Architecture, has_tokenizer
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.head import Head, _linear
from featcal_core.evaluation.linear_head import pooled
from featcal_core.evaluation.preprocessing import (
    _image_inputs,
    _image_processor,
    _text_inputs,
    _tokenizer,
)
from featcal_core.evaluation.tower import _load_tower, _tower_prefix
from featcal_core.io.adapters import open_expert

logger = logging.getLogger(__name__)

__all__ = ["ExpertHead"]


class _PooledOutput(nn.Module):
    """features(**inputs) (B, d): the tower's pooler_output, or with features "mean_pooling" the
    mean of its last_hidden_state over the real tokens (linear_head.pooled)."""

    def __init__(self, tower: nn.Module, features: str = "pooler_output"):
        super().__init__()
        self.tower = tower
        self.features = features

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return pooled(self.tower(**inputs), inputs.get("attention_mask"), self.features)


class ExpertHead(Head):
    """The classification head of a fine-tuned expert. Two kinds of expert directory:

    - a full transformers classification model (`config.json` `architectures`, e.g.
      BertForSequenceClassification): its classifier on the pooled output;
    - a bare tower (e.g. CLIPVisionModel) with a linear head beside it (`classifier.safetensors`
      + `classifier.json`, see `featcal_core.evaluation.linear_head`): that Linear on
      `pooler_output`, or on the mean of `last_hidden_state` over the real tokens.

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
        # checks dir, config, weights; a LoRA adapter (no classifier of its own) is refused
        checkpoint = open_expert(
            self.expert_dir, "expert", None, reader="an expert's classification head"
        )
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

    @property
    def labels(self) -> list[str]:
        """Class names in class-index order: the linear head's labels, else the config's
        id2label, else the indices as text."""
        if self.linear_file is not None:
            return list(self.linear_file.labels)
        id2label = self.config.get("id2label") or {}
        return [str(id2label.get(str(i), id2label.get(i, i))) for i in range(self.num_classes)]

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

    def own_identity(self) -> dict[str, Any]:
        """The expert's files (classifier, tokenizer or image processor), the fallback
        tokenizer's folder and the truncation length."""
        from featcal_core.provenance.identity import content_digest

        fallback = self.tokenizer_dir
        return {
            "expert": content_digest(self.expert_dir),
            "tokenizer_dir": content_digest(fallback) if fallback is not None else None,
            "max_length": self.max_length,
        }

    def preprocess(self, rows: list[Any]) -> dict[str, torch.Tensor]:
        if self.modality == "image":
            if self._preprocessor is None:
                self._preprocessor = _image_processor(self.expert_dir, "expert")
            return _image_inputs(self._preprocessor, rows)
        if self._preprocessor is None:
            source, role = self.expert_dir, "expert"
            if self.tokenizer_dir is not None and not has_tokenizer(self.expert_dir):
                logger.info(
                    "%s has no tokenizer files: using %s's", self.expert_dir, self.tokenizer_dir
                )
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
        linear: nn.Linear | None
        if self.linear_file is not None:
            features: nn.Module = _PooledOutput(model, self.linear_file.features)
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
