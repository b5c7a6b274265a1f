"""Outputs the LLM ecosystem loads: merged and calibrated models split into indexed safetensors
shards above `--max-shard-size` (run.max_shard_size), carrying the base's tokenizer, chat template
and generation config (an allow-list: not its README.md or .gitattributes), and experts whose
vocabulary is not the base's refused before anything is written (tiny real Llama pools)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import factories
from factories import TINY_LLAMA
from featcal_cli.main import main
from featcal_core.data.synthetic import WORDS, build_pool
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import INDEX_NAME, Checkpoint
from featcal_core.io.digests import sha256_file
from featcal_core.io.markers import MARKER, read_marker, verify_output
from featcal_core.io.shard_size import parse_shard_size
from featcal_core.io.shards import plan_layout
from featcal_core.merging.run import merge_checkpoints
from featcal_core.method.calibration import calibrate

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
#: small enough that the tiny Llama (about 80 kB of float32) is written in several shards
SMALL = "20KB"
#: files of a Hub repository that are not the model's
REPOSITORY_FILES = ("README.md", ".gitattributes", "LICENSE")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A tiny float32 Llama pool whose base folder is as a Hub snapshot holds it: weights, config,
    tokenizer with a chat template, generation config, and the repository's own files."""
    root = tmp_path_factory.mktemp("shards")
    zoo = build_pool(root / "zoo", "llama", TINY_LLAMA, ("alpha", "beta"), rows=6)
    tokenizer = AutoTokenizer.from_pretrained(zoo.base)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(zoo.base)
    GenerationConfig(bos_token_id=2, eos_token_id=3, max_new_tokens=7).save_pretrained(zoo.base)
    for name in REPOSITORY_FILES:
        (zoo.base / name).write_text(f"the base repository's {name}\n")
    return zoo


def _state(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def _merge_args(zoo, out: Path, *extra: str) -> list[str]:
    args = ["merge", "--base", str(zoo.base), "--method", "task_arithmetic"]
    for task, path in zoo.experts.items():
        args += ["--expert", f"{task}={path}"]
    return [*args, "--out", str(out), "--no-progress", *extra]


def _assert_sharded(out: Path, limit: int) -> list[str]:
    """`out` holds shards named as transformers names them, each within `limit` (or one tensor),
    an index that places every tensor and totals their bytes, and a marker listing them all."""
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    count = len(shards)
    assert count > 2, shards
    assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    index = json.loads((out / INDEX_NAME).read_text())
    state = _state(out)
    assert index["weight_map"].keys() == state.keys()
    assert set(index["weight_map"].values()) == set(shards)
    sizes = {name: t.numel() * t.element_size() for name, t in state.items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for shard in shards:
        held = load_file(str(out / shard))
        assert all(index["weight_map"][name] == shard for name in held)
        assert len(held) == 1 or sum(sizes[name] for name in held) <= limit
    listed = read_marker(out)["files"]
    for name in [*shards, INDEX_NAME]:
        assert listed[name] == sha256_file(out / name), name
    assert verify_output(out) is None
    return shards


def _assert_carries_the_base_files(out: Path, base: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    assert (out / "generation_config.json").read_bytes() == (
        base / "generation_config.json"
    ).read_bytes()
    for name in REPOSITORY_FILES:  # a README.md there is featcal's own card (a merge's)
        copied = (out / name).is_file() and "the base repository's" in (out / name).read_text()
        assert not copied and (name == "README.md" or not (out / name).exists()), name
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == TEMPLATE
    assert GenerationConfig.from_pretrained(out).max_new_tokens == 7


def _assert_loads_as(out: Path, expected: dict[str, torch.Tensor]) -> None:
    model = AutoModelForCausalLM.from_pretrained(out)
    state = model.state_dict()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


# ----- merge ---------------------------------------------------------------------------------
def test_merge_written_as_shards_loads_and_equals_the_unsharded_merge(pool, tmp_path):
    flat, out = tmp_path / "flat", tmp_path / "sharded"
    merge_checkpoints(pool.base, pool.experts, flat, "task_arithmetic", progress=False)
    assert sorted(p.name for p in flat.glob("*.safetensors")) == ["model.safetensors"]
    assert not (flat / INDEX_NAME).exists()

    assert main(_merge_args(pool, out, "--max-shard-size", SMALL)) == 0
    _assert_sharded(out, parse_shard_size(SMALL))
    expected = load_file(str(flat / "model.safetensors"))
    got = _state(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
    _assert_loads_as(out, expected)
    _assert_carries_the_base_files(out, pool.base)
    _assert_carries_the_base_files(flat, pool.base)
    assert json.loads((out / "merge.json").read_text())["max_shard_size"] == 20_000


def test_a_source_whose_files_fit_keeps_them_and_its_index(pool, tmp_path):
    """The default limit (transformers' 50GB) keeps a sharded base's own files and index; a
    smaller limit splits anew; one tensor above the limit sits alone in its shard."""
    base = shutil.copytree(pool.base, tmp_path / "base")
    factories.reshard(base, shards=2)
    layout = plan_layout(Checkpoint(base))
    assert sorted(layout.files) == sorted(p.name for p in base.glob("*.safetensors"))
    assert layout.copy_index == base / INDEX_NAME and layout.index is None

    split = plan_layout(Checkpoint(base), 1)  # every tensor above the limit
    assert len(split.files) == len(Checkpoint(base).tensors)
    assert split.index is not None and split.copy_index is None
    assert split.index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in _state(base).values()
    )

    out = tmp_path / "merged"
    merge_checkpoints(base, pool.experts, out, "task_arithmetic", progress=False)
    assert (out / INDEX_NAME).read_bytes() == (base / INDEX_NAME).read_bytes()
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(layout.files)


def test_shard_sizes_read_as_transformers_writes_them(pool, tmp_path, capsys):
    assert parse_shard_size(None) == 50 * 10**9  # transformers 5.x save_pretrained's default
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("500MB") == 500 * 10**6
    assert parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size("1.5kb") == 1500
    assert parse_shard_size(4096) == 4096
    for bad in ("5XB", "", "-1GB", "0"):
        with pytest.raises(FeatCalError, match="--max-shard-size"):
            parse_shard_size(bad)
    out = tmp_path / "out"
    factories.cli_fails(
        _merge_args(pool, out, "--max-shard-size", "lots"),
        capsys,
        "--max-shard-size",
        "run.max_shard_size",
    )

    from featcal_core.params import RunSettings

    assert RunSettings().max_shard_size == "50GB"
    assert RunSettings(max_shard_size=1000).max_shard_size == "1000"
    with pytest.raises(ValueError, match="not a size"):
        RunSettings(max_shard_size="big")


def test_the_pipeline_merge_is_redone_when_the_shard_size_changes(pool, tmp_path):
    from featcal.tasks.merge import merge_task

    out = tmp_path / "merged"
    experts = {t: str(p) for t, p in pool.experts.items()}
    merge = merge_task.fn
    merge(str(pool.base), experts, str(out), "task_arithmetic", {"scale": 0.3}, SMALL)
    shards = _assert_sharded(out, parse_shard_size(SMALL))
    written = out.stat().st_ino
    merge(str(pool.base), experts, str(out), "task_arithmetic", {"scale": 0.3}, SMALL)
    assert out.stat().st_ino == written  # reused, not written again
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    merge(str(pool.base), experts, str(out), "task_arithmetic", {"scale": 0.3}, None)
    assert out.stat().st_ino != written
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / INDEX_NAME).exists()


# ----- calibrate -----------------------------------------------------------------------------
def test_calibrate_written_as_shards_loads_and_equals_the_unsharded_calibration(pool, tmp_path):
    flat, out = tmp_path / "flat", tmp_path / "sharded"
    settings = dict(num_per_task=4, precision="float32", progress=False)
    calibrate(pool.base, pool.merged, pool.experts, pool.calib, flat, **settings)
    args = [*pool.cli_args(out), "--num-per-task", "4", "--precision", "float32"]
    assert main([*args, "--max-shard-size", SMALL]) == 0
    _assert_sharded(out, parse_shard_size(SMALL))
    assert sorted(p.name for p in flat.glob("*.safetensors")) == ["model.safetensors"]
    expected = load_file(str(flat / "model.safetensors"))
    merged = load_file(str(pool.merged / "model.safetensors"))
    assert not torch.equal(
        expected["model.layers.1.mlp.down_proj.weight"],
        merged["model.layers.1.mlp.down_proj.weight"],
    )
    got = _state(out)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
    _assert_loads_as(out, expected)
    _assert_carries_the_base_files(out, pool.base)  # the merged folder has no tokenizer


# ----- the vocabulary ------------------------------------------------------------------------
def _expert_with_tokenizer(pool, tmp_path: Path, words: list[str], added=()) -> Path:
    """A copy of expert beta saved with a word tokenizer over `words` (plus `added` tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    expert = shutil.copytree(pool.experts["beta"], tmp_path / "beta")
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<s>", "</s>", *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.pad_token = "<pad>"
    tokenizer.add_tokens(list(added))
    tokenizer.save_pretrained(expert)
    return expert


def _files(directory: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()}


def _refused(pool, tmp_path, expert: Path, capsys, *needles: str) -> None:
    """Merge and calibrate both refuse `expert` as beta in one line naming it and `needles`;
    nothing is written and the expert's files are as they were."""
    before = _files(expert)
    zoo = factories.Zoo(pool.base, pool.merged, {**pool.experts, "beta": expert}, pool.calib)
    out = tmp_path / "out"
    for args in (_merge_args(zoo, out), zoo.cli_args(out)):
        line = factories.cli_fails(args, capsys, "expert 'beta'", str(expert), *needles)
        assert "base" in line, line
        assert not out.exists()
        assert [p.name for p in tmp_path.iterdir() if "featcal-tmp" in p.name] == []
    assert _files(expert) == before


def test_an_expert_with_another_vocabulary_is_refused(pool, tmp_path, capsys):
    expert = _expert_with_tokenizer(pool, tmp_path, list(reversed(WORDS)))  # same size
    _refused(pool, tmp_path, expert, capsys, "tokenizer.json", "vocabulary")


def test_an_expert_with_added_tokens_is_refused(pool, tmp_path, capsys):
    expert = _expert_with_tokenizer(pool, tmp_path, WORDS, added=["<tool>"])
    _refused(pool, tmp_path, expert, capsys, "added tokens", "'<tool>'")


def test_an_expert_whose_config_has_another_vocab_size_is_refused(pool, tmp_path, capsys):
    expert = shutil.copytree(pool.experts["beta"], tmp_path / "beta")
    config = json.loads((expert / "config.json").read_text())
    config["vocab_size"] += 8
    (expert / "config.json").write_text(json.dumps(config))
    _refused(pool, tmp_path, expert, capsys, "vocab_size", str(config["vocab_size"]))


def test_other_special_tokens_or_chat_template_only_warn(pool, tmp_path, caplog):
    expert = _expert_with_tokenizer(pool, tmp_path, WORDS)
    tokenizer = AutoTokenizer.from_pretrained(expert)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    tokenizer.pad_token = "</s>"
    tokenizer.save_pretrained(expert)
    experts = {**pool.experts, "beta": expert}
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="featcal_core"):
        merge_checkpoints(pool.base, experts, out, "average", progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("chat template" in w and str(expert) in w for w in warnings), warnings
    assert any("special tokens" in w and "pad_token" in w for w in warnings), warnings
    _assert_carries_the_base_files(out, pool.base)
    assert MARKER in {p.name for p in out.iterdir()}
