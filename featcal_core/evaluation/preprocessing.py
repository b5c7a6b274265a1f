"""Preprocessing for the classification heads: image processors and tokenizers loaded from a
model directory, and a batch of rows (PIL images or arrays, or strings) turned into model inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from featcal_core.architectures.base import encode_texts, load_tokenizer
from featcal_core.errors import FeatCalError


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
