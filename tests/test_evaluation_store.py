"""The evaluation store (featcal_core/evaluation/result_cache.py): a row is reused only when the
model's files, the head, the evaluation rows, the settings and the code are what produced it;
a reused row is the evaluated one, byte for byte; a store that is off or unusable only costs the
evaluation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import featcal.tasks.evaluate as evaluate_task
from featcal_core.evaluation import result_cache
from featcal_core.evaluation.expert_head import ExpertHead
from featcal_core.evaluation.zero_shot_head import ZeroShotHead
from featcal_core.params import load_params
from featcal_core.provenance import identity


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "store" / "evaluations.sqlite"
    monkeypatch.setenv(result_cache.VARIABLE, str(path))
    return path


def _counting(calls: list[str]):
    def evaluate():
        calls.append("evaluated")
        return {"a": {"accuracy": 0.5, "loss": 1.25, "examples": 4}, "b": {"accuracy": 0.75}}

    return evaluate


def test_rows_are_reused_only_when_every_key_is_stored(store):
    calls: list[str] = []
    keys = {"a": result_cache.row_key({"x": 1}), "b": result_cache.row_key({"x": 2})}
    first, reused = result_cache.reuse_or_evaluate(keys, _counting(calls))
    assert not reused and calls == ["evaluated"] and store.is_file()
    again, reused = result_cache.reuse_or_evaluate(keys, _counting(calls))
    assert reused and calls == ["evaluated"] and again == first
    assert json.dumps(again) == json.dumps(first)  # the same row, key order included
    # one key new: the group is evaluated (its rows share one pass), then stored
    keys["b"] = result_cache.row_key({"x": 3})
    _, reused = result_cache.reuse_or_evaluate(keys, _counting(calls))
    assert not reused and len(calls) == 2
    # a row without a key (a head that cannot say what it reads) is never stored or reused
    keys["b"] = None
    for count in (3, 4):
        _, reused = result_cache.reuse_or_evaluate(keys, _counting(calls))
        assert not reused and len(calls) == count


@pytest.mark.parametrize("setting", ["off", "unusable"])
def test_a_store_that_is_off_or_unusable_only_costs_the_evaluation(tmp_path, monkeypatch, setting):
    if setting == "unusable":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a folder")
        monkeypatch.setenv(result_cache.VARIABLE, str(blocker / "evaluations.sqlite"))
    else:
        monkeypatch.setenv(result_cache.VARIABLE, "off")
        assert result_cache.store_path() is None
    calls: list[str] = []
    keys = {"a": result_cache.row_key({"x": 1}), "b": result_cache.row_key({"x": 2})}
    for count in (1, 2):
        rows, reused = result_cache.reuse_or_evaluate(keys, _counting(calls))
        assert not reused and len(calls) == count and rows["a"]["loss"] == 1.25


def test_a_damaged_or_non_json_row_is_evaluated_again(store):
    calls: list[str] = []
    key = result_cache.row_key({"x": 1})

    def not_json():
        calls.append("evaluated")
        return {"a": {"accuracy": float("nan")}}

    for count in (1, 2):  # NaN is not stored: evaluated each time
        result_cache.reuse_or_evaluate({"a": key}, not_json)
        assert len(calls) == count
    import sqlite3

    for text in ("{broken", '{"accuracy": 0.25}', "[1, 2]"):  # damaged, edited, not a row
        result_cache.record({key: {"accuracy": 1.0}})
        assert result_cache.lookup([key]) == {key: {"accuracy": 1.0}}
        with sqlite3.connect(store) as connection:
            connection.execute("UPDATE evaluation_rows SET result = ? WHERE key = ?", (text, key))
        assert result_cache.lookup([key]) == {}, text
    with sqlite3.connect(store) as connection:  # a row that is JSON but no object, its digest right
        connection.execute(
            "UPDATE evaluation_rows SET result = ?, sha256 = ? WHERE key = ?",
            ("[1, 2]", result_cache._sha256(key, "[1, 2]"), key),
        )
    assert result_cache.lookup([key]) == {}


def test_a_forged_row_is_not_a_result(store, tmp_path, monkeypatch):
    """A row written into the store by another hand, its plain sha256 recomputed, is evaluated
    again: rows are signed with a key only this user can read; a key file others can read turns
    the store off."""
    import hashlib
    import sqlite3

    key = result_cache.row_key({"x": 2})
    result_cache.record({key: {"accuracy": 0.5}})
    assert result_cache.lookup([key]) == {key: {"accuracy": 0.5}}
    forged = '{"accuracy": 0.99}'
    with sqlite3.connect(store) as connection:
        connection.execute(
            "UPDATE evaluation_rows SET result = ?, sha256 = ? WHERE key = ?",
            (forged, hashlib.sha256(forged.encode()).hexdigest(), key),
        )
    assert result_cache.lookup([key]) == {}
    # a row signed for another key does not verify under this one
    other = result_cache.row_key({"x": 3})
    with sqlite3.connect(store) as connection:
        connection.execute(
            "UPDATE evaluation_rows SET result = ?, sha256 = ? WHERE key = ?",
            (forged, result_cache._sha256(other, forged), key),
        )
    assert result_cache.lookup([key]) == {}
    # the key: made once, mode 0600; another user's readable key means no store
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result_cache._signing_key.cache_clear()
    signing = tmp_path / "cache" / "featcal" / result_cache.SIGNING_KEY
    assert result_cache._signing_key() == signing.read_bytes().strip()
    assert signing.stat().st_mode & 0o777 == 0o600
    signing.chmod(0o644)
    result_cache._signing_key.cache_clear()
    assert result_cache._signing_key() is None
    result_cache.record({key: {"accuracy": 0.5}})
    assert result_cache.lookup([key]) == {}
    result_cache._signing_key.cache_clear()


def test_the_key_follows_the_code_and_every_part(monkeypatch):
    parts = {"model": "m", "data": "d", "batch_size": 4}
    key = result_cache.row_key(parts)
    assert result_cache.row_key(dict(reversed(list(parts.items())))) == key  # order-free
    for name, value in (("model", "m2"), ("data", "d2"), ("batch_size", 8), ("new", None)):
        assert result_cache.row_key({**parts, name: value}) != key
    code = result_cache.code_identity()
    assert set(code) >= {"featcal_core", "torch", "transformers", "datasets"}
    monkeypatch.setattr(result_cache, "code_identity", lambda: {**code, "featcal_core": "edited"})
    assert result_cache.row_key(parts) != key


def test_content_digest_skips_the_card_records_and_marker_not_the_model(tmp_path):
    from featcal_core.provenance.records import FEATCAL_RECORD, MERGE_RECORD
    from featcal_core.repair.adamerging import ADAMERGING_RECORD
    from featcal_core.repair.regmean import REGMEAN_RECORD
    from featcal_core.repair.reuse import REUSE_RECORD

    records = {FEATCAL_RECORD, MERGE_RECORD, REGMEAN_RECORD, ADAMERGING_RECORD, REUSE_RECORD}
    assert records <= identity.NOT_CONTENT  # every record a repaired checkpoint carries
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    save_file({"w": torch.ones(2, 2)}, str(folder / "model.safetensors"))
    digest = identity.content_digest(folder)
    for name in identity.NOT_CONTENT:
        (folder / name).write_text("changes with each run")
    assert identity.content_digest(folder) == digest
    (folder / "config.json").write_text('{"a": 2}')
    changed = identity.content_digest(folder)
    assert changed != digest
    save_file({"w": 2 * torch.ones(2, 2)}, str(folder / "model.safetensors"))
    assert identity.content_digest(folder) not in (digest, changed)
    (folder / "sub").mkdir()
    (folder / "sub" / "tokenizer.json").write_text("{}")  # any other file counts
    assert identity.content_digest(folder) != changed


def test_head_identities_follow_their_files_prompts_and_replacement_linear(tmp_path):
    import factories

    base = factories.tiny_clip_model(tmp_path / "base")
    head = ZeroShotHead(base, ["cat", "dog"], ["a {}."])
    first = head.identity()
    assert first == ZeroShotHead(base, ["cat", "dog"], ["a {}."]).identity()
    assert ZeroShotHead(base, ["cat", "dog"], ["a photo of a {}."]).identity() != first
    assert ZeroShotHead(base, ["dog", "cat"], ["a {}."]).identity() != first
    weight, bias = torch.zeros(2, 8), torch.zeros(2)
    replaced = head.with_linear(weight, bias).identity()
    assert replaced != first
    assert head.with_linear(weight, bias + 1).identity() != replaced
    tensors = load_file(str(base / "model.safetensors"))
    key = next(k for k in tensors if k.startswith("text_model."))
    tensors[key] = tensors[key] + 1
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    assert ZeroShotHead(base, ["cat", "dog"], ["a {}."]).identity() != first

    pool = factories.bert_zoo(tmp_path / "pool", tasks=("alpha",))
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig.from_pretrained(pool.base, num_labels=3))
    model.save_pretrained(tmp_path / "expert")
    expert = ExpertHead(tmp_path / "expert", tokenizer_dir=pool.base).identity()
    assert expert is not None and expert["head"] == "ExpertHead"
    assert ExpertHead(tmp_path / "expert", tokenizer_dir=pool.base).identity() == expert
    assert ExpertHead(tmp_path / "expert", tokenizer_dir=pool.base, max_length=8).identity() != (
        expert
    )
    with torch.no_grad():
        model.classifier.weight.add_(1.0)
    model.save_pretrained(tmp_path / "expert")
    assert ExpertHead(tmp_path / "expert", tokenizer_dir=pool.base).identity() != expert


def _spy(monkeypatch, name: str) -> list[str]:
    """Count the calls of evaluate_task.<name> (the real function still runs)."""
    calls: list[str] = []
    real = getattr(evaluate_task, name)

    def counted(directory, *args, **kwargs):
        calls.append(str(directory))
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(evaluate_task, name, counted)
    return calls


def _changed_copy(source, target, scale: float | None):
    """A copy of the checkpoint `source`: its weights scaled (None: only its card and featcal
    records rewritten)."""
    shutil.copytree(source, target)
    if scale is None:
        for name in ("README.md", "featcal.json"):
            (target / name).write_text(f"another run's {name}")
        return target
    tensors = load_file(str(target / "model.safetensors"))
    tensors = {k: v * scale if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_a_second_evaluation_reuses_each_unchanged_model_and_reads_the_same(
    tmp_path, store, monkeypatch
):
    """The evaluate step of a tiny CLIP setting (zero-shot heads, 2 tasks, 4 rows each): the same
    evaluation again reuses every row; the table is the one the store being off gives; a model
    whose weights changed is evaluated again, one whose card and records changed is not; another
    row limit evaluates everything again."""
    from test_pipeline import write_params

    path = write_params(tmp_path)
    params = load_params(path)
    experts = {task: p.ref for task, p in params.models.experts.items()}
    models = {  # two other towers (one equal to a row already evaluated would be reused)
        "merged": str(_changed_copy(Path(experts["beta"]), tmp_path / "merged", 0.9)),
        "calibrated": str(_changed_copy(Path(experts["alpha"]), tmp_path / "calibrated", 0.8)),
    }
    base, results = params.models.base.ref, str(tmp_path / "results")
    calls = _spy(monkeypatch, "evaluate_linears")

    def evaluate(run_params, rows):
        calls.clear()
        return evaluate_task.evaluate_models.fn(run_params, base, experts, rows, results)

    first = evaluate(params, models)
    assert len(calls) == 8  # 2 tasks x (base, expert, merged, calibrated)
    second = evaluate(params, models)
    assert calls == [] and json.dumps(second) == json.dumps(first)
    monkeypatch.setenv(result_cache.VARIABLE, "off")
    assert evaluate(params, models) == first and len(calls) == 8  # what the store gave
    monkeypatch.setenv(result_cache.VARIABLE, str(store))

    records_only = _changed_copy(models["merged"], tmp_path / "merged-again", None)
    weights = _changed_copy(models["calibrated"], tmp_path / "calibrated-again", 0.5)
    third = evaluate(params, {"merged": str(records_only), "calibrated": str(weights)})
    assert calls == [str(weights)] * 2  # only the changed weights, once per task
    for task in first:
        assert third[task]["merged"] == first[task]["merged"]
        assert third[task]["base"] == first[task]["base"]

    document = yaml.safe_load(path.read_text())
    document["evaluation"] = {"max_examples_per_task": 5}
    path.write_text(yaml.safe_dump(document))
    fewer = evaluate(load_params(path), models)
    assert len(calls) == 8 and all(r["examples"] == 5 for t in fewer.values() for r in t.values())


def test_label_scoring_rows_are_reused_and_follow_the_prompt(tmp_path, store, monkeypatch):
    """A tiny Llama's label scoring: base, experts, merged and calibrated rows reused by a second
    evaluation; another prompt scores every model again."""
    from test_pipeline import LANGUAGE_MODELS, _labelled_texts

    from featcal_core.data.synthetic import build_pool

    config, _, _ = LANGUAGE_MODELS["llama"]
    pool = build_pool(tmp_path / "pool", "llama", config, ("alpha", "beta"))
    document = {
        "run": {"name": "lm", "results_dir": str(tmp_path / "results")},
        "models": {"base": str(pool.base), "experts": {t: str(p) for t, p in pool.experts.items()}},
        "tasks": {
            task: {
                "calibration": {"path": str(data), "split": "train"},
                "evaluation": {"path": str(data), "split": "test"},
                "label_words": ["good", "bad", "fun"],
                "prompt": "review: {text} verdict:",
            }
            for i, task in enumerate(pool.experts)
            for data in [_labelled_texts(tmp_path / f"texts_{task}", seed=i, rows=(4, 6))]
        },
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(document))
    experts = {t: str(p) for t, p in pool.experts.items()}
    models = {
        "merged": str(_changed_copy(Path(experts["beta"]), tmp_path / "merged", 0.9)),
        "calibrated": str(_changed_copy(Path(experts["alpha"]), tmp_path / "calibrated", 0.8)),
    }
    calls = _spy(monkeypatch, "evaluate_lm_dataset")

    def evaluate():
        calls.clear()
        return evaluate_task.evaluate_models.fn(
            load_params(path), str(pool.base), experts, models, str(tmp_path / "results")
        )

    first = evaluate()
    assert len(calls) == 8 and "perplexity" in first["alpha"]["expert"]
    assert json.dumps(evaluate()) == json.dumps(first) and calls == []
    document["tasks"]["alpha"]["prompt"] = "text: {text} label:"
    path.write_text(yaml.safe_dump(document))
    evaluate()
    assert len(calls) == 4  # alpha's four models; beta's rows reused


def test_the_key_says_how_the_own_head_ran_and_what_the_device_computes_in(tmp_path, store):
    """The own head alone runs as one classifier, beside refit Linears through the features
    (other bits in bfloat16); torch's float32 matmul precision and CPU threads name the device."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    class Head:
        def identity(self):
            return {"head": "stub"}

    pair = (torch.ones(2, 3), torch.zeros(2))
    alone = result_cache.classification_keys(folder, Head(), folder, None, {"own": None}, {})
    beside = result_cache.classification_keys(
        folder, Head(), folder, None, {"own": None, "refit": pair}, {}
    )
    assert alone["own"] != beside["own"]

    cpu = torch.device("cpu")
    first = identity.device_identity(cpu)
    was = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium" if was != "medium" else "highest")
        assert identity.device_identity(cpu) != first
    finally:
        torch.set_float32_matmul_precision(was)
    assert identity.device_identity(cpu) == first
    code = identity.code_identity()
    assert {"torchvision", "tokenizers", "safetensors", "cuda", "cudnn"} <= set(code)


def test_content_digest_reads_through_symlinked_folders(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "labels.arrow").write_bytes(b"1 2 3")
    data = tmp_path / "data"
    data.mkdir()
    (data / "test").symlink_to(target, target_is_directory=True)
    (target / "loop").symlink_to(data, target_is_directory=True)  # a cycle is walked once
    digest = identity.content_digest(data)
    (target / "labels.arrow").write_bytes(b"1 2 4")
    assert identity.content_digest(data) != digest


def test_a_zero_shot_head_names_its_cached_class_embeddings(tmp_path):
    import factories

    base = factories.tiny_clip_model(tmp_path / "base")
    head = ZeroShotHead(base, ["cat", "dog"], ["a {}."], cache_dir=tmp_path / "heads")
    assert head.identity()["embeddings"] is None  # none cached yet
    head.class_embeddings()
    cached = head.identity()["embeddings"]
    assert cached is not None
    save_file({"embeddings": torch.zeros(2, 8)}, str(head.cache_path()))  # another file there
    assert ZeroShotHead(base, ["cat", "dog"], ["a {}."], tmp_path / "heads").identity()[
        "embeddings"
    ] not in (None, cached)
