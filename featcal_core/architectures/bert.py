"""Hugging Face BERT-family encoders: `BertModel` and models built on it (`bert.` prefix).

Stem: word + position + token-type embeddings and their LayerNorm. Blocks: `BertLayer`
(attention.self.query/key/value, attention.output.dense + LayerNorm, intermediate.dense,
output.dense + LayerNorm). Padding tokens weigh 0; with [CLS] pooling (default) the last block
weights [CLS] 1 and other tokens 0.01, except in the key and value projections; `pooling="mean"`
keeps all real tokens at 1 (sentence-transformers models such as all-MiniLM-L6-v2).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from transformers import BertConfig

from featcal_core.architectures import register
from featcal_core.architectures.base import Architecture, encode_texts, load_tokenizer


class _Stem(nn.Module):
    def __init__(self, config: BertConfig):
        from transformers.models.bert.modeling_bert import BertEmbeddings

        super().__init__()
        self.embeddings = BertEmbeddings(config)


@register
class HFBert(Architecture):
    name = "hf-bert"
    optional_tower_roots = ("pooler.",)  # BertForSequenceClassification may drop the pooler
    modality = "text"
    probe_key = "embeddings.word_embeddings.weight"
    prefix_candidates = ("", "bert.")
    stem_roots = ("embeddings.",)
    pooled_position = 0
    pooled_exempt = ("attention.self.key", "attention.self.value")

    def __init__(self, config: dict[str, Any], pooling: str | None = None):
        super().__init__(config, pooling)
        self.hf_config = BertConfig.from_dict(dict(config))
        self.hf_config._attn_implementation = "eager"

    @classmethod
    def matches(cls, config: dict[str, Any]) -> bool:
        return config.get("model_type") == "bert"

    @property
    def num_blocks(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    def block_prefix(self, index: int) -> str:
        return f"encoder.layer.{index}."

    def build_stem(self, dtype: torch.dtype) -> nn.Module:
        return _Stem(self.hf_config).to(dtype).eval()

    def run_stem(self, stem: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = inputs["input_ids"]
        token_types = inputs.get("token_type_ids")
        if token_types is None:
            token_types = torch.zeros_like(ids)
        return cast(_Stem, stem).embeddings(input_ids=ids, token_type_ids=token_types)

    def build_block(self, dtype: torch.dtype) -> nn.Module:
        from transformers.models.bert.modeling_bert import BertLayer

        return BertLayer(self.hf_config).to(dtype).eval()

    def run_block(self, block: nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        additive = (1.0 - mask.to(hidden.dtype))[:, None, None, :] * torch.finfo(hidden.dtype).min
        out = block(hidden, attention_mask=additive)
        return out[0] if isinstance(out, tuple) else out

    def prepare_inputs(
        self, base_dir: str, rows: list[Any], max_length: int, targets: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        tokenizer = load_tokenizer(base_dir)
        limit = min(max_length, int(self.hf_config.max_position_embeddings))
        encoded = encode_texts(tokenizer, rows, limit)
        inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        if "token_type_ids" in encoded:
            inputs["token_type_ids"] = encoded["token_type_ids"]
        return inputs
