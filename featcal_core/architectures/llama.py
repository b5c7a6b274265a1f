"""Hugging Face Llama-class decoders: `LlamaForCausalLM` / `LlamaModel` and the models with the same
layout, `MistralForCausalLM` and `Qwen2ForCausalLM` (`model.` prefix, or none for the bare model).

Stem: the token embeddings (`embed_tokens`). Blocks: the family's DecoderLayer (`layers.{i}.`):
input_layernorm (scale-only RMSNorm), self_attn.q/k/v/o_proj (grouped-query attention; Qwen2 adds
q/k/v biases), post_attention_layernorm (RMSNorm), mlp.gate/up/down_proj. Rotary position
embeddings are computed for positions 0..S-1 (right padding) and attention is causal with padded
keys masked (eager attention). The final `norm` and `lm_head` are not calibrated.

Inputs: each calibration row's tokens (with the tokenizer's special tokens, e.g. bos), followed,
when the set has a `target` column, by the target's tokens (no special tokens; the prompt is cut
from the end when the pair exceeds the token limit). Token weights: padding 0, every real token 1
(no pooled token; docs/featcal.md gives causal LMs no special rule), or, with
`token_weighting = "answer"`, 1 only at the positions whose next token is a target token (the
positions whose outputs predict the answer) and 0 elsewhere; prompt tokens are still attended to.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, cast

import torch
import transformers
from torch import nn

from featcal_core.architectures import register
from featcal_core.architectures.base import (
    WEIGHT_MASK,
    Architecture,
    encode_texts,
    load_tokenizer,
)
from featcal_core.errors import FeatCalError

log = logging.getLogger(__name__)

#: model_type → (transformers module, class-name stem)
_FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
}


class _Stem(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, padding_idx: int | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, padding_idx)


@register
class HFLlama(Architecture):
    name = "hf-llama"
    modality = "text"
    probe_key = "embed_tokens.weight"
    prefix_candidates = ("model.", "")
    stem_roots = ("embed_tokens.",)
    pooled_position = None
    pooled_exempt = ()
    norm_types = ()  # no LayerNorm in these blocks; the RMS norms are set per family below
    causal = True  # evaluated by label continuation and perplexity (featcal_core.evaluation.language_model)

    def __init__(self, config: dict[str, Any], pooling: str | None = None):
        super().__init__(config, pooling)
        model_type = config["model_type"]
        module_name, stem = _FAMILIES[model_type]
        self.hf_config = getattr(transformers, f"{stem}Config").from_dict(dict(config))
        self.hf_config._attn_implementation = "eager"
        module = importlib.import_module(module_name)
        self._layer_cls = getattr(module, f"{stem}DecoderLayer")
        self._rotary_cls = getattr(module, f"{stem}RotaryEmbedding")
        self.rms_norm_types = (getattr(module, f"{stem}RMSNorm"),)
        self._rotary: dict[torch.device, nn.Module] = {}
        self.window, self._mixed_window = _sliding_window(self.hf_config, model_type)

    @classmethod
    def matches(cls, config: dict[str, Any]) -> bool:
        return config.get("model_type") in _FAMILIES

    def set_pooling(self, pooling: str) -> None:
        if pooling != "mean":
            raise FeatCalError(
                f"--pooling {pooling!r}: {self.name} (causal LM) has no pooled token; every real "
                "token weighs 1 (use --pooling mean or leave it out)"
            )
        self.pooled_position = None

    @property
    def num_blocks(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    def block_prefix(self, index: int) -> str:
        return f"layers.{index}."

    def build_stem(self, dtype: torch.dtype) -> nn.Module:
        cfg = self.hf_config
        return _Stem(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id).to(dtype).eval()

    def run_stem(self, stem: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(_Stem, stem).embed_tokens(inputs["input_ids"])

    def build_block(self, dtype: torch.dtype) -> nn.Module:
        return self._layer_cls(self.hf_config, layer_idx=0).to(dtype).eval()

    def rotary(self, device: torch.device) -> nn.Module:
        """The family's rotary embedding on `device`, built once per device. Its inverse
        frequencies stay float32 whatever the model dtype (as in the full model); cos/sin come
        back in the hidden states' dtype."""
        device = torch.device(device)
        if device not in self._rotary:
            self._rotary[device] = self._rotary_cls(config=self.hf_config).to(device).eval()
        return self._rotary[device]

    def attention_mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive (B, 1, S, S) mask for eager attention: causal, padded keys masked, and the
        sliding window where the family uses one. The masked value is kept within float32's range
        so that eager attention's float32 softmax never sees a row of -inf."""
        seq = mask.shape[-1]
        positions = torch.arange(seq, device=mask.device)
        distance = positions[:, None] - positions[None, :]  # query − key
        allowed = distance >= 0
        if self.window is not None and seq > self.window:
            if self._mixed_window:
                raise FeatCalError(
                    f"{self.name}: this config mixes sliding-window and full-attention layers and "
                    f"the calibration texts are longer than the window ({seq} > {self.window} "
                    "tokens); pass a smaller --max-length"
                )
            allowed = allowed & (distance < self.window)
        allowed = allowed[None, None] & mask.bool()[:, None, None, :]
        masked = max(torch.finfo(dtype).min, torch.finfo(torch.float32).min)
        additive = torch.zeros(allowed.shape, dtype=dtype, device=mask.device)
        return additive.masked_fill(~allowed, masked)

    def run_block(self, block: nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        seq = hidden.shape[1]
        position_ids = torch.arange(seq, device=hidden.device)[None].expand(hidden.shape[0], -1)
        cos_sin = self.rotary(hidden.device)(hidden, position_ids)
        out = block(
            hidden,
            attention_mask=self.attention_mask(mask, hidden.dtype),
            position_ids=position_ids,
            position_embeddings=cos_sin,
        )
        return out[0] if isinstance(out, tuple) else out

    def prepare_inputs(
        self, base_dir: str, rows: list[Any], max_length: int, targets: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        tokenizer = load_tokenizer(base_dir, right_padded=True)
        limit = min(max_length, int(self.hf_config.max_position_embeddings))
        if targets is None:
            if self.token_weighting == "answer":
                raise FeatCalError(
                    "--token-weighting answer needs a `target` column (the answers) in every "
                    "calibration set; add one or use --token-weighting all"
                )
            encoded = encode_texts(tokenizer, rows, limit)
            return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        inputs = prompt_and_answer(tokenizer, rows, targets, limit)
        if self.token_weighting != "answer":
            del inputs[WEIGHT_MASK]
        return inputs


def prompt_and_answer(
    tokenizer, rows: list[Any], targets: list[str], limit: int
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and WEIGHT_MASK (B, S) for rows followed by their targets, right
    padded. A row keeps its special tokens, a target gets none; when a pair is longer than `limit`
    tokens the prompt loses its last tokens (the target keeps at most limit - 1). WEIGHT_MASK is 1
    at the positions whose next token belongs to the target."""
    if len(targets) != len(rows):
        raise FeatCalError(f"{len(rows)} calibration rows but {len(targets)} targets")
    pairs = []
    for row, target in zip(rows, targets, strict=True):
        prompt = tokenizer(str(row))["input_ids"]
        answer = tokenizer(str(target), add_special_tokens=False)["input_ids"][: max(limit - 1, 1)]
        pairs.append((prompt[: max(limit - len(answer), 1)], answer))
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), int(tokenizer.pad_token_id), dtype=torch.long)
    mask = torch.zeros(len(pairs), width, dtype=torch.long)
    weights = torch.zeros(len(pairs), width, dtype=torch.long)
    for i, (prompt, answer) in enumerate(pairs):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer, dtype=torch.long)
        mask[i, : len(prompt) + len(answer)] = 1
        weights[i, max(len(prompt) - 1, 0) : len(prompt) + len(answer) - 1] = 1
    if not bool(weights.any()):
        raise FeatCalError(
            "the calibration targets have no tokens; fill the `target` column with the answers"
        )
    return {"input_ids": ids, "attention_mask": mask, WEIGHT_MASK: weights}


def _sliding_window(config, model_type: str) -> tuple[int | None, bool]:
    """(window, mixed): the attention window eager attention must apply through the mask (None:
    full causal attention) and whether only some layers use it."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None, False
    if model_type == "mistral":
        return int(window), False
    types = getattr(config, "layer_types", None) or []
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None, False
    return int(window), not all(sliding)
