"""What featcal reads stays what its digests cover, and what it writes stays out of its inputs:
a dataset split reads only files of its own folder, a model folder holds one set of weights,
the class-embedding cache follows everything that changes an embedding, and the evaluation
store lies outside the inputs, skips rows of the wrong types and a store locked elsewhere."""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import time
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file, save_file

import factories
from featcal_core.data.calibration_data import load_calibration_set
from featcal_core.data.source_rows import open_source
from featcal_core.errors import FeatCalError
from featcal_core.evaluation import result_cache
from featcal_core.evaluation.dataset import _load_split
from featcal_core.evaluation.zero_shot_head import ZeroShotHead
from featcal_core.io import cache_store
from featcal_core.io.checkpoint import INDEX_NAME, SINGLE_NAME, Checkpoint
from featcal_core.provenance.identity import content_digest

FIX = "re-save the dataset with save_to_disk"


# ------------------------------------------------------------------ dataset splits: own files only


def _saved(path: Path, values=(1, 2, 3)) -> Path:
    datasets.Dataset.from_dict(
        {"text": [f"row {v}" for v in values], "label": list(values)}
    ).save_to_disk(str(path))
    return path


def _data_file(split: Path) -> Path:
    (name,) = [e["filename"] for e in json.loads((split / "state.json").read_text())["_data_files"]]
    return split / name


def _name_in_state(split: Path, name: str) -> None:
    state = json.loads((split / "state.json").read_text())
    state["_data_files"] = [{"filename": name}]
    (split / "state.json").write_text(json.dumps(state))


def _escaping(tmp_path: Path, how: str) -> tuple[Path, Path, str]:
    """(folder to open, the split whose state.json escapes, the data file name it holds): the
    split's rows moved to tmp_path/outside/rows.arrow and named from there."""
    root = tmp_path / "data" / "eval"
    split = root / "test" if how == "dict" else root
    if how == "dict":
        datasets.DatasetDict(
            {"test": datasets.load_from_disk(str(_saved(tmp_path / "rows")))}
        ).save_to_disk(str(root))
    else:
        _saved(root)
    outside = tmp_path / "outside" / "rows.arrow"
    outside.parent.mkdir()
    shutil.move(_data_file(split), outside)
    if how == "link":
        name = "data-00000-of-00001.arrow"
        (split / name).symlink_to(outside)
    elif how == "absolute":
        name = str(outside)
    else:
        name = "../../outside/rows.arrow" if how == "relative" else "../../../outside/rows.arrow"
    _name_in_state(split, name)
    return root, split, name


@pytest.mark.parametrize("how", ["relative", "absolute", "link", "dict"])
def test_a_split_naming_a_data_file_outside_its_folder_is_refused_by_every_opener(tmp_path, how):
    folder, split, name = _escaping(tmp_path, how)
    loaded = datasets.load_from_disk(str(folder))  # the loader itself reads the outside file
    assert len(loaded["test"] if how == "dict" else loaded) == 3
    digest = content_digest(folder)
    (tmp_path / "outside" / "rows.arrow").write_bytes(b"changed")
    assert (content_digest(folder) == digest) is (how != "link")  # what the digests miss

    openers = [
        lambda: _load_split(folder, "test" if how == "dict" else None),
        lambda: open_source(
            {"path": str(folder), "split": "test" if how == "dict" else None},
            key="tasks.alpha.evaluation",
        ),
    ]
    if how != "dict":
        openers.append(lambda: load_calibration_set("alpha", folder, "text", 2, 0))
    for opener in openers:
        with pytest.raises(FeatCalError) as caught:
            opener()
        message = str(caught.value)
        assert "\n" not in message
        assert str(split / "state.json") in message and repr(name) in message
        assert FIX in message


def test_a_dataset_dict_naming_a_split_outside_its_folder_is_refused(tmp_path):
    other = _saved(tmp_path / "other")
    root = tmp_path / "data" / "eval"
    datasets.DatasetDict({"test": datasets.load_from_disk(str(other))}).save_to_disk(str(root))
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["../../other"]}))
    with pytest.raises(FeatCalError, match=r"names split '\.\./\.\./other'.*save_to_disk"):
        _load_split(root, "../../other")


def test_files_and_links_inside_the_folder_are_read(tmp_path):
    split = _saved(tmp_path / "eval")
    inner = split / "shards" / "rows.arrow"
    inner.parent.mkdir()
    shutil.move(_data_file(split), inner)
    _name_in_state(split, "shards/rows.arrow")
    (split / "linked.arrow").symlink_to(inner)
    assert len(_load_split(split, None)) == 3
    _name_in_state(split, "linked.arrow")
    assert len(open_source({"path": str(split)}, key="tasks.alpha.evaluation")) == 3
    # a split folder that is itself a link (a DVC checkout, a shared disk) reads its own files
    data = tmp_path / "data"
    datasets.DatasetDict({"test": _load_split(split, None)}).save_to_disk(str(tmp_path / "real"))
    data.mkdir()
    (data / "eval").symlink_to(tmp_path / "real", target_is_directory=True)
    assert len(_load_split(data / "eval", "test")) == 3


def test_the_folder_digest_covers_every_data_file_state_json_names(tmp_path):
    split = _saved(tmp_path / "eval")
    shutil.move(_data_file(split), split / "README.md")  # a name a model folder's digest skips
    _name_in_state(split, "README.md")
    assert len(_load_split(split, None)) == 3
    digest = content_digest(split)
    shutil.move(_data_file(_saved(tmp_path / "other", (4, 5, 6))), split / "README.md")
    assert content_digest(split) != digest


def test_the_cli_refuses_a_calibration_set_reading_outside_its_folder(tmp_path, capsys):
    zoo = factories.clip_zoo(tmp_path / "zoo")
    calib = zoo.calib["alpha"]
    outside = tmp_path / "outside" / "rows.arrow"
    outside.parent.mkdir()
    shutil.move(_data_file(calib), outside)
    _name_in_state(calib, str(outside))
    factories.cli_fails(
        zoo.cli_args(tmp_path / "out"), capsys, str(calib / "state.json"), str(outside), FIX
    )


# ------------------------------------------------------------------ one set of weights per folder


def _model(folder: Path, scale: float = 1.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "bert"}))
    tensors = {f"layer{i}.weight": torch.full((2, 2), scale * i) for i in range(3)}
    save_file(tensors, str(folder / SINGLE_NAME), metadata={"format": "pt"})
    return folder


def test_a_single_file_beside_an_index_naming_other_shards_is_refused(tmp_path):
    folder = _model(tmp_path / "model")
    factories.reshard(folder, shards=2)
    assert len(Checkpoint(folder).files) == 2
    _model(folder, scale=2.0)  # another model.safetensors beside the index
    with pytest.raises(FeatCalError) as caught:
        Checkpoint(folder, role="expert")
    message = str(caught.value)
    for needle in (str(folder), SINGLE_NAME, INDEX_NAME, "model-00001-of-00002", "remove one"):
        assert needle in message, needle
    (folder / INDEX_NAME).unlink()
    assert Checkpoint(folder).files == [SINGLE_NAME]


def test_an_index_naming_the_single_file_alone_agrees_with_it(tmp_path):
    folder = _model(tmp_path / "model")
    weight_map = dict.fromkeys(load_file(str(folder / SINGLE_NAME)), SINGLE_NAME)
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert Checkpoint(folder).files == [SINGLE_NAME]


def test_the_cli_refuses_an_expert_with_two_sets_of_weights(tmp_path, capsys):
    zoo = factories.clip_zoo(tmp_path / "zoo")
    expert = zoo.experts["beta"]
    single = (expert / SINGLE_NAME).read_bytes()
    factories.reshard(expert)
    (expert / SINGLE_NAME).write_bytes(single)
    factories.cli_fails(
        zoo.cli_args(tmp_path / "out"), capsys, str(expert), SINGLE_NAME, INDEX_NAME, "remove one"
    )


# ------------------------------------------------------------------ the class-embedding cache key


def _edit_config(base: Path, **text_config) -> None:
    config = json.loads((base / "config.json").read_text())
    config["text_config"].update(text_config)
    (base / "config.json").write_text(json.dumps(config, indent=2))


def test_the_class_embedding_cache_follows_the_text_towers_config(tmp_path):
    base = factories.tiny_clip_model(tmp_path / "base")
    heads = tmp_path / "heads"
    first = ZeroShotHead(base, ["cat", "dog"], ["a {}."], cache_dir=heads)
    before = first.class_embeddings()
    assert first.cache_path().is_file()

    config = json.loads((base / "config.json").read_text())  # same content, another layout
    (base / "config.json").write_text(json.dumps(config))
    same = ZeroShotHead(base, ["cat", "dog"], ["a {}."], cache_dir=heads)
    assert same.cache_key() == first.cache_key()

    assert config["text_config"]["hidden_act"] != "relu"
    _edit_config(base, hidden_act="relu")
    changed = ZeroShotHead(base, ["cat", "dog"], ["a {}."], cache_dir=heads)
    assert changed.cache_key() != first.cache_key()
    after = changed.class_embeddings()
    assert not torch.allclose(after, before)  # computed with the new activation, not read
    uncached = ZeroShotHead(base, ["cat", "dog"], ["a {}."], cache_dir=None).class_embeddings()
    assert torch.equal(after, uncached)


def test_the_class_embedding_cache_key_covers_weights_tokenizer_names_and_templates(tmp_path):
    base = factories.tiny_clip_model(tmp_path / "base")
    key = ZeroShotHead(base, ["cat", "dog"], ["a {}."]).cache_key()
    assert ZeroShotHead(base, ["cat", "cow"], ["a {}."]).cache_key() != key
    assert ZeroShotHead(base, ["cat", "dog"], ["the {}."]).cache_key() != key
    tokenizer = json.loads((base / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zz</w>"] = len(tokenizer["model"]["vocab"])
    (base / "tokenizer.json").write_text(json.dumps(tokenizer))
    tokenized = ZeroShotHead(base, ["cat", "dog"], ["a {}."]).cache_key()
    assert tokenized != key
    tensors = load_file(str(base / SINGLE_NAME))
    tensors["text_projection.weight"] = tensors["text_projection.weight"] * 2
    save_file(tensors, str(base / SINGLE_NAME), metadata={"format": "pt"})
    assert ZeroShotHead(base, ["cat", "dog"], ["a {}."]).cache_key() not in (key, tokenized)


# ------------------------------------------------------------------ the evaluation store


def test_a_store_inside_an_input_is_refused_before_anything_is_evaluated(tmp_path, monkeypatch):
    from test_pipeline import write_params

    import featcal.tasks.evaluate as evaluate_task
    from featcal_core.params import load_params

    params = load_params(write_params(tmp_path))
    experts = {task: p.ref for task, p in params.models.experts.items()}
    calls: list[str] = []
    monkeypatch.setattr(evaluate_task, "evaluate_linears", lambda *a, **k: calls.append("x"))
    data = Path(params.tasks["beta"].evaluation.path)
    for inside in (Path(experts["alpha"]) / "store.sqlite", data / "test" / "store.sqlite"):
        monkeypatch.setenv(result_cache.VARIABLE, str(inside))
        before = sorted(p.name for p in inside.parent.iterdir())
        with pytest.raises(FeatCalError) as caught:
            evaluate_task.evaluate_models.fn(
                params, params.models.base.ref, experts, {}, str(tmp_path / "results")
            )
        message = str(caught.value)
        assert f"{result_cache.VARIABLE}={inside}" in message and "outside" in message
        assert str(inside.parent if inside.parent.name != "test" else data) in message
        assert sorted(p.name for p in inside.parent.iterdir()) == before and calls == []


def test_check_outside_takes_a_store_beside_the_inputs(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    monkeypatch.setenv(result_cache.VARIABLE, str(tmp_path / "link" / "sub" / "store.sqlite"))
    with pytest.raises(FeatCalError, match="lies inside expert 'a'"):
        result_cache.check_outside({"expert 'a'": model})
    monkeypatch.setenv(result_cache.VARIABLE, str(tmp_path / "model-store.sqlite"))
    result_cache.check_outside({"expert 'a'": model})
    monkeypatch.setenv(result_cache.VARIABLE, "off")
    result_cache.check_outside({"expert 'a'": tmp_path})


@pytest.mark.parametrize(
    "text",
    [
        '{"accuracy": "0.5", "loss": 1.0, "examples": 4}',
        '{"accuracy": 0.5, "loss": "low", "examples": 4}',
        '{"accuracy": 0.5, "loss": 1.0, "examples": 4.5}',
        '{"accuracy": true, "loss": 1.0, "examples": 4}',
        '{"accuracy": 1.5, "loss": 1.0, "examples": 4}',
        '{"accuracy": NaN, "loss": 1.0, "examples": 4}',
        '{"accuracy": 0.5, "loss": null, "examples": 4}',
        '{"accuracy": 0.5, "loss": 1.0, "examples": 4, "note": [1]}',
        '{"loss": 1.0, "examples": 4}',
    ],
)
def test_a_stored_row_of_the_wrong_types_is_evaluated_again(tmp_path, monkeypatch, caplog, text):
    store = tmp_path / "evaluations.sqlite"
    monkeypatch.setenv(result_cache.VARIABLE, str(store))
    key = result_cache.row_key({"case": text})
    good = {"accuracy": 0.25, "loss": 1.5, "examples": 4, "split_rows": 9}
    calls: list[str] = []

    def evaluate():
        calls.append("evaluated")
        return {"row": dict(good)}

    result_cache.reuse_or_evaluate({"row": key}, evaluate)
    with sqlite3.connect(store) as connection:  # the row replaced, its digest matching
        connection.execute(
            "UPDATE evaluation_rows SET result = ?, sha256 = ? WHERE key = ?",
            (text, result_cache._sha256(key, text), key),
        )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=result_cache.__name__):
        rows, reused = result_cache.reuse_or_evaluate({"row": key}, evaluate)
    assert not reused and rows == {"row": good} and calls == ["evaluated"] * 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "evaluated again" in warnings[0], warnings
    assert result_cache.reuse_or_evaluate({"row": key}, evaluate) == ({"row": good}, True)


def test_a_store_locked_by_another_process_is_skipped_with_one_warning(
    tmp_path, monkeypatch, caplog
):
    assert cache_store.BUSY_TIMEOUT <= 5  # a locked store costs seconds, not minutes
    monkeypatch.setattr(cache_store, "BUSY_TIMEOUT", 0.2)
    store = tmp_path / "evaluations.sqlite"
    monkeypatch.setenv(result_cache.VARIABLE, str(store))
    result_cache.record({result_cache.row_key({"x": 0}): {"accuracy": 1.0}})
    holder = sqlite3.connect(store, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another writer holds the store (as another process would)
    calls: list[str] = []

    def evaluate():
        calls.append("evaluated")
        return {"row": {"accuracy": 0.5}}

    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger=cache_store.__name__):
            for i in range(6):
                rows, reused = result_cache.reuse_or_evaluate(
                    {"row": result_cache.row_key({"x": i})}, evaluate
                )
                assert not reused and rows == {"row": {"accuracy": 0.5}}
        elapsed = time.monotonic() - start
    finally:
        holder.rollback()
        holder.close()
    assert len(calls) == 6
    assert elapsed < 2.0, elapsed  # one bounded wait, then skipped: not one wait per use
    busy = [r.getMessage() for r in caplog.records if "busy" in r.getMessage()]
    assert len(busy) == 1 and str(store) in busy[0], busy
