"""Each bad input ends with exit status 2, a one-line message naming the file or argument, and no
output directory (or temporary directory) left behind; an existing --out is never touched."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from safetensors.torch import load_file, save_file

import factories
from featcal_cli.main import main


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    return factories.clip_zoo(root / "clip"), factories.bert_zoo(root / "bert")


@pytest.fixture
def zoo(pristine, tmp_path):
    """A private copy of the tiny CLIP zoo that a test may damage."""
    src = pristine[0]
    shutil.copytree(src.base.parent, tmp_path / "clip")
    remap = lambda p: tmp_path / "clip" / p.name  # noqa: E731
    return factories.Zoo(
        remap(src.base),
        remap(src.merged),
        {t: remap(p) for t, p in src.experts.items()},
        {t: remap(p) for t, p in src.calib.items()},
    )


def _fails(args: list[str], capsys, *needles: str) -> str:
    out = Path(args[args.index("--out") + 1])
    existed = out.exists()
    capsys.readouterr()  # drop what building the inputs printed
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("featcal: error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    assert out.exists() == existed
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == []
    return err


def _edit(path: Path, fn) -> None:
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_expert_of_another_architecture(zoo, pristine, tmp_path, capsys):
    zoo.experts["alpha"] = pristine[1].experts["alpha"]  # a BERT expert
    _fails(zoo.cli_args(tmp_path / "out"), capsys, "expert 'alpha'", "hf-bert", "hf-clip-vision")


def test_merged_with_other_shapes(zoo, tmp_path, capsys):
    other = factories.clip_zoo(tmp_path / "wide", tasks=("x",))
    config = json.loads((other.base / "config.json").read_text())
    assert config["intermediate_size"] == 64
    from transformers import CLIPVisionConfig, CLIPVisionModel

    wide = CLIPVisionModel(CLIPVisionConfig(**{**factories.TINY_CLIP, "intermediate_size": 48}))
    wide.save_pretrained(tmp_path / "wide_merged")
    zoo.merged = tmp_path / "wide_merged"
    _fails(zoo.cli_args(tmp_path / "out"), capsys, "merged model", "shape", "mlp.fc1")


def test_missing_tensor(zoo, tmp_path, capsys):
    key = "encoder.layers.1.mlp.fc2.bias"
    _edit(zoo.experts["beta"] / "model.safetensors", lambda t: t.pop(key))
    _fails(zoo.cli_args(tmp_path / "out"), capsys, key, str(zoo.experts["beta"]))


def test_nan_in_weight(zoo, tmp_path, capsys):
    key = "encoder.layers.1.self_attn.q_proj.weight"
    _edit(
        zoo.experts["alpha"] / "model.safetensors",
        lambda t: t[key].__setitem__((0, 0), float("nan")),
    )
    _fails(zoo.cli_args(tmp_path / "out"), capsys, key, "NaN or Inf", str(zoo.experts["alpha"]))


def test_inf_in_hidden_state(zoo, tmp_path, capsys):
    """Finite weights whose activations overflow: caught in the hidden states."""

    def blow_up(tensors):
        tensors["encoder.layers.0.layer_norm1.weight"].fill_(3e38)

    _edit(zoo.experts["beta"] / "model.safetensors", blow_up)
    _fails(zoo.cli_args(tmp_path / "out"), capsys, "NaN or Inf", "expert 'beta'", "block 0")


def test_truncated_safetensors(zoo, tmp_path, capsys):
    path = zoo.merged / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(path), "truncated")


def test_garbage_safetensors(zoo, tmp_path, capsys):
    path = zoo.experts["alpha"] / "model.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(path))


def test_missing_shard(zoo, tmp_path, capsys):
    factories.reshard(zoo.merged, shards=2)
    shard = zoo.merged / "model-00002-of-00002.safetensors"
    shard.unlink()
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(shard), "missing")


def test_model_directory_does_not_exist(zoo, tmp_path, capsys):
    zoo.experts["alpha"] = tmp_path / "nowhere"
    _fails(zoo.cli_args(tmp_path / "out"), capsys, str(tmp_path / "nowhere"), "does not exist")


def test_calibration_set_does_not_exist(zoo, tmp_path, capsys):
    zoo.calib["beta"] = tmp_path / "no_set"
    _fails(zoo.cli_args(tmp_path / "out"), capsys, "--calib beta=", "does not exist")


def test_empty_calibration_set(zoo, tmp_path, capsys):
    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"image": []}).save_to_disk(str(empty))
    zoo.calib["alpha"] = empty
    _fails(zoo.cli_args(tmp_path / "out"), capsys, "--calib alpha=", "empty")


def test_calibration_set_without_the_column(zoo, tmp_path, capsys):
    texts = tmp_path / "texts"
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(texts))
    zoo.calib["alpha"] = texts
    _fails(zoo.cli_args(tmp_path / "out"), capsys, "--calib alpha=", "'image'")


def test_calib_task_without_expert(zoo, tmp_path, capsys):
    zoo.calib["gamma"] = zoo.calib["alpha"]
    _fails(zoo.cli_args(tmp_path / "out"), capsys, "--calib gamma", "--expert gamma")


def test_expert_without_calib(zoo, tmp_path, capsys):
    del zoo.calib["beta"]
    _fails(zoo.cli_args(tmp_path / "out"), capsys, "--expert beta", "--calib beta")


def test_runner_options_need_the_flow_and_spill_dir_does_not_go_with_it(zoo, tmp_path, capsys):
    args = zoo.cli_args(tmp_path / "out")
    _fails(args + ["--runner", "dask"], capsys, "--runner dask", "--results-dir")
    _fails(
        args + ["--results-dir", str(tmp_path / "r"), "--spill-dir", str(tmp_path / "s")],
        capsys,
        "--spill-dir has no effect with --results-dir",
    )


def test_unsupported_architecture(zoo, tmp_path, capsys):
    config_path = zoo.base / "config.json"
    config = json.loads(config_path.read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    config_path.write_text(json.dumps(config))
    _fails(
        zoo.cli_args(tmp_path / "out"),
        capsys,
        str(config_path),
        "GPT2LMHeadModel",
        "hf-bert",
        "hf-clip-vision",
    )


def test_existing_out_is_left_untouched(zoo, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _fails(zoo.cli_args(out), capsys, str(out), "--overwrite")
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_failed_overwrite_keeps_the_old_output(zoo, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(zoo.cli_args(out)) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    zoo.calib["alpha"] = tmp_path / "no_set"
    _fails(zoo.cli_args(out) + ["--overwrite"], capsys, "--calib alpha=")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_overwrite_refuses_a_folder_featcal_did_not_write(zoo, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _fails(zoo.cli_args(out) + ["--overwrite"], capsys, str(out), "was not written by featcal")
    assert [p.name for p in out.iterdir()] == ["precious.txt"]


def test_overwrite_replaces(zoo, tmp_path):
    out = tmp_path / "out"
    assert main(zoo.cli_args(out)) == 0
    (out / "model.safetensors").write_bytes(b"stale")  # ours, even when changed
    assert main(zoo.cli_args(out) + ["--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() != b"stale"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []


def test_bad_input_from_the_shell_prints_no_traceback(zoo, tmp_path):
    zoo.experts["alpha"] = tmp_path / "nowhere"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "featcal_cli.main", *zoo.cli_args(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("featcal: error: ")
    assert not out.exists()
