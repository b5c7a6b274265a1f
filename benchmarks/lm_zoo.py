"""The tiny Llama LM zoo of `lm_token_weighting.py`: a word-level tokenizer, a pretrained base, one
fine-tuned expert per task, Task Arithmetic merges (scale chosen on validation) and the calibration
sets, recorded in work/zoo.json with the settings that built them."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from lm_data import clip_all, eval_rows
from lm_scoring import Scorer
from lm_settings import (
    BATCH,
    FINETUNE_LR,
    GEOMETRY,
    MAX_TEXT_TOKENS,
    PRETRAIN_LR,
    SPECIALS,
    TASKS,
    TEMPLATE,
    ZOO_VERSION,
)
from lm_training import finetune, pretrain, save_model

from featcal_core.merging.run import merge_checkpoints

log = logging.getLogger("lm_token_weighting")


# ----- tokenizer --------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], extra: list[str], vocab: int):
    """A word-level tokenizer trained on `texts` (+ `extra` words, always kept), bos prepended."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS, show_progress=False
    )
    # the extra words (label words, "->") repeated often enough to be in any vocabulary
    tokenizer.train_from_iterator([*texts, *(" ".join(extra) for _ in range(1000))], trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tokenizer.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="right",
    )


# ----- the zoo ----------------------------------------------------------------------------------
def zoo_settings(args) -> dict:
    return {
        "version": ZOO_VERSION,
        "seed": args.seed,
        "n": args.n,
        "steps_pretrain": args.steps_pretrain,
        "steps_finetune": args.steps_finetune,
        "vocab": args.vocab,
        "scales": list(args.scales),
        "max_val": args.max_val,
        "geometry": GEOMETRY,
        "lr": [PRETRAIN_LR, FINETUNE_LR],
        "batch": BATCH,
        "max_text_tokens": MAX_TEXT_TOKENS,
    }


def build_zoo(args, work: Path, tasks: dict) -> dict:
    """Tokenizer + base, experts, merge (scale chosen on validation) and calibration sets; returns
    the zoo record (also written to work/zoo.json)."""
    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    zoo = work / "zoo"
    if zoo.exists():
        shutil.rmtree(zoo)
    zoo.mkdir(parents=True)
    train_texts = [t for task in TASKS for t in tasks[task]["train"][0]]
    extra = sorted({w for task in TASKS for w in tasks[task]["words"]} | {"->"})
    tokenizer = train_tokenizer(train_texts, extra, args.vocab)
    for word in extra:
        ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
            raise RuntimeError(f"label word {word!r} is not one token of the vocabulary: {ids}")
    clip_all(tokenizer, tasks)
    log.info("tokenizer: %d entries", len(tokenizer))

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **GEOMETRY,
    )
    base_model = LlamaForCausalLM(config)
    log.info("base: %d parameters", sum(p.numel() for p in base_model.parameters()))
    pretrain_texts = [t for task in TASKS for t in tasks[task]["train"][0]]
    record = {"settings": zoo_settings(args), "vocab_size": len(tokenizer)}
    record["pretrain_loss"] = pretrain(
        base_model, tokenizer, pretrain_texts, args.steps_pretrain, args.seed
    )
    base = save_model(base_model, tokenizer, zoo / "base")
    base_state = {k: v.clone() for k, v in base_model.state_dict().items()}

    scorer = Scorer(base, tasks, eval_rows(tasks, args))
    experts, record["experts"] = {}, {}
    for index, task in enumerate(TASKS):
        torch.manual_seed(args.seed + 1 + index)
        base_model.load_state_dict(base_state)
        texts, labels = tasks[task]["train"]
        loss = finetune(
            base_model,
            tokenizer,
            texts,
            labels,
            tasks[task]["words"],
            args.steps_finetune,
            args.seed + 1 + index,
            f"expert {task}",
        )
        experts[task] = save_model(base_model, tokenizer, zoo / "experts" / task)
        val = scorer.accuracy(experts[task], task, "validation")
        record["experts"][task] = {"train_loss": loss, "validation_accuracy": val}
        log.info("expert %s: validation accuracy %.3f (chance 0.5)", task, val)

    merges = {}
    for scale in args.scales:
        path = zoo / f"merged_ta_{scale:g}"
        merge_checkpoints(
            base, experts, path, "task_arithmetic", {"scale": scale}, overwrite=True, progress=False
        )
        merges[scale] = scorer.all_tasks(path, "validation")["avg"]
        log.info("task arithmetic scale %g: average validation accuracy %.4f", scale, merges[scale])
    scale = max(args.scales, key=lambda s: (merges[s], -args.scales.index(s)))
    record["merge_validation"] = {f"{s:g}": merges[s] for s in args.scales}
    record["scale"] = scale

    record["calib"] = {}
    for task in TASKS:
        texts, labels = tasks[task]["train"]
        rng = np.random.default_rng(args.seed)
        rows = sorted(
            int(i) for i in rng.choice(len(texts), size=min(args.n, len(texts)), replace=False)
        )
        words = tasks[task]["words"]
        datasets.Dataset.from_dict(
            {
                "text": [TEMPLATE.format(text=texts[i]) for i in rows],
                "target": [" " + words[labels[i]] for i in rows],
                "label": [labels[i] for i in rows],
            }
        ).save_to_disk(str(zoo / "calib" / task))
        record["calib"][task] = rows
    record["build_seconds"] = round(time.perf_counter() - started, 1)
    record["val_cache"] = [[*k, v] for k, v in scorer.cache.items()]
    (work / "zoo.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
