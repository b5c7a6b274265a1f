"""LoRA adapters (peft `save_pretrained` folders) as experts: `is_adapter`, `AdapterCheckpoint`,
`open_expert`.

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors`: for each adapted
module M a pair lora_A (r, d_in) and lora_B (d_out, r), and possibly full tensors that replace the
base's (`modules_to_save`, biases trained with `bias: all | lora_only`, a saved embedding).
`AdapterCheckpoint` presents such a folder as the expert it stands for, over the run's base
`Checkpoint`: the base's config, tensor names, shapes and dtypes, and on `read` each tensor
materialised as peft's `merge_and_unload` computes it,

    W' = W + s · (B · A)      (d_out, d_in); transposed for Conv1D layers and embeddings
    s  = α / r, or α / √r with `use_rslora`  (r, α per module: `rank_pattern`, `alpha_pattern`)

in float32 (or the base tensor's dtype when wider), then cast to the base tensor's dtype, one
tensor (or row chunk) at a time: peak memory is that of a dense expert. featcal's own code does
this; peft is not imported. (For a float16/bfloat16 base peft rounds an embedding's delta to that
dtype before adding it; featcal rounds once, so the two can differ there by one step of the dtype.)

`open_expert` opens an expert where merge, calibration and the pool check open one; an adapter
evaluated as a language model is loaded over its base (featcal_core.evaluation.language_model).
Where an expert is read as a full model of its own (an expert's classification head, the trained
repairs) an adapter is refused.

`fan_in_fan_out` is applied as peft applies it, by the module's type: ignored for a
torch.nn.Linear, always applied to a transformers Conv1D (weight (d_in, d_out): GPT-2's c_attn,
c_proj, c_fc), with one warning per adapter where the config says otherwise. The type comes from
the base's model_type (`_CONV1D`; featcal's families are Linear throughout); for another base,
from the weight's shape, the config's flag deciding for a square weight.

The patterns of adapter_config.json (target_modules, exclude_modules, modules_to_save,
layers_pattern, rank_pattern and alpha_pattern keys) are matched in bounded time
(featcal_core.io.patterns): an invalid one, or one that backtracks catastrophically, is refused in
one line naming the file, the field and the pattern.

Refused in one line naming the file: a folder holding both an adapter and a full model
(`is_adapter`), an adapter that changes no tensor of the base (its tensors all name modules the
base lacks), one whose target_modules selects none of its LoRA modules (as peft refuses it),
other `peft_type`s (IA3, LoHa, LoKr, ...), DoRA (`use_dora`), `layer_replication`, LoRA variants
whose merge is not W + s·BA (`target_parameters`, trainable tokens, aLoRA, QA-LoRA, ...),
initialisations relative to a residual base (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ) and LoRA on
convolutions. The adapter's
`base_model_name_or_path` is compared with the run's base; a difference is logged as a warning
(not refused).
"""

from __future__ import annotations

import json
import logging
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch

from featcal_core.errors import FeatCalError
from featcal_core.finite import all_finite
from featcal_core.io.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint
from featcal_core.io.outputs import sha256_file
from featcal_core.io.patterns import Patterns
from featcal_core.io.safetensors_io import (
    DTYPES,
    Reader,
    SafetensorsFormatError,
    read_header,
)

if TYPE_CHECKING:
    from featcal_core.architectures.base import Architecture

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: pickled adapter weights (older peft): never read
ADAPTER_PICKLED = "adapter_model.bin"
#: the key prefix PeftModel.save_pretrained writes (adapters saved by transformers lack it)
PEFT_PREFIX = "base_model.model."
#: how to use an adapter featcal does not apply
_MERGE_FIX = (
    "merge it into its base with peft (merge_and_unload, then save_pretrained) and pass that folder"
)
#: adapter_config.json fields whose truthy value makes the merge other than W + s·BA
_REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "layer_replication": "layer_replication",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
}
#: fields featcal reads or that do not change the merged weights
_KNOWN_FIELDS = {
    "alpha_pattern",
    "auto_mapping",
    "base_model_name_or_path",
    "bias",
    "corda_config",
    "ensure_weight_tying",
    "eva_config",
    "exclude_modules",
    "fan_in_fan_out",
    "inference_mode",
    "init_lora_weights",
    "layers_pattern",
    "layers_to_transform",
    "loftq_config",
    "lora_alpha",
    "lora_bias",
    "lora_dropout",
    "lora_ga_config",
    "megatron_config",
    "megatron_core",
    "modules_to_save",
    "peft_type",
    "peft_version",
    "qalora_group_size",
    "r",
    "rank_pattern",
    "revision",
    "runtime_config",
    "target_modules",
    "task_type",
    "use_rslora",
}
#: `init_lora_weights` values whose adapter is relative to a modified (residual) base
_RESIDUAL_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
#: LoRA factor tensors: (module, part, adapter name or None, parameter or None)
_FACTOR = re.compile(
    r"(?P<module>.+)\.(?P<part>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)"
)
_EMBEDDING_FACTOR = re.compile(
    r"(?P<module>.+)\.(?P<part>lora_embedding_A|lora_embedding_B)(?:\.(?P<adapter>[^.]+))?"
)
#: transformers' Conv1D layers (weight (d_in, d_out)) by the base's model_type; the other layers of
#: these models, and all of featcal's families, are torch.nn.Linear
_CONV1D = {
    "gpt2": ("c_attn", "q_attn", "c_proj", "c_fc"),
    "openai-gpt": ("c_attn", "c_proj", "c_fc"),
    "decision_transformer": ("c_attn", "q_attn", "c_proj", "c_fc"),
    "imagegpt": ("c_attn", "q_attn", "c_proj", "c_fc"),
    "clvp": ("c_fc", "c_proj"),
    "clvp_decoder": ("c_fc", "c_proj"),
}
#: key segments of PEFT tensors featcal does not apply (DoRA magnitudes, AdaLoRA, tokens, ...)
_OTHER_PEFT = re.compile(r"(^|\.)(lora_\w+|token_adapter|trainable_tokens_\w+)(\.|$)")


def is_adapter(directory: str | Path) -> bool:
    """True for a peft adapter folder (adapter_config.json). A folder that also holds a full
    model's weights is refused: which of the two is meant cannot be told."""
    path = Path(directory)
    if not (path / ADAPTER_CONFIG).is_file():
        return False
    full = [name for name in (SINGLE_NAME, INDEX_NAME) if (path / name).is_file()]
    if full:
        adapter = [n for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if (path / n).is_file()]
        raise FeatCalError(
            f"{path} holds both a LoRA adapter ({', '.join(adapter)}) and a full model "
            f"({', '.join(full)}); keep the adapter and the model in separate folders and pass "
            "the one you mean"
        )
    return True


def open_expert(
    path: str | Path, role: str, base: Checkpoint | None, *, reader: str = "this step"
) -> Checkpoint:
    """The expert at `path`: a `Checkpoint`, or for a LoRA adapter folder its
    `AdapterCheckpoint` over `base`. `base` None: adapters are refused, naming `reader` (what
    needs the expert as a full model)."""
    if not is_adapter(path):
        return Checkpoint(path, role)
    if base is None:
        raise FeatCalError(
            f"{role} {path} is a LoRA adapter ({ADAPTER_CONFIG}); {reader} reads experts as full "
            f"models: {_MERGE_FIX}"
        )
    return AdapterCheckpoint(path, base, role)


def expert_weight_paths(directory: str | Path, role: str = "expert") -> list[Path]:
    """The files that fix an expert's weights: an adapter's safetensors and config, else the
    checkpoint's shards and index (`Checkpoint.weight_paths`)."""
    path = Path(directory)
    if is_adapter(path):
        return [path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG]
    return Checkpoint(path, role).weight_paths()


def load_adapter_weights(
    model: torch.nn.Module, directory: str | Path, base: str | Path, role: str = "expert"
) -> None:
    """Put the expert of adapter `directory` into `model` (the base at `base`, loaded with
    from_pretrained): each tensor the adapter changes, materialised and copied in place, one
    at a time."""
    view = AdapterCheckpoint(directory, Checkpoint(base, "base model"), role)
    state = model.state_dict()  # shares storage with the parameters
    for name in view.edits:
        if name not in state:
            raise FeatCalError(
                f"{role} {directory}: the model loaded from {base} has no tensor {name!r} for "
                f"the adapter to change; {_MERGE_FIX}"
            )
        with torch.no_grad():
            state[name].copy_(view.read([name])[name])


@dataclass
class _Edit:
    """How one base tensor becomes the expert's: W (the base's, or the adapter's `replace`),
    plus s·(B·A) (`factors`: A key, B key; transposed with `transpose`), plus s·bias
    (`bias`: the lora_B bias key, for a bias tensor)."""

    replace: str | None = None
    factors: tuple[str, str] | None = None
    transpose: bool = False
    bias: str | None = None
    scaling: float = 1.0
    sources: list[str] = field(default_factory=list)  # adapter keys, for messages


class AdapterCheckpoint(Checkpoint):
    """A LoRA adapter folder presented as the expert it makes of `base` (see the module doc).

    `config`, `tensors`, `files` are the base's; `read(names)` and `reader(file)` materialise
    the expert's tensors; `describe()` and `weight_paths()` name the adapter's files."""

    def __init__(self, directory: str | Path, base: Checkpoint, role: str = "expert"):
        # the base's structure (config, tensor names, shards), then the adapter's own fields
        self.__dict__.update(vars(base))
        self.tensors = dict(base.tensors)
        self.directory = Path(directory)
        self.role = role
        self.base = base
        if not self.directory.is_dir():
            raise FeatCalError(
                f"{role} directory {self.directory} does not exist; pass a save_pretrained "
                "directory or a peft adapter folder"
            )
        self.config_path = self.directory / ADAPTER_CONFIG
        self.weights_path = self.directory / ADAPTER_WEIGHTS
        self._patterns = Patterns(self.config_path, "correct it in that file")
        self.adapter_config = self._read_config()
        self._check_config()
        self._check_base()
        if not self.weights_path.is_file():
            pickled = (self.directory / ADAPTER_PICKLED).is_file()
            raise FeatCalError(
                f"{self.weights_path} is missing"
                + (f" (only the pickled {ADAPTER_PICKLED}, which is not read)" if pickled else "")
                + f"; save the {role} with peft's save_pretrained(..., safe_serialization=True)"
            )
        try:
            self.adapter_entries, _ = read_header(self.weights_path)
        except (OSError, SafetensorsFormatError) as exc:
            raise FeatCalError(
                f"{self.weights_path} is not a readable safetensors file ({exc}); re-download or "
                f"re-save the {role}"
            ) from exc
        family = _family(base)
        self._known_family = family is not None
        self._prefixes = _tower_prefix(base, family)
        self.edits: dict[str, _Edit] = self._plan()

    # ----- adapter_config.json --------------------------------------------------------------
    def _read_config(self) -> dict[str, Any]:
        try:
            config = json.loads(self.config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FeatCalError(
                f"{self.config_path} is not valid JSON ({exc}); re-save the {self.role}"
            ) from exc
        if not isinstance(config, dict):
            raise FeatCalError(f"{self.config_path} is not a JSON object; re-save the {self.role}")
        return config

    def _check_config(self) -> None:
        """Refuse what featcal does not apply exactly, in one line naming the type and file."""
        config, source = self.adapter_config, self.config_path
        peft_type = str(config.get("peft_type") or "")
        if peft_type.upper() != "LORA":
            raise FeatCalError(
                f"{source}: peft_type {peft_type or None!r} is not applied by featcal (LoRA "
                f"only); {_MERGE_FIX}"
            )
        for key, name in _REFUSED_FIELDS.items():
            if config.get(key):
                raise FeatCalError(
                    f"{source}: {name} is not applied by featcal (its merge is not W + s·B·A); "
                    f"{_MERGE_FIX}"
                )
        init = str(config.get("init_lora_weights", True)).lower()
        if init.startswith(_RESIDUAL_INITS):
            raise FeatCalError(
                f"{source}: init_lora_weights {init!r} makes the adapter relative to a modified "
                "base, not the base; convert it to a plain LoRA (peft save_pretrained with "
                f"path_initial_model_for_weight_conversion) or {_MERGE_FIX}"
            )
        bias = config.get("bias", "none")
        if bias not in ("none", "all", "lora_only"):
            raise FeatCalError(
                f"{source}: bias {bias!r} is not one of 'none', 'all', 'lora_only'; re-save the "
                f"{self.role} with peft"
            )
        for key in ("r", "lora_alpha"):
            value = config.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise FeatCalError(
                    f"{source}: {key} is {value!r}, not a positive number; re-save the {self.role}"
                )
        for key in ("rank_pattern", "alpha_pattern"):
            if not isinstance(config.get(key) or {}, dict):
                raise FeatCalError(
                    f"{source}: {key} is not a map of module patterns to numbers; re-save the "
                    f"{self.role}"
                )
        self._check_patterns()
        unknown = sorted(k for k, v in config.items() if v and k not in _KNOWN_FIELDS)
        unknown = [k for k in unknown if k not in _REFUSED_FIELDS]
        if unknown:
            log.warning(
                "%s: field(s) %s are not read by featcal; the adapter is applied as W + s·B·A",
                source,
                ", ".join(unknown),
            )

    def _check_patterns(self) -> None:
        """Compile every pattern of the config as peft compiles it (an invalid one is refused)."""
        config, compile_ = self.adapter_config, self._patterns.compile
        for key in ("target_modules", "exclude_modules", "layers_pattern", "modules_to_save"):
            value = config.get(key)
            if value is not None and not isinstance(value, str | list):
                raise FeatCalError(
                    f"{self.config_path}: {key} is {value!r}, not a pattern or a list of module "
                    f"names; re-save the {self.role} with peft"
                )
        for key in ("target_modules", "exclude_modules"):
            if isinstance(config.get(key), str):
                compile_(key, config[key])
        patterns = config.get("layers_pattern") or []
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            compile_("layers_pattern", str(pattern), _layers_regex(pattern))
        for module in config.get("modules_to_save") or []:
            compile_("modules_to_save entry", str(module), _saved_regex(module))
        for key in ("rank_pattern", "alpha_pattern"):
            for pattern in config.get(key) or {}:
                compile_(f"{key} key", pattern, _pattern_regex(pattern))

    def _check_base(self) -> None:
        """Warn when `base_model_name_or_path` does not name the run's base."""
        named = self.adapter_config.get("base_model_name_or_path")
        if not named or not isinstance(named, str):
            log.info(
                "%s names no base model; its LoRA weights are applied to %s",
                self.config_path,
                self.base.directory,
            )
            return
        if not same_base(named, self.base):
            log.warning(
                "%s: base_model_name_or_path is %r but the run's base is %s; the LoRA weights are "
                "applied to the run's base: check that the adapter was trained on it",
                self.config_path,
                named,
                self.base.directory,
            )

    # ----- the plan: which base tensors change, and how ---------------------------------------
    def _plan(self) -> dict[str, _Edit]:
        """{base tensor name: _Edit} from the adapter's tensor names (see the module doc)."""
        factors: dict[str, dict[str, str]] = {}  # module → {"A"/"B"/"Bbias": key}
        embeddings: dict[str, dict[str, str]] = {}
        replaced: dict[str, tuple[int, str]] = {}  # target → (priority, key)
        adapters: set[str] = set()
        outside: list[str] = []
        for key, entry in self.adapter_entries.items():
            name = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
            if not DTYPES[entry.dtype].is_floating_point:
                raise FeatCalError(
                    f"{self.weights_path}: tensor {key!r} has dtype {entry.dtype}, not a float; "
                    f"re-save the {self.role} with peft"
                )
            found = _FACTOR.fullmatch(name)
            if found:
                if found["adapter"]:
                    adapters.add(found["adapter"])
                part = found["part"][-1] + ("bias" if found["param"] == "bias" else "")
                if part == "Abias":
                    raise self._unsupported(key, "a lora_A bias")
                factors.setdefault(found["module"], {})[part] = key
                continue
            found = _EMBEDDING_FACTOR.fullmatch(name)
            if found:
                if found["adapter"]:
                    adapters.add(found["adapter"])
                embeddings.setdefault(found["module"], {})[found["part"][-1]] = key
                continue
            if ".original_module." in f".{name}.":
                continue  # the base's own copy of a modules_to_save module
            if ".modules_to_save." in name:
                module, rest = name.split(".modules_to_save.", 1)
                target = self._replacement(module, rest)
                priority = 2
            elif ".base_layer." in name:
                target = self._to_base(name.replace(".base_layer.", ".", 1))
                priority = 1
            elif _OTHER_PEFT.search(name):
                raise self._unsupported(key, "a PEFT tensor other than LoRA's A and B")
            else:
                target = self._to_base(name)
                priority = 0
            if target is None:
                outside.append(key)
            elif target not in replaced or replaced[target][0] < priority:
                replaced[target] = (priority, key)
        if len(adapters) > 1:
            raise FeatCalError(
                f"{self.weights_path} holds the LoRA weights of several adapters "
                f"({', '.join(sorted(adapters))}); save one adapter per folder"
            )
        edits: dict[str, _Edit] = {}
        for target, (_, key) in replaced.items():
            self._check_shape(key, target, self.adapter_entries[key].shape)
            edits[target] = _Edit(replace=key, sources=[key])
        untargeted: list[str] = []
        flipped: dict[bool, list[str]] = {True: [], False: []}  # fan_in_fan_out applied: modules
        for module, parts in factors.items():
            self._add_factors(
                edits,
                module,
                parts,
                embedding=False,
                outside=outside,
                untargeted=untargeted,
                flipped=flipped,
            )
        for module, parts in embeddings.items():
            self._add_factors(
                edits,
                module,
                parts,
                embedding=True,
                outside=outside,
                untargeted=untargeted,
                flipped=flipped,
            )
        if untargeted and len(untargeted) == len(factors) + len(embeddings):
            raise FeatCalError(
                f"{self.config_path}: target_modules {self.adapter_config.get('target_modules')!r} "
                f"selects none of the {len(untargeted)} LoRA module(s) of {self.weights_path} "
                f"(e.g. {untargeted[0]!r}); peft refuses such an adapter too: correct "
                "target_modules (and exclude_modules, modules_to_save)"
            )
        if not edits:
            self._refuse_empty(outside)
        self._warn_fan_in_fan_out(flipped)
        if outside:
            log.info(
                "%s %s: %d adapter tensor(s) for modules the base %s lacks (a task head; neither "
                "merged nor calibrated): %s",
                self.role,
                self.directory,
                len(outside),
                self.base.directory,
                ", ".join(repr(k) for k in outside[:3]) + (" ..." if len(outside) > 3 else ""),
            )
        return edits

    def _refuse_empty(self, outside: list[str]) -> None:
        """Refuse an adapter that changes no tensor of the base (its task vector would be 0)."""
        if outside:
            named = self.adapter_config.get("base_model_name_or_path")
            trained = f" (it names {named!r})" if isinstance(named, str) and named else ""
            raise FeatCalError(
                f"{self.role} {self.directory}: its {len(outside)} adapter tensor(s) name modules "
                f"the base {self.base.directory} lacks (e.g. {outside[0]!r}), so it changes no "
                f"tensor of the base; the adapter is for another model: pass the base it was "
                f"trained on{trained}"
            )
        raise FeatCalError(
            f"{self.weights_path} holds no tensor that changes the base {self.base.directory}; "
            f"re-save the {self.role} with peft"
        )

    def _warn_fan_in_fan_out(self, flipped: dict[bool, list[str]]) -> None:
        """One warning per adapter where fan_in_fan_out is overridden by the module type."""
        for applied, modules in flipped.items():
            if modules:
                log.warning(
                    "%s: fan_in_fan_out is %s but %d adapted module(s) (e.g. %r) are %s layers; "
                    "it is %s for them, as peft does",
                    self.config_path,
                    "false" if applied else "true",
                    len(modules),
                    modules[0],
                    "transformers Conv1D" if applied else "torch.nn.Linear",
                    "applied" if applied else "ignored",
                )

    def _add_factors(
        self,
        edits: dict[str, _Edit],
        module: str,
        parts: dict[str, str],
        *,
        embedding: bool,
        outside: list[str],
        untargeted: list[str],
        flipped: dict[bool, list[str]],
    ) -> None:
        """Add module `module`'s s·(B·A) (and lora_B bias) to `edits`; record it in `outside`
        (not in the base), `untargeted` (ignored) or `flipped` (fan_in_fan_out overridden)."""
        if "A" not in parts or "B" not in parts:
            have = next(iter(parts.values()))
            raise FeatCalError(
                f"{self.weights_path}: tensor {have!r} has no matching lora_"
                f"{'embedding_' if embedding else ''}{'B' if 'A' in parts else 'A'}; re-save the "
                f"{self.role} with peft"
            )
        if not self._targets(module):
            untargeted.append(module)
            log.warning(
                "%s: module %r is not among the target_modules of %s; its LoRA weights are "
                "ignored, as peft ignores them",
                self.weights_path,
                module,
                self.config_path,
            )
            return
        a_key, b_key = parts["A"], parts["B"]
        a_shape = self.adapter_entries[a_key].shape
        b_shape = self.adapter_entries[b_key].shape
        if len(a_shape) != 2 or len(b_shape) != 2:
            raise self._unsupported(a_key, f"LoRA of a {len(a_shape)}-d weight (a convolution)")
        target = self._to_base(f"{module}.weight")
        if target is None:
            outside.extend(parts.values())
            return
        rank = self._rank(module)
        if a_shape[0] != rank or b_shape[1] != rank:
            raise FeatCalError(
                f"{self.config_path} gives module {module!r} rank {rank} (r, rank_pattern) but "
                f"{self.weights_path} holds lora_A {list(a_shape)} and lora_B {list(b_shape)}; "
                f"re-save the {self.role} with peft"
            )
        rows, cols = (b_shape[0], a_shape[1])
        if embedding:  # lora_embedding_A (r, vocab), lora_embedding_B (d, r): (B·A)ᵀ
            transpose = True
        else:
            transpose = self._conv1d(module, target, (rows, cols))
            if transpose != bool(self.adapter_config.get("fan_in_fan_out")):
                flipped[transpose].append(module)
        self._check_shape(a_key, target, (cols, rows) if transpose else (rows, cols))
        edit = edits.setdefault(target, _Edit())
        edit.factors = (a_key, b_key)
        edit.transpose = transpose
        edit.scaling = self._scaling(module)
        edit.sources += [a_key, b_key]
        if "Bbias" in parts:
            bias_target = self._to_base(f"{module}.bias")
            if bias_target is None:
                raise FeatCalError(
                    f"{self.weights_path}: tensor {parts['Bbias']!r} (lora_bias) adds to the bias "
                    f"of {module!r}, which the base {self.base.directory} lacks; pass the "
                    "adapter's own base"
                )
            self._check_shape(
                parts["Bbias"], bias_target, self.adapter_entries[parts["Bbias"]].shape
            )
            bias_edit = edits.setdefault(bias_target, _Edit())
            bias_edit.bias = parts["Bbias"]
            bias_edit.scaling = edit.scaling
            bias_edit.sources.append(parts["Bbias"])

    def _conv1d(self, module: str, target: str, shape: tuple[int, int]) -> bool:
        """Whether `module` is a transformers Conv1D (weight (d_in, d_out), the transpose of
        `shape`) rather than a torch.nn.Linear: by the base's model_type (`_CONV1D`; Linear in
        featcal's families), else by the base weight's shape, fan_in_fan_out deciding if square."""
        model_type = self.base.config.get("model_type")
        if isinstance(model_type, str) and model_type in _CONV1D:
            return module.rsplit(".", 1)[-1] in _CONV1D[model_type]
        if self._known_family:
            return False
        rows, cols = shape
        if rows != cols:
            return tuple(self.tensors[target].shape) == (cols, rows)
        return bool(self.adapter_config.get("fan_in_fan_out"))

    def _unsupported(self, key: str, what: str) -> FeatCalError:
        return FeatCalError(
            f"{self.weights_path}: tensor {key!r} is {what}, which featcal does not apply; "
            f"{_MERGE_FIX}"
        )

    def _check_shape(self, key: str, target: str, shape: tuple[int, ...]) -> None:
        want = self.tensors[target].shape
        if tuple(shape) != tuple(want):
            raise FeatCalError(
                f"{self.weights_path}: tensor {key!r} gives {target!r} shape {list(shape)}, the "
                f"base {self.base.directory} has {list(want)}; the adapter is not for this base "
                "(a resized vocabulary, another model): pass the adapter's own base"
            )

    def _to_base(self, name: str) -> str | None:
        """The base tensor `name` (a key of the adapted model) stands for, or None. Exact, else
        through the architecture's key prefixes (a BertForSequenceClassification adapter over a
        BertModel base: "bert.encoder..." → "encoder...")."""
        if name in self.tensors:
            return name
        prefix, candidates = self._prefixes
        for candidate in sorted(candidates, key=len, reverse=True):
            if name.startswith(candidate) and prefix + name[len(candidate) :] in self.tensors:
                return prefix + name[len(candidate) :]
        return None

    def _replacement(self, module: str, rest: str) -> str | None:
        """The base tensor of `module.modules_to_save[.adapter].rest`: with or without the
        adapter name's segment, whichever the base holds."""
        found = self._to_base(f"{module}.{rest}")
        if found is None and "." in rest:
            found = self._to_base(f"{module}.{rest.split('.', 1)[1]}")
        return found

    def _targets(self, module: str) -> bool:
        """peft's target-module rule (check_target_module_exists) for module name `module`."""
        config, match = self.adapter_config, self._patterns.match
        excluded = config.get("exclude_modules")
        if isinstance(excluded, str):
            if match("exclude_modules", excluded, module, full=True):
                return False
        elif excluded and (module in excluded or any(module.endswith(f".{p}") for p in excluded)):
            return False
        saved = config.get("modules_to_save") or []
        if any(
            match("modules_to_save entry", str(m), module, pattern=_saved_regex(m)) for m in saved
        ):
            return False
        targets = config.get("target_modules")
        if targets is None or targets == "all-linear":
            return True
        if isinstance(targets, str):
            return match("target_modules", targets, module, full=True) is not None
        if module in targets:
            return True
        if not any(module.endswith(f".{t}") for t in targets):
            return False
        layers = config.get("layers_to_transform")
        if layers is None or layers == []:
            return True
        patterns = config.get("layers_pattern")
        found = None
        if not patterns:
            found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        else:
            for pattern in [patterns] if isinstance(patterns, str) else patterns:
                found = match(
                    "layers_pattern", str(pattern), module, pattern=_layers_regex(pattern)
                )
                if found is not None:
                    break
        if found is None:
            return False
        index = int(found["idx"])
        return index == layers if isinstance(layers, int) else index in layers

    def _pattern_key(self, field: str, module: str) -> str:
        """peft's get_pattern_key: the first key of `field` (rank_pattern, alpha_pattern) that
        matches the end of `module`, else `module`."""
        for key in self.adapter_config.get(field) or {}:
            if self._patterns.match(f"{field} key", key, module, pattern=_pattern_regex(key)):
                return key
        return module

    def _rank(self, module: str) -> int:
        config = self.adapter_config
        pattern = config.get("rank_pattern") or {}
        return int(pattern.get(self._pattern_key("rank_pattern", module), config["r"]))

    def _scaling(self, module: str) -> float:
        """s = α / r (α / √r with use_rslora), r and α by rank_pattern and alpha_pattern."""
        config = self.adapter_config
        pattern = config.get("alpha_pattern") or {}
        alpha = float(pattern.get(self._pattern_key("alpha_pattern", module), config["lora_alpha"]))
        rank = self._rank(module)
        return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    # ----- reading ----------------------------------------------------------------------------
    def reader(self, file: str) -> _AdapterReader:  # type: ignore[override]
        """A reader of the expert's tensors stored in the base's shard `file` (a context
        manager, as `Checkpoint.reader`)."""
        return _AdapterReader(self, file)

    def read(self, names: list[str], check_finite: bool = True) -> dict[str, torch.Tensor]:
        """The named tensors, each materialised (base shards and the adapter opened once)."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name not in self.tensors:
                raise FeatCalError(
                    f"tensor {name!r} is missing from the base {self.base.directory} of "
                    f"{self.role} {self.directory}; the base is incomplete or of another "
                    "architecture"
                )
            by_file.setdefault(self.tensors[name].file, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, keys in by_file.items():
            with self.reader(file) as shard:
                for key in keys:
                    out[key] = shard[key]
        if check_finite:
            for key, tensor in out.items():
                if not all_finite(tensor):
                    raise FeatCalError(
                        f"tensor {key!r} of {self.role} {self.directory} (LoRA over "
                        f"{self.base.directory}) contains NaN or Inf; fix or re-create the adapter"
                    )
        return out

    def materialise(
        self,
        name: str,
        base: Reader,
        adapter: Reader,
        rows: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Tensor `name` of the expert (or its rows [start, stop)), in the base tensor's dtype."""
        edit = self.edits.get(name)
        try:
            if edit is None:
                return base[name] if rows is None else base.rows(name, *rows)
            source, key = (adapter, edit.replace) if edit.replace else (base, name)
            weight = source[key] if rows is None else source.rows(key, *rows)
            dtype = DTYPES[self.tensors[name].dtype]
            if edit.factors is None and edit.bias is None:
                return weight.to(dtype)
            compute = torch.promote_types(torch.float32, weight.dtype)
            out = weight.to(compute)
            if edit.factors is not None:
                a = adapter[edit.factors[0]].to(compute)
                b = adapter[edit.factors[1]].to(compute)
                if edit.transpose:  # (B · A[:, rows])ᵀ: rows of (B · A)ᵀ
                    delta = (b @ (a if rows is None else a[:, rows[0] : rows[1]])).T
                else:
                    delta = (b if rows is None else b[rows[0] : rows[1]]) @ a
                out += delta * edit.scaling
            if edit.bias is not None:
                bias = adapter[edit.bias].to(compute)
                out += (bias if rows is None else bias[rows[0] : rows[1]]) * edit.scaling
            return out.to(dtype)
        except (OSError, SafetensorsFormatError) as exc:
            raise FeatCalError(
                f"cannot read tensor {name!r} of {self.role} {self.directory} (LoRA over "
                f"{self.base.directory}: {exc}); re-save the adapter or the base"
            ) from exc

    # ----- records ----------------------------------------------------------------------------
    def describe(self) -> dict:
        """How a record names this expert: {"path": the adapter folder, absolute; "sha256":
        {adapter_model.safetensors, adapter_config.json: hex digest}}."""
        return {
            "path": str(self.directory.resolve()),
            "sha256": {p.name: sha256_file(p) for p in self.weight_paths()},
        }

    def weight_paths(self) -> list[Path]:
        return [self.weights_path, self.config_path]


class _AdapterReader:
    """The expert's tensors of one base shard: `with view.reader(file) as r: r[name]`,
    `r.rows(name, start, stop)`."""

    def __init__(self, view: AdapterCheckpoint, file: str):
        self.view = view
        self.file = file
        self._stack = ExitStack()
        self._base: Reader | None = None
        self._adapter: Reader | None = None

    def __enter__(self) -> _AdapterReader:
        view = self.view
        try:
            self._base = self._stack.enter_context(view.base.reader(self.file))
            self._adapter = self._stack.enter_context(
                Reader(view.weights_path, view.adapter_entries)
            )
        except OSError as exc:
            self._stack.close()
            raise FeatCalError(
                f"cannot open {view.base.directory / self.file} or {view.weights_path} ({exc}); "
                f"check the base and the {view.role}"
            ) from exc
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __getitem__(self, name: str) -> torch.Tensor:
        assert self._base is not None and self._adapter is not None  # used inside `with`
        return self.view.materialise(name, self._base, self._adapter)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        assert self._base is not None and self._adapter is not None  # used inside `with`
        return self.view.materialise(name, self._base, self._adapter, (start, stop))


# ----- helpers ------------------------------------------------------------------------------
def _pattern_regex(key: str) -> str:
    """The regex peft's get_pattern_key makes of a rank_pattern / alpha_pattern key."""
    return rf"(.*\.)?({key})$"


def _saved_regex(module: Any) -> str:
    """The regex peft makes of a modules_to_save entry (matched at the start of a name)."""
    return rf"(^|.*\.){module}($|\..*)"


def _layers_regex(pattern: Any) -> str:
    """The regex peft makes of a layers_pattern entry (group `idx`: the layer index)."""
    return rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."


def _family(base: Checkpoint) -> type[Architecture] | None:
    """The featcal family (an Architecture class) whose `matches` accepts the base, or None."""
    from featcal_core.architectures import REGISTRY, supported

    supported()
    return next((cls for cls in REGISTRY.values() if cls.matches(base.config)), None)


def _tower_prefix(
    base: Checkpoint, family: type[Architecture] | None
) -> tuple[str, tuple[str, ...]]:
    """(the base's tower prefix, the prefixes an adapted model may use) when the base's family
    is known, else ("", ())."""
    if family is None:
        return "", ()
    try:
        arch = family(base.config)
        return arch.resolve_prefix(base), tuple(arch.prefix_candidates)
    except FeatCalError:
        return "", ()


def same_base(named: str, base: Checkpoint) -> bool:
    """Whether `named` (an adapter's base_model_name_or_path: a local path or a Hub id) names
    `base`: the same folder, else the same last name (a folder's, a Hub id's, the Hugging Face
    cache's `models--owner--name`, or the base config's `_name_or_path`), case-insensitively."""
    local = Path(named).expanduser()
    folder = base.directory.resolve()
    if local.is_dir() and local.resolve() == folder:
        return True
    mine: set[str] = {folder.name, base.directory.name}
    for part in folder.parts:
        if part.startswith("models--"):
            mine.add(part.split("--")[-1])
    recorded = base.config.get("_name_or_path")
    if isinstance(recorded, str) and recorded:
        mine.add(PurePosixPath(recorded.rstrip("/")).name)
    theirs = PurePosixPath(named.rstrip("/").replace("\\", "/")).name
    return theirs.casefold() in {name.casefold() for name in mine if name}
