"""One structural comparison of a checkpoint with its base: `check_same_structure`.

It reads config.json and the safetensors headers `Checkpoint` has already read (no weights), and
refuses, in one line naming the file, a checkpoint that is not of the base's architecture:

- config.json: its family (featcal_core.architectures), `model_type` or a shape field
  (`SHAPE_FIELDS`, also inside the nested `vision_config` and `text_config`) differs from the
  base's. A model that holds the base's tower among others (a CLIPModel base, CLIPVisionModel
  experts) is compared on that tower's config (`Architecture.tower_config`).
- tensor names: each checkpoint's tower (stem and blocks, named as its architecture names them)
  lies under one of the architecture's key prefixes and has exactly the blocks its config
  declares, and the other checkpoint's tower holds no tensor the base's lacks (an extra block,
  an extra tensor inside a block).

Tensors outside the tower that the base lacks (a task's classification head) are allowed and
named in one logged line: they are neither merged nor calibrated. Missing tensors, shapes and
dtypes are compared where the tensors are paired (the merge, the calibration's model set), since
what may be taken from the base differs there.
"""

from __future__ import annotations

import logging
from typing import Any

from featcal_core.architectures import REGISTRY, Architecture, detect, supported
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint

log = logging.getLogger(__name__)

#: config.json fields that fix a model's depth and widths (HF, T5 and open_clip names)
SHAPE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_layers",
    "num_decoder_layers",
    "d_model",
    "d_ff",
    "d_kv",
    "num_heads",
    "width",
    "layers",
    "heads",
    "head_width",
    "mlp_ratio",
)
#: nested configs compared field by field (CLIPModel's towers)
NESTED = ("vision_config", "text_config")
#: tensor names shown in one message
_SHOWN = 3


def check_same_structure(base: Checkpoint, other: Checkpoint, role: str | None = None) -> None:
    """Refuse `other` (an expert or merged model; `role` names it, default `other.role`) when its
    config or tensor names are not of `base`'s architecture; log the tensors outside the tower
    that the base lacks."""
    role = role or other.role
    base_source = base.directory / "config.json"
    source = other.directory / "config.json"
    arch, other_arch = _family(base), _family(other)
    base_type, other_type = base.config.get("model_type"), other.config.get("model_type")
    same_family = (arch is None and other_arch is None) or (
        arch is not None and other_arch is not None and arch.name == other_arch.name
    )
    if not same_family or (arch is None and base_type != other_type):
        raise FeatCalError(
            f"{source}: model_type {other_type!r} ({_name(other_arch)}), the base's "
            f"({base_source}) is {base_type!r} ({_name(arch)}); {role} must be a fine-tune of "
            "the base with its architecture: fix its config.json or pass the right folder"
        )
    configs = (base.config, other.config)
    if base_type != other_type and arch is not None and other_arch is not None:
        configs = (arch.tower_config(), other_arch.tower_config())  # e.g. CLIPModel, CLIPVision
    mine, theirs = structure(configs[0]), structure(configs[1])
    for key, value in mine.items():
        if key in theirs and theirs[key] != value:
            raise FeatCalError(
                f"{source}: {key} is {theirs[key]!r}, the base's ({base_source}) is {value!r}; "
                f"{role} must be a fine-tune of the base with its architecture (model type, "
                "depth and widths): pass an expert of this base, or its own base"
            )
    if arch is None or other_arch is None:
        return  # no family known: the merge pairs the tensors by their exact names
    base_prefix = _prefix(arch, base, base_source)
    base_tower = _tower(arch, base, base_prefix, base_source)
    other_prefix = _prefix(other_arch, other, source)
    other_tower = {
        canonical: key
        for key in other.tensors
        if key.startswith(other_prefix) and other_arch.owns(canonical := key[len(other_prefix) :])
    }
    extra = sorted(set(other_tower) - set(base_tower))
    if extra:
        raise FeatCalError(
            f"{role} {other.directory} has tensors the base {base.directory} lacks in its "
            f"{arch.name} tower ({arch.num_blocks} blocks): "
            f"{_names([other_tower[c] for c in extra])}; an extra block or layer changes the "
            "architecture: pass an expert fine-tuned from this base"
        )
    _tower(other_arch, other, other_prefix, source)
    heads = [
        key
        for key in other.tensors
        if key not in base.tensors
        and not (key.startswith(other_prefix) and other_arch.owns(key[len(other_prefix) :]))
        and not (key.startswith(other_prefix) and base_prefix + key[len(other_prefix) :] in base)
    ]
    if heads:
        log.info(
            "%s %s has %d tensor(s) the base lacks, outside the %s tower (a task head; neither "
            "merged nor calibrated): %s",
            role,
            other.directory,
            len(heads),
            arch.name,
            _names(heads),
        )


def structure(config: dict[str, Any]) -> dict[str, Any]:
    """The structural fields of a config: `model_type`, `SHAPE_FIELDS`, and the same of each
    nested config (keys `vision_config.hidden_size`, ...)."""
    found = {key: config[key] for key in ("model_type", *SHAPE_FIELDS) if key in config}
    for nested in NESTED:
        inner = config.get(nested)
        if isinstance(inner, dict):
            found.update({f"{nested}.{key}": value for key, value in structure(inner).items()})
    return found


def _family(checkpoint: Checkpoint) -> Architecture | None:
    """The adapter of the checkpoint's config, or None when no family matches it."""
    supported()  # imports every adapter
    if not any(cls.matches(checkpoint.config) for cls in REGISTRY.values()):
        return None
    return detect(checkpoint.config, str(checkpoint.directory / "config.json"))


def _name(arch: Architecture | None) -> str:
    return arch.name if arch is not None else "no supported family"


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(key) for key in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _prefix(arch: Architecture, checkpoint: Checkpoint, source) -> str:
    """The key prefix of the tower: where the architecture's probe tensor is."""
    for prefix in arch.prefix_candidates:
        if prefix + arch.probe_key in checkpoint.tensors:
            return prefix
    raise FeatCalError(
        f"{source} declares a {arch.name} model but {checkpoint.role} {checkpoint.directory} "
        f"holds no {arch.name} weights (no tensor {arch.probe_key!r} under the prefixes "
        f"{list(arch.prefix_candidates)}); its weights are of another architecture: fix its "
        "config.json or pass the right folder"
    )


def _tower(arch: Architecture, checkpoint: Checkpoint, prefix: str, source) -> dict[str, str]:
    """{canonical name: key} of the tower's tensors, which must be the stem's and those of
    exactly the blocks the config declares."""
    blocks = [arch.block_prefix(index) for index in range(arch.num_blocks)]
    tower: dict[str, str] = {}
    outside: list[str] = []
    found: set[int] = set()
    for key in checkpoint.tensors:
        canonical = key[len(prefix) :]
        if not key.startswith(prefix) or not arch.owns(canonical):
            continue
        tower[canonical] = key
        if canonical.startswith(arch.stem_roots):
            continue
        index = next((i for i, block in enumerate(blocks) if canonical.startswith(block)), None)
        if index is None:
            outside.append(key)
        else:
            found.add(index)
    if outside:
        raise FeatCalError(
            f"{checkpoint.role} {checkpoint.directory} has tensors of blocks its {source} does "
            f"not declare ({arch.num_blocks} blocks): {_names(outside)}; the weights and the "
            "config are of different models: re-save the checkpoint"
        )
    missing = [index for index in range(arch.num_blocks) if index not in found]
    if missing:
        raise FeatCalError(
            f"{source} declares {arch.num_blocks} blocks but {checkpoint.role} "
            f"{checkpoint.directory} holds no tensor of block {missing[0]} "
            f"({prefix + blocks[missing[0]]!r}; {len(missing)} such); the weights and the config "
            "are of different models: re-save the checkpoint"
        )
    return tower


def check_fine_tune(base: Checkpoint, other: Checkpoint, role: str | None = None) -> None:
    """Refuse `other` unless it is a fine-tune of `base`: its structure
    (`check_same_structure`) and its token ids (featcal_core.io.vocabulary), as every command
    and `featcal check` compare them."""
    from featcal_core.io.vocabulary import check_same_vocabulary

    check_same_structure(base, other)
    check_same_vocabulary(base, other, role)
