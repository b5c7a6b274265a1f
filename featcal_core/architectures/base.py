"""What FeatCal needs to know about a model family: one `Architecture` subclass per family.

An adapter says how to find the tower inside a checkpoint (key prefix), how to build and run the
stem (not calibrated) and one block, how to turn a calibration set into model inputs, and which
token weights each module gets. Everything else (statistics, solves, streaming, I/O) is generic.

Names: a *canonical* tensor name is the checkpoint key with the tower prefix removed (e.g.
"encoder.layers.3.mlp.fc1.weight"); a block's *local* names are relative to `block_prefix(i)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint

#: weight of non-pooled tokens in the last block (docs/featcal.md, "Token weights")
POOLED_OTHER_WEIGHT = 0.01
#: token weighting modes: "all" (every real token; docs/featcal.md's rule) or "answer" (causal
#: LMs whose calibration set has a `target` column: only the positions that predict its tokens)
TOKEN_WEIGHTINGS = ("all", "answer")
#: inputs key of the (B, S) 0/1 token-weight mask when it differs from the attention mask
WEIGHT_MASK = "weight_mask"


class Architecture(ABC):
    """Adapter for one model family. Subclasses register themselves with `@register`."""

    #: short name used in messages and records, e.g. "hf-clip-vision"
    name: str = ""
    #: "image" (calibration sets need an `image` column) or "text" (a `text` column)
    modality: str = ""
    #: canonical name that exists in every checkpoint of the family; used to find the prefix
    probe_key: str = ""
    #: prefixes a checkpoint may put before canonical names (tried in order)
    prefix_candidates: tuple[str, ...] = ("",)
    #: canonical-name prefixes of the stem (not calibrated, but run for every model)
    stem_roots: tuple[str, ...] = ()
    #: position of the pooled token (CLS) in the last block; None = all tokens matter
    pooled_position: int | None = 0
    #: local names of Linear modules exempt from the pooled-token rule (keys and values)
    pooled_exempt: tuple[str, ...] = ()
    #: module types treated as norms; RMS-style norms are listed in `rms_norm_types`
    norm_types: tuple[type[nn.Module], ...] = (nn.LayerNorm,)
    rms_norm_types: tuple[type[nn.Module], ...] = ()
    #: "all" or "answer" (see TOKEN_WEIGHTINGS); only causal LMs accept "answer"
    token_weighting: str = "all"
    # ----- what evaluation needs from the family (declared here, never tested for by name) -----
    #: a causal LM: evaluated by label continuation and perplexity, "answer" weighting allowed
    causal: bool = False
    #: canonical-name prefixes of tower tensors an expert checkpoint may lack (e.g. BERT's pooler)
    optional_tower_roots: tuple[str, ...] = ()
    #: "expert": experts carry their own classification heads; "zero_shot": experts are bare
    #: towers, scored zero-shot with the base's text tower (no head to refit)
    task_heads: str = "expert"

    def __init__(self, config: dict[str, Any], pooling: str | None = None):
        self.config = config
        if pooling is not None:
            self.set_pooling(pooling)

    # ----- detection and layout -------------------------------------------------------------
    @classmethod
    @abstractmethod
    def matches(cls, config: dict[str, Any]) -> bool:
        """True when config.json describes a model of this family."""

    def tower_config(self) -> dict[str, Any]:
        """The part of config.json that describes the tower FeatCal calibrates: the whole config,
        or a nested one where a model holds several towers (CLIPModel's vision_config)."""
        return self.config

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @abstractmethod
    def block_prefix(self, index: int) -> str:
        """Canonical prefix of block `index`, e.g. "encoder.layers.3."."""

    # ----- encoder-decoder models (T5): all optional, one stack by default ---------------------
    #: index of the first decoder block (blocks before it are the encoder's); None: one stack
    decoder_start: int | None = None
    #: canonical names the bridge reads from each model (e.g. the encoder's final norm)
    bridge_names: tuple[str, ...] = ()

    def block_kind(self, index: int) -> str | None:
        """Which block module `build_block` makes for block `index` (None: the only one)."""
        return None

    def reads_context(self, module: str) -> bool:
        """True when `module` of a decoder block reads the encoder output (cross-attention k/v):
        its token weights come from the encoder tokens' mask."""
        return False

    def run_bridge(self, tensors: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """The decoder's context from the encoder's last block output (B, S, d) of one model,
        given that model's `bridge_names` tensors."""
        raise NotImplementedError(f"{self.name} has no decoder")

    def run_decoder_stem(self, stem: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The decoder's block-0 input (B, T, d) for a batch of model inputs."""
        raise NotImplementedError(f"{self.name} has no decoder")

    def checkpoint_key(self, index: int, local: str) -> str:
        """Canonical name of block `index`'s module tensor `local` (default: the block's prefix
        and `checkpoint_name`); an adapter whose blocks share a tensor kept in another block
        (T5's relative position bias, in block 0) overrides it."""
        return self.block_prefix(index) + self.checkpoint_name(local)

    def checkpoint_name(self, local: str) -> str:
        """The checkpoint's local name (relative to `block_prefix(i)`) of the block module's
        tensor `local` (a key of `build_block(...).state_dict()`). Identity by default; an adapter
        whose block module holds a tensor under another name overrides it (e.g. open_clip's packed
        `attn.in_proj_weight`, held by an `attn.in_proj` Linear so that it is calibrated)."""
        return local

    def resolve_prefix(self, checkpoint: Checkpoint) -> str:
        """The key prefix of the tower inside `checkpoint`."""
        return self.find_prefix(checkpoint, f"{checkpoint.role} {checkpoint.directory}")

    def find_prefix(self, names, what: str) -> str:
        """The key prefix of the tower among `names` (anything supporting `in`); `what` names the
        source in the error."""
        for prefix in self.prefix_candidates:
            if prefix + self.probe_key in names:
                return prefix
        raise FeatCalError(
            f"{what} has no tensor {self.probe_key!r} (tried prefixes "
            f"{list(self.prefix_candidates)}); it is not a {self.name} checkpoint"
        )

    def owns(self, canonical: str) -> bool:
        """True for the stem's and the blocks' tensors (the ones FeatCal reads)."""
        block_root = self.block_prefix(0).rsplit("0.", 1)[0]
        return canonical.startswith(self.stem_roots) or canonical.startswith(block_root)

    def set_pooling(self, pooling: str) -> None:
        choices = {"cls": 0, "mean": None}
        if pooling not in choices:
            raise FeatCalError(f"--pooling {pooling!r} is not one of {sorted(choices)}")
        self.pooled_position = choices[pooling]

    def set_token_weighting(self, mode: str) -> None:
        """Choose the token weighting; "answer" needs a causal LM (`causal = True`)."""
        if mode not in TOKEN_WEIGHTINGS:
            raise FeatCalError(
                f"--token-weighting {mode!r} is not one of {', '.join(TOKEN_WEIGHTINGS)}"
            )
        if mode == "answer" and not self.causal:
            raise FeatCalError(
                f"--token-weighting answer: {self.name} is not a causal LM; answer-token "
                "weighting applies to Llama-class decoders (leave it at 'all')"
            )
        self.token_weighting = mode

    # ----- modules ----------------------------------------------------------------------------
    @abstractmethod
    def build_stem(self, dtype: torch.dtype) -> nn.Module:
        """An empty stem module whose state_dict keys are canonical names."""

    @abstractmethod
    def run_stem(self, stem: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states (B, S, d) for a batch of model inputs."""

    @abstractmethod
    def build_block(self, dtype: torch.dtype) -> nn.Module:
        """An empty block module whose state_dict keys are local names."""

    @abstractmethod
    def run_block(self, block: nn.Module, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Block output (B, S, d) for hidden (B, S, d) and token mask (B, S) of 1/0. Decoder
        blocks of an encoder-decoder model also get `context=(encoder output (B, Sc, d), encoder
        mask (B, Sc))`."""

    # ----- data -------------------------------------------------------------------------------
    @abstractmethod
    def prepare_inputs(
        self, base_dir: str, rows: list[Any], max_length: int, targets: list[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Model inputs for the calibration rows (PIL images or strings), incl. "attention_mask";
        `targets` (the set's `target` column, when it has one) feed encoder-decoder decoders and
        are appended to a causal LM's rows. An adapter may add WEIGHT_MASK, the (B, S) 0/1 token
        weights when they differ from the attention mask."""

    # ----- token weights ----------------------------------------------------------------------
    def token_weights(self, module: str, last_block: bool, mask: torch.Tensor) -> torch.Tensor:
        """ω (B, S) for one module's input: padding 0; in the last block only the pooled token
        keeps weight 1 and the others get 0.01, except for the exempt (key/value) modules."""
        weights = mask.to(torch.float64)
        if last_block and self.pooled_position is not None and self.is_pooled_module(module):
            scale = torch.full_like(weights[0], POOLED_OTHER_WEIGHT)
            scale[self.pooled_position] = 1.0
            weights = weights * scale
        return weights

    def is_pooled_module(self, module: str) -> bool:
        return not any(module == name for name in self.pooled_exempt)


#: a local directory holds a saved tokenizer when it has one of these (transformers 5 would
#: otherwise build an empty one from config.json alone and tokenize everything as unknown)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "spiece.model",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "sentencepiece.bpe.model",
)


def has_tokenizer(directory: str | Path) -> bool:
    """True when the local directory holds saved tokenizer files."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def require_tokenizer(directory: str | Path, what: str = "base model") -> None:
    """Refuse a local `directory` without tokenizer files (one line naming it and the fix)."""
    if Path(directory).is_dir() and not has_tokenizer(directory):
        raise FeatCalError(
            f"{what} {directory}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); save "
            "the model's tokenizer there with tokenizer.save_pretrained"
        )


def load_tokenizer(directory: str | Path, what: str = "base model", right_padded: bool = False):
    """The tokenizer saved in `directory` (a clear FeatCalError when there is none).

    right_padded: pad on the right, with eos as the pad token when the tokenizer has none
    (causal LMs)."""
    from transformers import AutoTokenizer

    require_tokenizer(directory, what)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise FeatCalError(
            f"{what} {directory}: cannot load the tokenizer ({exc}); save it there with "
            "tokenizer.save_pretrained"
        ) from exc
    if right_padded:
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise FeatCalError(
                    f"{what} {directory}: the tokenizer has neither a pad nor an eos token; set "
                    "tokenizer.pad_token and save it there"
                )
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
    return tokenizer


def encode_texts(tokenizer, rows: list[Any], max_length: int) -> dict[str, torch.Tensor]:
    """Padded, truncated token tensors for a batch of texts (every tensor the tokenizer gives)."""
    encoded = tokenizer(
        [str(row) for row in rows],
        padding=True,
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    return {key: value for key, value in encoded.items() if isinstance(value, torch.Tensor)}
