"""Convert an open_clip checkpoint into a featcal checkpoint directory (`featcal import-open-clip`).

The output directory holds config.json (`"model_type": "open_clip_vision"`, open_clip's vision_cfg
fields, `heads`, `quick_gelu`, the preprocessing mean/std; see open_clip/architecture.py) and
model.safetensors with the vision tower's tensors under their original keys (`visual.`-prefixed
for a full CLIP state dict, bare for a VisionTransformer's own). It is written to a temporary
directory beside the target and renamed into place.

Sources: a `.safetensors` state dict; a `.bin` / `.pt` / `.pth` state dict, read with
`torch.load(weights_only=True)`; or a whole pickled module (how the original Task Arithmetic experts
were published), which only `trust_pickle=True` unpickles (unpickling can run arbitrary code). The
model config comes from `model_cfg` (a dict, or an `open_clip_config.json` path holding
`model_cfg.vision_cfg` as on the Hub) or from an `open_clip_config.json` beside the source.
"""

from __future__ import annotations

import json
import logging
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import SINGLE_NAME, sha256_file
from featcal_core.io.outputs import check_output, guarded_directory
from featcal_core.io.safetensors_io import (
    NAMES,
    Reader,
    SafetensorsFormatError,
    read_header,
    save_tensors,
)
from featcal_core.open_clip.architecture import (
    MODEL_TYPE,
    OPENAI_MEAN,
    OPENAI_STD,
    OpenCLIPSettings,
    OpenCLIPVision,
)

log = logging.getLogger(__name__)

CONFIG_NAME = "open_clip_config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
#: keys of the open_clip model config copied into config.json besides vision_cfg
_MODEL_KEYS = ("embed_dim", "quick_gelu")
#: preprocess_cfg key → config.json key
_PREPROCESS_KEYS = {
    "mean": "image_mean",
    "std": "image_std",
    "resize_mode": "resize_mode",
    "interpolation": "interpolation",
    "fill_color": "fill_color",
}


def import_open_clip(
    source: str | Path,
    out_dir: str | Path,
    model_cfg: dict[str, Any] | str | Path | None = None,
    trust_pickle: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the featcal checkpoint directory `out_dir` for the open_clip checkpoint `source`;
    returns its config. Raises FeatCalError (naming the file) on bad input, leaving `out_dir` as
    it was."""
    source, out = Path(source), Path(out_dir)
    inputs = (source, model_cfg if isinstance(model_cfg, str | Path) else None)
    check_output(out, overwrite=overwrite, inputs=inputs)
    if not source.is_file():
        raise FeatCalError(
            f"{source} is not a file; pass an open_clip checkpoint (.safetensors, "
            f"{', '.join(PICKLE_SUFFIXES)})"
        )
    config = featcal_config(*_model_config(source, model_cfg))
    arch = OpenCLIPVision(config)
    state = _load(source, trust_pickle)
    tensors = _vision_tensors(state, source)
    _check_against_config(tensors, arch, source)
    config["open_clip_source"] = {"file": source.name, "sha256": sha256_file(source)}
    with guarded_directory(out, overwrite=overwrite, inputs=inputs) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_tensors(tmp / SINGLE_NAME, tensors, {"format": "pt"})
    log.info("imported %d tensors of %s into %s", len(tensors), source, out)
    return config


def featcal_config(
    model_cfg: Mapping[str, Any], preprocess: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """config.json for an open_clip model config (`embed_dim`, `quick_gelu`, `vision_cfg`) and
    preprocess config (`mean`, `std`, ...); `where` names their source in errors."""
    vision = model_cfg.get("vision_cfg")
    if not isinstance(vision, Mapping):
        raise FeatCalError(
            f"{where}: no vision_cfg in the open_clip model config (expected model_cfg.vision_cfg "
            "as in the Hub's open_clip_config.json)"
        )
    config: dict[str, Any] = {"model_type": MODEL_TYPE, **vision}
    for key in _MODEL_KEYS:
        if key in model_cfg:
            config[key] = model_cfg[key]
    if "quick_gelu" not in model_cfg:
        log.warning(
            "%s: the open_clip model config does not set quick_gelu; using nn.GELU (open_clip's "
            "default). OpenAI-pretrained towers (e.g. ViT-B-32 'openai') need quick_gelu: true",
            where,
        )
        config["quick_gelu"] = False
    for key, name in _PREPROCESS_KEYS.items():
        if preprocess.get(key) is not None:
            config[name] = preprocess[key]
    config.setdefault("image_mean", list(OPENAI_MEAN))
    config.setdefault("image_std", list(OPENAI_STD))
    config["heads"] = OpenCLIPSettings(config, where).heads  # also validates the config
    return config


def _model_config(source: Path, model_cfg) -> tuple[dict, dict, str]:
    """(model config, preprocess config, where they came from)."""
    where = "model_cfg"
    if model_cfg is None:
        path = source.parent / CONFIG_NAME
        if not path.is_file():
            raise FeatCalError(
                f"{source}: no model config; pass --config {CONFIG_NAME} (model_cfg.vision_cfg "
                f"as on the Hub) or put {CONFIG_NAME} next to the checkpoint"
            )
        model_cfg = path
    if isinstance(model_cfg, (str, Path)):
        where = str(model_cfg)
        try:
            model_cfg = json.loads(Path(model_cfg).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FeatCalError(f"{where} is not a readable JSON file ({exc})") from exc
    if not isinstance(model_cfg, Mapping):
        raise FeatCalError(f"{where}: the open_clip config must be a JSON object")
    preprocess = model_cfg.get("preprocess_cfg") or {}
    if isinstance(model_cfg.get("model_cfg"), Mapping):
        model_cfg = model_cfg["model_cfg"]
    if not isinstance(preprocess, Mapping):
        raise FeatCalError(f"{where}: preprocess_cfg must be a JSON object")
    return dict(model_cfg), dict(preprocess), where


def _load(source: Path, trust_pickle: bool) -> dict[str, torch.Tensor]:
    """The state dict in `source` (name → tensor)."""
    suffix = source.suffix.lower()
    if suffix == ".safetensors":
        try:
            entries, _ = read_header(source)
            with Reader(source, entries) as reader:
                return {name: reader[name] for name in entries}
        except (OSError, SafetensorsFormatError, KeyError) as exc:
            raise FeatCalError(f"{source} is not a readable safetensors file ({exc})") from exc
    if suffix not in PICKLE_SUFFIXES:
        raise FeatCalError(
            f"{source}: unknown checkpoint format {suffix!r}; pass a .safetensors or "
            f"{'/'.join(PICKLE_SUFFIXES)} file"
        )
    try:
        loaded = torch.load(source, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        loaded = _load_pickle(source, trust_pickle, str(exc))
    except Exception as exc:  # truncated zip, empty file, ...
        raise FeatCalError(
            f"{source} is not a readable PyTorch checkpoint ({type(exc).__name__}: "
            f"{_first_line(exc)}); re-save it with torch.save(model.state_dict(), ...)"
        ) from exc
    return _state_dict(loaded, source)


def _load_pickle(source: Path, trust_pickle: bool, reason: str) -> Any:
    """Unpickle `source` in full, only when trusted; `reason` is the weights-only failure."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", reason)
    what = (
        f"a pickled Python object ({found.group(1)}), not a plain state dict"
        if found
        else "not a state dict torch.load can read with weights_only=True"
    )
    if not trust_pickle:
        raise FeatCalError(
            f"{source} is {what}; unpickling it can run arbitrary code, so it is refused. Pass "
            "--trust-pickle (trust_pickle=True) only for files you trust, or re-save it with "
            "torch.save(model.state_dict(), ...)"
        )
    log.warning(
        "%s: unpickling a whole Python object (--trust-pickle); this runs code from the file",
        source,
    )
    try:
        return torch.load(source, weights_only=False, map_location="cpu")
    except Exception as exc:
        raise FeatCalError(
            f"{source} could not be unpickled ({type(exc).__name__}: {_first_line(exc)}); the "
            "classes it refers to must be importable (e.g. install open_clip_torch)"
        ) from exc


def _state_dict(loaded: Any, source: Path) -> dict[str, torch.Tensor]:
    """A tensor state dict from what torch.load returned: a state dict, a training checkpoint
    ({"state_dict": ...}, DDP `module.` keys), or a module (unwrapping `.model` then `.visual`)."""
    if isinstance(loaded, nn.Module):
        for attribute in ("model", "visual"):
            inner = getattr(loaded, attribute, None)
            if isinstance(inner, nn.Module):
                loaded = inner
        loaded = loaded.state_dict()
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]
    if not isinstance(loaded, Mapping):
        raise FeatCalError(
            f"{source} holds a {type(loaded).__name__}, not a state dict or a module; pass an "
            "open_clip checkpoint"
        )
    state = {k: v for k, v in loaded.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def _vision_tensors(state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    """The vision tower's tensors, keys unchanged (`visual.`-prefixed or bare)."""
    for prefix in OpenCLIPVision.prefix_candidates:
        if prefix + OpenCLIPVision.probe_key in state:
            break
    else:
        sample = ", ".join(repr(k) for k in list(state)[:3]) or "no tensors"
        raise FeatCalError(
            f"{source} holds no open_clip vision tower tensor 'visual.conv1.weight' or "
            f"'conv1.weight' (found {sample}); it is not an open_clip checkpoint"
        )
    tensors = {k: v for k, v in state.items() if k.startswith(prefix)}
    for key, tensor in tensors.items():
        if tensor.dtype not in NAMES:
            raise FeatCalError(f"{source}: tensor {key!r} has unsupported dtype {tensor.dtype}")
    return tensors


def _check_against_config(tensors: dict[str, torch.Tensor], arch: OpenCLIPVision, source: Path):
    """Every stem and block tensor the adapter reads is present with the config's shape, and the
    checkpoint has no more blocks than the config."""
    prefix = arch.find_prefix(tensors, str(source))
    with torch.device("meta"):
        expected = {
            name: tuple(t.shape) for name, t in arch.build_stem(torch.float32).state_dict().items()
        }
        block = arch.build_block(torch.float32).state_dict()
    for index in range(arch.num_blocks):
        for name, tensor in block.items():
            key = arch.block_prefix(index) + arch.checkpoint_name(name)
            expected[key] = tuple(tensor.shape)
    for name, shape in expected.items():
        key = prefix + name
        if key not in tensors:
            s = arch.settings
            raise FeatCalError(
                f"{source} lacks tensor {key!r}, which the config implies ({s.layers} layers, "
                f"width {s.width}, layer scale {s.layer_scale}, ln_pre {s.ln_pre}); pass the "
                "checkpoint's own open_clip config"
            )
        if tuple(tensors[key].shape) != shape:
            raise FeatCalError(
                f"{source}: tensor {key!r} has shape {list(tensors[key].shape)} but the config "
                f"implies {list(shape)}; pass the checkpoint's own open_clip config"
            )
    extra = prefix + arch.block_prefix(arch.num_blocks)
    if any(k.startswith(extra) for k in tensors):
        raise FeatCalError(
            f"{source} has more than the config's {arch.num_blocks} blocks ({extra!r}...); pass "
            "the checkpoint's own open_clip config"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no details"
