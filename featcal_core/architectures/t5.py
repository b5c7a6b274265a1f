"""Hugging Face T5 / FLAN-T5: `T5ForConditionalGeneration` (encoder, then decoder) and
`T5EncoderModel` (encoder only).

Stem: the shared token embedding (`shared`), for the encoder's input ids and, with a decoder, for
the teacher-forced decoder input ids (the calibration set's `target` column shifted right behind
`decoder_start_token_id`, each position weighted by whether the label it predicts is a real token;
without that column the decoder sees that one start token). Blocks:
`encoder.block.{i}` then `decoder.block.{j}`, each a `T5Block`: q/k/v/o (no biases), the
`DenseReluDense` feed-forward (wi, wo; gated: wi_0, wi_1, wo) and scale-only RMS `layer_norm`s;
decoder blocks add the cross-attention `EncDecAttention` whose k/v read the decoder's context: the
student's is the merged model's `encoder.final_layer_norm` on the calibrated encoder output, an
expert's its own final norm on its own encoder output. Every block uses its stack's relative
position bias from block 0's `relative_attention_bias` table of the model being run (not
calibrated, nor are the embedding, the final norms and `lm_head`). Token weights: padding 0, every
other token 1; the cross-attention k/v are weighted by the encoder tokens' mask.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from featcal_core.architectures import register
from featcal_core.architectures.base import Architecture, encode_texts, load_tokenizer
from featcal_core.errors import FeatCalError

_BIAS = "layer.0.SelfAttention.relative_attention_bias.weight"


class _Stem(nn.Module):
    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.shared = nn.Embedding(vocab_size, d_model)


@register
class HFT5(Architecture):
    name = "hf-t5"
    modality = "text"
    probe_key = "shared.weight"
    prefix_candidates = ("", "t5.", "transformer.")
    stem_roots = ("shared.",)
    pooled_position = None
    pooled_exempt = ()
    norm_types = ()

    def __init__(self, config: dict[str, Any], pooling: str | None = None):
        super().__init__(config, pooling)
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5LayerNorm

        self.rms_norm_types = (T5LayerNorm,)
        base = T5Config.from_dict(dict(config))
        base._attn_implementation = "eager"
        self.encoder_config = copy.deepcopy(base)
        self.encoder_config.is_decoder = False
        self.encoder_config.use_cache = False
        archs = config.get("architectures") or ["T5ForConditionalGeneration"]
        self.encoder_only = all("EncoderModel" in a for a in archs)
        self.num_encoder = int(base.num_layers)
        self.num_decoder = (
            0 if self.encoder_only else int(base.num_decoder_layers or base.num_layers)
        )
        self.decoder_start = None if self.encoder_only else self.num_encoder
        self.bridge_names = () if self.encoder_only else ("encoder.final_layer_norm.weight",)
        self.decoder_config = copy.deepcopy(base)
        self.decoder_config.is_decoder = True
        self.decoder_config.use_cache = False
        self.decoder_config.num_layers = self.num_decoder
        self.start_token = int(
            base.decoder_start_token_id
            if base.decoder_start_token_id is not None
            else base.pad_token_id or 0
        )
        self.norm_eps = float(base.layer_norm_epsilon)

    @classmethod
    def matches(cls, config: dict[str, Any]) -> bool:
        return config.get("model_type") == "t5"

    def set_pooling(self, pooling: str) -> None:
        if pooling != "mean":
            raise FeatCalError(
                f"--pooling {pooling!r}: {self.name} has no pooled token; every real token weighs "
                "1 (use --pooling mean or leave it out)"
            )

    @property
    def num_blocks(self) -> int:
        return self.num_encoder + self.num_decoder

    def _stack(self, index: int) -> tuple[str, int]:
        if index < self.num_encoder:
            return "encoder", index
        return "decoder", index - self.num_encoder

    def block_prefix(self, index: int) -> str:
        stack, i = self._stack(index)
        return f"{stack}.block.{i}."

    def block_kind(self, index: int) -> str:
        return self._stack(index)[0]

    def checkpoint_key(self, index: int, local: str) -> str:
        if local == _BIAS:  # every block runs with its stack's block-0 position-bias table
            return f"{self._stack(index)[0]}.block.0.{_BIAS}"
        return super().checkpoint_key(index, local)

    def owns(self, canonical: str) -> bool:
        return canonical.startswith(("shared.", "encoder.block.", "decoder.block."))

    def reads_context(self, module: str) -> bool:
        return module in ("layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v")

    # ----- modules ----------------------------------------------------------------------------
    def build_stem(self, dtype: torch.dtype) -> nn.Module:
        cfg = self.encoder_config
        return _Stem(cfg.vocab_size, cfg.d_model).to(dtype).eval()

    def run_stem(self, stem: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(_Stem, stem).shared(inputs["input_ids"])

    def run_decoder_stem(self, stem: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return cast(_Stem, stem).shared(inputs["input_ids"])

    def build_block(self, dtype: torch.dtype, kind: str = "encoder") -> nn.Module:
        from transformers.models.t5.modeling_t5 import T5Block

        config = self.encoder_config if kind == "encoder" else self.decoder_config
        # with its own position-bias table (read from block 0: see `checkpoint_key`)
        return T5Block(config, has_relative_attention_bias=True, layer_idx=0).to(dtype).eval()

    def run_block(
        self, block: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, context=None
    ) -> torch.Tensor:
        dtype = hidden.dtype
        masked = max(torch.finfo(dtype).min, torch.finfo(torch.float32).min)
        keys = mask.bool()[:, None, None, :]  # (B, 1, 1, S)
        if block.is_decoder:
            seq = mask.shape[-1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).tril()
            keys = keys & causal[None, None]
        self_mask = torch.zeros(keys.shape, dtype=dtype, device=mask.device)
        self_mask = self_mask.masked_fill(~keys, masked)
        kwargs = {}
        if block.is_decoder:
            if context is None:
                raise FeatCalError(f"{self.name}: a decoder block needs the encoder's context")
            encoder_hidden, encoder_mask = context
            cross = torch.zeros(encoder_mask.shape, dtype=dtype, device=mask.device)
            cross = cross.masked_fill(~encoder_mask.bool(), masked)[:, None, None, :]
            kwargs = {"encoder_hidden_states": encoder_hidden, "encoder_attention_mask": cross}
        out = block(hidden, attention_mask=self_mask, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def run_bridge(self, tensors: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """The encoder's final T5LayerNorm (scale-only RMS norm, statistics in float32)."""
        weight = tensors["encoder.final_layer_norm.weight"]
        variance = hidden.to(torch.float32).pow(2).mean(-1, keepdim=True)
        normed = hidden * torch.rsqrt(variance + self.norm_eps)
        if weight.dtype in (torch.float16, torch.bfloat16):
            normed = normed.to(weight.dtype)
        return weight * normed

    # ----- data -------------------------------------------------------------------------------
    def prepare_inputs(
        self, base_dir: str, rows: list[Any], max_length: int, targets: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        tokenizer = load_tokenizer(base_dir, right_padded=True)
        encoded = encode_texts(tokenizer, rows, max_length)
        inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
        if self.encoder_only:
            return inputs
        count = len(rows)
        if targets is None:  # no target column: the decoder sees its start token only
            inputs["decoder_input_ids"] = torch.full((count, 1), self.start_token)
            inputs["decoder_attention_mask"] = torch.ones(count, 1, dtype=torch.long)
            return inputs
        labels = encode_texts(tokenizer, targets, max_length)
        ids, mask = labels["input_ids"], labels["attention_mask"]
        start = torch.full((count, 1), self.start_token, dtype=ids.dtype)
        inputs["decoder_input_ids"] = torch.cat([start, ids[:, :-1]], dim=1)
        # position j predicts label j: it counts when that label token is real (not padding)
        inputs["decoder_attention_mask"] = mask
        return inputs
