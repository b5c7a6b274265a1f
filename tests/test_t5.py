"""T5 (hf-t5: T5ForConditionalGeneration and T5EncoderModel): the reference's blocks against the HF
forward, end to end through `featcal calibrate` against the float64 reference
(`reference_featcal_t5`), and bad inputs (a checkpoint of another family, an encoder-only expert
for an encoder-decoder base)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_llama import TINY_LLAMA, _fails, _tiny_bert, _with_expert
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5EncoderModel,
    T5ForConditionalGeneration,
)

import factories
from featcal_cli.main import main
from featcal_core.data.synthetic import build_pool, load_pool, t5_tokenizer
from reference import reference_featcal_t5, t5_hidden_states, t5_inputs

ALPHA, RHO, LAM = 0.25, 2.2, 0.05

#: inner dimension (heads × d_kv = 24) differs from d_model; few buckets and a short max distance
#: so that the calibration texts reach the logarithmic and the clamped buckets
TINY_T5 = dict(
    d_model=16,
    d_ff=32,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=2,
    d_kv=12,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=8,
)
#: FLAN-T5 / v1.1 layout: gated-gelu feed-forward, untied-style config, unequal stacks
TINY_T5_GATED = dict(
    TINY_T5, feed_forward_proj="gated-gelu", num_decoder_layers=3, tie_word_embeddings=False
)

TEXTS = [
    "the movie was good fun",
    "a bad plot",
    " ".join(["the long dull story of an actor in a film scene"] * 2),  # 20 words: clamped buckets
]
TARGETS = ["good", "bad awful long dull", "fun story"]


def _tiny_model(settings: dict, encoder_only: bool = False, seed: int = 0):
    """A float64 tiny T5 (eager attention) with every parameter jittered (norm scales and the
    relative attention tables included)."""
    tokenizer = t5_tokenizer()
    config = T5Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        **settings,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = (T5EncoderModel if encoder_only else T5ForConditionalGeneration)(config)
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model, tokenizer


def test_tokenizer_and_decoder_inputs_follow_t5_conventions():
    tokenizer = t5_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.bos_token_id is None
    inputs = t5_inputs(tokenizer, ["the movie", "a good long plot"], ["good", "bad film long"])
    movie, good, bad, film, long = tokenizer.convert_tokens_to_ids(
        ["movie", "good", "bad", "film", "long"]
    )
    assert inputs["input_ids"][0].tolist()[1:] == [movie, 1, 0, 0]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    # labels [[good, </s>, <pad>, <pad>], [bad, film, long, </s>]] shifted right behind the start
    # token (<pad>); the decoder mask marks the positions that predict a real label token
    assert inputs["decoder_input_ids"].tolist() == [[0, good, 1, 0], [0, bad, film, long]]
    assert inputs["decoder_attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    alone = t5_inputs(tokenizer, ["the movie", "a good long plot"])
    assert alone["decoder_input_ids"].tolist() == [[0], [0]]
    assert alone["decoder_attention_mask"].tolist() == [[1], [1]]


@pytest.mark.parametrize("settings", [TINY_T5, TINY_T5_GATED], ids=["relu", "gated-gelu"])
@pytest.mark.parametrize("targets", [TARGETS, None], ids=["targets", "start-token"])
def test_reference_blocks_reproduce_the_hf_forward(settings, targets):
    """Stems + T5Blocks with the reference's position biases and masks, encoder then decoder (with
    the encoder's final-normed output as context), give HF's encoder and decoder outputs."""
    model, tokenizer = _tiny_model(settings)
    inputs = t5_inputs(tokenizer, TEXTS, targets)
    with torch.no_grad():
        out = model(**inputs)
        encoder_out = out.encoder_last_hidden_state
        decoder_out = model.decoder(
            input_ids=inputs["decoder_input_ids"],
            attention_mask=inputs["decoder_attention_mask"],
            encoder_hidden_states=encoder_out,
            encoder_attention_mask=inputs["attention_mask"],
        ).last_hidden_state
        logits = out.logits
    enc, dec = t5_hidden_states(model, inputs)
    torch.testing.assert_close(enc, encoder_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dec, decoder_out, rtol=1e-12, atol=1e-12)
    scale = model.config.d_model**-0.5 if model.config.scale_decoder_outputs else 1.0
    torch.testing.assert_close(model.lm_head(dec * scale), logits, rtol=1e-12, atol=1e-12)
    assert not torch.equal(dec[0], dec[1])  # the encoder context reaches the decoder


def test_reference_blocks_reproduce_the_hf_encoder_model():
    model, tokenizer = _tiny_model(TINY_T5_GATED, encoder_only=True)
    inputs = t5_inputs(tokenizer, TEXTS)
    with torch.no_grad():
        expected = model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        ).last_hidden_state
    enc, dec = t5_hidden_states(model, inputs)
    assert dec is None
    torch.testing.assert_close(enc, expected, rtol=1e-12, atol=1e-12)


# ----- end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def t5_pool(tmp_path_factory):
    """A tiny float64 T5ForConditionalGeneration pool (3 tasks, `text` + `target` columns)."""
    root = tmp_path_factory.mktemp("t5")
    return build_pool(root / "zoo", "t5", TINY_T5, ("alpha", "beta", "gamma"), dtype=torch.float64)


def _inputs(pool, max_length: int = 128):
    tokenizer = AutoTokenizer.from_pretrained(pool.base)
    start = json.loads((pool.base / "config.json").read_text())["decoder_start_token_id"]
    out = {}
    for task, path in pool.calib.items():
        data = datasets.load_from_disk(str(path))
        targets = list(data["target"]) if "target" in data.column_names else None
        out[task] = t5_inputs(tokenizer, list(data["text"]), targets, max_length, start)
    return out


def _reference(pool, model_cls):
    def load(path):
        return model_cls.from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager"
        ).eval()

    experts = {t: load(p) for t, p in pool.experts.items()}
    return reference_featcal_t5(
        load(pool.base), load(pool.merged), experts, _inputs(pool), ALPHA, RHO, LAM
    )


def _run_and_compare(pool, out: Path, model_cls, changed: tuple[str, ...], blocks: int) -> None:
    assert main(pool.cli_args(out)) == 0
    reference = _reference(pool, model_cls)
    merged = load_file(str(pool.merged / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(merged)  # the merged checkpoint's keys (tied aliases stay left out)
    for key, tensor in got.items():
        assert tensor.dtype == torch.float64, key
        torch.testing.assert_close(tensor, reference[key], rtol=1e-9, atol=1e-11, msg=key)
    for key in changed:
        assert not torch.equal(got[key], merged[key]), key
    # shared embedding, relative_attention_bias tables, final norms (and lm_head) stay the merged
    for key in merged:
        if ".block." not in key or "relative_attention_bias" in key:
            assert torch.equal(got[key], merged[key]), key
    record = json.loads((out / "featcal.json").read_text())
    assert len(record["blocks"]) == blocks
    assert model_cls.from_pretrained(out).dtype == torch.float64


def test_t5_end_to_end_matches_float64_reference(t5_pool, tmp_path):
    changed = (
        "encoder.block.0.layer.0.SelfAttention.q.weight",
        "encoder.block.0.layer.0.layer_norm.weight",
        "encoder.block.1.layer.1.DenseReluDense.wo.weight",
        "decoder.block.0.layer.0.SelfAttention.o.weight",
        "decoder.block.1.layer.1.EncDecAttention.k.weight",
        "decoder.block.1.layer.1.EncDecAttention.v.weight",
        "decoder.block.1.layer.1.layer_norm.weight",
        "decoder.block.1.layer.2.DenseReluDense.wi.weight",
    )
    _run_and_compare(t5_pool, tmp_path / "out", T5ForConditionalGeneration, changed, 4)


def test_t5_end_to_end_without_target_column(tmp_path):
    """No `target` column: the decoder sees the start token alone (gated-gelu, 2 + 3 blocks)."""
    pool = build_pool(
        tmp_path / "zoo",
        "t5",
        dict(TINY_T5_GATED, no_target=True),
        ("alpha", "beta"),
        dtype=torch.float64,
    )
    assert "target" not in datasets.load_from_disk(str(pool.calib["alpha"])).column_names
    changed = (
        "encoder.block.1.layer.1.DenseReluDense.wi_0.weight",
        "decoder.block.2.layer.1.EncDecAttention.k.weight",
        "decoder.block.2.layer.2.DenseReluDense.wi_1.weight",
        "decoder.block.2.layer.2.layer_norm.weight",
    )
    _run_and_compare(pool, tmp_path / "out", T5ForConditionalGeneration, changed, 5)


def test_t5_encoder_model_end_to_end(tmp_path):
    """A T5EncoderModel pool (its calibration sets carry a `target` column, which it ignores)."""
    pool = build_pool(
        tmp_path / "zoo",
        "t5",
        dict(TINY_T5_GATED, encoder_only=True),
        ("alpha", "beta", "gamma"),
        dtype=torch.float64,
    )
    keys = load_file(str(pool.merged / "model.safetensors"))
    assert not any(k.startswith("decoder.") for k in keys)
    changed = (
        "encoder.block.0.layer.0.SelfAttention.k.weight",
        "encoder.block.1.layer.1.DenseReluDense.wo.weight",
        "encoder.block.1.layer.1.layer_norm.weight",
    )
    _run_and_compare(pool, tmp_path / "out", T5EncoderModel, changed, 2)


def _to_transformers4_layout(directory: Path, stale_cross_bias: bool) -> None:
    """Rewrite a T5 checkpoint in place the way transformers 4.x wrote FLAN-T5: the tied
    encoder/decoder `embed_tokens` copies and an untied `lm_head` (not the shared embedding); with
    stale_cross_bias, also the unused decoder cross-attention table older checkpoints carry."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    shared = tensors["shared.weight"]
    tensors["encoder.embed_tokens.weight"] = shared.clone()
    if "decoder.final_layer_norm.weight" in tensors:
        tensors["decoder.embed_tokens.weight"] = shared.clone()
        tensors["lm_head.weight"] = shared.flip(0).clone()
        if stale_cross_bias:
            table = tensors["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
            key = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
            tensors[key] = torch.randn_like(table)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("stale_cross_bias", [False, True], ids=["4.x-keys", "stale-cross-bias"])
def test_transformers4_layout_checkpoints_give_the_same_blocks(t5_pool, tmp_path, stale_cross_bias):
    """Checkpoints with 4.x's extra keys (embed_tokens copies, an untied lm_head, a stale cross-
    attention table) calibrate to the same blocks; the extra keys come back as the merged's."""
    plain = tmp_path / "plain"
    assert main(t5_pool.cli_args(plain)) == 0
    expected = load_file(str(plain / "model.safetensors"))
    shutil.copytree(t5_pool.base.parent, tmp_path / "zoo")
    pool = load_pool(tmp_path / "zoo")
    for directory in (pool.base, pool.merged, *pool.experts.values()):
        _to_transformers4_layout(directory, stale_cross_bias)
    out = tmp_path / "out"
    assert main(pool.cli_args(out)) == 0
    got = load_file(str(out / "model.safetensors"))
    merged = load_file(str(pool.merged / "model.safetensors"))
    assert set(got) == set(merged)
    for key in merged:
        if key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-12, atol=1e-12, msg=key)
        else:
            assert torch.equal(got[key], merged[key]), key


# ----- bad inputs -------------------------------------------------------------------------------


def test_bert_expert_with_t5_base_fails_clearly(t5_pool, tmp_path, capsys):
    bert = _tiny_bert(tmp_path / "bert")
    zoo = _with_expert(t5_pool, "beta", bert)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(bert / "config.json"), "hf-bert", "hf-t5")


def test_llama_expert_with_t5_base_fails_clearly(t5_pool, tmp_path, capsys):
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=30, **TINY_LLAMA)).save_pretrained(llama)
    zoo = _with_expert(t5_pool, "gamma", llama)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(llama / "config.json"), "hf-t5")


def test_encoder_only_expert_with_encoder_decoder_base_fails_clearly(t5_pool, tmp_path, capsys):
    """An expert saved as a T5EncoderModel has no decoder blocks to calibrate the decoder with."""
    encoder = tmp_path / "encoder_only"
    T5EncoderModel.from_pretrained(t5_pool.experts["beta"], dtype=torch.float64).save_pretrained(
        encoder
    )
    assert not any(k.startswith("decoder.") for k in load_file(str(encoder / "model.safetensors")))
    zoo = _with_expert(t5_pool, "beta", encoder)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(encoder))


def test_t5_base_without_tokenizer_fails_clearly(t5_pool, tmp_path, capsys):
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(t5_pool.base / name, base / name)
    zoo = factories.Zoo(base, t5_pool.merged, t5_pool.experts, t5_pool.calib)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(base), "tokenizer")


def test_expert_with_missing_shard_fails_clearly(t5_pool, tmp_path, capsys):
    expert = tmp_path / "beta"
    shutil.copytree(t5_pool.experts["beta"], expert)
    factories.reshard(expert, shards=3)
    missing = expert / "model-00003-of-00003.safetensors"
    missing.unlink()
    zoo = _with_expert(t5_pool, "beta", expert)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(missing), "model.safetensors.index.json")
    assert not (tmp_path / "out").exists()
