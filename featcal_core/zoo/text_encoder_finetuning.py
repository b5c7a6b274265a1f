"""Fine-tuning a zoo text expert in the paper's regime: the encoder alone, under a frozen head.

`finetune_text_encoder` fits a Linear head on the frozen base's pooled features (train split),
then keeps it (and the base's pooler) frozen while the embeddings and the encoder blocks train. It
saves a plain `BertModel` + tokenizer + `classifier.safetensors` (`linear_head`, features
`mean_pooling` or `pooler_output`), so that every expert reads its task through a head that fine-
tuning never touched, as the paper's CLIP experts read theirs through the frozen text tower's
zero-shot heads. Seeded and deterministic; the test split is never read; the output directory is
written under a temporary sibling name and renamed into place.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from featcal_core.errors import FeatCalError
from featcal_core.evaluation.linear_head import pooled, save_linear_head
from featcal_core.io.outputs import guarded_directory
from featcal_core.zoo.text_finetuning import Tokens, tokenize_split
from featcal_core.zoo.training_inputs import (
    check_out_dir,
    check_run,
    class_names,
    label_tensor,
    load_pretrained,
)
from featcal_core.zoo.training_loop import (
    EVAL_BATCH,
    evaluate,
    fit_linear_probe,
    index_batches,
    tail_mean,
    task_vector_ratio,
    torch_threads,
    train_steps,
)

logger = logging.getLogger(__name__)

#: pooling name (the preset's and `featcal.pooling`'s) -> the linear head's `features`
POOLING_FEATURES = {"mean": "mean_pooling", "cls": "pooler_output"}
#: the tower's tensors that stay the base's: the pooler is part of the head (CLS pooling) or unused
FROZEN_ROOTS = ("pooler.",)


def finetune_text_encoder(
    base_dir: str | Path,
    dataset: Any,
    out_dir: str | Path,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 2e-5,
    weight_decay: float = 0.01,
    max_length: int = 64,
    pooling: str = "mean",
    probe_steps: int = 300,
    head: FrozenHead | None = None,
    seed: int = 0,
    progress: bool = True,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Fine-tune the `BertModel` in base_dir (with its tokenizer files) on dataset["train"]
    (`text`, ClassLabel `label`) under a head fitted on the frozen base and kept frozen.

    pooling "mean": the head reads the mean of last_hidden_state over the real tokens (the
    sentence-transformers pooling of all-MiniLM-L6-v2); "cls": the base's pooler_output (tanh of
    a dense layer on [CLS]). The head: `probe_steps` full-batch AdamW steps on the base's train
    features (`fit_linear_probe`), or `head` when given (`fit_frozen_head` on the same base,
    dataset, pooling and max_length: one head for several trainings). Then `steps` AdamW steps (10 % warmup, linear decay, dropout
    on) train the embeddings and encoder blocks; the head and the pooler stay as they were. Texts
    are truncated to max_length tokens. Returns {"validation_accuracy", "validation_loss",
    "probe_validation_accuracy" (the base with the head), "train_loss" (mean of the last 10 % of
    steps), "task_vector_ratio" (‖θ − θ₀‖ / ‖θ₀‖ over the tower's floating tensors),
    "num_classes", "steps", "pooling", "seconds" (wall)}; the test split is never read.
    """
    from transformers import BertModel

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    check_out_dir(out_dir, overwrite)
    check_run(steps, batch_size, lr)
    features, what = _check(pooling, max_length, probe_steps), f"dataset for {out_dir.name}"
    names = class_names(dataset, ("text", "label"), what)
    tokenizer = _bert_tokenizer(base_dir)
    if head is not None and (head.features, head.labels) != (features, names):
        raise FeatCalError(
            f"finetune_text_encoder({out_dir.name}): the given head reads {head.features} for "
            f"classes {head.labels}, the run {features} for {names}; fit it with fit_frozen_head "
            "on the same dataset and pooling"
        )
    started = time.perf_counter()
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        train_x, val_x = (
            tokenize_split(tokenizer, dataset[s], max_length, what, s)
            for s in ("train", "validation")
        )
        train_y, val_y = (
            label_tensor(dataset[s], len(names), what, s) for s in ("train", "validation")
        )
        torch.manual_seed(seed)  # a pooler missing from the base is initialised from the seed
        model = load_pretrained(BertModel, base_dir, "text base")
        initial = {
            k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()
        }

        def head_input(tokens: Tokens, index: torch.Tensor) -> torch.Tensor:
            batch = tokens.batch(index)
            return pooled(model(**batch), batch["attention_mask"], features)

        if head is None:
            head = _probe(
                model,
                head_input,
                train_x,
                train_y,
                val_x,
                val_y,
                names,
                features,
                probe_steps,
                seed,
            )
        linear = head.linear()
        probe_accuracy = head.validation_accuracy
        trained = [p for n, p in model.named_parameters() if not n.startswith(FROZEN_ROOTS)]
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(not name.startswith(FROZEN_ROOTS))
        logger.info(
            "%s: fine-tuning the encoder on %d train texts, %d classes, %d steps of %d; the "
            "base with the frozen head reads validation at %.4f",
            out_dir.name,
            len(train_y),
            len(names),
            steps,
            batch_size,
            probe_accuracy,
        )
        torch.manual_seed(seed)  # dropout masks
        model.train()
        generator = torch.Generator().manual_seed(seed)
        batches = index_batches(len(train_y), batch_size, generator)

        def step_loss(_: int) -> torch.Tensor:
            index = next(batches)
            return F.cross_entropy(linear(head_input(train_x, index)), train_y[index])

        losses = train_steps(
            step_loss, trained, steps, lr, weight_decay, out_dir.name, progress, cosine=False
        )
        model.eval()
        with torch.no_grad():
            val_accuracy, val_loss = evaluate(lambda index: linear(head_input(val_x, index)), val_y)
        with guarded_directory(out_dir, overwrite=overwrite, flag="out_dir") as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            save_linear_head(tmp, linear.weight, linear.bias, names, features=features)
        ratio = task_vector_ratio(initial, model.state_dict())
    stats = {
        "validation_accuracy": val_accuracy,
        "validation_loss": val_loss,
        "probe_validation_accuracy": probe_accuracy,
        "train_loss": tail_mean(losses),
        "task_vector_ratio": ratio,
        "num_classes": len(names),
        "steps": steps,
        "pooling": pooling,
        "seconds": time.perf_counter() - started,
    }
    logger.info("%s: fine-tuned %s", out_dir.name, stats)
    return stats


@dataclass(frozen=True)
class FrozenHead:
    """A Linear head fitted on the frozen base: weight (classes, hidden), bias (classes), the
    class names, the features it reads (linear_head FEATURES) and the base's validation accuracy
    under it (a fraction)."""

    weight: torch.Tensor
    bias: torch.Tensor
    labels: list[str]
    features: str
    validation_accuracy: float

    def linear(self) -> torch.nn.Linear:
        """A frozen nn.Linear holding a copy of the head."""
        layer = torch.nn.Linear(self.weight.shape[1], self.weight.shape[0])
        with torch.no_grad():
            layer.weight.copy_(self.weight)
            layer.bias.copy_(self.bias)
        return layer.requires_grad_(False)


def fit_frozen_head(
    base_dir: str | Path,
    dataset: Any,
    *,
    max_length: int = 64,
    pooling: str = "mean",
    probe_steps: int = 300,
    seed: int = 0,
    threads: int | None = None,
) -> FrozenHead:
    """The head `finetune_text_encoder` fits for the same arguments (bit for bit): fitted on the
    base's train features, scored on validation; the test split is never read."""
    from transformers import BertModel

    base_dir = Path(base_dir)
    features, what = _check(pooling, max_length, probe_steps), "dataset for the frozen head"
    names = class_names(dataset, ("text", "label"), what)
    tokenizer = _bert_tokenizer(base_dir)
    with torch_threads(threads), torch.random.fork_rng(devices=[]):
        train_x, val_x = (
            tokenize_split(tokenizer, dataset[s], max_length, what, s)
            for s in ("train", "validation")
        )
        train_y, val_y = (
            label_tensor(dataset[s], len(names), what, s) for s in ("train", "validation")
        )
        torch.manual_seed(seed)
        model = load_pretrained(BertModel, base_dir, "text base")

        def head_input(tokens: Tokens, index: torch.Tensor) -> torch.Tensor:
            batch = tokens.batch(index)
            return pooled(model(**batch), batch["attention_mask"], features)

        return _probe(
            model, head_input, train_x, train_y, val_x, val_y, names, features, probe_steps, seed
        )


def _probe(
    model: Any,
    head_input,
    train_x: Tokens,
    train_y: torch.Tensor,
    val_x: Tokens,
    val_y: torch.Tensor,
    names: list[str],
    features: str,
    probe_steps: int,
    seed: int,
) -> FrozenHead:
    linear = fit_linear_probe(
        frozen_features(model, head_input, train_x), train_y, len(names), int(probe_steps), seed
    )
    accuracy, _ = evaluate(lambda index: linear(head_input(val_x, index)), val_y)
    return FrozenHead(
        linear.weight.detach().clone(), linear.bias.detach().clone(), names, features, accuracy
    )


def _check(pooling: str, max_length: int, probe_steps: int) -> str:
    """The head's features for `pooling`, after checking the options."""
    if pooling not in POOLING_FEATURES:
        raise FeatCalError(
            f"finetune_text_encoder: pooling {pooling!r} is not one of {sorted(POOLING_FEATURES)}"
        )
    if max_length < 2:
        raise FeatCalError(f"finetune_text_encoder: max_length {max_length} < 2; pass e.g. 64")
    if int(probe_steps) < 1:
        raise FeatCalError(f"finetune_text_encoder: probe_steps {probe_steps} < 1; pass e.g. 300")
    return POOLING_FEATURES[pooling]


def _bert_tokenizer(base_dir: Path) -> Any:
    from transformers import AutoConfig, AutoTokenizer

    config = load_pretrained(AutoConfig, base_dir, "text base")
    if config.model_type != "bert":
        raise FeatCalError(
            f"{base_dir / 'config.json'}: model_type {config.model_type!r}, expected 'bert'; pass "
            "a BertModel directory (e.g. all-MiniLM-L6-v2)"
        )
    return load_pretrained(AutoTokenizer, base_dir, "text base tokenizer")


@torch.no_grad()
def frozen_features(model: Any, head_input, tokens: Tokens) -> torch.Tensor:
    """head_input(tokens, index) (N, hidden) over every row of `tokens`, in batches, with the
    model in eval mode (no dropout): the features a probe is fitted on."""
    model.eval()
    count = len(tokens.input_ids)
    return torch.cat(
        [
            head_input(tokens, torch.arange(start, min(start + EVAL_BATCH, count)))
            for start in range(0, count, EVAL_BATCH)
        ]
    )
