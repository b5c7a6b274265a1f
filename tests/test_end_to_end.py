"""Tiny CLIP vision and BERT checkpoints, end to end through `featcal calibrate`, against the
in-memory float64 reference in tests/reference.py."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    BertModel,
    CLIPModel,
    CLIPVisionModel,
)

import factories
from featcal_cli.main import main
from reference import Family, reference_featcal

ALPHA, RHO, LAM = 0.25, 2.2, 0.05


def _inputs(zoo, kind):
    out = {}
    for task, path in zoo.calib.items():
        data = datasets.load_from_disk(str(path))
        if kind == "clip":
            processor = AutoImageProcessor.from_pretrained(zoo.base)
            pixels = processor(
                images=[im.convert("RGB") for im in data["image"]], return_tensors="pt"
            )
            pixels = pixels["pixel_values"]
            out[task] = {"pixel_values": pixels, "attention_mask": torch.ones(len(pixels), 17)}
        else:
            tok = AutoTokenizer.from_pretrained(zoo.base)
            enc = tok(
                list(data["text"]),
                padding=True,
                truncation=True,
                max_length=128,
                return_tensors="pt",
            )
            out[task] = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    return out


def _reference(zoo, kind, model_cls):
    def load(p):
        return model_cls.from_pretrained(p, dtype=torch.float64, attn_implementation="eager").eval()

    experts = {t: load(p) for t, p in zoo.experts.items()}
    return reference_featcal(
        Family(kind), load(zoo.base), load(zoo.merged), experts, _inputs(zoo, kind), ALPHA, RHO, LAM
    )


def _assert_matches(out_dir, reference, prefix="", rtol=1e-9, atol=1e-11):
    got = load_file(str(out_dir / "model.safetensors"))
    assert set(got) == {prefix + k for k in reference}
    for key, ref in reference.items():
        torch.testing.assert_close(got[prefix + key].to(torch.float64), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", ["clip", "bert"])
def test_cli_matches_float64_reference(tmp_path, kind):
    build, model_cls = {
        "clip": (factories.clip_zoo, CLIPVisionModel),
        "bert": (factories.bert_zoo, BertModel),
    }[kind]
    zoo = build(tmp_path / "zoo", tasks=("alpha", "beta", "gamma"), dtype=torch.float64)
    out = tmp_path / "out"
    assert main(zoo.cli_args(out)) == 0
    reference = _reference(zoo, kind, model_cls)
    _assert_matches(out, reference)
    # calibration changed the blocks, and only the blocks
    merged = load_file(str(zoo.merged / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    block = (
        "encoder.layers.1.mlp.fc2.weight"
        if kind == "clip"
        else "encoder.layer.1.output.dense.weight"
    )
    assert not torch.equal(got[block], merged[block])
    for key in merged:
        if "encoder." not in key:
            assert torch.equal(got[key], merged[key]), key
    model = model_cls.from_pretrained(out)
    assert model.dtype == torch.float64


def test_record_contents(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "zoo")
    out = tmp_path / "out"
    assert main(zoo.cli_args(out) + ["--alpha", "0.3", "--num-per-task", "5", "--seed", "3"]) == 0
    record = json.loads((out / "featcal.json").read_text())
    assert record["architecture"] == "hf-clip-vision"
    assert record["hyperparameters"]["alpha"] == 0.3
    assert record["hyperparameters"]["num_per_task"] == 5
    calib = record["inputs"]["calibration"]["alpha"]
    assert len(calib["indices"]) == 5 and calib["rows"] == 12
    assert len(calib["sha256"]) == 64
    assert set(record["inputs"]["experts"]) == {"alpha", "beta"}
    assert len(record["inputs"]["merged"]["sha256"]["model.safetensors"]) == 64
    assert [b["index"] for b in record["blocks"]] == [0, 1]
    for block in record["blocks"]:
        assert set(block["drift_before"]) == {"alpha", "beta"}
        assert block["seconds"] >= 0
    assert record["peak_rss_bytes"] > 10_000_000
    # the seeded sample is reproducible and differs with the seed
    out2 = tmp_path / "out2"
    assert main(zoo.cli_args(out2) + ["--num-per-task", "5", "--seed", "4"]) == 0
    other = json.loads((out2 / "featcal.json").read_text())["inputs"]["calibration"]["alpha"]
    assert other["indices"] != calib["indices"]


@pytest.mark.parametrize("extra", [[], ["--alpha", "1", "--lam", "0"]])
def test_calibration_reduces_block_drift(tmp_path, extra):
    """Experts differ from the base in their blocks only: each calibrated block's output is closer
    to the experts' (summed over tasks; the pooled token in the last block) than before."""
    zoo = factories.clip_zoo(tmp_path / "zoo", tasks=("a", "b", "c"), rows=16, blocks_only=True)
    out = tmp_path / "out"
    assert main(zoo.cli_args(out) + extra) == 0
    record = json.loads((out / "featcal.json").read_text())
    for block in record["blocks"]:
        assert sum(block["drift_after"].values()) < sum(block["drift_before"].values()), block


def test_single_expert_equal_to_merged_comes_back_unchanged(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "zoo", tasks=("only",), dtype=torch.float64, rows=16)
    out = tmp_path / "out"
    args = [
        "calibrate",
        "--base",
        str(zoo.base),
        "--merged",
        str(zoo.experts["only"]),
        "--expert",
        f"only={zoo.experts['only']}",
        "--calib",
        f"only={zoo.calib['only']}",
        "--out",
        str(out),
        "--lam",
        "0",
        "--eps",
        "0",
        "--no-progress",
    ]
    assert main(args) == 0
    got = load_file(str(out / "model.safetensors"))
    expert = load_file(str(zoo.experts["only"] / "model.safetensors"))
    for key in expert:
        torch.testing.assert_close(got[key], expert[key], rtol=1e-5, atol=1e-6)


def test_large_lambda_returns_the_anchor(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "zoo", dtype=torch.float64)
    out = tmp_path / "out"
    assert main(zoo.cli_args(out) + ["--lam", "1e9", "--rho", "2.0"]) == 0
    got = load_file(str(out / "model.safetensors"))
    merged = load_file(str(zoo.merged / "model.safetensors"))
    base = load_file(str(zoo.base / "model.safetensors"))
    for key in merged:
        if key.startswith("encoder."):
            anchor = 2.0 * merged[key] - base[key]
            torch.testing.assert_close(got[key], anchor, rtol=1e-5, atol=1e-5)


def test_transformers4_layout_clipmodel_and_shards_give_the_same_result(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "zoo", dtype=torch.float64)
    plain = tmp_path / "plain"
    assert main(zoo.cli_args(plain)) == 0
    reference = load_file(str(plain / "model.safetensors"))

    # experts in 4.x layout (vision_model.*), merged sharded, base a full CLIPModel
    for path in zoo.experts.values():
        factories.to_transformers4_layout(path)
    factories.reshard(zoo.merged, shards=3)
    clip_model_dir = tmp_path / "clipmodel"
    factories.clip_model_with_tower(zoo.base, clip_model_dir)
    zoo.base = clip_model_dir
    mixed = tmp_path / "mixed"
    assert main(zoo.cli_args(mixed)) == 0
    assert (mixed / "model.safetensors.index.json").is_file()
    got = {}
    for shard in sorted(mixed.glob("*.safetensors")):
        got.update(load_file(str(shard)))
    assert set(got) == set(reference)
    for key in reference:
        torch.testing.assert_close(got[key], reference[key], rtol=1e-12, atol=1e-12)
    assert CLIPVisionModel.from_pretrained(mixed).dtype == torch.float64
    assert CLIPModel.from_pretrained(clip_model_dir) is not None


def test_bf16_runs_without_nan_and_matches_fp32(tmp_path):
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        zoo = factories.clip_zoo(tmp_path / f"zoo_{dtype}", dtype=dtype)
        out = tmp_path / f"out_{dtype}"
        assert main(zoo.cli_args(out)) == 0
        results[dtype] = load_file(str(out / "model.safetensors"))
    for key, ref in results[torch.float32].items():
        got = results[torch.bfloat16][key]
        assert got.dtype == torch.bfloat16
        assert torch.isfinite(got.float()).all()
        scale = ref.abs().max().clamp(min=1e-3)
        assert float((got.float() - ref).abs().max() / scale) < 0.05, key


def test_spill_dir_gives_identical_output(tmp_path):
    zoo = factories.bert_zoo(tmp_path / "zoo")
    a, b = tmp_path / "a", tmp_path / "b"
    exact = ["--precision", "float32"]  # another batch size regroups bfloat16's roundings
    assert main(zoo.cli_args(a) + exact) == 0
    spill = tmp_path / "spill"
    assert main(zoo.cli_args(b) + exact + ["--spill-dir", str(spill), "--batch-size", "5"]) == 0
    assert (
        load_file(str(a / "model.safetensors")).keys()
        == load_file(str(b / "model.safetensors")).keys()
    )
    for key, tensor in load_file(str(a / "model.safetensors")).items():
        torch.testing.assert_close(load_file(str(b / "model.safetensors"))[key], tensor)
    assert list(spill.iterdir()) == []  # the spill files are removed afterwards


def test_console_script_runs(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "zoo")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "featcal_cli.main", "-v", *zoo.cli_args(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "block 1 (2 of 2)" in proc.stderr  # a per-block line: one -v away
    assert "calibrated 2 blocks" in proc.stderr
    assert (out / "model.safetensors").is_file()
