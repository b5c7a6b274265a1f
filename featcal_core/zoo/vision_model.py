"""The zoo's small CLIP vision tower: its config, its image processor and the preprocessed images.

`vision_config` and `image_processor` describe a fresh tower; `base_processor` is a saved base's
processor; `PixelStore` preprocesses a split's images once and hands out pixel_values per batch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.zoo.training_inputs import ENCODE_CHUNK, load_pretrained

logger = logging.getLogger(__name__)


def vision_config(
    image_size: int = 32,
    patch_size: int = 4,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 512,
):
    """A small `CLIPVisionConfig`: (image_size / patch_size)^2 + 1 tokens of width hidden_size."""
    from transformers import CLIPVisionConfig

    if image_size % patch_size:
        raise FeatCalError(
            f"vision_config: image_size {image_size} is not a multiple of patch_size "
            f"{patch_size}; pick sizes that divide"
        )
    if hidden_size % heads:
        raise FeatCalError(
            f"vision_config: hidden_size {hidden_size} is not a multiple of heads {heads}; pick "
            "sizes that divide"
        )
    return CLIPVisionConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        num_channels=3,
    )


def image_processor(image_size: int = 32):
    """A `CLIPImageProcessor`: RGB, shortest edge resized to image_size (bicubic), centre crop
    image_size x image_size, pixels scaled to [0, 1] then normalised with mean = std = 0.5
    (pixel_values in [-1, 1])."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        do_resize=True,
        size={"shortest_edge": image_size},
        do_center_crop=True,
        crop_size={"height": image_size, "width": image_size},
        do_rescale=True,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_convert_rgb=True,
    )


def base_processor(base_dir: Path) -> Any:
    from transformers import AutoConfig, AutoImageProcessor

    if (base_dir / "preprocessor_config.json").is_file():
        return load_pretrained(AutoImageProcessor, base_dir, "vision base image processor")
    config = load_pretrained(AutoConfig, base_dir, "vision base")
    size = getattr(config, "image_size", None) or config.vision_config.image_size
    logger.warning("%s has no preprocessor_config.json; using image_processor(%d)", base_dir, size)
    return image_processor(size)


class PixelStore:
    """Images preprocessed once by an image processor and kept compactly.

    A processor that rescales and normalises (CLIPImageProcessor) is run without those two steps:
    its resized, centre-cropped images (B, 3, S, S) are kept as uint8 (float32 if not integral)
    and `pixels` applies rescale + normalise per batch, equal to the processor's own output up to
    float rounding. Any other processor's pixel_values are kept as float32 and used as they are.
    """

    def __init__(self, processor: Any):
        self.processor = processor
        self.deferred = all(
            getattr(processor, name, None) not in (None, False)
            for name in ("do_rescale", "do_normalize", "rescale_factor", "image_mean", "image_std")
        )
        if self.deferred:
            self.scale = float(processor.rescale_factor)
            self.mean = torch.tensor(processor.image_mean, dtype=torch.float32).view(1, -1, 1, 1)
            self.std = torch.tensor(processor.image_std, dtype=torch.float32).view(1, -1, 1, 1)

    def encode(self, split: Any, what: str, name: str) -> torch.Tensor:
        """The stored form (B, 3, S, S) of the `image` column of split."""
        chunks = []
        for start in range(0, len(split), ENCODE_CHUNK):
            images = split[start : start + ENCODE_CHUNK]["image"]
            if any(image is None for image in images):
                raise FeatCalError(
                    f"{what}: split {name!r} has empty entries in column 'image'; drop them with "
                    "dataset.filter(lambda row: row['image'] is not None)"
                )
            try:
                if self.deferred:
                    raw = self.processor(
                        images=images, do_rescale=False, do_normalize=False, return_tensors="pt"
                    )["pixel_values"]
                    integral = raw.dtype == torch.uint8 or bool(
                        (raw == raw.round()).all() and raw.min() >= 0 and raw.max() <= 255
                    )
                    chunks.append(raw.to(torch.uint8) if integral else raw.float())
                else:
                    raw = self.processor(images=images, return_tensors="pt")["pixel_values"]
                    chunks.append(raw.float())
            except (TypeError, ValueError, OSError) as exc:
                raise FeatCalError(
                    f"{what}: split {name!r} column 'image' could not be preprocessed ({exc}); "
                    "store PIL images (datasets.Image feature)"
                ) from exc
        dtype = torch.uint8 if all(c.dtype == torch.uint8 for c in chunks) else torch.float32
        return torch.cat([chunk.to(dtype) for chunk in chunks])

    def pixels(self, stored: torch.Tensor) -> torch.Tensor:
        """pixel_values (B, 3, S, S) float32 of stored images."""
        if not self.deferred:
            return stored.float()
        return (stored.float() * self.scale - self.mean) / self.std
