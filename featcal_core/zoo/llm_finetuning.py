"""Full fine-tuning of a causal LM expert on a two-word choice task (featcal_core.zoo.llm_tasks).

Each training example is the prompt `task.template.format(text=...)` followed by the answer
word (" " + word); the loss is the cross-entropy of the answer's tokens alone. AdamW, linear
warm-up over the first tenth of the steps then linear decay to zero, batches drawn with a seeded
generator; forwards under bfloat16 autocast where the CPU or GPU runs it natively
(featcal_core.precision), weights and optimiser state in float32. The expert is written as a
float32 `save_pretrained` folder with the base's tokenizer files copied byte for byte.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from featcal_core.architectures.base import load_tokenizer
from featcal_core.io.vocabulary import TOKENIZER_FILES
from featcal_core.progress import stage_progress
from featcal_core.zoo.llm_tasks import LlmTask

log = logging.getLogger(__name__)

#: words of a text kept in a prompt (longer reviews are cut: prompts stay short on a CPU)
MAX_WORDS = 48


def clip_text(text: str, max_words: int = MAX_WORDS) -> str:
    """`text` cut to its first `max_words` words (whitespace-separated)."""
    words = text.split()
    return text if len(words) <= max_words else " ".join(words[:max_words])


def prompt(task: LlmTask, text: str) -> str:
    """The prompt of one example: the task's template around the clipped text."""
    return task.template.format(text=clip_text(text))


def _examples(tokenizer, task: LlmTask, texts: list[str], labels: list[int]):
    """(token ids, index where the answer starts) of each example."""
    words = [tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in task.words]
    out = []
    for text, label in zip(texts, labels, strict=True):
        ids = tokenizer(prompt(task, text))["input_ids"]
        out.append((ids + words[label], len(ids)))
    return out


def finetune_causal_expert(
    base_dir: str | Path,
    dataset: Any,
    out_dir: str | Path,
    task: LlmTask,
    *,
    steps: int,
    lr: float,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = False,
    threads: int | None = None,
) -> dict[str, Any]:
    """Fine-tune the causal LM in `base_dir` on `dataset["train"]` (columns text, label) and
    write it to `out_dir`; returns {"steps", "lr", "batch_size", "final_loss", "seconds"}."""
    from transformers import AutoModelForCausalLM

    from featcal_core.precision import native_bfloat16

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(base_dir, "base model", right_padded=True)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    train = dataset["train"]
    examples = _examples(tokenizer, task, list(train["text"]), [int(v) for v in train["label"]])
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm)))
    )
    fast = native_bfloat16(torch.device("cpu"))[0]
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    for _ in stage_progress(range(steps), desc="fine-tune", unit="step", enabled=progress):
        picked = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
        batch = [examples[i] for i in picked]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for row, (seq, start) in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            labels[row, start : len(seq)] = ids[row, start : len(seq)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fast):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        schedule.step()
        optimiser.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    out = Path(out_dir)
    model.eval().save_pretrained(out)
    for name in (*TOKENIZER_FILES, "chat_template.jinja"):
        if (Path(base_dir) / name).is_file():
            shutil.copy2(Path(base_dir) / name, out / name)
    tail = losses[-max(1, steps // 10) :]
    final = sum(tail) / len(tail)
    log.info("expert %s: %d steps, lr %g, final loss %.4f", out.name, steps, lr, final)
    return {
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "final_loss": final if math.isfinite(final) else None,
        "seconds": round(time.perf_counter() - started, 1),
    }
