"""open_clip vision towers: `open_clip.transformer.VisionTransformer` (the `visual` tower of an
open_clip `CLIP`, as used by the original Task Arithmetic experts), imported with
`featcal import-open-clip` (featcal_core/open_clip/importer.py).

config.json: `"model_type": "open_clip_vision"` plus open_clip's `vision_cfg` fields (image_size,
patch_size, width, layers, head_width, mlp_ratio, ls_init_value, ...), `heads`, `quick_gelu` and
the preprocessing `image_mean` / `image_std` (OpenAI CLIP's when absent).

Stem: conv1 (patches, no bias), class_embedding, positional_embedding, ln_pre (state_dict names as
in open_clip). Blocks: `transformer.resblocks.{i}.`, open_clip's `ResidualAttentionBlock`: pre-norm
ln_1 → multi-head self-attention → (ls_1) residual, ln_2 → mlp.c_fc → GELU or QuickGELU →
mlp.c_proj → (ls_2) residual. `nn.MultiheadAttention` keeps q, k and v in one packed
`attn.in_proj_weight` (3d × d) and does not call its out_proj as a module, so the block module
here runs attention explicitly with two real Linears, `attn.in_proj` (d → 3d, q/k/v stacked) and
`attn.out_proj`; `checkpoint_name` maps `attn.in_proj.{weight,bias}` to the checkpoint's
`attn.in_proj_{weight,bias}`. The packed projection is calibrated as one Linear on ln_1's output.

Token weights: with CLS pooling (open_clip `pool_type: "tok"`, the default) the last block weights
the CLS token (position 0) 1 and the patch tokens 0.01, as for HF CLIP, except in `attn.in_proj`:
docs/featcal.md exempts the key and value projections (CLS attends to every token's key and
value), and here k and v are rows of the one packed Linear, whose single input statistic cannot
weigh tokens differently per output row, so the whole `attn.in_proj` (its q rows too) keeps weight 1
for every token. Average pooling (`pool_type: "avg"`) or an attentional pooler: every token 1.

Unsupported open_clip settings (timm or ResNet towers, the custom block with qk_norm / scaled
cosine attention / head or inner scales, act_kwargs, norm_kwargs other than eps) are refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F

from featcal_core.architectures import register
from featcal_core.architectures.base import Architecture
from featcal_core.errors import FeatCalError

MODEL_TYPE = "open_clip_vision"
#: OpenAI CLIP's preprocessing statistics (open_clip's defaults)
OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)

#: checkpoint-local name of the block module's tensors that open_clip names differently
_CHECKPOINT_NAMES = {
    "attn.in_proj.weight": "attn.in_proj_weight",
    "attn.in_proj.bias": "attn.in_proj_bias",
}
#: vision_cfg switches this adapter does not reproduce (they select other block or tower types)
_UNSUPPORTED_TRUE = (
    "timm_model_name",
    "qk_norm",
    "scaled_cosine_attn",
    "scale_heads",
    "scale_attn_inner",
    "scale_attn",
    "scale_fc",
)


def _pair(value: Any, what: str) -> tuple[int, int]:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise FeatCalError(f"open_clip vision config: {what} {value!r} is not one int or two")
        return int(value[0]), int(value[1])
    return int(value), int(value)


class OpenCLIPSettings:
    """The vision tower's geometry and options, read from config.json (or an open_clip vision_cfg
    merged with quick_gelu and the preprocessing); bad or unsupported values raise FeatCalError."""

    def __init__(self, config: dict[str, Any], source: str = "config.json"):
        def fail(message: str) -> FeatCalError:
            return FeatCalError(f"{source}: {message}")

        for key in _UNSUPPORTED_TRUE:
            if config.get(key):
                raise fail(
                    f"open_clip vision setting {key}={config[key]!r} is not supported (only the "
                    "standard ViT ResidualAttentionBlock is)"
                )
        if config.get("block_type") not in (None, "default"):
            raise fail(f"open_clip block_type {config['block_type']!r} is not supported")
        if isinstance(config.get("layers"), (list, tuple)):
            raise fail("open_clip ModifiedResNet towers (layers given as a list) are not supported")
        if config.get("act_kwargs"):
            raise fail(f"open_clip act_kwargs {config['act_kwargs']!r} are not supported")
        norm_kwargs = dict(config.get("norm_kwargs") or {})
        self.eps = float(norm_kwargs.pop("eps", 1e-5))
        if norm_kwargs:
            raise fail(f"open_clip norm_kwargs {sorted(norm_kwargs)} are not supported (eps is)")
        if config.get("pos_embed_type", "learnable") not in ("learnable", "sin_cos_2d"):
            raise fail(f"open_clip pos_embed_type {config['pos_embed_type']!r} is not supported")
        missing = [k for k in ("image_size", "patch_size", "width", "layers") if k not in config]
        if missing:
            raise fail(f"open_clip vision config lacks {missing}; re-run featcal import-open-clip")
        try:
            self.image_size = _pair(config["image_size"], "image_size")
            self.patch_size = _pair(config["patch_size"], "patch_size")
            self.width = int(config["width"])
            self.layers = int(config["layers"])
            head_width = int(config.get("head_width", 64))
            self.heads = int(config.get("heads") or self.width // max(head_width, 1))
            self.mlp_width = int(self.width * float(config.get("mlp_ratio", 4.0)))
            ls = config.get("ls_init_value")
            self.layer_scale = ls is not None
            self.ln_pre = not bool(config.get("no_ln_pre", False))
            self.quick_gelu = bool(config.get("quick_gelu", False))
            self.mean = tuple(float(v) for v in _channels(config.get("image_mean"), OPENAI_MEAN))
            self.std = tuple(float(v) for v in _channels(config.get("image_std"), OPENAI_STD))
        except (TypeError, ValueError) as exc:
            raise fail(f"malformed open_clip vision config ({exc})") from exc
        if self.width <= 0 or self.layers <= 0 or self.heads <= 0 or self.width % self.heads:
            raise fail(
                f"open_clip width {self.width} must be a positive multiple of heads {self.heads}"
            )
        sizes = zip(self.image_size, self.patch_size, strict=True)
        if min(self.patch_size) <= 0 or any(size < patch for size, patch in sizes):
            raise fail(
                f"image_size {list(self.image_size)} / patch_size {list(self.patch_size)} give "
                "no patches"
            )
        self.grid = (  # as open_clip's VisionTransformer (the conv drops a remainder)
            self.image_size[0] // self.patch_size[0],
            self.image_size[1] // self.patch_size[1],
        )
        self.tokens = 1 + self.grid[0] * self.grid[1]
        self.cls_pooled = config.get("pool_type", "tok") == "tok" and not config.get(
            "attentional_pool"
        )
        self.resize_mode = config.get("resize_mode") or "shortest"
        self.interpolation = config.get("interpolation") or "bicubic"
        self.fill_color = int(config.get("fill_color", 0))


def _channels(value: Any, default: tuple[float, ...]) -> tuple[float, ...]:
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    return tuple(value)


class _LayerNorm(nn.LayerNorm):
    """open_clip's LayerNorm: float16/bfloat16 inputs are normalized in float32 and cast back
    (`LayerNormFp32`); other dtypes as `nn.LayerNorm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            weight = None if self.weight is None else self.weight.float()
            bias = None if self.bias is None else self.bias.float()
            out = F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)
            return out.to(x.dtype)
        return super().forward(x)


class _QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class _LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class _Attention(nn.Module):
    """Multi-head self-attention with the packed q/k/v projection as one Linear."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(width, 3 * width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq, width))


class _Block(nn.Module):
    """open_clip's `ResidualAttentionBlock` (self-attention, batch first) with real Linears."""

    def __init__(self, s: OpenCLIPSettings):
        super().__init__()
        self.ln_1 = _LayerNorm(s.width, eps=s.eps)
        self.attn = _Attention(s.width, s.heads)
        self.ls_1 = _LayerScale(s.width) if s.layer_scale else nn.Identity()
        self.ln_2 = _LayerNorm(s.width, eps=s.eps)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(s.width, s.mlp_width))
        self.mlp.add_module("gelu", _QuickGELU() if s.quick_gelu else nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(s.mlp_width, s.width))
        self.ls_2 = _LayerScale(s.width) if s.layer_scale else nn.Identity()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        key_mask = None if bool((mask > 0).all()) else mask > 0
        x = x + self.ls_1(self.attn(self.ln_1(x), key_mask))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class _Stem(nn.Module):
    """Patch embedding, class token, learned positions and ln_pre, named as in open_clip."""

    def __init__(self, s: OpenCLIPSettings):
        super().__init__()
        self.conv1 = nn.Conv2d(3, s.width, s.patch_size, stride=s.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(s.width))
        self.positional_embedding = nn.Parameter(torch.zeros(s.tokens, s.width))
        self.ln_pre = _LayerNorm(s.width, eps=s.eps) if s.ln_pre else nn.Identity()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.conv1(pixels.to(self.conv1.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # (B, grid², width)
        cls = self.class_embedding.to(patches.dtype).expand(patches.shape[0], 1, -1)
        tokens = torch.cat([cls, patches], dim=1) + self.positional_embedding.to(patches.dtype)
        return self.ln_pre(tokens)


@register
class OpenCLIPVision(Architecture):
    name = "open-clip-vision"
    task_heads = "zero_shot"  # experts are bare vision towers (featcal_core.open_clip.zero_shot)
    modality = "image"
    probe_key = "conv1.weight"
    prefix_candidates = ("visual.", "")
    pooled_position: int | None = 0
    pooled_exempt = ("attn.in_proj",)

    def __init__(self, config: dict[str, Any], pooling: str | None = None):
        self.settings = OpenCLIPSettings(config)
        self.stem_roots = ("conv1.", "class_embedding", "positional_embedding")
        if self.settings.ln_pre:
            self.stem_roots += ("ln_pre.",)
        self.pooled_position = 0 if self.settings.cls_pooled else None
        super().__init__(config, pooling)

    @classmethod
    def matches(cls, config: dict[str, Any]) -> bool:
        return config.get("model_type") == MODEL_TYPE

    @property
    def num_blocks(self) -> int:
        return self.settings.layers

    def block_prefix(self, index: int) -> str:
        return f"transformer.resblocks.{index}."

    def checkpoint_name(self, local: str) -> str:
        return _CHECKPOINT_NAMES.get(local, local)

    def build_stem(self, dtype: torch.dtype) -> nn.Module:
        return _Stem(self.settings).to(dtype).eval()

    def run_stem(self, stem: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return stem(inputs["pixel_values"])

    def build_block(self, dtype: torch.dtype) -> nn.Module:
        return _Block(self.settings).to(dtype).eval()

    def run_block(self, block: nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return block(hidden, mask)

    def transform(self):
        """open_clip's own evaluation transform for this tower (resize, center crop, normalize)."""
        from open_clip.transform import image_transform

        s = self.settings
        size = s.image_size[0] if s.image_size[0] == s.image_size[1] else s.image_size
        try:
            return image_transform(
                size,
                is_train=False,
                mean=s.mean,
                std=s.std,
                resize_mode=s.resize_mode,
                interpolation=s.interpolation,
                fill_color=s.fill_color,
            )
        except AssertionError as exc:
            raise FeatCalError(
                f"open_clip preprocessing resize_mode {s.resize_mode!r} / interpolation "
                f"{s.interpolation!r} is not supported by open_clip ({exc})"
            ) from exc

    def prepare_inputs(
        self, base_dir: str, rows: list[Any], max_length: int, targets: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        transform = self.transform()
        pixels = torch.stack([transform(_as_rgb(row)) for row in rows])
        return {
            "pixel_values": pixels,
            "attention_mask": torch.ones(len(rows), self.settings.tokens),
        }


def _as_rgb(image: Any) -> Image.Image:
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.asarray(image))
    return image.convert("RGB")
