"""The LLM zoo's tasks and expert fine-tuning (featcal_core/zoo/llm_tasks.py, llm_finetuning.py):
every row's label is what it says (sums checked, lines parsed), modules of the code task stay in
one split, and a tiny config-built Llama fine-tuned on a task learns it and is written with the
base's tokenizer files byte for byte."""

from __future__ import annotations

import ast

import datasets
import pytest
from test_harness import tiny_llama

from featcal_core.zoo import llm_tasks
from featcal_core.zoo.llm_finetuning import clip_text, finetune_causal_expert, prompt
from featcal_core.zoo.sources import load_source


def test_arithmetic_rows_are_labelled_by_their_sums():
    rows = llm_tasks.arithmetic(seed=3)
    assert len(rows.values) == llm_tasks.ARITHMETIC_ROWS and rows.labels.mean() == 0.5
    for text, label in zip(rows.values, rows.labels, strict=True):
        a, rest = text.split(" + ")
        b, c = rest.split(" = ")
        assert (int(a) + int(b) == int(c)) == bool(label), text


def test_code_rows_parse_exactly_when_labelled_valid_and_modules_stay_in_one_split():
    rows = llm_tasks.python_lines(seed=0)
    assert len(rows.values) == llm_tasks.CODE_ROWS
    assert abs(rows.labels.mean() - 0.5) < 0.01
    for text, label in zip(rows.values[:500], rows.labels[:500], strict=True):
        try:
            ast.parse(text)
            parsed = True
        except SyntaxError:
            parsed = False
        assert parsed == bool(label), text
    data = load_source("python_lines", seed=0)
    modules = {}
    for split in ("train", "validation", "test"):
        texts = set(data[split]["text"])
        modules[split] = {m for t, m in zip(rows.values, rows.groups, strict=True) if t in texts}
    assert not modules["train"] & modules["test"] and not modules["train"] & modules["validation"]


def test_prompts_clip_long_texts():
    long = " ".join(f"w{i}" for i in range(200))
    assert len(clip_text(long).split()) == 48
    task = llm_tasks.LLM_TASKS["sentiment"]
    assert prompt(task, "Fine.") == "Review: Fine.\nIs this review positive? Answer:"


@pytest.mark.parametrize("name", sorted(llm_tasks.LLM_TASKS))
def test_every_task_has_a_registered_source_and_two_words(name):
    from featcal_core.zoo.sources import SOURCES

    task = llm_tasks.LLM_TASKS[name]
    assert task.source in SOURCES and "{text}" in task.template and len(set(task.words)) == 2


def test_a_tiny_llama_learns_a_task_and_keeps_the_base_tokenizer(tmp_path):
    from featcal_core.evaluation.language_model import label_continuation

    base = tiny_llama(tmp_path / "base", seed=0)
    task = llm_tasks.LlmTask("toy", "{text} ->", ("fun", "dull"))
    texts = ["good good", "bad bad", "good", "bad"] * 8
    labels = [0, 1, 0, 1] * 8
    data = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": texts, "label": labels})}
    )
    before = label_continuation(base, base, texts[:8], labels[:8], list(task.words), task.template)
    stats = finetune_causal_expert(
        base, data, tmp_path / "expert", task, steps=40, lr=3e-3, batch_size=8, seed=1
    )
    after = label_continuation(
        tmp_path / "expert", base, texts[:8], labels[:8], list(task.words), task.template
    )
    assert after["accuracy"] == 1.0 and after["loss"] < before["loss"], (before, after, stats)
    for path in base.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            assert (tmp_path / "expert" / path.name).read_bytes() == path.read_bytes(), path.name
