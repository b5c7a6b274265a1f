"""A Hugging Face cache taken as it is: the snapshot folders `huggingface_hub.snapshot_download`
lays out (every file a symlink to a hash-named blob) against the loopback Hub (tests/mock_hub.py).
A tiny CLIP (slow tokenizer: vocab.json, merges.txt) and a tiny Llama (tokenizer.json) go
through `featcal merge` and `featcal calibrate` from their snapshots and from plain copies of the
same files: the same input digests and bit-identical weights. `featcal run` and `featcal
compare` run from the CLIP snapshots."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from huggingface_hub import snapshot_download
from mock_hub import MockHub
from test_pipeline import write_params

from factories import TINY_LLAMA
from featcal_cli.main import main
from featcal_core.data.synthetic import build_pool, image_set
from featcal_core.io.checkpoint import Checkpoint
from featcal_core.io.vocabulary import check_same_vocabulary, read_vocabulary


def _snapshots(folders: dict[str, Path], cache: Path) -> dict[str, Path]:
    """repo id → its snapshot folder in `cache`, downloaded by huggingface_hub from the loopback
    Hub serving `folders`."""
    with MockHub() as hub:
        for repo_id, folder in folders.items():
            hub.add(repo_id, folder)
        return {
            repo_id: Path(snapshot_download(repo_id, cache_dir=cache, endpoint=hub.endpoint))
            for repo_id in folders
        }


def _plain(snapshot: Path, out: Path) -> Path:
    """The snapshot's files as plain copies (links followed)."""
    shutil.copytree(snapshot, out, symlinks=False)
    return out


def _with_slow_tokenizer_files(base: Path) -> Path:
    """`base` with vocab.json and merges.txt beside its tokenizer.json, as the public CLIP
    repositories have them (vocab.json in its tokenizer's order, not sorted)."""
    model = json.loads((base / "tokenizer.json").read_text())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    (base / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    (base / "merges.txt").write_text("\n".join(["#version: 0.2", *merges]) + "\n")
    return base


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """(the params of test_pipeline's tiny CLIP setting, {repo id: snapshot}, {repo id: copy})."""
    root = tmp_path_factory.mktemp("clip-cache")
    params = yaml.safe_load(write_params(root).read_text())
    folders = {"owner/base": _with_slow_tokenizer_files(Path(params["models"]["base"]))}
    folders |= {f"owner/expert-{t}": Path(p) for t, p in params["models"]["experts"].items()}
    snapshots = _snapshots(folders, root / "hf")
    plain = {r: _plain(s, root / "plain" / r.replace("/", "--")) for r, s in snapshots.items()}
    return params, snapshots, plain


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(the pool's calibration sets, {repo id: snapshot}, {repo id: copy}) of a tiny Llama pool."""
    root = tmp_path_factory.mktemp("llama-cache")
    pool = build_pool(root / "pool", "llama", dict(TINY_LLAMA))
    folders = {"owner/llama": pool.base} | {f"owner/llama-{t}": p for t, p in pool.experts.items()}
    for folder in pool.experts.values():  # experts saved with the base's tokenizer, as published
        shutil.copy(pool.base / "tokenizer.json", folder / "tokenizer.json")
    snapshots = _snapshots(folders, root / "hf")
    plain = {r: _plain(s, root / "plain" / r.replace("/", "--")) for r, s in snapshots.items()}
    return pool.calib, snapshots, plain


def test_snapshot_files_compare_by_their_names_not_their_blobs(clip, llama):
    _, snapshots, plain = clip
    base = snapshots["owner/base"]
    assert (base / "vocab.json").is_symlink() and (base / "merges.txt").is_symlink()
    assert "." not in (base / "vocab.json").resolve().name  # a hash-named blob
    cached, copied = Checkpoint(base, "base model"), Checkpoint(plain["owner/base"], "merged")
    assert read_vocabulary(cached) == read_vocabulary(copied)
    check_same_vocabulary(cached, copied)  # byte-identical files: the same vocabulary
    _, snapshots, plain = llama
    assert (snapshots["owner/llama"] / "tokenizer.json").is_symlink()
    check_same_vocabulary(
        Checkpoint(snapshots["owner/llama"], "base model"),
        Checkpoint(plain["owner/llama-alpha"], "expert"),
    )


def _merge_and_calibrate(models: dict[str, Path], base: str, calib: dict, out: Path) -> Path:
    """`featcal merge` then `featcal calibrate` of `models` (repo id → folder) into out/."""
    experts = {r.rsplit("-", 1)[1]: p for r, p in models.items() if r != base}
    pairs = [arg for task, path in experts.items() for arg in ("--expert", f"{task}={path}")]
    merged, calibrated = out / "merged", out / "calibrated"
    merge = ["merge", "--base", str(models[base]), *pairs, "--method", "task_arithmetic"]
    assert main([*merge, "--out", str(merged), "--no-progress"]) == 0
    calib_args = [arg for task, path in calib.items() for arg in ("--calib", f"{task}={path}")]
    calibrate = ["calibrate", "--base", str(models[base]), "--merged", str(merged), *pairs]
    calibrate += [*calib_args, "--out", str(calibrated), "--num-per-task", "4", "--no-progress"]
    assert main(calibrate) == 0
    return out


def _inputs(record: dict) -> dict:
    """A record's input digests, without the folders' paths."""
    text = json.dumps(record["inputs"], sort_keys=True)
    return json.loads(text, object_hook=lambda d: {k: v for k, v in d.items() if k != "path"})


@pytest.mark.parametrize("setting", ["clip", "llama"])
def test_merge_and_calibrate_from_a_cache_equal_the_plain_copies(setting, request, tmp_path):
    given, snapshots, plain = request.getfixturevalue(setting)
    if setting == "clip":
        base = "owner/base"
        calib = {t: image_set(tmp_path / f"calib_{t}", 8, i) for i, t in enumerate(given["tasks"])}
    else:
        base, calib = "owner/llama", given
    outputs = {
        layout: _merge_and_calibrate(models, base, calib, tmp_path / layout)
        for layout, models in (("cache", snapshots), ("plain", plain))
    }
    weights = [
        (outputs[layout] / "calibrated" / "model.safetensors").read_bytes() for layout in outputs
    ]
    assert weights[0] == weights[1]
    records = [
        json.loads((o / "calibrated" / "featcal.json").read_text()) for o in outputs.values()
    ]
    assert _inputs(records[0]) == _inputs(records[1])
    merges = [json.loads((o / "merged" / "merge.json").read_text()) for o in outputs.values()]
    assert _inputs(merges[0]) == _inputs(merges[1])


@pytest.mark.slow  # featcal processes with Prefect and MLflow
def test_run_and_compare_from_snapshot_folders(clip, tmp_path, prefect_api):
    params, snapshots, _ = clip
    params = dict(params, run=dict(params["run"], results_dir=str(tmp_path / "results")))
    params["models"] = {
        "base": str(snapshots["owner/base"]),
        "experts": {t: str(snapshots[f"owner/expert-{t}"]) for t in params["models"]["experts"]},
    }
    params["compare"] = {
        "variants": [{"name": "ta", "set": ["repair.method=none"]}, {"name": "ta-featcal"}]
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "PREFECT_API_URL": prefect_api,
        "FEATCAL_EVALUATION_CACHE": "off",
    }
    for command in ("run", "compare"):
        cmd = [sys.executable, "-m", "featcal_cli.main", command, "--params", str(path)]
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path
        )
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
    results = tmp_path / "results"
    assert (results / "calibrated" / "featcal.json").is_file()
    assert (results / "variants" / "ta-featcal" / "calibrated" / "featcal.json").is_file()
