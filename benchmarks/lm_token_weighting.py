"""Answer-token vs all-token weighting of FeatCal on Llama-class causal LMs, measured on validation
data (a benchmark, not a test).

The method page publishes no token-weighting rule for causal LMs: "padding 0; all other tokens 1
unless a measured alternative (answer tokens only) is better on validation data — report both".
No pretrained LM is available offline, so this script builds a tiny LM zoo from the offline text
zoo's real classification data (data/zoo/text/data: rotten_tomatoes, subjectivity, polarity, hedge)
and measures both weightings.

What it builds, all under --work:
  - a word-level tokenizer (`tokenizers` WordLevel, NFKC + lowercase, `Whitespace` split into word
    and punctuation runs, at most --vocab entries of frequency >= 2 from the four train splits plus
    the label words and "->"; <pad> <unk> <s> </s>; bos prepended; right padding), wrapped in
    `PreTrainedTokenizerFast` and saved in the base directory. Every text is cut to its first
    MAX_TEXT_TOKENS tokens everywhere (training, calibration, evaluation);
  - a base `LlamaForCausalLM` (hidden 128, 4 layers, 4 heads, 2 kv heads, intermediate 256,
    max_position_embeddings 128, untied lm_head; about 1.6 M parameters at vocab 4000, seeded),
    pretrained by next-token prediction on the plain texts of the union of the four train splits
    (--steps-pretrain steps of batch 32, AdamW lr 2e-3, warmup + cosine);
  - one expert per task fine-tuned from the base on its train split (--steps-finetune steps of
    batch 32, AdamW lr 1e-3, warmup + cosine) on "{text} ->" followed by " " + the label word
    (the ClassLabel names: rotten/fresh, plot/review, negative/positive, certain/uncertain, one
    token each), the loss being the cross-entropy of the label word's token only;
  - the Task Arithmetic merge (`featcal_core.merging.run.merge_checkpoints`, the API behind
    `featcal merge --method task_arithmetic`) with the scale from --scales that has the best average
    validation accuracy;
  - per task a calibration set of --n rows drawn with --seed from the train split (`save_to_disk`;
    columns text = "{text} ->", target = " " + label word, label).

What it measures: FeatCal (`featcal_core.calibrate`, ρ = 2.2, α ∈ {0.25, 0.5, 1.0} × λ ∈ {0.05,
0.5}) with token_weighting "all" (every real token of prompt + answer weighs 1) and "answer" (only
the positions whose next token is an answer token). Accuracy is label-continuation accuracy
(`featcal_core.evaluation.language_model.label_continuation`, prompt "{text} ->", the task's two label words).
Validation (at most --max-val seeded rows per task) scores every grid point; per weighting the grid
point with the best average validation accuracy is selected (ties: the earlier grid point), and the
weighting with the better selected validation accuracy wins (ties: "all", the method page's rule).
The test split (at most --max-test seeded rows per task; 0 = all) is scored only for the base, the
experts, the merged model, each weighting's selected setting and the paper defaults (α 0.25, λ 0.05,
ρ 2.2). Gap closed = (model − merged) / (expert − merged) on average test accuracy, where "expert"
is the average of each expert on its own task.

Defaults: --steps-pretrain 400, --steps-finetune 150, --vocab 4000, --n 32, --scales 0.3 0.5 1.0,
--max-val 300, --max-test 500, --threads 1, texts cut to 56 tokens, calibration max_length 64.
Writes <out>/lm_token_weighting.md and .csv (default benchmarks/results) and prints the table.
The whole default run took 10.3 minutes on a busy 2-core CPU (zoo build 6 of them):

    nice -n 10 .venv/bin/python benchmarks/lm_token_weighting.py
    nice -n 10 .venv/bin/python benchmarks/lm_token_weighting.py --work /tmp/lmtw --keep  # reuse zoo
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from featcal_core import FeatCalParams, calibrate  # noqa: E402
from featcal_core.evaluation.language_model import label_continuation  # noqa: E402
from featcal_core.merging.run import merge_checkpoints  # noqa: E402
from featcal_core.report import gap_closed  # noqa: E402

log = logging.getLogger("lm_token_weighting")

DATA = ROOT / "data" / "zoo" / "text" / "data"
TASKS = ("rotten_tomatoes", "subjectivity", "polarity", "hedge")
TEMPLATE = "{text} ->"
WEIGHTINGS = ("all", "answer")
ALPHAS = (0.25, 0.5, 1.0)
LAMS = (0.05, 0.5)
RHO = 2.2
PAPER = (0.25, 0.05)  # (α, λ) of the authors' demo, ρ = 2.2
MAX_TEXT_TOKENS = 56  # texts are cut to this many tokens (bos + text + "->" + answer ≤ 64)
MAX_LENGTH = 64  # token limit of training sequences and of calibration rows
BATCH = 32
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
GEOMETRY = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
PRETRAIN_LR = 2e-3
FINETUNE_LR = 1e-3
ZOO_VERSION = 1


# ----- data -------------------------------------------------------------------------------------
def load_tasks() -> dict[str, dict]:
    """task → {"words": label words, split → (texts, labels)} from the offline text zoo."""
    import datasets

    tasks = {}
    for task in TASKS:
        data = datasets.load_from_disk(str(DATA / task))
        names = data["train"].features["label"].names
        entry = {"words": [str(n).lower() for n in names]}
        for split in ("train", "validation", "test"):
            entry[split] = (
                [str(t) for t in data[split]["text"]],
                [int(x) for x in data[split]["label"]],
            )
        tasks[task] = entry
    return tasks


def clip_texts(tokenizer, texts: list[str]) -> list[str]:
    """Each text cut after its first MAX_TEXT_TOKENS tokens (by the tokenizer's offsets)."""
    out = []
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    for text, offsets in zip(texts, encoded["offset_mapping"], strict=True):
        out.append(
            text if len(offsets) <= MAX_TEXT_TOKENS else text[: offsets[MAX_TEXT_TOKENS - 1][1]]
        )
    return out


def subset(texts: list[str], labels: list[int], limit: int, seed: int) -> tuple[list, list]:
    """At most `limit` rows (0 = all; else a seeded sample), ordered by text length."""
    rows = list(range(len(texts)))
    if 0 < limit < len(texts):
        rows = [
            int(i) for i in np.random.default_rng(seed).choice(len(texts), limit, replace=False)
        ]
    rows.sort(key=lambda i: (len(texts[i]), i))  # by length: less padding (accuracy is a mean)
    return [texts[i] for i in rows], [labels[i] for i in rows]


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


# ----- training ---------------------------------------------------------------------------------
def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def batches(count: int, steps: int, rng: np.random.Generator):
    """`steps` batches of BATCH row indices, epoch by epoch in a seeded order."""
    order: list[int] = []
    for _ in range(steps):
        if len(order) < BATCH:
            order += [int(i) for i in rng.permutation(count)]
        yield order[:BATCH]
        order = order[BATCH:]


def train(model, steps: int, peak_lr: float, loss_fn, count: int, seed: int, what: str) -> float:
    """AdamW (warmup + cosine, clip 1.0) over seeded batches; returns the mean loss of the last
    10 % of steps."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    losses, started = [], time.perf_counter()
    for step, rows in enumerate(batches(count, steps, rng)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        loss = loss_fn(rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, steps // 5) == 0:
            log.info("%s: step %d/%d, loss %.4f (%.0f s)", what, step + 1, steps,
                     float(np.mean(losses[-20:])), time.perf_counter() - started)  # fmt: skip
    model.eval()
    return float(np.mean(losses[-max(1, steps // 10) :]))


def pretrain(model, tokenizer, texts: list[str], steps: int, seed: int) -> float:
    """Next-token prediction on the plain texts (bos text eos)."""
    sequences = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]
    sequences = [s[:MAX_LENGTH] for s in sequences]

    def loss_fn(rows):
        ids, mask = pad([sequences[i] for i in rows], tokenizer.pad_token_id)
        labels = ids.masked_fill(mask == 0, -100)
        return model(input_ids=ids, attention_mask=mask, labels=labels).loss

    return train(model, steps, PRETRAIN_LR, loss_fn, len(sequences), seed, "pretrain")


def finetune(model, tokenizer, texts, labels, words, steps: int, seed: int, what: str) -> float:
    """Cross-entropy of the label word's token after "{text} ->" (only the answer positions go
    through the lm_head)."""
    prompts = tokenizer([TEMPLATE.format(text=t) for t in texts])["input_ids"]
    answers = [tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in words]

    def loss_fn(rows):
        sequences = [prompts[i] + answers[labels[i]] for i in rows]
        ids, mask = pad(sequences, tokenizer.pad_token_id)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        picks, targets = [], []
        for row, i in enumerate(rows):
            start = len(prompts[i]) - 1  # the position whose next token is the answer's first
            for k, token in enumerate(answers[labels[i]]):
                picks.append(hidden[row, start + k])
                targets.append(token)
        logits = model.lm_head(torch.stack(picks))
        return torch.nn.functional.cross_entropy(logits, torch.tensor(targets))

    return train(model, steps, FINETUNE_LR, loss_fn, len(prompts), seed, what)


def save_model(model, tokenizer, path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


# ----- evaluation -------------------------------------------------------------------------------
class Scorer:
    """Label-continuation accuracy of model directories on the (capped) splits, cached."""

    def __init__(self, tokenizer_dir: Path, tasks: dict, eval_rows: dict):
        self.tokenizer_dir = tokenizer_dir
        self.tasks = tasks
        self.rows = eval_rows  # (task, split) → (texts, labels)
        self.cache: dict[tuple[str, str, str], float] = {}

    def accuracy(self, model_dir: Path, task: str, split: str) -> float:
        key = (str(model_dir), task, split)
        if key not in self.cache:
            texts, labels = self.rows[task, split]
            result = label_continuation(
                model_dir, self.tokenizer_dir, texts, labels, self.tasks[task]["words"],
                template=TEMPLATE, batch_size=64,
            )  # fmt: skip
            self.cache[key] = result["accuracy"]
        return self.cache[key]

    def all_tasks(self, model_dir: Path, split: str) -> dict[str, float]:
        """task → accuracy, plus "avg"."""
        scores = {task: self.accuracy(model_dir, task, split) for task in TASKS}
        scores["avg"] = float(np.mean([scores[t] for t in TASKS]))
        return scores


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
        loss = finetune(base_model, tokenizer, texts, labels, tasks[task]["words"],
                        args.steps_finetune, args.seed + 1 + index, f"expert {task}")  # fmt: skip
        experts[task] = save_model(base_model, tokenizer, zoo / "experts" / task)
        val = scorer.accuracy(experts[task], task, "validation")
        record["experts"][task] = {"train_loss": loss, "validation_accuracy": val}
        log.info("expert %s: validation accuracy %.3f (chance 0.5)", task, val)

    merges = {}
    for scale in args.scales:
        path = zoo / f"merged_ta_{scale:g}"
        merge_checkpoints(base, experts, path, "task_arithmetic", {"scale": scale},
                          overwrite=True, progress=False)  # fmt: skip
        merges[scale] = scorer.all_tasks(path, "validation")["avg"]
        log.info("task arithmetic scale %g: average validation accuracy %.4f", scale, merges[scale])
    scale = max(args.scales, key=lambda s: (merges[s], -args.scales.index(s)))
    record["merge_validation"] = {f"{s:g}": merges[s] for s in args.scales}
    record["scale"] = scale

    record["calib"] = {}
    for task in TASKS:
        texts, labels = tasks[task]["train"]
        rng = np.random.default_rng(args.seed)
        rows = sorted(int(i) for i in rng.choice(len(texts), size=min(args.n, len(texts)),
                                                   replace=False))  # fmt: skip
        words = tasks[task]["words"]
        datasets.Dataset.from_dict({
            "text": [TEMPLATE.format(text=texts[i]) for i in rows],
            "target": [" " + words[labels[i]] for i in rows],
            "label": [labels[i] for i in rows],
        }).save_to_disk(str(zoo / "calib" / task))  # fmt: skip
        record["calib"][task] = rows
    record["build_seconds"] = round(time.perf_counter() - started, 1)
    record["val_cache"] = [[*k, v] for k, v in scorer.cache.items()]
    (work / "zoo.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def clip_all(tokenizer, tasks: dict) -> None:
    for task in TASKS:
        for split in ("train", "validation", "test"):
            texts, labels = tasks[task][split]
            tasks[task][split] = (clip_texts(tokenizer, texts), labels)


def eval_rows(tasks: dict, args) -> dict:
    rows = {}
    for index, task in enumerate(TASKS):
        for split, limit in (("validation", args.max_val), ("test", args.max_test)):
            texts, labels = tasks[task][split]
            rows[task, split] = subset(texts, labels, limit, args.seed + 100 + index)
    return rows


def standard_error(scores: dict[str, float], counts: dict[str, int]) -> float:
    """Binomial standard error of the average over tasks of per-task accuracies."""
    variance = sum(scores[t] * (1 - scores[t]) / counts[t] for t in TASKS)
    return math.sqrt(variance) / len(TASKS)


# ----- report -----------------------------------------------------------------------------------
def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "w", newline="") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600
    os.replace(tmp, path)


def report(args, record, grid, finals, winner: str, seconds: float, noise: dict[str, float]):
    """Markdown and CSV; returns the markdown."""
    fmt = lambda v: f"{v:g}"  # noqa: E731
    lines = [
        "# FeatCal token weighting on tiny Llama LMs: all tokens vs answer tokens",
        "",
        "Built by `benchmarks/lm_token_weighting.py` (see its docstring): a word-level tokenizer "
        f"({record['vocab_size']} entries) and a tiny LlamaForCausalLM (hidden 128, 4 layers, "
        f"4 heads / 2 kv heads, intermediate 256) pretrained {args.steps_pretrain} steps on the "
        "train texts of rotten_tomatoes, subjectivity, polarity and hedge; one expert per task "
        f'fine-tuned {args.steps_finetune} steps on `"{{text}} ->" + " <label word>"`; Task '
        f"Arithmetic merge, scale {fmt(record['scale'])} chosen on validation "
        f"({', '.join(f'{s}: {pct(v)}' for s, v in record['merge_validation'].items())}); "
        f"FeatCal with n = {args.n} calibration rows per task (train split, seed {args.seed}), "
        f"ρ = {RHO}. Accuracy = label-continuation accuracy (%), validation ≤ {args.max_val} rows "
        f"per task, test ≤ {args.max_test or 'all'} rows per task. Selection on validation only; "
        f"the test split is scored only for the rows of the second table. Run time "
        f"{seconds / 60:.1f} min (zoo build {record['build_seconds'] / 60:.1f} min).",
        "",
        "## Validation grid (average validation accuracy, %)",
        "",
        "| α | λ | all | answer |",
        "|---|---|---|---|",
    ]
    for alpha in ALPHAS:
        for lam in LAMS:
            cells = [pct(grid[w, alpha, lam]["avg"]) for w in WEIGHTINGS]
            lines.append(f"| {fmt(alpha)} | {fmt(lam)} | {' | '.join(cells)} |")
    lines += [
        "",
        f"Validation prefers token weighting **{winner}** "
        + "("
        + ", ".join(
            f"{f['weighting']}: {pct(f['validation']['avg'])}"
            for f in finals
            if f["kind"] == "featcal (val-selected)"
        )
        + "); binomial standard error of each of these averages: "
        + ", ".join(f"{w} ± {100 * noise[w]:.1f}" for w in WEIGHTINGS)
        + " points (both are scored on the same rows, so their difference is less noisy than "
        "that suggests, but a difference of about one point is within noise).",
        "",
        "## Selected settings: validation and test accuracy (%)",
        "",
        "| model | weighting | α | λ | val avg | test avg | "
        + " | ".join(f"test {t}" for t in TASKS)
        + " | gap closed (test) |",
        "|---|---|---|---|---|---|" + "---|" * len(TASKS) + "---|",
    ]
    csv_rows = []
    header = ["section", "model", "weighting", "alpha", "lam", "rho", "scale", "split", "avg",
              *TASKS, "gap_closed_pct"]  # fmt: skip
    for (w, alpha, lam), scores in grid.items():
        csv_rows.append(["grid", "featcal", w, alpha, lam, RHO, record["scale"], "validation",
                         scores["avg"], *(scores[t] for t in TASKS), ""])  # fmt: skip
    for f in finals:
        gap = f.get("gap")
        lines.append(
            f"| {f['kind']} | {f.get('weighting') or '—'} | "
            f"{fmt(f['alpha']) if f.get('alpha') is not None else '—'} | "
            f"{fmt(f['lam']) if f.get('lam') is not None else '—'} | "
            f"{pct(f['validation']['avg']) if f.get('validation') else '—'} | "
            f"{pct(f['test']['avg'])} | "
            + " | ".join(pct(f["test"][t]) for t in TASKS)
            + f" | {'—' if gap is None else f'{gap:.1f} %'} |"
        )
        for split in ("validation", "test"):
            if f.get(split):
                csv_rows.append([
                    "final", f["kind"], f.get("weighting") or "", f.get("alpha", ""),
                    f.get("lam", ""), RHO if f.get("alpha") is not None else "",
                    record["scale"] if f["kind"] != "base" and f["kind"] != "experts" else "",
                    split, f[split]["avg"], *(f[split][t] for t in TASKS),
                    "" if gap is None or split != "test" else gap,
                ])  # fmt: skip
    experts = ", ".join(
        f"{t} {pct(v['validation_accuracy'])}" for t, v in record["experts"].items()
    )
    lines += ["", f"Experts' validation accuracy on their own task: {experts}.", ""]
    markdown = "\n".join(lines)
    out = Path(args.out)
    write_atomic(out / "lm_token_weighting.md", markdown)
    buffer = _csv_text(header, csv_rows)
    write_atomic(out / "lm_token_weighting.csv", buffer)
    return markdown


def _csv_text(header: list, rows: list[list]) -> str:
    import io

    handle = io.StringIO()
    writer = csv.writer(handle, lineterminator="\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])
    return handle.getvalue()


# ----- main -------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--keep", action="store_true",
                        help="reuse the zoo under --work when its settings match")  # fmt: skip
    parser.add_argument("--n", type=int, default=32, help="calibration rows per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps-pretrain", type=int, default=400)
    parser.add_argument("--steps-finetune", type=int, default=150)
    parser.add_argument("--vocab", type=int, default=4000, help="tokenizer vocabulary limit")
    parser.add_argument("--scales", type=float, nargs="+", default=[0.3, 0.5, 1.0],
                        help="Task Arithmetic scales tried (chosen on validation)")  # fmt: skip
    parser.add_argument("--max-val", type=int, default=300,
                        help="validation rows per task (seeded sample; 0 = all)")  # fmt: skip
    parser.add_argument("--max-test", type=int, default=500,
                        help="test rows per task (seeded sample; 0 = all)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                        help="results directory")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="featcal's own INFO logs too")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.verbose:
        for name in ("featcal_core", "featcal", "transformers", "datasets"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if "token_weighting" not in inspect.signature(calibrate).parameters:
        raise SystemExit("featcal_core.calibrate has no token_weighting option in this checkout")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    import datasets

    datasets.disable_progress_bars()
    started = time.perf_counter()
    temporary = args.work is None
    work = Path(args.work or tempfile.mkdtemp(prefix="lm_token_weighting-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, work, started)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path, started: float) -> int:
    from transformers import PreTrainedTokenizerFast

    tasks = load_tasks()
    record = None
    zoo_file = work / "zoo.json"
    if args.keep and zoo_file.is_file():
        saved = json.loads(zoo_file.read_text())
        if saved.get("settings") == json.loads(json.dumps(zoo_settings(args))):
            record = saved
            log.info("reusing the zoo in %s (built in %.0f s)", work, saved["build_seconds"])
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(work / "zoo" / "base"))
            clip_all(tokenizer, tasks)
        else:
            log.info("zoo in %s was built with other settings: rebuilding", work)
    if record is None:
        record = build_zoo(args, work, tasks)
    zoo = work / "zoo"
    base = zoo / "base"
    experts = {task: zoo / "experts" / task for task in TASKS}
    calib = {task: zoo / "calib" / task for task in TASKS}
    merged = zoo / f"merged_ta_{record['scale']:g}"
    scorer = Scorer(base, tasks, eval_rows(tasks, args))
    for model, task, split, value in record.get("val_cache", []):
        scorer.cache[model, task, split] = value
    log.info("experts' validation accuracy: %s",
             {t: round(v["validation_accuracy"], 3) for t, v in record["experts"].items()})  # fmt: skip
    log.info("merge scale %g (validation: %s)", record["scale"], record["merge_validation"])

    grid, dirs = {}, {}
    for w in WEIGHTINGS:
        for alpha in ALPHAS:
            for lam in LAMS:
                out = work / "calibrated" / f"{w}_a{alpha:g}_l{lam:g}"
                tick = time.perf_counter()
                calibrate(base, merged, experts, calib, out, FeatCalParams(alpha, RHO, lam),
                          num_per_task=args.n, max_length=MAX_LENGTH, seed=args.seed,
                          token_weighting=w, overwrite=True, progress=False)  # fmt: skip
                grid[w, alpha, lam] = scorer.all_tasks(out, "validation")
                dirs[w, alpha, lam] = out
                log.info("featcal %s α=%g λ=%g: average validation accuracy %.4f (%.0f s)",
                         w, alpha, lam, grid[w, alpha, lam]["avg"],
                         time.perf_counter() - tick)  # fmt: skip

    order = [(a, lam) for a in ALPHAS for lam in LAMS]
    chosen = {
        w: max(order, key=lambda p, w=w: (grid[(w, *p)]["avg"], -order.index(p)))
        for w in WEIGHTINGS
    }
    winner = max(WEIGHTINGS, key=lambda w: (grid[(w, *chosen[w])]["avg"], -WEIGHTINGS.index(w)))
    log.info("validation: selected %s; prefers %s", chosen, winner)

    # test: only the chosen settings (and the paper defaults, the base, experts, merged)
    expert_test = {task: scorer.accuracy(experts[task], task, "test") for task in TASKS}
    expert_test["avg"] = float(np.mean([expert_test[t] for t in TASKS]))
    expert_val = {task: record["experts"][task]["validation_accuracy"] for task in TASKS}
    expert_val["avg"] = float(np.mean([expert_val[t] for t in TASKS]))
    merged_test = scorer.all_tasks(merged, "test")
    finals = [
        {"kind": "base", "validation": scorer.all_tasks(base, "validation"),
         "test": scorer.all_tasks(base, "test")},
        {"kind": "experts", "validation": expert_val, "test": expert_test},
        {"kind": f"merged (TA {record['scale']:g})",
         "validation": scorer.all_tasks(merged, "validation"), "test": merged_test},
    ]  # fmt: skip
    for label, settings in [("featcal (val-selected)", chosen), ("featcal (paper defaults)",
                                                                  dict.fromkeys(WEIGHTINGS, PAPER))]:  # fmt: skip
        for w in WEIGHTINGS:
            alpha, lam = settings[w]
            finals.append({
                "kind": label, "weighting": w, "alpha": alpha, "lam": lam,
                "validation": grid[w, alpha, lam],
                "test": scorer.all_tasks(dirs[w, alpha, lam], "test"),
            })  # fmt: skip
    for f in finals:
        if f["kind"] not in ("base", "experts"):
            gap = gap_closed(merged_test["avg"], f["test"]["avg"], expert_test["avg"])
            f["gap"] = None if gap is None else gap + 0.0  # no "-0.0"
    counts = {task: len(scorer.rows[task, "validation"][0]) for task in TASKS}
    noise = {
        w: standard_error(grid[(w, *chosen[w])], counts) for w in WEIGHTINGS
    }  # binomial standard error of each selected average validation accuracy
    seconds = time.perf_counter() - started
    markdown = report(args, record, grid, finals, winner, seconds, noise)
    print(markdown)
    log.info("done in %.1f min", seconds / 60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
