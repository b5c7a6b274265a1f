"""A one-go repair's output (RegMean, Surgery, AdaMerging) is reused only when it verifies and
was made from the inputs asked for now (featcal_core/repair/reuse.py); `featcal compare` run
again reuses them (test_compare.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import factories
from featcal_core.io.outputs import guarded_directory
from featcal_core.method.settings import Settings
from featcal_core.repair import reuse
from featcal_core.repair.registry import RepairInputs
from featcal_core.repair.registry import get as get_repair


class _Head:
    def __init__(self, identity):
        self._identity = identity

    def identity(self):
        return self._identity


@pytest.fixture
def pool(tmp_path):
    zoo = factories.clip_zoo(tmp_path / "pool")
    sets = {}
    for task in zoo.experts:  # stand-ins for calibration set folders: their files are what counts
        sets[task] = tmp_path / "sets" / task
        sets[task].mkdir(parents=True)
        (sets[task] / "rows.json").write_text(json.dumps([task, 1, 2]))
    return zoo, sets


def _inputs(zoo, sets, out, **changes):
    values = dict(
        base=str(zoo.base),
        merged=str(zoo.experts["alpha"]),  # any checkpoint folder stands for the merge
        experts={t: str(p) for t, p in zoo.experts.items()},
        calibration_sets={t: str(p) for t, p in sets.items()},
        out=str(out),
        settings=Settings(num_per_task=8, seed=1),
        options={"steps": 5},
        heads=lambda: {"alpha": _Head({"h": 1}), "beta": _Head({"h": 2})},
    )
    values.update(changes)
    return RepairInputs(**values)


def _write_output(out, record):
    with guarded_directory(out, overwrite=True) as tmp:
        save_file({"w": torch.ones(3)}, str(tmp / "model.safetensors"))
        (tmp / "alpha").mkdir()
    return record


def test_an_output_is_reused_only_for_the_same_inputs_and_while_it_verifies(tmp_path, pool):
    zoo, sets = pool
    repair = get_repair("adamerging")  # fits to heads: their identities count
    out = tmp_path / "calibrated"
    inputs = _inputs(zoo, sets, out)
    wanted = reuse.fingerprint(repair, inputs)
    assert reuse.reusable(out, wanted) is None  # nothing there yet
    record = _write_output(out, {"method": "adamerging", "coefficients": [0.3, 0.4]})
    reuse.remember(out, wanted, record, {"seconds": 12.5, "peak_rss_mb": 900.0})
    saved = reuse.reusable(out, reuse.fingerprint(repair, _inputs(zoo, sets, out)))
    assert saved["record"] == record and saved["cost"] == {"seconds": 12.5, "peak_rss_mb": 900.0}

    changed = {
        "options": {"steps": 6},
        "settings": Settings(num_per_task=8, seed=2),
        "merged": str(zoo.experts["beta"]),
        "heads": lambda: {"alpha": _Head({"h": 1}), "beta": _Head({"h": 3})},
    }
    for key, value in changed.items():
        other = reuse.fingerprint(repair, _inputs(zoo, sets, out, **{key: value}))
        assert reuse.reusable(out, other) is None, key
    (sets["beta"] / "rows.json").write_text(json.dumps(["beta", 1, 3]))  # a set's rows
    assert reuse.reusable(out, reuse.fingerprint(repair, _inputs(zoo, sets, out))) is None
    (sets["beta"] / "rows.json").write_text(json.dumps(["beta", 1, 2]))
    assert reuse.reusable(out, wanted)["record"] == record

    # an expert's weights
    copy = shutil.copytree(zoo.experts["beta"], tmp_path / "beta-copy")
    tensors = load_file(str(copy / "model.safetensors"))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(copy / "model.safetensors"))
    experts = {"alpha": str(zoo.experts["alpha"]), "beta": str(copy)}
    assert (
        reuse.reusable(out, reuse.fingerprint(repair, _inputs(zoo, sets, out, experts=experts)))
        is None
    )

    # a file written into the output since (refit heads travel with a calibrated model), the
    # marker updated: the output verifies, but it is no longer what the repair wrote
    from featcal_core.io.outputs import write_json

    write_json(out / "heads.json", {"alpha": "head"})
    assert reuse.reusable(out, wanted) is None
    (out / "heads.json").unlink()
    _write_output(out, record)
    reuse.remember(out, wanted, record)
    assert reuse.reusable(out, wanted)["record"] == record

    # the tasks' order (the repairs sum over the tasks in it)
    reordered = dict(reversed(list(inputs.experts.items())))
    other = reuse.fingerprint(repair, _inputs(zoo, sets, out, experts=reordered))
    assert reuse.reusable(out, other) is None

    # the output itself: a changed file, or one the marker does not list
    save_file({"w": torch.zeros(3)}, str(out / "model.safetensors"))
    assert reuse.reusable(out, wanted) is None
    _write_output(out, record)  # a new output without the record: not reused
    assert reuse.reusable(out, wanted) is None
    reuse.remember(out, wanted, record)
    (out / "alpha" / "extra.bin").write_bytes(b"not featcal's")
    assert reuse.reusable(out, wanted) is None


def test_a_head_that_cannot_say_what_it_reads_is_never_reused(tmp_path, pool):
    zoo, sets = pool
    out = tmp_path / "calibrated"
    heads = lambda: {"alpha": _Head(None), "beta": _Head({"h": 2})}  # noqa: E731
    inputs = _inputs(zoo, sets, out, heads=heads)
    assert reuse.fingerprint(get_repair("surgery"), inputs) is None
    reuse.remember(out, None, {"any": 1})
    assert not (out / reuse.REUSE_RECORD).exists() and reuse.reusable(out, None) is None
    # RegMean fits to no head: the heads do not enter its fingerprint
    assert reuse.fingerprint(get_repair("regmean"), inputs)["heads"] is None
