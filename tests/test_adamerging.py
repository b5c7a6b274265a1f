"""Layer-wise AdaMerging as a repair baseline (featcal_core/repair/adamerging.py), on the tiny CLIP
vision pool of test_surgery (experts with linear heads) under a full CLIPModel base: the written
tensors against a float64 brute force, Task Arithmetic at the first step, lower entropy, bad
input, determinism."""

from __future__ import annotations

import json
import shutil

import datasets
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_surgery import TASKS, pool  # noqa: F401  (module fixture: tiny CLIP pool with heads)

import factories
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.expert_head import ExpertHead
from featcal_core.io.outputs import MARKER
from featcal_core.merging.run import merge_checkpoints
from featcal_core.repair.adamerging import ADAMERGING_RECORD, DEFAULT_INIT, adamerge_checkpoint

CPU = torch.device("cpu")
TOWER = "vision_model."
#: tower tensors that every expert leaves at the base's value (reset in the `models` fixture)
STEMS = ("embeddings.", "pre_layrnorm.")
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread (a busy 2-core machine makes two spin against each
    other, many times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tensors(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / WEIGHTS))


@pytest.fixture(scope="module")
def models(pool, tmp_path_factory):  # noqa: F811
    """base: a full CLIPModel (text tower, projections) whose vision tower is the pool's base;
    experts: the pool's (CLIPVisionModel, 5.x layout, linear heads) with their stem tensors reset
    to the base's; ta: their Task Arithmetic merge (scale 0.3); template: ta with a text-tower
    tensor, logit_scale and a stem tensor shifted, so that kept tensors are told from the base's."""
    root = tmp_path_factory.mktemp("adamerging")
    base = factories.clip_model_with_tower(pool.base, root / "base")
    base_tower = _tensors(pool.base)
    experts = {}
    for task, source in pool.experts.items():
        experts[task] = shutil.copytree(source, root / f"expert_{task}")
        state = _tensors(experts[task])
        state.update({k: base_tower[k] for k in state if k.startswith(STEMS)})
        save_file(state, str(experts[task] / WEIGHTS), metadata={"format": "pt"})
    ta = root / "ta"
    merge_checkpoints(base, experts, ta, "task_arithmetic", {"scale": DEFAULT_INIT}, progress=False)
    template = shutil.copytree(ta, root / "template")
    (template / MARKER).unlink()
    state = _tensors(template)
    for key in ("text_model.final_layer_norm.weight", "logit_scale", TOWER + "pre_layrnorm.bias"):
        state[key] = state[key] + 0.25
    save_file(state, str(template / WEIGHTS), metadata={"format": "pt"})
    return {"base": base, "experts": experts, "calib": pool.calib, "ta": ta, "template": template}


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory):
    """30 steps at lr 1e-2 (the default 1e-3 moves λ by about 0.03 in 30 steps)."""
    out = tmp_path_factory.mktemp("trained") / "out"
    record = adamerge_checkpoint(
        models["base"],
        models["template"],
        models["experts"],
        models["calib"],
        out,
        steps=30,
        lr=1e-2,
        log_every=10,
        progress=False,
    )
    return out, record


# --------------------------------------------------------------------- (1) the written tensors
def test_tower_is_base_plus_weighted_task_vectors_and_the_rest_is_the_template(models, trained):
    out, record = trained
    assert json.loads((out / ADAMERGING_RECORD).read_text()) == record
    written, template = _tensors(out), _tensors(models["template"])
    base = _tensors(models["base"])
    experts = {t: _tensors(d) for t, d in models["experts"].items()}
    assert {k: (v.dtype, v.shape) for k, v in written.items()} == {
        k: (v.dtype, v.shape) for k, v in template.items()
    }
    for name in ("config.json", "preprocessor_config.json"):
        assert (out / name).read_bytes() == (models["template"] / name).read_bytes()

    coefficients = record["coefficients"]
    assert set(coefficients) == set(TASKS)
    learnt = set(coefficients[TASKS[0]])
    assert all(set(coefficients[t]) == learnt for t in TASKS)
    tower = {k for k in template if k.startswith(TOWER)}
    stems = {k for k in tower if k[len(TOWER) :].startswith(STEMS)}
    assert learnt == tower - stems and stems  # all the tower but what no expert changes
    assert record["tensors"] == {
        "learnt": len(learnt),
        "unchanged": len(stems),
        "from_merged": len(template) - len(learnt),
    }
    for key, value in written.items():
        if key not in learnt:
            assert torch.equal(value, template[key]), key  # kept bit for bit, stems included
            continue
        theta0 = base[key].double()
        want = theta0.clone()
        for task in TASKS:
            tau = experts[task][key[len(TOWER) :]].double() - theta0
            want += coefficients[task][key] * tau
        torch.testing.assert_close(value.double(), want, rtol=1e-6, atol=1e-7, msg=key)


# ------------------------------------------------------------ (2) one tiny step: Task Arithmetic
def test_one_tiny_step_is_task_arithmetic_at_the_initial_scale(models, tmp_path):
    out = tmp_path / "out"
    record = adamerge_checkpoint(
        models["base"],
        models["ta"],
        models["experts"],
        models["calib"],
        out,
        steps=1,
        lr=1e-12,
        progress=False,
    )
    lambdas = [v for task in TASKS for v in record["coefficients"][task].values()]
    assert lambdas == pytest.approx([DEFAULT_INIT] * len(lambdas), abs=1e-7)
    written, ta = _tensors(out), _tensors(models["ta"])
    assert set(written) == set(ta)
    for key, value in ta.items():
        torch.testing.assert_close(written[key], value, msg=key)
    assert record["entropy"]["steps"] == [1] and record["hyperparameters"]["lr"] == 1e-12


# ------------------------------------------------------------------------- (3) lower entropy
def test_training_lowers_the_calibration_entropy_and_keeps_lambda_in_0_1(models, trained):
    out, record = trained
    entropy = record["entropy"]
    assert entropy["steps"] == [1, 10, 20, 30] and len(entropy["values"]) == 4
    assert entropy["last"] < entropy["first"]
    init, final = entropy["calibration_init"], entropy["calibration_final"]
    assert final["mean"] < 0.5 * init["mean"], (init, final)  # measured: 0.41 -> 0.02
    lambdas = [v for task in TASKS for v in record["coefficients"][task].values()]
    assert all(0.0 <= v <= 1.0 for v in lambdas)
    assert max(abs(v - DEFAULT_INIT) for v in lambdas) > 0.05
    hyper = record["hyperparameters"]
    assert (hyper["steps"], hyper["init"], hyper["batch_size"]) == (30, DEFAULT_INIT, 16)
    assert record["inputs"]["calibration"]["alpha"]["sha256"] and record["peak_rss_bytes"] > 0

    # the recorded final entropy is the written checkpoint's, under each expert's own head
    for task in TASKS:
        head = ExpertHead(models["experts"][task])
        images = datasets.load_from_disk(str(models["calib"][task]))["image"]
        with torch.no_grad():
            logits = head.classifier(out, CPU)(**head.preprocess(images))
        logp = torch.log_softmax(logits, dim=-1)
        mean = float(-(logp.exp() * logp).sum(-1).mean())
        assert mean == pytest.approx(final["tasks"][task], rel=1e-3, abs=1e-6), task


# --------------------------------------------------------------------------- (4) bad input
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": 0}, r"--steps must be a positive integer \(got 0\)"),
        ({"lr": 0.0}, r"--lr must be a positive number \(got 0.0\)"),
        ({"lr": -1e-3}, r"--lr must be a positive number \(got -0.001\)"),
        ({"init": 1.5}, r"--init must be a number in \[0, 1\] \(got 1.5\)"),
        ({"init": -0.1}, r"--init must be a number in \[0, 1\] \(got -0.1\)"),
        ({"calib": "delta"}, r"task 'delta' has no --expert delta=DIR"),
    ],
)
def test_bad_input_fails_naming_the_value_and_leaves_out_untouched(
    models, trained, tmp_path, change, message
):
    out = shutil.copytree(trained[0], tmp_path / "out")  # an earlier output of featcal's
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calib = dict(models["calib"])
    if change.get("calib"):
        calib[change.pop("calib")] = models["calib"][TASKS[0]]
    with pytest.raises(FeatCalError, match=message):
        adamerge_checkpoint(
            models["base"],
            models["ta"],
            models["experts"],
            calib,
            out,
            overwrite=True,
            progress=False,
            **change,
        )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".out*"))


# ---------------------------------------------------------------------------- (5) determinism
def test_same_seed_gives_identical_coefficients(models, tmp_path):
    def run(name: str, seed: int) -> dict:
        record = adamerge_checkpoint(
            models["base"],
            models["ta"],
            models["experts"],
            models["calib"],
            tmp_path / name,
            steps=6,
            lr=1e-2,
            batch_size=5,
            seed=seed,
            progress=False,
        )
        return record["coefficients"]

    first, again, other = run("a", 3), run("b", 3), run("c", 4)
    assert first == again
    assert first != other  # another batch order
    assert (tmp_path / "a" / WEIGHTS).read_bytes() == (tmp_path / "b" / WEIGHTS).read_bytes()


# --------------------------------------------------------------------- (6) the command


def test_cli_writes_what_the_api_writes(models, tmp_path, capsys):
    from featcal_cli.main import main

    args = [
        "adamerging",
        "--base",
        str(models["base"]),
        "--merged",
        str(models["template"]),
        "--steps",
        "3",
        "--lr",
        "0.01",
        "--no-progress",
    ]
    for task in TASKS:
        args += [
            "--expert",
            f"{task}={models['experts'][task]}",
            "--calib",
            f"{task}={models['calib'][task]}",
        ]
    assert main([*args, "--out", str(tmp_path / "cli")]) == 0
    adamerge_checkpoint(
        models["base"],
        models["template"],
        models["experts"],
        models["calib"],
        tmp_path / "api",
        steps=3,
        lr=0.01,
        progress=False,
    )
    assert (tmp_path / "cli" / WEIGHTS).read_bytes() == (tmp_path / "api" / WEIGHTS).read_bytes()
    cli, api = (json.loads((tmp_path / d / ADAMERGING_RECORD).read_text()) for d in ("cli", "api"))
    assert cli["coefficients"] == api["coefficients"]
    assert main([*args, "--out", str(tmp_path / "bad"), "--init", "1.5"]) == 2
    assert "--init must be a number in [0, 1] (got 1.5)" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
