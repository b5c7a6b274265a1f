"""Merge methods (featcal_core.merging) and `featcal merge`: outputs against independent in-memory
computations, a hand-checked TIES example, layouts, dtypes, and bad inputs."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import factories
from factories import TINY_LLAMA
from featcal_cli import merge_command
from featcal_cli.main import build_parser
from featcal_core import merging
from featcal_core.data.synthetic import build_pool
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import sha256_file
from featcal_core.io.safetensors_io import Reader
from featcal_core.merging.base import MergeMethod
from featcal_core.merging.run import merge_checkpoints
from featcal_core.merging.ties import Ties, kept_count

TASKS = ("alpha", "beta", "gamma")


# ----- fixtures and helpers --------------------------------------------------------------------
@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoos")
    return {
        "clip": factories.clip_zoo(root / "clip", tasks=TASKS, rows=2),
        "bert": factories.bert_zoo(root / "bert", tasks=TASKS[:2], rows=2),
        "clip_bf16": factories.clip_zoo(
            root / "bf16", tasks=TASKS[:2], dtype=torch.bfloat16, rows=2
        ),
        "llama": build_pool(root / "llama", "llama", TINY_LLAMA, TASKS, rows=2),
        "llama_bf16": build_pool(
            root / "llama16", "llama", TINY_LLAMA, TASKS[:2], dtype=torch.bfloat16, rows=2
        ),
    }


@pytest.fixture
def zoo(zoos, tmp_path):
    """A private copy of the CLIP zoo's base and experts that a test may damage."""
    src = zoos["clip"]
    base = shutil.copytree(src.base, tmp_path / "in" / "base")
    experts = {t: shutil.copytree(p, tmp_path / "in" / p.name) for t, p in src.experts.items()}
    return factories.Zoo(base, src.merged, experts, {})


def _state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (one file or shards), loaded whole."""
    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def _reference(method: str, hp: dict, base: dict, experts: list[dict]) -> dict[str, torch.Tensor]:
    """The merged model computed in memory, in float64, independently of featcal_core.merging."""
    out = {}
    for name, theta0 in base.items():
        b = theta0.double()
        thetas = torch.stack([e[name].double() for e in experts])
        if method == "task_arithmetic":
            out[name] = b + hp["scale"] * (thetas - b).sum(0)
        elif method == "average":
            out[name] = thetas.mean(0)
        elif method == "ties":
            taus = (thetas - b).reshape(len(experts), -1)
            n = taus.shape[1]
            keep = min(n, max(1, math.ceil(n * hp["top_k"] / 100)))
            ordered = taus.abs().sort(dim=1, descending=True).values
            threshold = ordered[:, keep - 1 : keep]  # k-th largest magnitude per task
            trimmed = torch.where(taus.abs() >= threshold, taus, torch.zeros_like(taus))
            sign = torch.sign(trimmed.sum(0))
            agree = (torch.sign(trimmed) == sign) & (trimmed != 0)
            total = (trimmed * agree).sum(0)
            count = agree.sum(0)
            mean = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
            out[name] = b + hp["scale"] * mean.reshape(b.shape)
        else:
            raise AssertionError(method)
    return out


def _leftovers(out: Path) -> list[str]:
    return [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _fails(call, out: Path, *needles: str) -> str:
    """`call()` raises a one-line FeatCalError holding every needle and leaves `out` as it was."""
    existed = out.exists()
    before = sorted(p.name for p in out.iterdir()) if existed else None
    with pytest.raises(FeatCalError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    assert out.exists() == existed
    if existed:
        assert sorted(p.name for p in out.iterdir()) == before
    assert _leftovers(out) == []
    return message


def _edit(path: Path, fn) -> None:
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _checkpoint(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


# ----- every method against an in-memory computation ------------------------------------------
CASES = [
    ("task_arithmetic", {}, {"scale": 0.3}),
    ("task_arithmetic", {"scale": 0.7}, {"scale": 0.7}),
    ("average", {}, {}),
    ("ties", {}, {"top_k": 20.0, "scale": 1.0}),
    ("ties", {"top_k": 35, "scale": 0.6}, {"top_k": 35.0, "scale": 0.6}),
    ("ties", {"top_k": 100}, {"top_k": 100.0, "scale": 1.0}),
]


@pytest.mark.parametrize("family", ["clip", "bert", "llama"])
@pytest.mark.parametrize(("method", "given", "filled"), CASES)
def test_method_matches_in_memory_computation(zoos, tmp_path, family, method, given, filled):
    zoo = zoos[family]
    out = tmp_path / "merged"
    record = merge_checkpoints(zoo.base, zoo.experts, out, method, given, progress=False)

    base = load_file(str(zoo.base / "model.safetensors"))
    experts = [load_file(str(p / "model.safetensors")) for p in zoo.experts.values()]
    expected = _reference(method, filled, base, experts)
    merged = _state(out)
    assert merged.keys() == base.keys()
    for name, tensor in merged.items():
        assert tensor.dtype == base[name].dtype, name
        torch.testing.assert_close(tensor, expected[name].to(tensor.dtype), rtol=1e-6, atol=1e-7)

    # every other file of the base is copied; the record is written and returned
    for path in zoo.base.iterdir():
        if path.name != "model.safetensors":
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert json.loads((out / "merge.json").read_text()) == record
    assert record["method"] == method
    assert record["hyperparameters"] == filled
    assert record["inputs"]["base"]["path"] == str(zoo.base.resolve())
    assert record["inputs"]["base"]["sha256"] == {
        "model.safetensors": sha256_file(zoo.base / "model.safetensors")
    }
    assert sorted(record["inputs"]["experts"]) == sorted(zoo.experts)
    for task, path in zoo.experts.items():
        digest = record["inputs"]["experts"][task]["sha256"]["model.safetensors"]
        assert digest == sha256_file(path / "model.safetensors")
    assert record["tensors"] == {"merged": len(base), "copied": 0}
    assert record["wall_seconds"] >= 0 and record["peak_rss_bytes"] > 0
    assert _leftovers(out) == []


def test_merged_model_loads_with_transformers(zoos, tmp_path):
    from transformers import CLIPVisionModel

    zoo = zoos["clip"]
    out = tmp_path / "merged"
    merge_checkpoints(zoo.base, zoo.experts, out, "ties", progress=False)
    model = CLIPVisionModel.from_pretrained(out)
    assert model.config.hidden_size == factories.TINY_CLIP["hidden_size"]


# ----- TIES by hand ----------------------------------------------------------------------------
def test_ties_hand_checked_example():
    """top_k 50 keeps k = 3 of 6 entries per task vector, ties at the threshold all kept.

    θ0 = [1, -1, 0.5, 2, 0, 3]
    τ1 = [ 0.5, -2.0,  0.1, 0.0,  3.0, 0.25] → trimmed [ 0.5, -2, 0, 0,  3, 0   ]  (3, 2, 0.5)
    τ2 = [-1.0, -1.0,  0.2, 0.4, -4.0, 1.0 ] → trimmed [-1,   -1, 0, 0, -4, 1   ]  (4, then 1 ×3)
    τ3 = [ 2.0,  0.5, -0.3, 0.0,  1.0, 0.75] → trimmed [ 2,    0, 0, 0,  1, 0.75]  (2, 1, 0.75)
    Σ  = [1.5, -3, 0, 0, 0, 1.75] → γ = [+, −, 0, 0, 0, +]
    disjoint mean = [(0.5+2)/2, (−2−1)/2, 0, 0, 0, (1+0.75)/2] = [1.25, −1.5, 0, 0, 0, 0.875]
    """
    theta0 = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, 3.0], dtype=torch.float64)
    taus = [
        [0.5, -2.0, 0.1, 0.0, 3.0, 0.25],
        [-1.0, -1.0, 0.2, 0.4, -4.0, 1.0],
        [2.0, 0.5, -0.3, 0.0, 1.0, 0.75],
    ]
    experts = [theta0 + torch.tensor(t, dtype=torch.float64) for t in taus]
    copies = [e.clone() for e in experts]
    ties = merging.get("ties")
    merged = ties.merge_tensor(theta0, experts, ties.check({"top_k": 50}))
    expected = theta0 + torch.tensor([1.25, -1.5, 0.0, 0.0, 0.0, 0.875], dtype=torch.float64)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-12)
    assert torch.equal(
        merged, torch.tensor([2.25, -2.5, 0.5, 2.0, 0.0, 3.875], dtype=torch.float64)
    )
    half = ties.merge_tensor(theta0, experts, ties.check({"top_k": 50, "scale": 0.5}))
    assert torch.equal(
        half, torch.tensor([1.625, -1.75, 0.5, 2.0, 0.0, 3.4375], dtype=torch.float64)
    )
    # float64 inputs are not modified in place
    assert torch.equal(theta0, torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, 3.0], dtype=torch.float64))
    assert all(torch.equal(e, c) for e, c in zip(experts, copies, strict=True))


def test_ties_trims_per_tensor_and_handles_matrices_and_scalars():
    ties = Ties()
    hp = ties.check({"top_k": 50})
    zero = torch.zeros(2, 2)
    t1 = torch.tensor([[0.125, 0.25], [0.375, 0.5]])  # keeps 0.375, 0.5
    t2 = torch.tensor([[-0.5, 0.125], [0.125, 0.125]])  # keeps 0.5, then the tied 0.125 ×3
    merged = ties.merge_tensor(zero, [t1, t2], hp)
    assert merged.shape == (2, 2) and merged.dtype == torch.float64
    assert torch.equal(merged, torch.tensor([[-0.5, 0.125], [0.25, 0.3125]], dtype=torch.float64))
    # a scalar: its one entry is always kept
    scalar = ties.merge_tensor(
        torch.tensor(1.0), [torch.tensor(1.5), torch.tensor(0.75), torch.tensor(2.0)], hp
    )
    assert scalar.shape == () and float(scalar) == 1.75  # γ = +: mean(0.5, 1.0)
    # experts equal to the base: nothing changes
    assert torch.equal(ties.merge_tensor(t1, [t1, t1], hp), t1.double())


def test_ties_kept_count():
    assert kept_count(10, 20) == 2
    assert kept_count(4, 20) == 1  # ceil(0.8)
    assert kept_count(5, 40) == 2
    assert kept_count(7, 1e-9) == 1  # at least one entry
    assert kept_count(7, 100) == 7


def test_ties_through_a_checkpoint_copies_non_float_tensors(tmp_path):
    theta0 = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, 3.0])
    taus = [
        torch.tensor([0.5, -2.0, 0.1, 0.0, 3.0, 0.25]),
        torch.tensor([-1.0, -1.0, 0.2, 0.4, -4.0, 1.0]),
        torch.tensor([2.0, 0.5, -0.3, 0.0, 1.0, 0.75]),
    ]
    ids = torch.arange(4).reshape(1, 4)
    base = _checkpoint(tmp_path / "base", {"w": theta0, "ids": ids})
    experts = {
        f"t{i}": _checkpoint(tmp_path / f"t{i}", {"w": theta0 + tau, "ids": ids + 10 + i})
        for i, tau in enumerate(taus)
    }
    out = tmp_path / "out"
    record = merge_checkpoints(base, experts, out, "ties", {"top_k": 50}, progress=False)
    merged = load_file(str(out / "model.safetensors"))
    assert torch.equal(merged["w"], torch.tensor([2.25, -2.5, 0.5, 2.0, 0.0, 3.875]))
    assert merged["ids"].dtype == torch.int64 and torch.equal(merged["ids"], ids)
    assert record["tensors"] == {"merged": 1, "copied": 1}


# ----- layouts and dtypes ----------------------------------------------------------------------
def test_sharded_base_keeps_its_shard_layout_and_index(zoos, zoo, tmp_path):
    factories.reshard(zoo.base, shards=3)
    out = tmp_path / "merged"
    record = merge_checkpoints(zoo.base, zoo.experts, out, "task_arithmetic", progress=False)

    shards = sorted(p.name for p in zoo.base.glob("*.safetensors"))
    assert len(shards) == 3
    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    index = "model.safetensors.index.json"
    assert (out / index).read_bytes() == (zoo.base / index).read_bytes()
    for shard in shards:
        with safe_open(str(zoo.base / shard), "pt") as a, safe_open(str(out / shard), "pt") as b:
            assert list(b.keys()) == list(a.keys())
            assert b.metadata() == a.metadata()
            for key in a.keys():
                assert b.get_slice(key).get_dtype() == a.get_slice(key).get_dtype()
    assert set(record["inputs"]["base"]["sha256"]) == {*shards, index}

    unsharded = load_file(str(zoos["clip"].base / "model.safetensors"))
    experts = [load_file(str(p / "model.safetensors")) for p in zoo.experts.values()]
    expected = _reference("task_arithmetic", {"scale": 0.3}, unsharded, experts)
    merged = _state(out)
    assert merged.keys() == unsharded.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name].float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_sharded_bf16_llama_gives_sharded_output_with_index_config_and_tokenizer(
    zoos, tmp_path, method
):
    """A Llama-layout causal LM in bf16, base and experts in shards of different counts: the output
    keeps the base's shards and index, is bf16, equals the unsharded merge, and carries the base's
    config and tokenizer files."""
    src = zoos["llama_bf16"]
    base = shutil.copytree(src.base, tmp_path / "base")
    experts = {t: shutil.copytree(p, tmp_path / p.name) for t, p in src.experts.items()}
    factories.reshard(base, shards=3)
    for count, path in enumerate(experts.values(), start=2):
        factories.reshard(path, shards=count)
    out, flat = tmp_path / "merged", tmp_path / "flat"
    merge_checkpoints(base, experts, out, method, progress=False)
    merge_checkpoints(src.base, src.experts, flat, method, progress=False)
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert len(shards) == 3 and sorted(p.name for p in out.glob("*.safetensors")) == shards
    index = "model.safetensors.index.json"
    assert (out / index).read_bytes() == (base / index).read_bytes()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes(), name
    merged, expected = _state(out), _state(flat)
    assert merged.keys() == expected.keys()
    assert all(t.dtype == torch.bfloat16 for t in merged.values())
    for key, tensor in merged.items():
        assert torch.equal(tensor, expected[key]), key


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "average"])
def test_bf16_inputs_give_bf16_output(zoos, tmp_path, method):
    zoo = zoos["clip_bf16"]
    out = tmp_path / "merged"
    merge_checkpoints(zoo.base, zoo.experts, out, method, progress=False)
    base = load_file(str(zoo.base / "model.safetensors"))
    assert {t.dtype for t in base.values()} == {torch.bfloat16}
    experts = [load_file(str(p / "model.safetensors")) for p in zoo.experts.values()]
    hp = merging.get(method).check({})
    expected = _reference(method, hp, base, experts)
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}
    for name, tensor in load_file(str(out / "model.safetensors")).items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor, expected[name].to(torch.bfloat16))


def test_expert_in_another_float_dtype_is_merged_into_the_base_dtype(zoos, zoo, tmp_path):
    _edit(
        zoo.experts["beta"] / "model.safetensors",
        lambda t: t.update({k: v.double() for k, v in t.items()}),
    )
    out = tmp_path / "merged"
    merge_checkpoints(zoo.base, zoo.experts, out, "average", progress=False)
    merged = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in merged.values()} == {torch.float32}


def test_reads_one_tensor_name_at_a_time(zoo, tmp_path, monkeypatch):
    """Base and expert tensors are read name by name, never a whole model ahead."""
    names: list[str] = []
    original = Reader.__getitem__

    def spy(self, name):
        names.append(name)
        return original(self, name)

    monkeypatch.setattr(Reader, "__getitem__", spy)
    merge_checkpoints(zoo.base, zoo.experts, tmp_path / "out", "ties", progress=False)
    group = 1 + len(zoo.experts)
    runs = [names[i : i + group] for i in range(0, len(names), group)]
    assert all(len(set(run)) == 1 and len(run) == group for run in runs)
    assert len({run[0] for run in runs}) == len(runs)  # every name read in one run only


@pytest.mark.parametrize(("method", "given", "filled"), CASES)
def test_row_chunks_give_the_whole_tensor_merge_bit_for_bit(
    zoos, tmp_path, monkeypatch, method, given, filled
):
    """Tensors above CHUNK_ENTRIES are merged in row chunks (TIES: thresholds from the whole
    tensor first), never read whole, and give exactly the whole-tensor merge."""
    import featcal_core.merging.run as run

    zoo = zoos["llama"]
    whole = tmp_path / "whole"
    merge_checkpoints(zoo.base, zoo.experts, whole, method, given, progress=False)
    rows: list[tuple[str, int, int]] = []
    whole_reads: list[str] = []
    original_rows, original_item = Reader.rows, Reader.__getitem__

    def spy_rows(self, name, start, stop):
        rows.append((name, start, stop))
        return original_rows(self, name, start, stop)

    def spy_item(self, name):
        whole_reads.append(name)
        return original_item(self, name)

    monkeypatch.setattr(Reader, "rows", spy_rows)
    monkeypatch.setattr(Reader, "__getitem__", spy_item)
    monkeypatch.setattr(run, "CHUNK_ENTRIES", 100)  # e.g. (64, 32) → chunks of 3 rows
    chunked = tmp_path / "chunked"
    merge_checkpoints(zoo.base, zoo.experts, chunked, method, given, progress=False)
    assert (chunked / "model.safetensors").read_bytes() == (
        whole / "model.safetensors"
    ).read_bytes()
    large = {
        n
        for n, e in Reader(whole / "model.safetensors").entries.items()
        if math.prod(e.shape) > 100
    }
    assert large and {name for name, _, _ in rows} == large
    assert not large & set(whole_reads)
    assert max(stop - start for _, start, stop in rows) < 64


def test_read_rows_and_chunked_writes(tmp_path):
    from featcal_core.io.safetensors_io import write_streaming

    tensor = torch.arange(60, dtype=torch.bfloat16).reshape(5, 3, 4)
    path = tmp_path / "t.safetensors"
    write_streaming(path, [("t", "BF16", (5, 3, 4))], lambda name: iter(tensor.split(2)))
    with Reader(path) as reader:
        assert torch.equal(reader["t"], tensor)
        assert torch.equal(reader.rows("t", 1, 4), tensor[1:4])
        assert reader.rows("t", 2, 2).shape == (0, 3, 4)
        with pytest.raises(ValueError, match="rows 4:6"):
            reader.rows("t", 4, 6)
    with pytest.raises(ValueError, match="wrote 48 entries, expected 60"):
        write_streaming(path, [("t", "BF16", (5, 3, 4))], lambda name: iter(tensor.split(2)[:2]))


# ----- registry --------------------------------------------------------------------------------
def test_registry_lists_and_gets_methods(monkeypatch, tmp_path, zoos):
    assert {"task_arithmetic", "ties", "average"} <= set(merging.available())
    for name in merging.available():
        method = merging.get(name)
        assert isinstance(method, MergeMethod) and method.name == name
    assert merging.get("ties").check(None) == {"top_k": 20.0, "scale": 1.0}

    monkeypatch.setattr(merging, "REGISTRY", dict(merging.REGISTRY))

    @merging.register
    class First(MergeMethod):
        name = "first_expert"
        defaults: dict = {}

        def merge_tensor(self, base, experts, hp):
            return experts[0].double()

    assert "first_expert" in merging.available()
    zoo = zoos["bert"]
    merge_checkpoints(zoo.base, zoo.experts, tmp_path / "out", "first_expert", progress=False)
    first = load_file(str(next(iter(zoo.experts.values())) / "model.safetensors"))
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(merged[k], first[k]) for k in first)

    class Other(MergeMethod):
        name = "ties"

        def merge_tensor(self, base, experts, hp):
            return base

    with pytest.raises(ValueError, match="ties"):
        merging.register(Other)


def test_merging_imports_no_orchestration():
    code = (
        "import sys, featcal_core.merging as m, featcal_core.merging.run; m.available(); "
        "bad = [x for x in ('prefect', 'mlflow', 'dvc') if x in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----- bad inputs ------------------------------------------------------------------------------
def test_expert_missing_a_tensor(zoo, tmp_path):
    key = "encoder.layers.1.mlp.fc2.bias"
    _edit(zoo.experts["beta"] / "model.safetensors", lambda t: t.pop(key))
    out = tmp_path / "out"
    call = lambda: merge_checkpoints(zoo.base, zoo.experts, out, "ties", progress=False)  # noqa: E731
    _fails(call, out, key, "missing", "expert 'beta'", str(zoo.experts["beta"]))


def test_expert_with_an_extra_tower_tensor(zoo, tmp_path):
    key = "encoder.layers.7.mlp.fc1.bias"  # a block the base does not have
    _edit(zoo.experts["alpha"] / "model.safetensors", lambda t: t.update({key: torch.ones(2)}))
    out = tmp_path / "out"
    call = lambda: merge_checkpoints(zoo.base, zoo.experts, out, "average", progress=False)  # noqa: E731
    _fails(call, out, key, "expert 'alpha'", "lacks", str(zoo.experts["alpha"]))


def test_expert_head_outside_the_base_layout_is_ignored(zoo, tmp_path):
    _edit(zoo.experts["alpha"] / "model.safetensors", lambda t: t.update(head=torch.ones(2)))
    out = tmp_path / "out"
    merge_checkpoints(zoo.base, zoo.experts, out, "average", progress=False)
    assert "head" not in load_file(str(out / "model.safetensors"))


def test_clipmodel_base_with_transformers4_vision_experts(tmp_path):
    """The paper's layout: a full CLIPModel base, CLIPVisionModel experts with 4.x keys. The
    vision tower is merged by canonical name; the text tower is the base's."""
    zoo = factories.clip_zoo(tmp_path / "zoo", tasks=("a", "b"), dtype=torch.float64)
    tower = {k: v for k, v in load_file(str(zoo.base / "model.safetensors")).items()}
    experts = {t: load_file(str(p / "model.safetensors")) for t, p in zoo.experts.items()}
    for path in zoo.experts.values():
        factories.to_transformers4_layout(path)
    clip = factories.clip_model_with_tower(zoo.base, tmp_path / "clipmodel")
    out = tmp_path / "out"
    merge_checkpoints(clip, zoo.experts, out, "task_arithmetic", {"scale": 0.5}, progress=False)
    merged = load_file(str(out / "model.safetensors"))
    base_full = load_file(str(clip / "model.safetensors"))
    assert set(merged) == set(base_full)
    for key, theta0 in tower.items():
        expected = theta0 + 0.5 * sum(e[key] - theta0 for e in experts.values())
        torch.testing.assert_close(merged["vision_model." + key], expected)
    for key in base_full:
        if not key.startswith("vision_model."):
            assert torch.equal(merged[key], base_full[key]), key


def test_expert_with_another_shape(zoo, tmp_path):
    key = "encoder.layers.0.mlp.fc1.weight"
    _edit(zoo.experts["gamma"] / "model.safetensors", lambda t: t.update({key: t[key][:48]}))
    out = tmp_path / "out"
    call = lambda: merge_checkpoints(zoo.base, zoo.experts, out, "task_arithmetic", progress=False)  # noqa: E731
    _fails(call, out, key, "shape", "[48, 32]", "[64, 32]", "expert 'gamma'")


def test_nan_in_an_expert(zoo, tmp_path):
    key = "encoder.layers.1.self_attn.q_proj.weight"
    _edit(
        zoo.experts["alpha"] / "model.safetensors",
        lambda t: t[key].__setitem__((0, 0), float("nan")),
    )
    out = tmp_path / "out"
    call = lambda: merge_checkpoints(zoo.base, zoo.experts, out, "ties", progress=False)  # noqa: E731
    _fails(call, out, key, "NaN or Inf", "expert 'alpha'", str(zoo.experts["alpha"]))


def test_result_overflowing_the_dtype(zoo, tmp_path):
    out = tmp_path / "out"
    call = lambda: merge_checkpoints(  # noqa: E731
        zoo.base, zoo.experts, out, "task_arithmetic", {"scale": 1e40}, progress=False
    )
    _fails(call, out, "NaN or Inf", "F32", "--scale")


def test_unknown_method(zoo, tmp_path):
    out = tmp_path / "out"
    call = lambda: merge_checkpoints(zoo.base, zoo.experts, out, "magic", progress=False)  # noqa: E731
    _fails(call, out, "'magic'", "average", "task_arithmetic", "ties")


@pytest.mark.parametrize(
    ("method", "hp", "needles"),
    [
        ("ties", {"top_k": 0}, ("'top_k'", "--top-k", "> 0", "<= 100", "0")),
        ("ties", {"top_k": 150}, ("'top_k'", "--top-k", "150")),
        ("ties", {"top_k": "20"}, ("'top_k'", "number")),
        ("ties", {"scale": float("nan")}, ("'scale'", "finite")),
        ("task_arithmetic", {"scale": True}, ("'scale'", "number")),
        ("task_arithmetic", {"top_k": 20}, ("'top_k'", "--top-k", "task_arithmetic", "scale")),
        ("average", {"scale": 0.5}, ("'scale'", "average", "no hyperparameters")),
    ],
)
def test_bad_hyperparameter(zoo, tmp_path, method, hp, needles):
    out = tmp_path / "out"
    call = lambda: merge_checkpoints(zoo.base, zoo.experts, out, method, hp, progress=False)  # noqa: E731
    _fails(call, out, *needles)


def test_no_experts(zoo, tmp_path):
    out = tmp_path / "out"
    _fails(lambda: merge_checkpoints(zoo.base, {}, out, "average"), out, "--expert")


def test_missing_expert_directory(zoo, tmp_path):
    out = tmp_path / "out"
    experts = {**zoo.experts, "delta": tmp_path / "nowhere"}
    call = lambda: merge_checkpoints(zoo.base, experts, out, "ties", progress=False)  # noqa: E731
    _fails(call, out, "expert 'delta'", str(tmp_path / "nowhere"), "does not exist")


def test_existing_out_is_left_untouched(zoo, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    call = lambda: merge_checkpoints(zoo.base, zoo.experts, out, "ties", progress=False)  # noqa: E731
    _fails(call, out, str(out), "--overwrite")
    assert (out / "precious.txt").read_text() == "keep me"


def test_failed_overwrite_keeps_the_old_output(zoo, tmp_path):
    out = tmp_path / "out"
    merge_checkpoints(zoo.base, zoo.experts, out, "average", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    key = "encoder.layers.0.mlp.fc2.weight"
    _edit(zoo.experts["beta"] / "model.safetensors", lambda t: t[key].fill_(float("inf")))
    call = lambda: merge_checkpoints(  # noqa: E731
        zoo.base, zoo.experts, out, "ties", overwrite=True, progress=False
    )
    _fails(call, out, key, "NaN or Inf", "expert 'beta'")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_overwrite_replaces(zoo, tmp_path):
    out = tmp_path / "out"
    merge_checkpoints(zoo.base, zoo.experts, out, "average", progress=False)
    merge_checkpoints(zoo.base, zoo.experts, out, "ties", overwrite=True, progress=False)
    assert json.loads((out / "merge.json").read_text())["method"] == "ties"
    assert _leftovers(out) == []


def test_overwrite_refuses_a_folder_featcal_did_not_write(zoo, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    call = lambda: merge_checkpoints(  # noqa: E731
        zoo.base, zoo.experts, out, "ties", overwrite=True, progress=False
    )
    with pytest.raises(FeatCalError, match="was not written by featcal"):
        call()
    assert [p.name for p in out.iterdir()] == ["precious.txt"]


def test_out_may_not_be_an_input(zoo):
    out = zoo.experts["alpha"]
    call = lambda: merge_checkpoints(  # noqa: E731
        zoo.base, zoo.experts, out, "ties", overwrite=True, progress=False
    )
    _fails(call, out, "is an input of this command", "choose another --out")


def test_base_files_that_are_not_copied(zoo, tmp_path):
    (zoo.base / "pytorch_model.bin").write_bytes(b"stale pickled weights")
    (zoo.base / "featcal.json").write_text("{}")
    (zoo.base / "README.md").write_text("a model card")
    out = tmp_path / "out"
    merge_checkpoints(zoo.base, zoo.experts, out, "average", progress=False)
    names = {p.name for p in out.iterdir()}
    assert "config.json" in names
    assert "pytorch_model.bin" not in names and "featcal.json" not in names
    assert "a model card" not in (out / "README.md").read_text()  # the merge's own card


# ----- command line ----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    return build_parser()


def _cli_args(zoo, out: Path, *extra: str) -> list[str]:
    args = ["merge", "--base", str(zoo.base)]
    for task, path in zoo.experts.items():
        args += ["--expert", f"{task}={path}"]
    return [*args, "--out", str(out), "--no-progress", *extra]


def test_cli_merges(zoos, tmp_path):
    zoo = zoos["clip"]
    out = tmp_path / "out"
    argv = _cli_args(zoo, out, "--method", "ties", "--top-k", "30", "--scale", "0.7")
    args = _parser().parse_args(argv)
    assert merge_command.run(args) == 0
    record = json.loads((out / "merge.json").read_text())
    assert record["method"] == "ties"
    assert record["hyperparameters"] == {"top_k": 30.0, "scale": 0.7}
    direct = tmp_path / "direct"
    merge_checkpoints(
        zoo.base, zoo.experts, direct, "ties", {"top_k": 30, "scale": 0.7}, progress=False
    )
    a, b = _state(out), _state(direct)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_defaults_and_bad_input(zoos, tmp_path):
    zoo = zoos["bert"]
    out = tmp_path / "out"
    args = _parser().parse_args(_cli_args(zoo, out, "--method", "task_arithmetic"))
    assert merge_command.run(args) == 0
    assert json.loads((out / "merge.json").read_text())["hyperparameters"] == {"scale": 0.3}

    other = tmp_path / "other"
    args = _parser().parse_args(_cli_args(zoo, other, "--method", "average", "--top-k", "10"))
    _fails(lambda: merge_command.run(args), other, "'top_k'", "--top-k", "average")

    args = _parser().parse_args(_cli_args(zoo, out, "--method", "average"))
    _fails(lambda: merge_command.run(args), out, str(out), "--overwrite")

    twice = [*_cli_args(zoo, other, "--method", "average"), "--expert", f"alpha={zoo.base}"]
    _fails(lambda: merge_command.run(_parser().parse_args(twice)), other, "alpha", "twice")


def test_cli_hp_takes_any_declared_hyperparameter(zoos, tmp_path):
    """--hp KEY=VALUE reaches the method's own check: a method added to the registry needs no
    flag of its own; a key given twice or unknown to the method is refused."""
    zoo = zoos["bert"]
    out = tmp_path / "out"
    args = _parser().parse_args(
        _cli_args(zoo, out, "--method", "ties", "--hp", "top_k=30", "--hp", "scale=0.7")
    )
    assert merge_command.run(args) == 0
    assert json.loads((out / "merge.json").read_text())["hyperparameters"] == {
        "top_k": 30,
        "scale": 0.7,
    }
    other = tmp_path / "other"
    twice = _cli_args(zoo, other, "--method", "ties", "--top-k", "30", "--hp", "top_k=20")
    _fails(lambda: merge_command.run(_parser().parse_args(twice)), other, "'top_k'", "twice")
    unknown = _cli_args(zoo, other, "--method", "task_arithmetic", "--hp", "density=0.5")
    _fails(
        lambda: merge_command.run(_parser().parse_args(unknown)),
        other,
        "'density'",
        "task_arithmetic",
    )


def test_cli_rejects_unknown_method_and_bad_expert_argument(zoos, tmp_path, capsys):
    zoo = zoos["bert"]
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(_cli_args(zoo, tmp_path / "out", "--method", "magic"))
    assert info.value.code == 2
    assert "ties" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(
            [
                "merge",
                "--base",
                "b",
                "--expert",
                "nodir",
                "--method",
                "ties",
                "--out",
                str(tmp_path / "out"),
            ]
        )
    assert "TASK=DIR" in capsys.readouterr().err


def test_old_bert_base_with_position_ids_buffer(tmp_path):
    """Older BERT checkpoints (e.g. all-MiniLM-L6-v2) store the int64 `embeddings.position_ids`
    buffer; experts saved by transformers 5 do not. Merging copies it from the base, the pool
    check and the calibration accept it, and evaluation ignores it."""
    from featcal_core import calibrate
    from featcal_core.provenance.resolve import check_pool, resolve_model

    pool = factories.bert_zoo(tmp_path / "pool", tasks=("alpha", "beta"), delta=0.02)
    weights = pool.base / "model.safetensors"
    tensors = load_file(str(weights))
    width = next(v.shape[0] for k, v in tensors.items() if "position_embeddings" in k)
    tensors["embeddings.position_ids"] = torch.arange(width, dtype=torch.int64)[None]
    save_file(tensors, str(weights), metadata={"format": "pt"})

    out = tmp_path / "merged"
    merge_checkpoints(
        pool.base, pool.experts, out, "task_arithmetic", {"scale": 0.5}, progress=False
    )
    merged = load_file(str(out / "model.safetensors"))
    assert torch.equal(merged["embeddings.position_ids"], tensors["embeddings.position_ids"])
    base = resolve_model({"kind": "local", "path": pool.base}, "models.base")
    experts = {t: resolve_model({"kind": "local", "path": p}, t) for t, p in pool.experts.items()}
    assert check_pool(base, experts) == "hf-bert"
    record = calibrate(
        pool.base, out, pool.experts, pool.calib, tmp_path / "cal", num_per_task=4, progress=False
    )
    assert len(record["blocks"]) >= 1
