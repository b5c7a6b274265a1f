"""A checkpoint that is not what it claims is refused before any work, with its inputs left byte
for byte as they were and no output folder: an index naming a shard outside its folder, a header
whose tensors overlap or leave the file, an expert of another structure than the base (config
fields, extra blocks, extra tensors inside a block), a config whose family is not the weights',
and, in `featcal check`, a truncated expert (featcal_core.io.checkpoint, featcal_core.io.structure,
featcal_core.preflight)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from test_pipeline import write_params

import factories
from featcal_cli.main import main
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.structure import check_same_structure


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny CLIP pool (base, experts alpha and beta) and a tiny BERT one, built once."""
    root = tmp_path_factory.mktemp("pools")
    factories.clip_zoo(root / "clip", rows=4)
    factories.bert_zoo(root / "bert", tasks=("alpha",), rows=4)
    return root


@pytest.fixture
def clip(source, tmp_path):
    """A private copy of the CLIP pool's base and experts: {"base", "alpha", "beta"} → folder."""
    folders = {"base": "base", "alpha": "expert_alpha", "beta": "expert_beta"}
    return {
        k: shutil.copytree(source / "clip" / v, tmp_path / "clip" / v) for k, v in folders.items()
    }


def tree_digest(*folders: Path) -> str:
    """One digest of every file (its bytes) and link (its target) below `folders`."""
    digest = hashlib.sha256()
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(dirs + files):
                path = Path(root, name)
                digest.update(str(path).encode())
                if path.is_symlink():
                    digest.update(b"link:" + os.readlink(path).encode())
                elif path.is_file():
                    digest.update(path.read_bytes())
    return digest.hexdigest()


def merge_refused(models: dict[str, Path], out: Path, capsys, *needles: str, more=()) -> str:
    """`featcal merge` of base + experts exits 2 with one line holding every needle, leaves no
    `out`, and changes no byte of the inputs (nor of the folders in `more`)."""
    before = tree_digest(*models.values(), *more)
    args = ["merge", "--base", str(models["base"]), "--method", "task_arithmetic"]
    for task, folder in models.items():
        if task != "base":
            args += ["--expert", f"{task}={folder}"]
    line = factories.cli_fails([*args, "--out", str(out), "--no-progress"], capsys, *needles)
    assert not out.exists()
    assert tree_digest(*models.values(), *more) == before
    return line


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_header(path: Path, edit) -> None:
    """Rewrite the JSON header of a safetensors file in place (its data bytes unchanged)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length :])


# --------------------------------------------------------------------------- the shard index


def test_an_index_naming_a_shard_outside_the_folder_is_refused(clip, tmp_path, capsys):
    expert = clip["alpha"]
    factories.reshard(expert, shards=2)
    index = expert / "model.safetensors.index.json"
    shard = "model-00002-of-00002.safetensors"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(expert / shard, outside / shard)
    original = index.read_text()

    def names(name: str) -> None:
        data = json.loads(original)
        data["weight_map"] = {k: name if v == shard else v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data))

    for name in (f"../../elsewhere/{shard}", str(outside / shard)):
        names(name)
        merge_refused(
            clip, tmp_path / "out", capsys, str(index), repr(name), "outside", more=[outside]
        )
    names(f"linked/{shard}")  # a folder inside that is a link to one outside
    (expert / "linked").symlink_to(outside, target_is_directory=True)
    merge_refused(clip, tmp_path / "out", capsys, str(index), "linked", "outside", more=[outside])
    (expert / "linked").unlink()
    names(shard)  # the file itself a link out of the folder
    (expert / shard).symlink_to(outside / shard)
    line = merge_refused(clip, tmp_path / "out", capsys, str(index), shard, "a link to")
    assert "copy the shard into" in line

    # a link into a content-addressed cache (the Hugging Face cache's blobs/) is read there
    (expert / shard).unlink()
    blob = outside / hashlib.sha256((outside / shard).read_bytes()).hexdigest()
    shutil.move(outside / shard, blob)
    (expert / shard).symlink_to(blob)
    assert shard in {info.file for info in Checkpoint(expert).tensors.values()}


# --------------------------------------------------------------------------- the header


def test_overlapping_out_of_bounds_or_unowned_header_ranges_are_refused(clip, tmp_path, capsys):
    path = clip["beta"] / "model.safetensors"
    original = path.read_bytes()
    first, second = "encoder.layers.0.mlp.fc1.bias", "encoder.layers.1.mlp.fc1.bias"

    def overlap(header):  # two tensors of one size on the same bytes
        header[second]["data_offsets"] = header[first]["data_offsets"]

    edit_header(path, overlap)
    merge_refused(clip, tmp_path / "out", capsys, str(path), first, second, "overlap")

    def beyond(header):  # the last tensor claims more bytes than the file has
        name = max(
            (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
        )
        start, end = header[name]["data_offsets"]
        header[name]["shape"] = [header[name]["shape"][0] * 2, *header[name]["shape"][1:]]
        header[name]["data_offsets"] = [start, start + 2 * (end - start)]

    path.write_bytes(original)
    edit_header(path, beyond)
    merge_refused(clip, tmp_path / "out", capsys, str(path), "out of bounds")

    # the safetensors library refuses bytes no tensor owns (between tensors or after the last)
    path.write_bytes(original + b"\0" * 8)
    merge_refused(clip, tmp_path / "out", capsys, str(path), "belong to no tensor")


# --------------------------------------------------------------------------- the structure


def test_an_expert_whose_config_has_another_structure_is_refused(clip, tmp_path, capsys):
    config = clip["alpha"] / "config.json"
    edit_config(clip["alpha"], num_attention_heads=8)  # same tensor shapes, other attention
    merge_refused(clip, tmp_path / "out", capsys, str(config), "num_attention_heads is 8", "is 4")
    edit_config(clip["alpha"], num_attention_heads=4, intermediate_size=128)
    merge_refused(clip, tmp_path / "out", capsys, str(config), "intermediate_size is 128")


def test_nested_configs_are_compared_field_by_field(clip, tmp_path):
    base = factories.clip_model_with_tower(clip["base"], tmp_path / "clipmodel")
    other = shutil.copytree(base, tmp_path / "clipmodel_expert")
    for task in ("alpha", "beta"):  # a CLIPModel base, CLIPVisionModel experts: the tower's config
        check_same_structure(Checkpoint(base), Checkpoint(clip[task]))
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["num_attention_heads"] = 2
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(FeatCalError, match="text_config.num_attention_heads is 2") as caught:
        check_same_structure(Checkpoint(base), Checkpoint(other, "expert 'alpha'"))
    assert str(other / "config.json") in str(caught.value) and "is 4" in str(caught.value)


def test_an_extra_block_is_refused_with_or_without_its_config(clip, tmp_path, capsys):
    def add_block(tensors):
        for key in [k for k in tensors if k.startswith("encoder.layers.1.")]:
            tensors[key.replace("layers.1.", "layers.2.")] = tensors[key].clone()

    edit_tensors(clip["beta"], add_block)  # config.json still says 2 blocks
    line = merge_refused(clip, tmp_path / "out", capsys, "expert 'beta'", "encoder.layers.2.")
    assert "lacks" in line and str(clip["beta"]) in line
    edit_config(clip["beta"], num_hidden_layers=3)
    merge_refused(
        clip, tmp_path / "out", capsys, str(clip["beta"] / "config.json"), "num_hidden_layers is 3"
    )


def test_tensors_the_base_lacks_inside_a_block_are_refused_heads_are_noted(
    clip, tmp_path, capsys, caplog
):
    key = "encoder.layers.0.mlp.gate.weight"
    edit_tensors(clip["alpha"], lambda t: t.update({key: torch.ones(4, 4)}))
    merge_refused(clip, tmp_path / "out", capsys, "expert 'alpha'", repr(key), "lacks")

    edit_tensors(clip["alpha"], lambda t: t.pop(key))
    edit_tensors(clip["alpha"], lambda t: t.update({"classifier.weight": torch.ones(3, 32)}))
    args = ["merge", "--base", str(clip["base"]), "--method", "task_arithmetic"]
    args += ["--expert", f"alpha={clip['alpha']}", "--expert", f"beta={clip['beta']}"]
    with caplog.at_level(logging.INFO, logger="featcal_core.io.structure"):
        assert main([*args, "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    notes = [r.getMessage() for r in caplog.records if r.name == "featcal_core.io.structure"]
    assert len(notes) == 1 and "'classifier.weight'" in notes[0] and "expert 'alpha'" in notes[0]
    assert "classifier.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))


# --------------------------------------------------------------------------- config vs weights


def test_a_config_of_another_family_than_the_weights_is_refused(source, clip, tmp_path, capsys):
    bert_config = source / "bert" / "base" / "config.json"
    shutil.copy(bert_config, clip["alpha"] / "config.json")  # BertModel's config, CLIP's weights
    merge_refused(
        clip,
        tmp_path / "out",
        capsys,
        str(clip["alpha"] / "config.json"),
        "'bert' (hf-bert)",
        "'clip_vision_model' (hf-clip-vision)",
    )

    # a BERT base and an expert that says BERT but holds CLIP's weights
    bert = {
        "base": shutil.copytree(source / "bert" / "base", tmp_path / "bert" / "base"),
        "alpha": shutil.copytree(source / "bert" / "expert_alpha", tmp_path / "bert" / "alpha"),
    }
    shutil.copy(clip["beta"] / "model.safetensors", bert["alpha"] / "model.safetensors")
    line = merge_refused(bert, tmp_path / "out", capsys, str(bert["alpha"] / "config.json"))
    assert "holds no hf-bert weights" in line and "embeddings.word_embeddings.weight" in line


# --------------------------------------------------------------------------- featcal check


def test_check_opens_every_local_checkpoint_and_compares_it_with_the_base(tmp_path, capsys):
    params = write_params(tmp_path)
    models = yaml.safe_load(params.read_text())["models"]
    alpha, beta = Path(models["experts"]["alpha"]), Path(models["experts"]["beta"])
    weights = alpha / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    edit_config(beta, num_attention_heads=2)
    before = tree_digest(Path(models["base"]), alpha, beta)
    capsys.readouterr()
    assert main(["check", "--params", str(params)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error: models." in line]
    assert len(errors) == 2, errors
    assert errors[0].startswith("featcal: error: models.experts.alpha: ")
    assert str(weights) in errors[0] and "truncated" in errors[0]
    assert errors[1].startswith("featcal: error: models.experts.beta: ")
    assert str(beta / "config.json") in errors[1] and "num_attention_heads is 2" in errors[1]
    assert tree_digest(Path(models["base"]), alpha, beta) == before
    assert not (tmp_path / "results").exists()
