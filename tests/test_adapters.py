"""peft LoRA adapters as experts (featcal_core.io.adapters): each materialised tensor equals peft's
`merge_and_unload` (LoRA, rsLoRA, rank/alpha patterns, fan_in_fan_out, biases, modules_to_save,
embeddings, key naming), `featcal merge` and `featcal calibrate` with adapters equal the same runs
with the merged dense experts, and what featcal does not apply is refused in one line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import factories
from factories import TINY_BERT, TINY_LLAMA
from featcal_cli.main import main
from featcal_core.data.synthetic import build_pool
from featcal_core.errors import FeatCalError
from featcal_core.io.adapters import AdapterCheckpoint, is_adapter, open_expert, same_base
from featcal_core.io.checkpoint import Checkpoint

peft = pytest.importorskip("peft")
#: peft's notes on saving embeddings and on 1-d lora_B biases (lora_bias): expected here
pytestmark = [
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`"),
    pytest.mark.filterwarnings("ignore:Adapter 'default'.*invalid shape"),
]

#: the Llama adapters of the tests: plain LoRA (with an embedding and modules_to_save), rsLoRA,
#: rank_pattern / alpha_pattern
LLAMA_LORAS = {
    "lora": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
        modules_to_save=["lm_head"],
    ),
    "rslora": dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "gate_proj"]
    ),
    "patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        rank_pattern={"v_proj": 2, "layers.1.mlp.up_proj": 6},
        alpha_pattern={"q_proj": 3, "up_proj": 20},
    ),
}
RTOL = 1e-5


def _perturb(model, seed: int) -> None:
    """LoRA B (and embedding A) non-zero, modules_to_save copies moved: the adapter changes W."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
            elif "modules_to_save" in name or (param.requires_grad and "lora_" not in name):
                param.add_(0.01 * torch.randn(param.shape, generator=gen, dtype=param.dtype))


def make_adapter(model, config, out: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """Save `model` with a LoRA `config` (perturbed) as a peft adapter at `out`; returns
    merge_and_unload's state dict (the dense expert)."""
    peft_model = peft.get_peft_model(model, config)
    _perturb(peft_model, seed)
    peft_model.save_pretrained(out)
    return {k: v.detach().clone() for k, v in peft_model.merge_and_unload().state_dict().items()}


def save_dense(state: dict[str, torch.Tensor], base: Path, out: Path) -> Path:
    """The dense expert: `state`'s tensors the base holds, in the base's layout and dtypes."""
    out.mkdir(parents=True)
    shutil.copy2(base / "config.json", out / "config.json")
    stored = load_file(str(base / "model.safetensors"))
    save_file(
        {k: state[k].to(v.dtype).contiguous() for k, v in stored.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, key
    scale = want.abs().max().clamp_min(1e-30)
    assert float((got - want).abs().max() / scale) <= RTOL, key


def llama_model(base: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny float32 Llama pool and its adapters: {name: (adapter dir, dense state)}."""
    root = tmp_path_factory.mktemp("adapters")
    pool = build_pool(root / "pool", "llama", TINY_LLAMA, ("alpha", "beta"))
    adapters = {}
    for seed, (name, settings) in enumerate(LLAMA_LORAS.items()):
        config = peft.LoraConfig(**settings)
        state = make_adapter(llama_model(pool.base), config, root / name, seed)
        adapters[name] = (root / name, state)
    return pool, adapters


# ----- (a) materialisation equals merge_and_unload -------------------------------------------
@pytest.mark.parametrize("name", list(LLAMA_LORAS))
def test_llama_adapters_equal_merge_and_unload(llama, name):
    pool, adapters = llama
    directory, state = adapters[name]
    base = Checkpoint(pool.base, "base model")
    expert = open_expert(directory, "expert 'a'", base)
    assert isinstance(expert, AdapterCheckpoint) and is_adapter(directory)
    assert expert.config == base.config and expert.tensors == base.tensors
    got = expert.read(list(base.tensors))
    changed = [k for k in got if not torch.equal(got[k], base.read([k])[k])]
    assert changed  # the adapter changes the base
    for key, tensor in got.items():
        assert_close(tensor, state[key], key)
    assert set(expert.describe()["sha256"]) == {"adapter_model.safetensors", "adapter_config.json"}


def test_row_chunks_and_key_names(llama, tmp_path):
    """Row chunks equal the whole tensor's rows (to float32 rounding); keys with the adapter
    name's segment (`lora_A.default.weight`) or without the `base_model.model.` prefix read the
    same."""
    pool, adapters = llama
    directory, _ = adapters["lora"]
    base = Checkpoint(pool.base, "base model")
    expert = AdapterCheckpoint(directory, base)
    names = list(base.tensors)
    whole = expert.read(names)
    (file,) = base.files
    with expert.reader(file) as reader:
        for key in names:
            rows = whole[key].shape[0]
            parts = [reader.rows(key, a, min(a + 5, rows)) for a in range(0, rows, 5)]
            assert_close(torch.cat(parts), whole[key], key)  # matmul blocking: ulps apart
    stored = load_file(str(directory / "adapter_model.safetensors"))
    for variant, rename in {
        "named": lambda k: (
            k.replace(".lora_A.", ".lora_A.default.")
            .replace(".lora_B.", ".lora_B.default.")
            .replace("lora_embedding_A", "lora_embedding_A.default")
            .replace("lora_embedding_B", "lora_embedding_B.default")
        ),
        "unprefixed": lambda k: k.removeprefix("base_model.model."),
    }.items():
        other = tmp_path / variant
        other.mkdir()
        shutil.copy2(directory / "adapter_config.json", other)
        save_file(
            {rename(k): v for k, v in stored.items()}, str(other / "adapter_model.safetensors")
        )
        again = AdapterCheckpoint(other, base).read(names)
        for key in names:
            assert torch.equal(again[key], whole[key]), (variant, key)


def test_bert_biases_modules_to_save_and_prefixes(tmp_path):
    """bias all / lora_only, lora_bias and modules_to_save on BertForSequenceClassification
    (keys "bert.…") over a BertModel base (keys "…"): the tower as merge_and_unload's."""
    from transformers import BertForSequenceClassification

    pool = build_pool(tmp_path / "pool", "bert", TINY_BERT, ("alpha",))
    base = Checkpoint(pool.base, "base model")
    cases = {
        "all": dict(bias="all", modules_to_save=["classifier", "intermediate.dense"]),
        "lora_only": dict(bias="lora_only"),
        "lora_bias": dict(lora_bias=True),
    }
    for seed, (name, settings) in enumerate(cases.items()):
        torch.manual_seed(seed)
        model = BertForSequenceClassification.from_pretrained(pool.base, num_labels=3)
        config = peft.LoraConfig(
            r=4, lora_alpha=16, target_modules=["query", "value", "output.dense"], **settings
        )
        state = make_adapter(model, config, tmp_path / name, seed)
        got = AdapterCheckpoint(tmp_path / name, base).read(list(base.tensors))
        changed = 0
        for key, tensor in got.items():
            assert_close(tensor, state[f"bert.{key}"], f"{name}: {key}")
            changed += not torch.equal(tensor, base.read([key])[key])
        biases = [k for k in got if k.endswith(".bias") and "attention.self.query" in k]
        assert changed and all(not torch.equal(got[k], base.read([k])[k]) for k in biases), name


def test_fan_in_fan_out_conv1d(tmp_path):
    """GPT-2's Conv1D weights (d_in, d_out) with fan_in_fan_out: (B·A)ᵀ; featcal has no GPT-2
    family, so this is checked where the tensors are materialised."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True
    )
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    state = make_adapter(model, lora, tmp_path / "adapter")
    base = Checkpoint(tmp_path / "base", "base model")
    expert = AdapterCheckpoint(tmp_path / "adapter", base)
    got = expert.read(list(base.tensors))
    assert not torch.equal(
        got["transformer.h.0.attn.c_attn.weight"],
        base.read(["transformer.h.0.attn.c_attn.weight"])["transformer.h.0.attn.c_attn.weight"],
    )
    for key, tensor in got.items():
        assert_close(tensor, state[key], key)
    with expert.reader(base.files[0]) as reader:
        key = "transformer.h.1.mlp.c_fc.weight"
        assert_close(reader.rows(key, 3, 11), got[key][3:11], key)


def test_bfloat16_base(tmp_path):
    """A bfloat16 base: computed in float32, rounded once to bfloat16; as merge_and_unload for
    Linear weights (exactly), within one bfloat16 step for the embedding (peft rounds its delta
    to bfloat16 before adding it)."""
    from transformers import LlamaForCausalLM

    pool = build_pool(tmp_path / "pool", "llama", TINY_LLAMA, ("alpha",), dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_pretrained(pool.base, dtype=torch.bfloat16)
    state = make_adapter(model, peft.LoraConfig(**LLAMA_LORAS["lora"]), tmp_path / "adapter")
    base = Checkpoint(pool.base, "base model")
    got = AdapterCheckpoint(tmp_path / "adapter", base).read(list(base.tensors))
    for key, tensor in got.items():
        assert tensor.dtype == torch.bfloat16
        if key == "model.embed_tokens.weight":
            error = (tensor.float() - state[key].float()).abs().max()
            assert float(error) <= 2**-7 * float(state[key].float().abs().max())
        else:
            assert torch.equal(tensor, state[key]), key


# ----- (b) featcal merge ---------------------------------------------------------------------
def _merge(out: Path, base: Path, experts: dict[str, Path]) -> dict[str, torch.Tensor]:
    args = ["merge", "--base", str(base), "--method", "task_arithmetic", "--hp", "scale=1.0"]
    for task, path in experts.items():
        args += ["--expert", f"{task}={path}"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    return load_file(str(out / "model.safetensors"))


def test_merge_with_adapters_equals_dense(llama, tmp_path, monkeypatch):
    pool, adapters = llama
    dense = {
        name: save_dense(state, pool.base, tmp_path / f"dense_{name}")
        for name, (_, state) in adapters.items()
        if name in ("lora", "rslora")
    }
    full = pool.experts["alpha"]
    want = _merge(
        tmp_path / "dense", pool.base, {"a": dense["lora"], "b": dense["rslora"], "c": full}
    )
    experts = {"a": adapters["lora"][0], "b": adapters["rslora"][0], "c": full}
    got = _merge(tmp_path / "adapters", pool.base, experts)
    assert set(got) == set(want)
    for key in want:
        assert_close(got[key], want[key], key)
    record = json.loads((tmp_path / "adapters" / "merge.json").read_text())
    assert set(record["inputs"]["experts"]["a"]["sha256"]) == {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    assert record["inputs"]["experts"]["a"]["path"] == str(adapters["lora"][0].resolve())
    # row chunks (large tensors are merged a chunk of rows at a time)
    monkeypatch.setattr("featcal_core.merging.run.CHUNK_ENTRIES", 100)
    chunked = _merge(tmp_path / "chunked", pool.base, experts)
    for key in want:
        assert_close(chunked[key], want[key], key)


# ----- (c) featcal calibrate -----------------------------------------------------------------
def test_calibrate_with_adapter_equals_dense(llama, tmp_path):
    pool, adapters = llama
    directory, state = adapters["patterns"]
    dense = save_dense(state, pool.base, tmp_path / "dense")

    def calibrate(expert: Path, out: Path) -> dict[str, torch.Tensor]:
        args = ["calibrate", "--base", str(pool.base), "--merged", str(pool.merged)]
        args += ["--expert", f"alpha={expert}", "--expert", f"beta={pool.experts['beta']}"]
        for task, path in pool.calib.items():
            args += ["--calib", f"{task}={path}"]
        assert main([*args, "--out", str(out), "--no-progress"]) == 0
        return load_file(str(out / "model.safetensors"))

    want = calibrate(dense, tmp_path / "out_dense")
    got = calibrate(directory, tmp_path / "out_adapter")
    assert set(got) == set(want)
    for key in want:
        assert_close(got[key], want[key], key)


# ----- (d) refusals and the base check ------------------------------------------------------
@pytest.mark.parametrize(
    "kind, needle",
    [
        ("dora", "DoRA (use_dora)"),
        ("ia3", "peft_type 'IA3'"),
        ("loha", "peft_type 'LOHA'"),
    ],
)
def test_unsupported_adapters_refused(llama, tmp_path, capsys, kind, needle):
    pool, _ = llama
    config = {
        "dora": lambda: peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
        "ia3": lambda: peft.IA3Config(
            target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]
        ),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=["q_proj"]),
    }[kind]()
    peft.get_peft_model(llama_model(pool.base), config).save_pretrained(tmp_path / kind)
    args = ["merge", "--base", str(pool.base), "--expert", f"a={tmp_path / kind}"]
    args += ["--method", "task_arithmetic", "--out", str(tmp_path / "out")]
    factories.cli_fails(args, capsys, needle, str(tmp_path / kind / "adapter_config.json"))


def test_other_refusals(llama, tmp_path):
    pool, adapters = llama
    directory, _ = adapters["lora"]
    base = Checkpoint(pool.base, "base model")
    # a step that reads experts as full models (trained repairs, expert heads)
    with pytest.raises(FeatCalError, match="is a LoRA adapter .*surgery reads experts"):
        open_expert(directory, "expert 'a'", None, reader="surgery")
    # a residual initialisation (PiSSA) and pickled weights
    pissa = tmp_path / "pissa"
    shutil.copytree(directory, pissa)
    config = json.loads((pissa / "adapter_config.json").read_text())
    (pissa / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": "pissa"}))
    with pytest.raises(FeatCalError, match="init_lora_weights 'pissa'"):
        AdapterCheckpoint(pissa, base)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy2(directory / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(FeatCalError, match="adapter_model.bin, which is not read"):
        AdapterCheckpoint(pickled, base)


def test_base_mismatch_is_a_warning(llama, tmp_path, caplog):
    pool, adapters = llama
    directory, _ = adapters["lora"]
    base = Checkpoint(pool.base, "base model")
    assert same_base(str(pool.base), base)
    assert same_base("someone/BASE", base)  # the folder's name, as a Hub id
    assert not same_base("meta-llama/Llama-2-7b-hf", base)
    other = tmp_path / "other"
    shutil.copytree(directory, other)
    config = json.loads((other / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "meta-llama/Llama-2-7b-hf"
    (other / "adapter_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="featcal_core.io.adapters"):
        expert = AdapterCheckpoint(other, base)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("meta-llama/Llama-2-7b-hf" in line and str(pool.base) in line for line in lines)
    assert expert.read(["lm_head.weight"])  # applied to the run's base


def test_resolve_hashes_and_pool_check(llama):
    """A local adapter resolves (its files hashed) and passes the pool check over its base."""
    from featcal_core.provenance.resolve import check_pool, resolve_model

    pool, adapters = llama
    directory, _ = adapters["rslora"]
    base = resolve_model({"kind": "local", "path": str(pool.base)}, "models.base")
    expert = resolve_model({"kind": "local", "path": str(directory)}, "models.experts.a")
    assert set(expert.files) == {"adapter_model.safetensors", "adapter_config.json"}
    assert check_pool(base, {"a": expert}) == "hf-llama"


def test_language_model_evaluation_of_an_adapter(llama, tmp_path):
    """Label continuation and perplexity of an adapter (over the base given as tokenizer_dir)
    equal those of its dense expert."""
    import datasets

    from featcal_core.evaluation.language_model import evaluate_lm_dataset

    pool, adapters = llama
    directory, state = adapters["lora"]
    dense = save_dense(state, pool.base, tmp_path / "dense")
    texts = ["the movie", "a good plot", "awful dull story", "great fun scene"]
    data = datasets.Dataset.from_dict({"text": texts, "label": [0, 1, 0, 1]})
    data.save_to_disk(str(tmp_path / "set"))

    def scores(model: Path) -> dict:
        return evaluate_lm_dataset(model, pool.base, tmp_path / "set", None, ["good", "bad"])

    want, got = scores(dense), scores(directory)
    assert set(got) == set(want) and "perplexity" in got
    assert scores(pool.base)["nll"] != pytest.approx(got["nll"], rel=1e-6)  # applied
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key


def test_untargeted_modules_are_ignored(llama, tmp_path, caplog):
    """LoRA weights of a module target_modules does not name are ignored (as peft ignores them)."""
    pool, adapters = llama
    directory, state = adapters["lora"]
    other = tmp_path / "narrowed"
    shutil.copytree(directory, other)
    config = json.loads((other / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "v_proj", "embed_tokens"]  # down_proj left out
    (other / "adapter_config.json").write_text(json.dumps(config))
    base = Checkpoint(pool.base, "base model")
    with caplog.at_level(logging.WARNING, logger="featcal_core.io.adapters"):
        got = AdapterCheckpoint(other, base).read(list(base.tensors))
    assert any("down_proj" in r.getMessage() for r in caplog.records)
    for key, tensor in got.items():
        want = base.read([key])[key] if "down_proj" in key else state[key]
        assert_close(tensor, want, key)
