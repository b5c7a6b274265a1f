"""Hostile LoRA adapters (featcal_core.io.adapters): patterns of adapter_config.json that are
invalid or backtrack catastrophically are refused in one line within seconds, fan_in_fan_out is
applied by module type as peft applies it, and an adapter that changes nothing or shares its
folder with a full model is refused in one line."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import factories
from factories import TINY_LLAMA
from featcal_core.data.synthetic import build_pool
from featcal_core.errors import FeatCalError
from featcal_core.io.adapters import AdapterCheckpoint, is_adapter
from featcal_core.io.checkpoint import Checkpoint

peft = pytest.importorskip("peft")

from test_adapters import LLAMA_LORAS, assert_close, llama_model, make_adapter  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`"),
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to"),
]

#: a pattern that makes the `regex` engine backtrack for minutes on a module name
STALL = r"(.|.)*[!?]"
LOGGER = "featcal_core.io.adapters"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny float32 Llama pool and two adapters: {name: (adapter dir, dense state)}."""
    root = tmp_path_factory.mktemp("refusals")
    pool = build_pool(root / "pool", "llama", TINY_LLAMA, ("alpha",))
    adapters = {}
    for seed, name in enumerate(("lora", "rslora")):
        config = peft.LoraConfig(**LLAMA_LORAS[name])
        adapters[name] = (
            root / name,
            make_adapter(llama_model(pool.base), config, root / name, seed),
        )
    return pool, adapters


def edited(source: Path, out: Path, **fields) -> Path:
    """A copy of adapter folder `source` at `out` with `fields` set in adapter_config.json."""
    shutil.copytree(source, out)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return out


def merge_args(base: Path, expert: Path, out: Path) -> list[str]:
    args = ["merge", "--base", str(base), "--expert", f"a={expert}"]
    return [*args, "--method", "task_arithmetic", "--out", str(out), "--no-progress"]


# ----- patterns: bounded time, valid syntax --------------------------------------------------
def test_backtracking_target_modules_is_refused_within_seconds(llama, tmp_path, capsys):
    """`(.|.)*Z` and a pattern that stalls the regex engine: one line each, in seconds."""
    pool, adapters = llama
    for name, pattern, needle in [
        ("z", "(.|.)*Z", "target_modules '(.|.)*Z'"),
        ("stall", STALL, f"target_modules {STALL!r} takes over 2 s to match module names"),
    ]:
        folder = edited(adapters["lora"][0], tmp_path / name, target_modules=pattern)
        started = time.monotonic()
        err = factories.cli_fails(
            merge_args(pool.base, folder, tmp_path / f"out_{name}"),
            capsys,
            f"{folder / 'adapter_config.json'}: ",
            needle,
        )
        assert time.monotonic() - started < 10, err
    assert "list the module names or write a simpler pattern" in err


def _stalling(field: str, adapter: Path, out: Path) -> tuple[Path, str]:
    """`adapter` with STALL in `field`; the field's name in the refusal."""
    if field == "target_modules":
        return edited(adapter, out, target_modules=STALL), "target_modules"
    if field == "exclude_modules":
        return edited(adapter, out, exclude_modules=STALL), "exclude_modules"
    if field == "modules_to_save":
        return edited(adapter, out, modules_to_save=[STALL]), "modules_to_save entry"
    if field == "layers_pattern":
        folder = edited(adapter, out, layers_to_transform=[0], layers_pattern=STALL)
        return folder, "layers_pattern"
    return edited(adapter, out, **{field: {STALL: 2}}), f"{field} key"


@pytest.mark.parametrize(
    "field",
    [
        "target_modules",
        "exclude_modules",
        "modules_to_save",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
    ],
)
def test_every_pattern_field_is_matched_in_bounded_time(llama, tmp_path, monkeypatch, field):
    pool, adapters = llama
    monkeypatch.setattr("featcal_core.io.patterns.BUDGET_S", 0.3)
    folder, name = _stalling(field, adapters["rslora"][0], tmp_path / "stall")
    base = Checkpoint(pool.base, "base model")
    started = time.monotonic()
    with pytest.raises(FeatCalError) as caught:
        AdapterCheckpoint(folder, base)
    assert time.monotonic() - started < 5
    assert str(caught.value) == (
        f"{folder / 'adapter_config.json'}: {name} {STALL!r} takes over 0.3 s to match module "
        "names (catastrophic backtracking, e.g. nested repetition as in (.|.)*); correct it in "
        "that file: list the module names or write a simpler pattern"
    )


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"target_modules": "("}, "target_modules"),
        ({"exclude_modules": "("}, "exclude_modules"),
        ({"modules_to_save": ["lm_head", "("]}, "modules_to_save entry"),
        ({"layers_pattern": ["layers", "("]}, "layers_pattern"),
        ({"rank_pattern": {"(": 2}}, "rank_pattern key"),
        ({"alpha_pattern": {"(": 2}}, "alpha_pattern key"),
    ],
)
def test_an_invalid_pattern_is_one_line(llama, tmp_path, fields, name):
    pool, adapters = llama
    folder = edited(adapters["rslora"][0], tmp_path / "bad", **fields)
    with pytest.raises(FeatCalError) as caught:
        AdapterCheckpoint(folder, Checkpoint(pool.base, "base model"))
    assert str(caught.value) == (
        f"{folder / 'adapter_config.json'}: {name} '(' is not a valid regular expression "
        "(missing ), unterminated subpattern); correct it in that file"
    )


def test_an_invalid_pattern_through_the_cli(llama, tmp_path, capsys):
    pool, adapters = llama
    folder = edited(adapters["lora"][0], tmp_path / "bad", target_modules="(")
    factories.cli_fails(
        merge_args(pool.base, folder, tmp_path / "out"),
        capsys,
        f"{folder / 'adapter_config.json'}: target_modules '(' is not a valid regular expression",
    )


# ----- fan_in_fan_out: by module type, as peft ---------------------------------------------
def _peft_merged(model, folder: Path) -> dict[str, torch.Tensor]:
    merged = peft.PeftModel.from_pretrained(model, folder).merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "fan_in_fan_out" in r.getMessage()
    ]


def test_fan_in_fan_out_is_ignored_for_linear_layers(llama, tmp_path, caplog):
    """A Llama adapter (q_proj, v_proj, down_proj: nn.Linear) with fan_in_fan_out true: applied
    as without it, as peft's merge_and_unload, with one warning."""
    pool, adapters = llama
    directory, dense = adapters["lora"]
    folder = edited(directory, tmp_path / "flagged", fan_in_fan_out=True)
    base = Checkpoint(pool.base, "base model")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = AdapterCheckpoint(folder, base).read(list(base.tensors))
    with pytest.warns(UserWarning, match="target module is `torch.nn.Linear`"):
        want = _peft_merged(llama_model(pool.base), folder)
    for key, tensor in got.items():
        assert_close(tensor, want[key], key)
        assert_close(tensor, dense[key], key)
    modules = sum(".lora_A." in k for k in load_file(str(folder / "adapter_model.safetensors")))
    (line,) = _warnings(caplog)
    assert re.fullmatch(
        rf"{re.escape(str(folder / 'adapter_config.json'))}: fan_in_fan_out is true but "
        rf"{modules} adapted module\(s\) \(e\.g\. '[\w.]+_proj'\) are torch\.nn\.Linear layers; "
        "it is ignored for them, as peft does",
        line,
    ), line
    assert modules == 6  # q_proj, v_proj, down_proj in 2 layers


def test_fan_in_fan_out_is_applied_to_conv1d_layers(tmp_path, caplog):
    """A GPT-2 adapter (c_attn, c_proj, c_fc: Conv1D, c_proj square) whose config says false:
    transposed all the same, as peft's merge_and_unload, with one warning."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True
    )
    make_adapter(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), lora, tmp_path / "adapter")
    folder = edited(tmp_path / "adapter", tmp_path / "unflagged", fan_in_fan_out=False)
    base = Checkpoint(tmp_path / "base", "base model")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = AdapterCheckpoint(folder, base).read(list(base.tensors))
    with pytest.warns(UserWarning, match="target module is `Conv1D`"):
        want = _peft_merged(GPT2LMHeadModel.from_pretrained(tmp_path / "base"), folder)
    key = "transformer.h.0.attn.c_proj.weight"
    assert not torch.equal(got[key], base.read([key])[key])
    for key, tensor in got.items():
        assert_close(tensor, want[key], key)
    assert _warnings(caplog) == [
        f"{folder / 'adapter_config.json'}: fan_in_fan_out is false but 8 adapted module(s) "
        "(e.g. 'transformer.h.0.attn.c_attn') are transformers Conv1D layers; it is applied for "
        "them, as peft does"
    ]


# ----- adapters that change nothing, folders holding two models ------------------------------
def test_an_adapter_for_modules_the_base_lacks_is_refused(llama, tmp_path, capsys):
    pool, adapters = llama
    directory, _ = adapters["rslora"]
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    shutil.copy2(directory / "adapter_config.json", folder)
    stored = load_file(str(directory / "adapter_model.safetensors"))
    renamed = {k.replace(".model.layers.", ".model.blocks."): v for k, v in stored.items()}
    save_file(renamed, str(folder / "adapter_model.safetensors"))
    err = factories.cli_fails(
        merge_args(pool.base, folder, tmp_path / "out"),
        capsys,
        f"expert 'a' {folder}: its {len(renamed)} adapter tensor(s) name modules the base "
        f"{pool.base} lacks (e.g. 'base_model.model.model.blocks.",
        "so it changes no tensor of the base; the adapter is for another model: pass the base "
        f"it was trained on (it names {str(pool.base)!r})",
    )
    example = re.search(r"\(e\.g\. '([^']+)'\)", err)
    assert example is not None and example[1] in renamed


def test_an_adapter_whose_modules_are_all_untargeted_is_refused(llama, tmp_path):
    pool, adapters = llama
    folder = edited(adapters["rslora"][0], tmp_path / "none", target_modules=["o_proj"])
    with pytest.raises(FeatCalError) as caught:
        AdapterCheckpoint(folder, Checkpoint(pool.base, "base model"))
    assert str(caught.value).startswith(
        f"{folder / 'adapter_config.json'}: target_modules ['o_proj'] selects none of the 6 LoRA "
        f"module(s) of {folder / 'adapter_model.safetensors'} (e.g. 'model.layers."
    )
    assert str(caught.value).endswith(
        "; peft refuses such an adapter too: correct target_modules (and exclude_modules, "
        "modules_to_save)"
    )


@pytest.mark.parametrize("full", ["model.safetensors", "model.safetensors.index.json"])
def test_a_folder_with_an_adapter_and_a_full_model_is_refused(llama, tmp_path, capsys, full):
    pool, adapters = llama
    folder = tmp_path / "both"
    shutil.copytree(adapters["lora"][0], folder)
    assert is_adapter(folder)
    shutil.copy2(pool.base / "config.json", folder)
    if full == "model.safetensors":
        shutil.copy2(pool.base / full, folder)
    else:
        (folder / full).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    want = (
        f"{folder} holds both a LoRA adapter (adapter_config.json, adapter_model.safetensors) "
        f"and a full model ({full}); keep the adapter and the model in separate folders and pass "
        "the one you mean"
    )
    with pytest.raises(FeatCalError) as caught:
        is_adapter(folder)
    assert str(caught.value) == want
    err = factories.cli_fails(merge_args(pool.base, folder, tmp_path / "out"), capsys, want)
    assert err == f"featcal: error: {want}"
