"""Calibration sets: seeded samples of local/Hub sources saved for `featcal calibrate`
(featcal_core/data/calibration_sets.py, source_rows.py, tasks/calibration_sets.py). CPU only, no network."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
from PIL import Image

import factories
from factories import grey_image, grey_images, save_grey_image_splits
from featcal_core.data.calibration_data import load_calibration_set
from featcal_core.data.calibration_sets import RECORD_NAME, draw_calibration_set, sample_rows
from featcal_core.data.source_rows import open_source
from featcal_core.errors import FeatCalError
from featcal_core.io.checkpoint import sha256_tree
from featcal_core.io.outputs import MARKER
from featcal_core.params import DataSource, Params

N_TRAIN, N_TEST = factories.N_TRAIN, factories.N_TEST
_image, _images = grey_image, grey_images


@pytest.fixture
def image_dir(tmp_path) -> Path:
    """A DatasetDict: train pixel values 0..11, test 100..104 (factories)."""
    return save_grey_image_splits(tmp_path / "src" / "images")


@pytest.fixture
def text_dir(tmp_path) -> Path:
    """A plain Dataset with its texts in a custom `sentence` column."""
    path = tmp_path / "src" / "texts"
    datasets.Dataset.from_dict(
        {"sentence": [f"sentence {i}" for i in range(N_TRAIN)], "label": list(range(N_TRAIN))}
    ).save_to_disk(str(path))
    return path


@pytest.fixture
def text_eval_dir(tmp_path) -> Path:
    """Held-out texts for `text_dir` (the content check loads the evaluation source)."""
    path = tmp_path / "src" / "texts_eval"
    datasets.Dataset.from_dict(
        {"sentence": [f"held out {i}" for i in range(N_TEST)], "label": list(range(N_TEST))}
    ).save_to_disk(str(path))
    return path


def local(path: Path, **fields) -> DataSource:
    return DataSource(path=str(path), **fields)


def draw(image_dir: Path, out: Path, n: int = 4, seed: int = 0, **kwargs) -> dict:
    kwargs.setdefault("image_column", "img")
    return draw_calibration_set(
        "mnist",
        local(image_dir, split="train"),
        local(image_dir, split="test"),
        out,
        n,
        seed,
        "image",
        **kwargs,
    )


def files_of(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def error_of(call, *args, **kwargs) -> str:
    with pytest.raises(FeatCalError) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir()) if parent.exists() else []


# ----------------------------------------------------------------------------------- sampling


def test_image_set_rows_ids_and_content(image_dir, tmp_path):
    out = tmp_path / "sets" / "mnist"
    record = draw(image_dir, out, n=4, seed=3)

    ids = sample_rows(N_TRAIN, 4, 3)
    assert len(ids) == 4 and ids == sorted(set(ids))
    assert record["row_ids"] == ids
    assert record["n_requested"] == 4 and record["n_rows"] == 4
    assert record["rows_available"] == N_TRAIN and record["seed"] == 3
    assert record["split"] == "train" and record["task"] == "mnist"
    assert record["columns"] == {"input": "img", "label": "label"}
    assert record["path"] == str(out)

    saved = datasets.load_from_disk(str(out))
    assert saved.column_names == ["image", "label", "source_row"]
    assert saved.features["source_row"] == datasets.Value("int64")
    assert saved["source_row"] == ids
    # each saved row is the source row it names: pixel value and label
    assert [int(np.asarray(img)[0, 0, 0]) for img in saved["image"]] == ids
    assert saved["label"] == [i % 3 for i in ids]

    loaded = load_calibration_set("mnist", out, "image", num_per_task=4, seed=0)
    assert loaded.total_rows == 4 and len(loaded.rows) == 4
    assert all(isinstance(img, Image.Image) for img in loaded.rows)


def test_record_file_and_digest(image_dir, tmp_path):
    out = tmp_path / "mnist"
    record = draw(image_dir, out)
    on_disk = json.loads((out / RECORD_NAME).read_text())
    assert on_disk == {k: v for k, v in record.items() if k != "path"}
    # the digest covers the dataset files, computed before the record was added
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / RECORD_NAME).unlink()
    (copy / MARKER).unlink()  # the guarded writer's marker, added when the set is committed
    assert record["digest"] == sha256_tree(copy)


def test_same_seed_same_bytes_other_seed_other_rows(image_dir, tmp_path):
    first = draw(image_dir, tmp_path / "a", seed=7)
    again = draw(image_dir, tmp_path / "b", seed=7)
    assert first["row_ids"] == again["row_ids"]
    assert first["digest"] == again["digest"]
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")  # byte-identical, record included

    other = draw(image_dir, tmp_path / "c", seed=8)
    assert other["row_ids"] != first["row_ids"]
    assert other["digest"] != first["digest"]


def test_n_at_least_rows_takes_all_in_order(image_dir, tmp_path):
    record = draw(image_dir, tmp_path / "all", n=1000)
    assert record["row_ids"] == list(range(N_TRAIN))
    assert record["n_requested"] == 1000 and record["n_rows"] == N_TRAIN
    saved = datasets.load_from_disk(str(tmp_path / "all"))
    assert saved["source_row"] == list(range(N_TRAIN))


def test_source_directory_untouched(image_dir, tmp_path):
    before = files_of(image_dir)
    draw(image_dir, tmp_path / "s1", n=5)
    draw(image_dir, tmp_path / "s2", n=1000)
    assert files_of(image_dir) == before  # no datasets cache files written beside the source


def test_text_column_renamed(text_dir, text_eval_dir, tmp_path):
    out = tmp_path / "sst2"
    record = draw_calibration_set(
        "sst2",
        local(text_dir, text_column="sentence"),
        local(text_eval_dir, text_column="sentence"),
        out,
        5,
        1,
        "text",
    )
    saved = datasets.load_from_disk(str(out))
    assert saved.column_names == ["text", "label", "source_row"]
    assert saved["text"] == [f"sentence {i}" for i in record["row_ids"]]
    assert saved["label"] == record["row_ids"]
    loaded = load_calibration_set("sst2", out, "text", num_per_task=5, seed=0)
    assert sorted(loaded.rows) == sorted(saved["text"])


def test_column_override_argument(text_dir, tmp_path):
    record = draw_calibration_set(
        "sst2", local(text_dir), None, tmp_path / "o", 3, 0, "text", text_column="sentence"
    )
    assert record["columns"]["input"] == "sentence"
    assert datasets.load_from_disk(str(tmp_path / "o")).column_names[0] == "text"


def test_no_label_column_is_fine(tmp_path):
    src = tmp_path / "nolabel"
    datasets.Dataset.from_dict({"text": ["a", "b", "c"]}).save_to_disk(str(src))
    record = draw_calibration_set("t", local(src), None, tmp_path / "o", 2, 0, "text")
    assert record["columns"] == {"input": "text", "label": None}
    assert datasets.load_from_disk(str(tmp_path / "o")).column_names == ["text", "source_row"]


def test_single_split_dict_needs_no_split(tmp_path):
    src = tmp_path / "only_train"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]})}).save_to_disk(
        str(src)
    )
    record = draw_calibration_set("t", local(src), None, tmp_path / "o", 1, 0, "text")
    assert record["split"] == "train"


# ----------------------------------------------------------------------------------- refusals


def test_refuses_calibration_equal_to_evaluation(image_dir, text_dir, tmp_path):
    out = tmp_path / "sets" / "mnist"
    same = local(image_dir, split="test")
    message = error_of(draw_calibration_set, "mnist", same, same, out, 4, 0, "image")
    assert "tasks.mnist.calibration" in message and "train data" in message
    # the same directory written differently is still the same data
    spelled = DataSource(path=str(image_dir) + "/../images/", split="test")
    error_of(draw_calibration_set, "mnist", spelled, same, out, 4, 0, "image")
    # any split name of a plain Dataset directory is the same rows
    message = error_of(
        draw_calibration_set,
        "sst2",
        local(text_dir, split="train"),
        local(text_dir, split="test"),
        out,
        4,
        0,
        "text",
    )
    assert "train data" in message
    hub = DataSource(hub="tanganke/mnist", split="test")
    message = error_of(draw_calibration_set, "mnist", hub, hub, out, 4, 0, "image")
    assert "train data" in message
    assert leftovers(tmp_path / "sets") == []


def test_missing_split_lists_available(image_dir, tmp_path):
    out = tmp_path / "sets" / "mnist"
    message = error_of(
        draw_calibration_set,
        "mnist",
        local(image_dir, split="validation"),
        local(image_dir, split="test"),
        out,
        4,
        0,
        "image",
    )
    assert "tasks.mnist.calibration.split" in message
    assert "'validation'" in message and "'test'" in message and "'train'" in message
    assert leftovers(tmp_path / "sets") == []


def test_several_splits_need_a_split(image_dir):
    message = error_of(open_source, local(image_dir), key="tasks.mnist.calibration")
    assert "tasks.mnist.calibration.split" in message and "'train'" in message


def test_missing_column_lists_available(image_dir, tmp_path):
    out = tmp_path / "sets" / "mnist"
    message = error_of(draw, image_dir, out, image_column="picture")
    assert "tasks.mnist.calibration.image_column" in message
    assert "'picture'" in message and "'img'" in message and "'label'" in message
    assert leftovers(tmp_path / "sets") == []
    # the default column name is looked for when none is configured
    message = error_of(draw, image_dir, out, image_column=None)
    assert "'image'" in message and "'img'" in message
    # an explicitly named label column must exist
    message = error_of(draw, image_dir, out, label_column="target")
    assert "tasks.mnist.calibration.label_column" in message and "'target'" in message
    assert leftovers(tmp_path / "sets") == []


def test_wrong_column_type(image_dir, tmp_path):
    message = error_of(draw, image_dir, tmp_path / "o", image_column="label")
    assert "tasks.mnist.calibration.image_column" in message and "images" in message


def test_empty_sources(tmp_path):
    out = tmp_path / "sets" / "t"
    features = datasets.Features({"text": datasets.Value("string")})
    empty = tmp_path / "empty"
    datasets.Dataset.from_dict({"text": []}, features=features).save_to_disk(str(empty))
    message = error_of(draw_calibration_set, "t", local(empty), None, out, 4, 0, "text")
    assert "tasks.t.calibration" in message and "no rows" in message
    both = tmp_path / "both"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": []}, features=features),
            "test": datasets.Dataset.from_dict({"text": ["x"]}, features=features),
        }
    ).save_to_disk(str(both))
    message = error_of(
        draw_calibration_set, "t", local(both, split="train"), None, out, 4, 0, "text"
    )
    assert "no rows" in message
    assert leftovers(tmp_path / "sets") == []


def test_missing_directory(tmp_path):
    out = tmp_path / "sets" / "t"
    message = error_of(
        draw_calibration_set, "t", local(tmp_path / "nowhere"), None, out, 4, 0, "text"
    )
    assert "tasks.t.calibration.path" in message and "does not exist" in message
    (tmp_path / "plain").mkdir()
    message = error_of(
        draw_calibration_set, "t", local(tmp_path / "plain"), None, out, 4, 0, "text"
    )
    assert "not a datasets save_to_disk directory" in message
    assert leftovers(tmp_path / "sets") == []


@pytest.mark.parametrize("n", [0, -3])
def test_n_below_one(image_dir, tmp_path, n):
    message = error_of(draw, image_dir, tmp_path / "sets" / "mnist", n=n)
    assert "featcal.num_per_task" in message and "mnist" in message
    assert leftovers(tmp_path / "sets") == []


def test_out_dir_overlapping_source(image_dir):
    message = error_of(draw, image_dir, image_dir / "calib")
    assert "overlaps" in message


# --------------------------------------------------------------------------- replacing outputs


def test_existing_set_replaced_atomically(image_dir, tmp_path):
    out = tmp_path / "sets" / "mnist"
    first = draw(image_dir, out, seed=1)
    before = files_of(out)
    # a failing rebuild leaves the earlier set as it was, and no temporary directories
    error_of(draw, image_dir, out, seed=2, image_column="picture")
    assert files_of(out) == before
    assert leftovers(tmp_path / "sets") == ["mnist"]
    # a file featcal did not write is never deleted: the rebuild stops and names it
    (out / "stale.txt").write_text("old")
    assert "stale.txt" in error_of(draw, image_dir, out, seed=2)
    assert (out / "stale.txt").read_text() == "old"
    (out / "stale.txt").unlink()
    # a successful rebuild replaces it
    second = draw(image_dir, out, seed=2)
    assert json.loads((out / RECORD_NAME).read_text())["row_ids"] == second["row_ids"]
    assert second["row_ids"] != first["row_ids"]
    assert leftovers(tmp_path / "sets") == ["mnist"]


# ---------------------------------------------------------------------------------------- Hub


def _script_builder(name, config=None, **kwargs):
    """A stand-in for datasets.load_dataset_builder of a dataset without per-split data files."""
    return SimpleNamespace(
        config=SimpleNamespace(data_files=None), info=SimpleNamespace(features=None)
    )


def test_hub_split_loads_only_its_files_and_offline_from_the_cache(tmp_path, monkeypatch):
    """Asking for `train` reads only train's files (the real load_dataset prepares every split:
    svhn's extra); the class names are the config's (README), not the parquet files' own.
    Offline, a later load finds those rows in the datasets cache (where datasets' own offline
    lookup does not)."""
    from huggingface_hub import constants

    from featcal_core.data.source_rows import load_hub_split
    from featcal_core.provenance import resolve

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    features = datasets.Features(
        {"x": datasets.Value("int32"), "label": datasets.ClassLabel(names=["0", "1"])}
    )
    card = datasets.Features(
        {"x": datasets.Value("int32"), "label": datasets.ClassLabel(names=["zero", "one"])}
    )
    rows = {"train": {"x": [1, 2, 3], "label": [1, 0, 1]}, "test": {"x": [4, 5], "label": [0, 1]}}
    repo = factories.hub_dataset_repo(
        tmp_path / "digits", features, rows, "cropped_digits", card_features=card, broken=("extra",)
    )
    with pytest.raises(datasets.exceptions.DatasetGenerationError):  # plain: every split read
        datasets.load_dataset(
            str(repo), "cropped_digits", split="train", cache_dir=str(tmp_path / "plain")
        )
    rows = load_hub_split(str(repo), "cropped_digits", "train")
    assert rows["x"] == [1, 2, 3]
    assert rows.features["label"].names == ["zero", "one"]
    assert load_hub_split(str(repo), "cropped_digits", "test")["x"] == [4, 5]

    # as an online load of owner/digits leaves it; then offline
    (tmp_path / "cache" / "digits").rename(tmp_path / "cache" / "owner___digits")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for module in (datasets.config, constants, resolve.hf_constants):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    offline = load_hub_split("owner/digits", "cropped_digits", "train")
    assert offline["x"] == [1, 2, 3] and offline.features["label"].names == ["zero", "one"]
    with pytest.raises(Exception, match="owner/digits"):  # never prepared: datasets' error
        load_hub_split("owner/digits", "cropped_digits", "extra")


def test_hub_source_revision_is_loaded_and_recorded(monkeypatch, tmp_path):
    """A pinned dataset revision reaches load_dataset and the record, with the commit the Hub
    names for it (offline: none, the digests of the rows are recorded either way)."""
    from huggingface_hub import HfApi

    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, kwargs.get("revision")))
        return datasets.Dataset.from_dict({"text": [f"{kwargs['split']} {i}" for i in range(8)]})

    class Info:
        sha = "a" * 40

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(datasets, "load_dataset_builder", _script_builder)
    monkeypatch.setattr(HfApi, "dataset_info", lambda self, repo, revision=None: Info())
    source = DataSource(hub="nyu-mll/glue", config="sst2", split="train", revision="v2")
    evaluation = DataSource(hub="nyu-mll/glue", config="sst2", split="validation")
    record = draw_calibration_set("sst2", source, evaluation, tmp_path / "o", 3, 0, "text")
    assert calls == [("nyu-mll/glue", "v2"), ("nyu-mll/glue", None)]
    assert record["source"] == "hub nyu-mll/glue@v2, config sst2, split train"
    assert record["source_identity"] == ["hub", "nyu-mll/glue", "sst2", "train", "v2"]
    assert record["source_commit"] == "a" * 40
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = draw_calibration_set("sst2", source, evaluation, tmp_path / "p", 3, 0, "text")
    assert again["source_commit"] is None
    with pytest.raises(ValueError, match="revision: is only for Hub datasets"):
        DataSource(path="./x", revision="v2")


def test_hub_source_loaded_with_its_split(monkeypatch, tmp_path):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        split = kwargs["split"]
        return datasets.Dataset.from_dict({"text": [f"{split} {i}" for i in range(8)]}, split=split)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(datasets, "load_dataset_builder", _script_builder)
    source = DataSource(hub="nyu-mll/glue", config="sst2", split="train")
    record = draw_calibration_set(
        "sst2",
        source,
        DataSource(hub="nyu-mll/glue", config="sst2", split="validation"),
        tmp_path / "o",
        3,
        0,
        "text",
    )
    # the calibration split, then the evaluation split for the content check
    assert calls == [
        ("nyu-mll/glue", "sst2", {"split": "train", "trust_remote_code": False}),
        ("nyu-mll/glue", "sst2", {"split": "validation", "trust_remote_code": False}),
    ]
    assert record["source"] == "hub nyu-mll/glue, config sst2, split train"
    assert record["source_identity"] == ["hub", "nyu-mll/glue", "sst2", "train"]
    assert record["evaluation_check"]["rows_checked"] == 8
    assert datasets.load_from_disk(str(tmp_path / "o"))["text"] == [
        f"train {i}" for i in record["row_ids"]
    ]


def test_hub_failure_is_one_line(monkeypatch, tmp_path):
    def failing(*args, **kwargs):
        raise ConnectionError("no route to host\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    monkeypatch.setattr(datasets, "load_dataset_builder", failing)
    message = error_of(
        draw_calibration_set,
        "mnist",
        DataSource(hub="tanganke/mnist", split="train"),
        DataSource(hub="tanganke/mnist", split="test"),
        tmp_path / "sets" / "mnist",
        4,
        0,
        "image",
    )
    assert "tasks.mnist.calibration" in message and "tanganke/mnist" in message
    assert "no route to host second line" in message
    assert leftovers(tmp_path / "sets") == []


# ------------------------------------------------------------------------------- Prefect task


def test_prefect_task_builds_every_task(image_dir, text_dir, text_eval_dir, tmp_path):
    from featcal.tasks.calibration_sets import build_calibration_sets

    params = Params.model_validate(
        {
            "run": {"results_dir": str(tmp_path / "results"), "seed": 5},
            "models": {
                "base": "./zoo/base",
                "experts": {"mnist": "./zoo/mnist", "sst2": "./zoo/sst2"},
            },
            "tasks": {
                "mnist": {
                    "calibration": {
                        "path": str(image_dir),
                        "split": "train",
                        "image_column": "img",
                    },
                    "evaluation": {"path": str(image_dir), "split": "test"},
                },
                "sst2": {
                    "calibration": {"path": str(text_dir), "text_column": "sentence"},
                    "evaluation": {"path": str(text_eval_dir)},
                },
            },
            "featcal": {"num_per_task": 3},
        }
    )
    records = build_calibration_sets.fn(params, {"mnist": "image", "sst2": "text"})
    assert set(records) == {"mnist", "sst2"}
    root = tmp_path / "results" / "calibration_sets"
    for task, modality in [("mnist", "image"), ("sst2", "text")]:
        assert records[task]["path"] == str(root / task)
        assert records[task]["row_ids"] == sample_rows(N_TRAIN, 3, 5)
        loaded = load_calibration_set(task, root / task, modality, num_per_task=3, seed=5)
        assert len(loaded.rows) == 3
    message = error_of(build_calibration_sets.fn, params, {"mnist": "image"})
    assert "tasks.sst2" in message


def test_hashing_the_evaluation_rows_shows_a_bar_on_a_terminal_only(
    image_dir, tmp_path, capsys, monkeypatch
):
    draw(image_dir, tmp_path / "quiet")
    assert "hash the evaluation rows" not in capsys.readouterr().err  # not a terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    draw(image_dir, tmp_path / "terminal")
    assert "mnist: hash the evaluation rows" in capsys.readouterr().err
