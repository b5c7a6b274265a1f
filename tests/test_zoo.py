"""The offline zoo: publishing into a Hugging Face cache folder, `featcal zoo` on datasets built in
the test, reuse, bad input, and the whole flow (zoo → download → ... → report with head
calibration) through a real Prefect flow."""

from __future__ import annotations

import json
import os

import datasets
import numpy as np
import pytest
import yaml
from huggingface_hub import snapshot_download
from PIL import Image

import factories
from featcal_cli.main import main
from featcal_core.errors import FeatCalError
from featcal_core.params import Params, load_params
from featcal_core.zoo import hub_cache
from featcal_core.zoo.build import PRESETS, ZooSpec, build_zoo, load_manifest


def _toy_images(path, vertical: bool, seed: int, rows=(40, 16)):
    """Two classes told apart by which half of a 16×16 image is bright (left/right or top/bottom),
    saved as a DatasetDict with train and test splits (no validation: the zoo carves it)."""
    rng = np.random.default_rng(seed)
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["first", "second"])}
    )
    splits = {}
    for split, count in zip(("train", "test"), rows, strict=True):
        images, labels = [], []
        for _ in range(count):
            label = int(rng.integers(0, 2))
            pixels = rng.integers(0, 60, (16, 16)).astype(np.uint8)
            half = (slice(0, 8), slice(None)) if vertical else (slice(None), slice(0, 8))
            other = (slice(8, 16), slice(None)) if vertical else (slice(None), slice(8, 16))
            pixels[half if label else other] += 150
            images.append(Image.fromarray(pixels, "L"))
            labels.append(label)
        splits[split] = datasets.Dataset.from_dict(
            {"image": images, "label": labels}, features=features
        )
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    return {
        "left": _toy_images(root / "left", vertical=False, seed=0),
        "top": _toy_images(root / "top", vertical=True, seed=1),
    }


# ------------------------------------------------------------------------------ hub cache


def test_publish_resolves_like_a_hub_download(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "x"}')
    (source / "model.safetensors").write_bytes(b"weights")
    commit = hub_cache.publish(source, tmp_path / "hub", "featcal-zoo/toy-base")
    assert len(commit) == 40 and commit == hub_cache.content_commit(source)
    assert hub_cache.publish(source, tmp_path / "hub", "featcal-zoo/toy-base") == commit
    found = snapshot_download(
        "featcal-zoo/toy-base", cache_dir=tmp_path / "hub", local_files_only=True
    )
    assert found.endswith(commit) and (tmp_path / "hub").is_dir()
    (source / "model.safetensors").write_bytes(b"other weights")
    assert hub_cache.publish(source, tmp_path / "hub", "featcal-zoo/toy-base") != commit
    with pytest.raises(FeatCalError, match="owner/name"):
        hub_cache.publish(source, tmp_path / "hub", "no-owner")


# -------------------------------------------------------------------------------- featcal zoo


def test_featcal_zoo_on_own_datasets_then_reuse(toy_data, tmp_path, capsys, caplog):
    out = tmp_path / "zoo"
    argv = [
        "zoo",
        "--modality",
        "image",
        "--name",
        "toy",
        "--out",
        str(out),
        "--no-progress",
        "--pretrain-steps",
        "2",
        "--expert-steps",
        "25",
    ]
    argv += [f"--dataset={task}={path}" for task, path in toy_data.items()]
    assert main(argv) == 0
    manifest = load_manifest(out)
    assert set(manifest["experts"]) == {"left", "top"} and manifest["skipped"] == {}
    for task, entry in manifest["experts"].items():
        rows = manifest["tasks"][task]["rows"]
        assert rows["test"] == 16 and rows["train"] + rows["validation"] == 40
        assert entry["validation_accuracy"] >= 0.8  # the toy task is learnt
        snapshot = snapshot_download(entry["repo_id"], cache_dir=out / "hub", local_files_only=True)
        assert snapshot.endswith(entry["commit"])
        names = set(os.listdir(snapshot))
        assert {"config.json", "model.safetensors", "classifier.safetensors"} <= names
        assert "preprocessor_config.json" in names
    split = datasets.load_from_disk(str(out / "data" / "left"))
    assert set(split) == {"train", "validation", "test"}

    # the same spec again: reused, nothing trained (the manifest is unchanged)
    before = (out / "zoo.json").read_text()
    caplog.set_level("INFO", logger="featcal_core.zoo.build")
    assert main(argv) == 0
    assert (out / "zoo.json").read_text() == before
    assert any("reusing" in r.getMessage() for r in caplog.records)


def test_the_preset_names_agree_in_the_registry_the_params_and_the_cli():
    import argparse

    from featcal_cli.zoo_command import add_arguments
    from featcal_core.params.sections import ZOO_PRESETS

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    choices = next(a.choices for a in parser._actions if a.dest == "preset")
    assert sorted(PRESETS) == sorted(ZOO_PRESETS) == sorted(choices)


def test_the_paper_regime_preset_keeps_base_fitted_heads_and_records_task_vector_sizes(
    toy_data, tmp_path
):
    """vision-paper: each expert's head is fitted on the base's features and frozen; the
    manifest records the base-with-that-head accuracy and ‖τ‖/‖θ₀‖ per expert."""
    import dataclasses

    spec = dataclasses.replace(
        PRESETS["vision-paper"],
        tasks={k: str(v) for k, v in toy_data.items()},
        optional=(),
        max_train=None,
        pretrain_steps=2,
        expert_steps=3,  # enough to move each expert off the base (task_vector_ratio > 0)
    )
    assert spec.extra == {"expert": {"head": "probe"}} and spec.lr < PRESETS["vision"].lr
    manifest = build_zoo(spec, tmp_path / "zoo", progress=False)
    for entry in manifest["experts"].values():
        assert 0.0 <= entry["probe_validation_accuracy"] <= 1.0
        assert 0.0 < entry["task_vector_ratio"] < 0.5
    assert manifest["spec"]["extra"] == {"expert": {"head": "probe"}}

    # the tower's shape as a JSON extra: a deeper base, the experts of its shape
    from transformers import AutoConfig

    deeper = dataclasses.replace(
        spec,
        name="deep",
        pretrain_steps=1,  # only the shapes are checked
        expert_steps=1,
        extra={
            **spec.extra,
            "pretrain": {"tower": {"layers": 2, "hidden_size": 32, "intermediate": 64}},
        },
    )
    manifest = build_zoo(deeper, tmp_path / "deep", progress=False)
    for entry in [manifest["base"], *manifest["experts"].values()]:
        folder = snapshot_download(
            entry["repo_id"], cache_dir=tmp_path / "deep" / "hub", local_files_only=True
        )
        config = AutoConfig.from_pretrained(folder)
        assert (config.num_hidden_layers, config.hidden_size) == (2, 32)


def test_zoo_bad_inputs_are_clear_and_leave_nothing(toy_data, tmp_path):
    no_label = tmp_path / "no_label"
    data = datasets.load_from_disk(str(toy_data["left"]))
    datasets.DatasetDict({k: v.remove_columns("label") for k, v in data.items()}).save_to_disk(
        str(no_label)
    )
    spec = ZooSpec(
        name="bad", modality="image", tasks={"x": str(no_label)}, pretrain_steps=1, expert_steps=1
    )
    out = tmp_path / "zoo"
    with pytest.raises(FeatCalError, match="label"):
        build_zoo(spec, out, progress=False)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".zoo")]

    missing = ZooSpec(name="bad", modality="image", tasks={"x": str(tmp_path / "nowhere")})
    with pytest.raises(FeatCalError, match="neither a built-in source"):
        build_zoo(missing, out, progress=False)

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(FeatCalError, match="not a zoo"):
        build_zoo(PRESETS["vision"], occupied, progress=False)
    assert (occupied / "keep.txt").read_text() == "mine"

    text_source = ZooSpec(name="bad", modality="image", tasks={"x": "polarity"})
    with pytest.raises(FeatCalError, match="modality"):
        build_zoo(text_source, out, progress=False)


def test_zoo_params_validation(tmp_path):
    params = Params.model_validate({"zoo": {"preset": "text"}})
    assert params.zoo.path.as_posix() == "data/zoo/text" and params.models is None
    spec = Params.model_validate(
        {"zoo": {"datasets": {"a": "/x"}, "name": "mine", "expert_steps": 3}}
    ).zoo.spec()
    assert spec.tasks == {"a": "/x"} and spec.name == "mine" and spec.expert_steps == 3
    path = tmp_path / "p.yaml"
    path.write_text("zoo: {preset: vision}\nmodels: {base: ./b, experts: {a: ./a}}\n")
    with pytest.raises(FeatCalError, match="either zoo"):
        load_params(path)
    path.write_text("run: {name: x}\n")
    with pytest.raises(FeatCalError, match=r"models: missing; .*zoo"):
        load_params(path)
    path.write_text("zoo: {preset: audio}\n")
    with pytest.raises(FeatCalError, match=r"zoo\.preset"):
        load_params(path)


# ------------------------------------------------------------------------- the whole flow


def test_flow_builds_the_zoo_and_runs_with_head_calibration(toy_data, tmp_path):
    """The whole flow as `featcal demo` runs it: no PREFECT_API_URL, so on Prefect's embedded
    (temporary) server. (Nothing here depends on how well the experts learnt their tasks, which
    test_featcal_zoo_on_own_datasets_then_reuse checks: a few training steps each.)"""
    params = {
        "run": {"name": "toy", "results_dir": str(tmp_path / "results")},
        "zoo": {
            "preset": "vision",
            "name": "toy",
            "dir": str(tmp_path / "zoo"),
            "datasets": {t: str(p) for t, p in toy_data.items()},
            "pretrain_steps": 2,
            "expert_steps": 3,
        },
        "featcal": {"num_per_task": 8, "batch_size": 8, "heads": True},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    proc = factories.run_featcal(tmp_path, path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    manifest = load_manifest(tmp_path / "zoo")
    lock = json.loads((tmp_path / "results" / "models.lock.json").read_text())
    # the experts were resolved as Hub references from the zoo's cache, at the zoo's commits
    assert lock["base"]["reference"] == "featcal-zoo/toy-base"
    for task, entry in manifest["experts"].items():
        assert lock["experts"][task]["commit"] == entry["commit"]
        assert lock["experts"][task]["reference"] == entry["repo_id"]
    evaluation = json.loads((tmp_path / "results" / "evaluation.json").read_text())
    for task in toy_data:
        row = evaluation[task]
        assert set(row) == {"expert", "merged", "calibrated", "merged_heads", "calibrated_heads"}
        assert all(r["examples"] == 16 for r in row.values())
    report = (tmp_path / "reports" / "toy" / "report.md").read_text()
    assert "Head calibration (beyond the paper)" in report

    # heads fit on other weights than the model now holds are refused, not used
    from featcal.flows.steps import Steps

    steps = Steps(load_params(path))
    assert set(steps.refit_heads()) == {"merged", "calibrated"}
    fitted = tmp_path / "results" / "refit_heads" / "calibrated" / "fitted_on.json"
    record = json.loads(fitted.read_text())
    record["weights"] = {name: "0" * 64 for name in record["weights"]}
    fitted.write_text(json.dumps(record))
    with pytest.raises(FeatCalError, match="fit on other calibrated weights"):
        steps.refit_heads()

    # `featcal compare` on the same zoo params (models and tasks come from the built zoo)
    params["compare"] = {
        "variants": [
            {"name": "merge-only", "set": ["repair.method=none"]},
            {"name": "regmean", "set": ["repair.method=regmean"]},
        ]
    }
    path.write_text(yaml.safe_dump(params))
    proc = factories.run_featcal(tmp_path, path, None, "compare")
    assert proc.returncode == 0, proc.stderr[-3000:]
    compared = json.loads((tmp_path / "reports" / "toy-compare" / "compare.json").read_text())
    assert [v["name"] for v in compared["variants"]] == ["merge-only", "regmean"]
    assert set(compared["evaluation"]) == set(toy_data)
    for variant in compared["variants"]:  # scored on held-out inputs of the zoo's train splits
        assert set(variant["label_free"]["tasks"]) == set(toy_data)
    assert compared["label_free"]["agreement"]["choice"] in ("merge-only", "regmean")


def test_default_params_use_the_vision_zoo_and_dvc_builds_it():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    params = load_params(os.path.join(root, "params.yaml"))
    assert params.zoo is not None and params.zoo.preset == "vision"
    assert params.zoo.path.as_posix().startswith("data/zoo/")
    assert params.featcal.heads  # head calibration shown beside the paper-faithful numbers
    # the label-free choice by default, among candidates that hold the paper's defaults
    assert params.select is not None and params.select.score == "agreement"
    names = [c.name for c in params.select.candidates]
    assert "paper" in names and "tuned-ties" in names
    from featcal.flows.selection_record import check_candidates

    check_candidates(params)
    with open(os.path.join(root, "dvc.yaml")) as handle:
        stages = yaml.safe_load(handle)["stages"]
    assert stages["zoo"]["cmd"] == "featcal zoo --params params.yaml"
    assert "data/zoo" in stages["zoo"]["outs"] and "zoo" in stages["zoo"]["params"]
    assert "data/zoo" in stages["download"]["deps"]
    text = load_params(os.path.join(root, "params", "text.yaml"))
    assert text.zoo.preset == "text" and text.zoo.spec().modality == "text"
