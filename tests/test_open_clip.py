"""open_clip vision towers (open-clip-vision): `featcal import-open-clip` of the three ways open_clip
checkpoints come (.safetensors state dict, .bin state dict, pickled whole module), the adapter's
stem and blocks against open_clip's own forward, end to end through `featcal calibrate` against the
float64 reference, and bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from open_clip.model import CLIP
from open_clip.transform import image_transform
from open_clip.transformer import QuickGELU, VisionTransformer
from PIL import Image
from safetensors.torch import load_file, save_file
from test_end_to_end import ALPHA, LAM, RHO, _assert_matches
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel

import factories
from featcal_cli.main import main
from featcal_core.architectures import detect
from featcal_core.data.synthetic import Pool, image_set
from featcal_core.errors import FeatCalError
from featcal_core.open_clip.importer import featcal_config, import_open_clip
from reference import Family, reference_featcal

VISION = dict(image_size=32, patch_size=8, width=32, layers=2, head_width=8, mlp_ratio=2.0)
TEXT = dict(context_length=8, vocab_size=64, width=32, heads=4, layers=1)
MODEL_CFG = {"embed_dim": 16, "quick_gelu": True, "vision_cfg": VISION, "text_cfg": TEXT}
PREPROCESS = {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3]}
TASKS = ("alpha", "beta", "gamma")
TOKENS = 1 + (32 // 8) ** 2


class ImageEncoder(nn.Module):
    """How the original task-vector experts were pickled: a wrapper holding the open_clip model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


def _perturbed(state: dict, seed: int, scale: float = 0.05) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()
    }


def _clip(state: dict | None = None) -> CLIP:
    model = CLIP(**MODEL_CFG).double().eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _import(*args: str) -> None:
    assert main(["import-open-clip", *args]) == 0


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Tiny float64 open_clip CLIPs: base, experts = base + noise, merged = base + 0.3 Σ deltas,
    saved the ways open_clip checkpoints come and imported with `featcal import-open-clip`."""
    root = tmp_path_factory.mktemp("open_clip")
    src = root / "src"
    (src / "base").mkdir(parents=True)
    torch.manual_seed(0)
    base_state = _perturbed(_clip().state_dict(), seed=1)  # LayerNorms away from (1, 0)
    experts = {t: _clip(_perturbed(base_state, seed=100 + i)) for i, t in enumerate(TASKS)}
    merged_state = {
        k: v + 0.3 * sum(m.state_dict()[k] - v for m in experts.values())
        for k, v in base_state.items()
    }
    models = {"base": _clip(base_state), "merged": _clip(merged_state), **experts}
    config = src / "base" / "open_clip_config.json"
    config.write_text(json.dumps({"model_cfg": MODEL_CFG, "preprocess_cfg": PREPROCESS}))

    def full(model):
        return {k: v.contiguous() for k, v in model.state_dict().items()}

    files = {
        "base": src / "base" / "open_clip_model.safetensors",  # full CLIP, config beside it
        "merged": src / "merged.safetensors",  # full CLIP
        "alpha": src / "alpha.bin",  # the bare VisionTransformer's state dict
        "beta": src / "beta.pt",  # a pickled whole module (wrapper → CLIP → visual)
        "gamma": src / "gamma.pth",  # a training checkpoint with DDP `module.` keys
    }
    save_file(full(models["base"]), str(files["base"]))
    save_file(full(models["merged"]), str(files["merged"]))
    torch.save(models["alpha"].visual.state_dict(), files["alpha"])
    torch.save(ImageEncoder(models["beta"]), files["beta"])
    state = {"module." + k: v for k, v in models["gamma"].state_dict().items()}
    torch.save({"epoch": 3, "state_dict": state}, files["gamma"])

    out = {name: root / "featcal" / name for name in files}
    _import(str(files["base"]), "--out", str(out["base"]))
    for name in ("merged", "alpha", "gamma"):
        _import(str(files[name]), "--out", str(out[name]), "--config", str(config))
    _import(
        str(files["beta"]), "--out", str(out["beta"]), "--config", str(config), "--trust-pickle"
    )
    calib = {t: image_set(root / f"calib_{t}", 12, seed=i) for i, t in enumerate(TASKS)}
    zoo = Pool(out["base"], out["merged"], {t: out[t] for t in TASKS}, calib)
    return {"zoo": zoo, "models": models, "files": files, "config": config, "root": root}


def _reference_inputs(calib: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    transform = image_transform(32, is_train=False, mean=PREPROCESS["mean"], std=PREPROCESS["std"])
    out = {}
    for task, path in calib.items():
        images = datasets.load_from_disk(str(path))["image"]
        pixels = torch.stack([transform(im.convert("RGB")) for im in images])
        out[task] = {"pixel_values": pixels, "attention_mask": torch.ones(len(pixels), TOKENS)}
    return out


def test_imported_checkpoints_keep_the_tower_keys(pool):
    zoo, models = pool["zoo"], pool["models"]
    config = json.loads((zoo.base / "config.json").read_text())
    assert config["model_type"] == "open_clip_vision"
    assert (config["heads"], config["quick_gelu"], config["layers"]) == (4, True, 2)
    assert config["image_mean"] == PREPROCESS["mean"] and config["image_std"] == PREPROCESS["std"]
    for name, directory in [("base", zoo.base), ("merged", zoo.merged), *zoo.experts.items()]:
        got = load_file(str(directory / "model.safetensors"))
        prefix = "" if name in ("alpha", "beta") else "visual."
        expected = models[name].visual.state_dict()
        assert set(got) == {prefix + k for k in expected}, name  # text tower dropped
        for key, tensor in expected.items():
            assert torch.equal(got[prefix + key], tensor), (name, key)
        assert "transformer.resblocks.0.attn.in_proj_weight" in {k[len(prefix) :] for k in got}


def test_cli_matches_float64_reference(pool, tmp_path):
    zoo, models = pool["zoo"], pool["models"]
    out = tmp_path / "out"
    assert main(zoo.cli_args(out)) == 0
    record = json.loads((out / "featcal.json").read_text())
    assert record["architecture"] == "open-clip-vision"
    assert record["hyperparameters"]["pooled_position"] == 0
    experts = {t: models[t].visual for t in TASKS}
    reference = reference_featcal(
        Family("open_clip"),
        models["base"].visual,
        models["merged"].visual,
        experts,
        _reference_inputs(zoo.calib),
        ALPHA,
        RHO,
        LAM,
    )
    _assert_matches(out, reference, prefix="visual.")
    merged = load_file(str(zoo.merged / "model.safetensors"))
    got = load_file(str(out / "model.safetensors"))
    for key in ("attn.in_proj_weight", "attn.in_proj_bias", "mlp.c_proj.weight", "ln_1.bias"):
        key = "visual.transformer.resblocks.1." + key
        assert not torch.equal(got[key], merged[key]), key
    for key in merged:  # the stem, ln_post and proj are not calibrated
        if ".resblocks." not in key:
            assert torch.equal(got[key], merged[key]), key


def _tower(quick_gelu: bool, ls_init_value: float | None) -> tuple[VisionTransformer, dict]:
    vision = dict(VISION, layers=3, ls_init_value=ls_init_value)
    model = (
        VisionTransformer(
            image_size=32,
            patch_size=8,
            width=32,
            layers=3,
            heads=4,
            mlp_ratio=2.0,
            ls_init_value=ls_init_value,
            output_dim=16,
            act_layer=QuickGELU if quick_gelu else nn.GELU,
        )
        .double()
        .eval()
    )
    model.load_state_dict(_perturbed(model.state_dict(), seed=7, scale=0.2))
    config = featcal_config({"quick_gelu": quick_gelu, "vision_cfg": vision}, {}, "test")
    return model, config


@pytest.mark.parametrize(("quick_gelu", "ls_init_value"), [(True, None), (False, 0.5)])
def test_stem_and_blocks_reproduce_open_clip(quick_gelu, ls_init_value):
    """Stem tokens = the input of open_clip's transformer; each block = open_clip's residual block
    (intermediates); ln_post(CLS) @ proj = open_clip's pooled output."""
    model, config = _tower(quick_gelu, ls_init_value)
    arch = detect(config)
    assert arch.name == "open-clip-vision" and arch.num_blocks == 3
    pixels = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    seen = {}
    hook = model.transformer.register_forward_pre_hook(lambda m, a: seen.setdefault("x", a[0]))
    with torch.no_grad():
        pooled = model(pixels)
        blocks = model.forward_intermediates(pixels, output_fmt="NLC", output_extra_tokens=True)
        hook.remove()
        state = model.state_dict()
        stem = arch.build_stem(torch.float64)
        stem.load_state_dict({name: state[name] for name in stem.state_dict()})
        hidden = arch.run_stem(stem, {"pixel_values": pixels})
        torch.testing.assert_close(hidden, seen["x"], rtol=1e-12, atol=1e-12)
        mask = torch.ones(2, TOKENS)
        for i in range(3):
            block = arch.build_block(torch.float64)
            prefix = arch.block_prefix(i)
            block.load_state_dict(
                {n: state[prefix + arch.checkpoint_name(n)] for n in block.state_dict()}
            )
            hidden = arch.run_block(block, hidden, mask)
            torch.testing.assert_close(hidden[:, 0:1], blocks["image_intermediates_prefix"][i])
            torch.testing.assert_close(hidden[:, 1:], blocks["image_intermediates"][i])
        torch.testing.assert_close(model.ln_post(hidden[:, 0]) @ model.proj, pooled)
    # the generic runner finds the packed projection as one Linear, and the norms
    linears = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    assert linears == ["attn.in_proj", "attn.out_proj", "mlp.c_fc", "mlp.c_proj"]
    assert [n for n, m in block.named_modules() if isinstance(m, nn.LayerNorm)] == ["ln_1", "ln_2"]
    weights = arch.token_weights("attn.in_proj", True, mask)
    assert bool((weights == 1).all())
    weights = arch.token_weights("mlp.c_fc", True, mask)
    assert weights[0, 0] == 1 and bool((weights[:, 1:] == 0.01).all())


def test_prepare_inputs_resize_crop_and_normalize_with_config_statistics():
    config = featcal_config(MODEL_CFG, PREPROCESS, "test")
    arch = detect(config)
    color = np.array([255, 102, 0], dtype=np.uint8)
    wide = np.broadcast_to(color, (40, 64, 3)).copy()  # an array; resized and center-cropped
    inputs = arch.prepare_inputs("unused", [wide, Image.fromarray(wide)], 128)
    assert inputs["pixel_values"].shape == (2, 3, 32, 32)
    assert inputs["attention_mask"].shape == (2, TOKENS)
    expected = (torch.tensor(color / 255.0) - torch.tensor(PREPROCESS["mean"])) / torch.tensor(
        PREPROCESS["std"]
    )
    got = inputs["pixel_values"].to(torch.float64).mean(dim=(2, 3))
    torch.testing.assert_close(got, expected.expand(2, 3), rtol=0, atol=1e-5)
    default = detect(featcal_config(MODEL_CFG, {}, "test"))
    assert default.settings.mean == (0.48145466, 0.4578275, 0.40821073)


def _fails(args: list[str], capsys, *needles: str) -> str:
    return factories.cli_fails(args, capsys, *needles)


def test_pickled_module_needs_trust_pickle(pool, tmp_path, capsys, caplog):
    pickled = pool["files"]["beta"]
    args = [
        "import-open-clip",
        str(pickled),
        "--out",
        str(tmp_path / "out"),
        "--config",
        str(pool["config"]),
    ]
    _fails(args, capsys, str(pickled), "--trust-pickle", "arbitrary code", "ImageEncoder")
    with pytest.raises(FeatCalError, match="trust_pickle"):
        import_open_clip(pickled, tmp_path / "out", model_cfg=pool["config"])
    assert main(args + ["--trust-pickle"]) == 0
    assert "unpickling a whole Python object" in caplog.text
    # the same tensors as the fixture's import of that file
    assert (
        load_file(str(tmp_path / "out" / "model.safetensors")).keys()
        == load_file(str(pool["zoo"].experts["beta"] / "model.safetensors")).keys()
    )


def test_checkpoint_of_another_family_fails_clearly(pool, tmp_path, capsys):
    hf = tmp_path / "hf_clip"
    CLIPVisionModel(CLIPVisionConfig(**factories.TINY_CLIP)).save_pretrained(hf)
    zoo = pool["zoo"]
    mixed = Pool(zoo.base, zoo.merged, {**zoo.experts, "beta": hf}, zoo.calib)
    _fails(
        mixed.cli_args(tmp_path / "out"),
        capsys,
        str(hf / "config.json"),
        "hf-clip-vision",
        "open-clip-vision",
    )
    args = [
        "import-open-clip",
        str(hf / "model.safetensors"),
        "--out",
        str(tmp_path / "imp"),
        "--config",
        str(pool["config"]),
    ]
    _fails(args, capsys, str(hf / "model.safetensors"), "not an open_clip checkpoint")


def _config_file(path: Path, **vision) -> Path:
    cfg = dict(MODEL_CFG, vision_cfg=dict(VISION, **vision))
    path.write_text(json.dumps({"model_cfg": cfg}))
    return path


def test_bad_import_inputs_fail_clearly(pool, tmp_path, capsys):
    files, config = pool["files"], str(pool["config"])
    out = str(tmp_path / "out")
    lone = tmp_path / "lone" / "alpha.bin"  # no open_clip_config.json beside it
    lone.parent.mkdir()
    shutil.copy2(files["alpha"], lone)
    _fails(
        ["import-open-clip", str(lone), "--out", out],
        capsys,
        str(lone),
        "--config open_clip_config.json",
    )
    deeper = _config_file(tmp_path / "deeper.json", layers=3)
    _fails(
        ["import-open-clip", str(files["alpha"]), "--out", out, "--config", str(deeper)],
        capsys,
        str(files["alpha"]),
        "'transformer.resblocks.2.ln_1.weight'",
    )
    wider = _config_file(tmp_path / "wider.json", width=64)
    _fails(
        ["import-open-clip", str(files["alpha"]), "--out", out, "--config", str(wider)],
        capsys,
        str(files["alpha"]),
        "has shape [32] but the config implies [64]",
    )
    shallower = _config_file(tmp_path / "shallower.json", layers=1)
    _fails(
        ["import-open-clip", str(files["alpha"]), "--out", out, "--config", str(shallower)],
        capsys,
        "more than the config's 1 blocks",
    )
    custom = _config_file(tmp_path / "custom.json", qk_norm=True)
    _fails(
        ["import-open-clip", str(files["alpha"]), "--out", out, "--config", str(custom)],
        capsys,
        str(custom),
        "qk_norm",
        "not supported",
    )
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    _fails(["import-open-clip", str(junk), "--out", out, "--config", config], capsys, str(junk))
    _fails(
        ["import-open-clip", str(tmp_path / "missing.bin"), "--out", out],
        capsys,
        str(tmp_path / "missing.bin"),
        "not a file",
    )
    existing = tmp_path / "existing"
    existing.mkdir()
    capsys.readouterr()
    assert main(["import-open-clip", str(files["alpha"]), "--out", str(existing)]) == 2
    assert "--overwrite" in capsys.readouterr().err and list(existing.iterdir()) == []


def test_merged_checkpoint_with_missing_shard_fails_clearly(pool, tmp_path, capsys):
    zoo = pool["zoo"]
    merged = tmp_path / "merged"
    shutil.copytree(zoo.merged, merged)
    factories.reshard(merged, shards=3)
    missing = merged / "model-00002-of-00003.safetensors"
    missing.unlink()
    broken = Pool(zoo.base, merged, zoo.experts, zoo.calib)
    _fails(broken.cli_args(tmp_path / "out"), capsys, str(missing), "model.safetensors.index.json")
    assert not (tmp_path / "out").exists()
