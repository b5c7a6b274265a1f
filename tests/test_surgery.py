"""Representation Surgery as a repair baseline (featcal_core/repair/surgery.py): training on a tiny
CLIP vision pool whose experts carry linear heads, the saved modules, determinism, bad input, CLI."""

from __future__ import annotations

import json
import shutil

import datasets
import pytest
import torch
from transformers import AutoImageProcessor, CLIPVisionModel

import factories
from featcal_cli.main import main
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.expert_head import ExpertHead
from featcal_core.evaluation.linear_head import save_linear_head
from featcal_core.method.settings import Settings
from featcal_core.repair import SURGERY_RECORD, SurgeryHead, load_surgery, train_surgery
from featcal_core.repair.surgery import fit_surgery, task_generator
from featcal_core.repair.surgery_module import SURGERY_CONFIG, SURGERY_WEIGHTS, save_surgery

TASKS = ("alpha", "beta", "gamma")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Tiny CLIP vision pool (3 tasks, 12 calibration images each); each expert gets what a
    published vision expert has: `architectures`, its image processor and a linear head."""
    root = tmp_path_factory.mktemp("surgery")
    zoo = factories.clip_zoo(root / "zoo", tasks=TASKS)
    for i, expert in enumerate(zoo.experts.values()):
        config = json.loads((expert / "config.json").read_text())
        config["architectures"] = ["CLIPVisionModel"]
        (expert / "config.json").write_text(json.dumps(config))
        shutil.copy(zoo.base / "preprocessor_config.json", expert)
        gen = torch.Generator().manual_seed(i)
        save_linear_head(expert, torch.randn(3, 32, generator=gen), torch.zeros(3), ["a", "b", "c"])
    return zoo


@pytest.fixture(scope="module")
def trained(pool, tmp_path_factory):
    """train_surgery with the paper's defaults (rank 16, 1000 steps, lr 1e-3, batches of 16)."""
    out = tmp_path_factory.mktemp("trained") / "out"
    record = train_surgery(pool.merged, pool.experts, pool.calib, out, progress=False)
    return out, record


def _pooled(model_dir, pixels) -> torch.Tensor:
    """Independent features: transformers' own CLIPVisionModel pooler_output (N, d)."""
    model = CLIPVisionModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(pixel_values=pixels).pooler_output


def _pixels(pool, task) -> torch.Tensor:
    images = datasets.load_from_disk(str(pool.calib[task]))["image"]
    processor = AutoImageProcessor.from_pretrained(pool.base)
    return processor(images=[im.convert("RGB") for im in images], return_tensors="pt")[
        "pixel_values"
    ]


# ------------------------------------------------------------------------------------ (a) training
def test_training_lowers_the_loss_and_the_distance_to_each_expert(pool, trained):
    out, record = trained
    assert json.loads((out / SURGERY_RECORD).read_text()) == record
    assert set(record["tasks"]) == set(TASKS) == {p.name for p in out.iterdir() if p.is_dir()}
    card = (out / "README.md").read_text()  # what the folder is and how to load it
    assert card.startswith("# Representation Surgery modules (not a checkpoint)")
    assert f'load_surgery("{TASKS[0]}")' in card and str(pool.merged) in card
    for task in TASKS:
        curve = record["tasks"][task]["loss"]
        assert curve["steps"][0] == 1 and curve["steps"][-1] == 1000 and len(curve["steps"]) == 21
        assert curve["last"] < 0.5 * curve["first"], curve  # measured: ≈ 0.36 → 0.05

        pixels = _pixels(pool, task)
        z, z_t = _pooled(pool.merged, pixels), _pooled(pool.experts[task], pixels)
        with torch.no_grad():
            z_hat = load_surgery(out / task)(z)
        before, after = (z - z_t).abs().mean(), (z_hat - z_t).abs().mean()
        assert after < 0.5 * before, (task, float(before), float(after))
        assert float(before) == pytest.approx(curve["l1_merged"], rel=1e-4)
        assert float(after) == pytest.approx(curve["l1_surgery"], rel=1e-3)


# ------------------------------------------------------------------------ (b) saving and loading
def test_saved_module_reloads_with_identical_outputs_and_states_its_shape(tmp_path, trained):
    gen = torch.Generator().manual_seed(0)
    z, z_t = torch.randn(20, 12, generator=gen), torch.randn(20, 12, generator=gen)
    module, _ = fit_surgery(z, z_t, rank=4, steps=20, batch_size=8, generator=gen)
    save_surgery(tmp_path / "m", module, {"task": "x"})
    loaded = load_surgery(tmp_path / "m")
    probe = torch.randn(7, 12, generator=gen)
    with torch.no_grad():
        assert torch.equal(loaded(probe), module(probe))
    assert (loaded.rank, loaded.dim) == (4, 12) and loaded.config["task"] == "x"

    out, _ = trained
    config = json.loads((out / "alpha" / SURGERY_CONFIG).read_text())
    assert (config["rank"], config["dim"], config["feature"]["dim"]) == (16, 32, 32)
    assert config["hyperparameters"]["lr"] == 1e-3 and config["inputs"]["calibration"]["sha256"]
    assert config["peak_rss_bytes"] > 0 and config["wall_seconds"] >= 0


def test_surgery_head_puts_the_module_between_features_and_head(pool, trained):
    out, _ = trained
    head = ExpertHead(pool.experts["beta"])
    module = load_surgery(out / "beta")
    images = datasets.load_from_disk(str(pool.calib["beta"]))["image"][:5]
    inputs = head.preprocess(images)
    features, linear = head.parts(pool.merged, CPU)
    with torch.no_grad():
        want = linear(module(features(**inputs)))
        got = SurgeryHead(head, module).classifier(pool.merged, CPU)(**inputs)
    torch.testing.assert_close(got, want)
    narrow, _ = fit_surgery(
        torch.randn(4, 8),
        torch.randn(4, 8),
        rank=4,
        steps=1,
        generator=torch.Generator().manual_seed(0),
    )
    with pytest.raises(FeatCalError, match="width 8 but the head reads 32 features"):
        SurgeryHead(head, narrow).parts(pool.merged, CPU)


# ------------------------------------------------------------------------------ (c) determinism
def test_same_seed_gives_identical_weights(pool, tmp_path):
    def run(name: str, seed: int) -> dict[str, bytes]:
        train_surgery(
            pool.merged,
            pool.experts,
            pool.calib,
            tmp_path / name,
            steps=40,
            batch_size=5,
            seed=seed,
            progress=False,
        )
        return {t: (tmp_path / name / t / SURGERY_WEIGHTS).read_bytes() for t in TASKS}

    first, again, other = run("a", 3), run("b", 3), run("c", 4)
    assert first == again
    assert all(first[t] != other[t] for t in TASKS)
    g1, g2 = task_generator(3, "alpha"), task_generator(3, "beta")
    assert not torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


# ------------------------------------------------------------------------------- (d) bad input
def test_bad_input_fails_before_any_output(pool, tmp_path):
    out = tmp_path / "out"
    calib = {t: p for t, p in pool.calib.items() if t != "beta"}
    with pytest.raises(FeatCalError, match="'beta' has no --calib beta=DIR"):
        train_surgery(pool.merged, pool.experts, calib, out, progress=False)
    missing = dict(pool.calib, gamma=tmp_path / "nowhere")
    with pytest.raises(FeatCalError, match="--calib gamma=.*nowhere.*does not exist"):
        train_surgery(pool.merged, pool.experts, missing, out, progress=False)
    with pytest.raises(FeatCalError, match="--rank must be a positive integer"):
        train_surgery(pool.merged, pool.experts, pool.calib, out, rank=0, progress=False)
    bare = factories.clip_zoo(tmp_path / "bare", tasks=("alpha",))  # expert without a head
    with pytest.raises(FeatCalError, match="'alpha'.*architectures|'alpha'.*no classification"):
        train_surgery(bare.merged, bare.experts, bare.calib, out, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    with pytest.raises(FeatCalError, match=f"{SURGERY_CONFIG} is missing"):
        load_surgery(tmp_path)


def test_cli_writes_what_the_api_writes(pool, tmp_path, capsys):
    args = ["surgery", "--merged", str(pool.merged), "--steps", "30", "--no-progress"]
    for task in TASKS:
        args += [
            "--expert",
            f"{task}={pool.experts[task]}",
            "--calib",
            f"{task}={pool.calib[task]}",
        ]
    assert main([*args, "--out", str(tmp_path / "cli"), "--seed", "2"]) == 0
    train_surgery(
        pool.merged,
        pool.experts,
        pool.calib,
        tmp_path / "api",
        steps=30,
        seed=2,
        settings=Settings(seed=2),
        progress=False,
    )
    for task in TASKS:
        cli, api = (tmp_path / d / task / SURGERY_WEIGHTS for d in ("cli", "api"))
        assert cli.read_bytes() == api.read_bytes()
    assert main([*args, "--out", str(tmp_path / "bad"), "--rank", "0"]) == 2
    assert "--rank must be a whole number >= 1 (got 0)" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
