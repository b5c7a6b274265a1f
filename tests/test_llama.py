"""Llama-layout decoders (hf-llama: Llama, Mistral, Qwen2): blocks against the HF forward, end to end
through `featcal calibrate` against the float64 reference, and bad inputs (a checkpoint of another
family, a missing shard, no tokenizer, [CLS] pooling)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file
from test_end_to_end import ALPHA, LAM, RHO, _assert_matches, _reference
from transformers import (
    AutoConfig,
    AutoModel,
    AutoTokenizer,
    BertConfig,
    BertModel,
    LlamaForCausalLM,
    LlamaModel,
    Qwen2ForCausalLM,
)

import factories
from factories import TINY_LLAMA
from featcal_cli.main import main
from featcal_core.architectures import detect
from featcal_core.data.synthetic import build_pool, word_tokenizer
from featcal_core.errors import FeatCalError
from reference import Family, reference_featcal

TINY_QWEN2 = dict(TINY_LLAMA, model_type="qwen2")


@pytest.fixture(scope="module")
def llama_pool(tmp_path_factory):
    """A tiny float64 Llama pool (3 tasks), built once; tests that damage it work on copies."""
    root = tmp_path_factory.mktemp("llama")
    return build_pool(
        root / "zoo", "llama", TINY_LLAMA, ("alpha", "beta", "gamma"), dtype=torch.float64
    )


def _run_and_compare(zoo, out: Path, model_cls) -> None:
    assert main(zoo.cli_args(out)) == 0
    _assert_matches(out, _reference(zoo, "llama", model_cls))
    merged = load_file(str(zoo.merged / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    for key in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight"):
        assert not torch.equal(got[key], merged[key]), key
    for key in merged:  # embeddings, the final norm and lm_head are not calibrated
        if ".layers." not in key:
            assert torch.equal(got[key], merged[key]), key


def test_llama_cli_matches_float64_reference(llama_pool, tmp_path):
    _run_and_compare(llama_pool, tmp_path / "out", LlamaForCausalLM)
    assert LlamaForCausalLM.from_pretrained(tmp_path / "out").dtype == torch.float64


def test_qwen2_with_attention_biases_matches_reference(tmp_path):
    zoo = build_pool(tmp_path / "zoo", "llama", TINY_QWEN2, ("alpha", "beta"), dtype=torch.float64)
    keys = load_file(str(zoo.merged / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.bias" in keys
    assert "model.layers.0.self_attn.o_proj.bias" not in keys
    _run_and_compare(zoo, tmp_path / "out", Qwen2ForCausalLM)


def test_bare_llama_model_expert_gives_the_same_result(llama_pool, tmp_path):
    """An expert saved as a bare LlamaModel (no `model.` prefix, no lm_head) is read the same."""
    plain = tmp_path / "plain"
    assert main(llama_pool.cli_args(plain)) == 0
    bare = tmp_path / "bare"
    LlamaModel.from_pretrained(llama_pool.experts["beta"], dtype=torch.float64).save_pretrained(
        bare
    )
    assert "embed_tokens.weight" in load_file(str(bare / "model.safetensors"))
    zoo = _with_expert(llama_pool, "beta", bare)
    out = tmp_path / "out"
    assert main(zoo.cli_args(out)) == 0
    expected = load_file(str(plain / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_blocks_reproduce_the_hf_model_forward(kind):
    """Stem + run_block, block after block, give the full model's hidden states on real tokens
    (rotary positions, causal + padding mask, Mistral's sliding window shorter than the text)."""
    tokenizer = word_tokenizer()
    extra = {"sliding_window": 3} if kind == "mistral" else {}
    config = AutoConfig.for_model(
        kind,
        vocab_size=len(tokenizer),
        pad_token_id=0,
        **{**TINY_LLAMA, "num_hidden_layers": 3},
        **extra,
    )
    config._attn_implementation = "eager"
    model = AutoModel.from_config(config).eval()
    arch = detect(config.to_dict())
    assert arch.name == "hf-llama" and arch.window == (3 if kind == "mistral" else None)
    enc = tokenizer(["the movie was good fun", "a bad plot"], padding=True, return_tensors="pt")
    mask = enc["attention_mask"]
    with torch.no_grad():
        expected = model(**enc, output_hidden_states=True).hidden_states
        stem = arch.build_stem(torch.float32)
        stem.load_state_dict(model.embed_tokens.state_dict(prefix="embed_tokens."))
        hidden = arch.run_stem(stem, enc)
        for i, layer in enumerate(model.layers):
            block = arch.build_block(torch.float32)
            block.load_state_dict(layer.state_dict())
            hidden = arch.run_block(block, hidden, mask)
            got = model.norm(hidden) if i == len(model.layers) - 1 else hidden
            torch.testing.assert_close(got * mask[..., None], expected[i + 1] * mask[..., None])


def test_missing_pad_token_pads_with_eos(llama_pool, tmp_path):
    word_tokenizer(pad=False).save_pretrained(tmp_path)
    arch = detect(json.loads((llama_pool.base / "config.json").read_text()))
    inputs = arch.prepare_inputs(str(tmp_path), ["the movie", "a good long plot"], 128)
    eos = word_tokenizer().eos_token_id
    assert inputs["input_ids"][0].tolist()[-2:] == [eos, eos]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_missing_tokenizer_and_cls_pooling_fail_clearly(llama_pool, tmp_path):
    config = json.loads((llama_pool.base / "config.json").read_text())
    with pytest.raises(FeatCalError, match="no tokenizer files"):
        detect(config).prepare_inputs(str(tmp_path), ["the movie"], 128)
    with pytest.raises(FeatCalError, match="no pooled token"):
        detect(config, pooling="cls")
    assert detect(config, pooling="mean").pooled_position is None


def _fails(args: list[str], capsys, *needles: str) -> str:
    return factories.cli_fails(args, capsys, *needles)


def _with_expert(pool, task: str, directory: Path):
    """`pool` with task's expert replaced by `directory`."""
    return factories.Zoo(pool.base, pool.merged, {**pool.experts, task: directory}, pool.calib)


def _tiny_bert(directory: Path) -> Path:
    config = BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=30,
    )
    BertModel(config).save_pretrained(directory)
    return directory


def test_bert_expert_with_llama_base_fails_clearly(llama_pool, tmp_path, capsys):
    bert = _tiny_bert(tmp_path / "bert")
    zoo = _with_expert(llama_pool, "beta", bert)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(bert / "config.json"), "hf-bert", "hf-llama")


def test_bert_tensors_under_a_llama_config_fail_clearly(llama_pool, tmp_path, capsys):
    bert = _tiny_bert(tmp_path / "bert")
    shutil.copy2(llama_pool.base / "config.json", bert / "config.json")
    zoo = _with_expert(llama_pool, "beta", bert)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(bert), "'embed_tokens.weight'")


def test_sharded_checkpoint_with_missing_shard_fails_clearly(llama_pool, tmp_path, capsys):
    merged = tmp_path / "merged"
    shutil.copytree(llama_pool.merged, merged)
    factories.reshard(merged, shards=3)
    missing = merged / "model-00002-of-00003.safetensors"
    missing.unlink()
    zoo = factories.Zoo(llama_pool.base, merged, llama_pool.experts, llama_pool.calib)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(missing), "model.safetensors.index.json")


# ----- calibration sets with answers (`target` column) and answer-token weighting -----------------


def _with_targets(pool, root: Path):
    """The pool with calibration sets that also hold a `target` column (one to three words)."""
    calib = {}
    for i, (task, path) in enumerate(pool.calib.items()):
        data = datasets.load_from_disk(str(path))
        words = ["good", "bad great", "the plot was dull"]
        data = data.add_column("target", [" " + words[(i + j) % 3] for j in range(len(data))])
        data.save_to_disk(str(root / f"calib_{task}"))
        calib[task] = root / f"calib_{task}"
    return factories.Zoo(pool.base, pool.merged, pool.experts, calib)


def _answer_inputs(zoo, answer_only: bool, limit: int = 64):
    """Brute-force inputs: each row's tokens (with bos), then its target's tokens; weights 1 at
    the positions whose next token is a target token (answer_only) or at every real token."""
    tok = AutoTokenizer.from_pretrained(zoo.base)
    out = {}
    for task, path in zoo.calib.items():
        data = datasets.load_from_disk(str(path))
        rows = []
        for text, target in zip(data["text"], data["target"], strict=True):
            prompt = tok(text)["input_ids"]
            answer = tok(target, add_special_tokens=False)["input_ids"]
            rows.append((prompt[: limit - len(answer)], answer))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id)
        mask, weights = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
        for i, (prompt, answer) in enumerate(rows):
            seq = prompt + answer
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            for j in range(len(seq) - 1):
                weights[i, j] = 1.0 if j + 1 >= len(prompt) else 0.0
        out[task] = {"input_ids": ids, "attention_mask": mask}
        if answer_only:
            out[task]["weight_mask"] = weights
    return out


@pytest.mark.parametrize("weighting", ["all", "answer"])
def test_targets_and_answer_weighting_match_float64_reference(llama_pool, tmp_path, weighting):
    zoo = _with_targets(llama_pool, tmp_path)
    out = tmp_path / "out"
    assert main(zoo.cli_args(out) + ["--token-weighting", weighting]) == 0
    record = json.loads((out / "featcal.json").read_text())
    assert record["hyperparameters"]["token_weighting"] == weighting

    def load(path):
        return LlamaForCausalLM.from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager"
        ).eval()

    reference = reference_featcal(
        Family("llama"),
        load(zoo.base),
        load(zoo.merged),
        {t: load(p) for t, p in zoo.experts.items()},
        _answer_inputs(zoo, weighting == "answer"),
        ALPHA,
        RHO,
        LAM,
    )
    _assert_matches(out, reference)


def test_answer_weighting_differs_from_all_and_drift_is_measured_on_answers(llama_pool, tmp_path):
    zoo = _with_targets(llama_pool, tmp_path)
    runs = {}
    for weighting in ("all", "answer"):
        out = tmp_path / weighting
        assert main(zoo.cli_args(out) + ["--token-weighting", weighting]) == 0
        runs[weighting] = (
            load_file(str(out / "model.safetensors")),
            json.loads((out / "featcal.json").read_text()),
        )
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(runs["all"][0][key], runs["answer"][0][key])
    # block 0's drift before calibration is the same stems' outputs, measured on other tokens
    before = {w: runs[w][1]["blocks"][0]["drift_before"]["alpha"] for w in runs}
    assert before["all"] != before["answer"]


def test_answer_weighting_needs_targets_and_a_causal_lm(llama_pool, tmp_path, capsys):
    args = llama_pool.cli_args(tmp_path / "out") + ["--token-weighting", "answer"]
    _fails(args, capsys, str(llama_pool.calib["alpha"]), "'target' column", "--token-weighting all")
    assert not (tmp_path / "out").exists()
    bert = factories.bert_zoo(tmp_path / "bert", tasks=("alpha",))
    args = bert.cli_args(tmp_path / "out") + ["--token-weighting", "answer"]
    _fails(args, capsys, "not a causal LM", "hf-bert")


def test_prompt_is_cut_before_the_answer_at_the_token_limit(llama_pool):
    from featcal_core.architectures.llama import prompt_and_answer

    tok = AutoTokenizer.from_pretrained(llama_pool.base)
    inputs = prompt_and_answer(tok, ["the a movie film good bad", "fun"], [" great awful", ""], 5)
    bos = tok.bos_token_id
    great, awful = tok(" great awful", add_special_tokens=False)["input_ids"]
    assert inputs["input_ids"][0].tolist() == [
        bos,
        *tok("the a", add_special_tokens=False)["input_ids"],
        great,
        awful,
    ]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert inputs["weight_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]
