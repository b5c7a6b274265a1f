"""open_clip models in the pipeline: `format: open_clip` references (local directories and files,
a Hub repository in open_clip's layout from an offline cache) imported once by the download step
and locked with their source; zero-shot evaluation through the base's open_clip text tower
against open_clip's own encode_image / encode_text; `featcal run` end to end; bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
import yaml
from open_clip.model import CLIP
from open_clip.transform import image_transform
from PIL import Image
from safetensors.torch import save_file
from test_pipeline import _labelled_images
from test_resolve import hub_cache

import factories
from featcal_cli.main import main
from featcal_core.errors import FeatCalError
from featcal_core.evaluation.accuracy import evaluate
from featcal_core.method.head_calibration import calibrate_head
from featcal_core.open_clip.zero_shot import OpenCLIPZeroShotHead
from featcal_core.params import ModelRef, load_params
from featcal_core.provenance import hub
from featcal_core.provenance.lock import models_from_lock, read_lock, verify_lock, write_lock
from featcal_core.provenance.resolve import ResolvedModel, check_pool, resolve_model

VISION = dict(image_size=32, patch_size=8, width=32, layers=2, head_width=8, mlp_ratio=2.0)
# open_clip's SimpleTokenizer (shipped with the package) needs its full vocabulary
TEXT = dict(context_length=16, vocab_size=49408, width=32, heads=4, layers=1)
MODEL_CFG = {"embed_dim": 16, "quick_gelu": True, "vision_cfg": VISION, "text_cfg": TEXT}
PREPROCESS = {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3]}
CONFIG = {"model_cfg": MODEL_CFG, "preprocess_cfg": PREPROCESS}
WEIGHTS = "open_clip_model.safetensors"
CLASSES = ["cat", "dog", "bird"]
TEMPLATES = ["a photo of a {}.", "a {}."]


def sha256(path: Path) -> str:
    from featcal_core.io.checkpoint import sha256_file

    return sha256_file(path)


def _clip(state: dict | None = None) -> CLIP:
    model = CLIP(**MODEL_CFG).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


def _perturbed_tower(state: dict, seed: int, scale: float = 0.05) -> dict:
    """The CLIP state with its vision tower (visual.*) moved by seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen) if k.startswith("visual.") else v
        for k, v in state.items()
    }


def _save(model: CLIP, directory: Path, config: bool = True) -> Path:
    """The Hub's open_clip layout: open_clip_config.json (optional) + open_clip_model.safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    if config:
        (directory / "open_clip_config.json").write_text(json.dumps(CONFIG))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / WEIGHTS))
    return directory


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A tiny open_clip CLIP base and two experts (perturbed vision towers; beta without its own
    open_clip_config.json), each task's labelled images, and a pickled-module expert."""
    root = tmp_path_factory.mktemp("open_clip_pool")
    torch.manual_seed(0)
    base = _clip()
    state = base.state_dict()
    experts = {
        t: _clip(_perturbed_tower(state, seed=10 + i)) for i, t in enumerate(("alpha", "beta"))
    }
    dirs = {
        "base": _save(base, root / "base"),
        "alpha": _save(experts["alpha"], root / "alpha"),
        "beta": _save(experts["beta"], root / "beta", config=False),
    }
    pickled = root / "pickled" / "expert.pt"
    pickled.parent.mkdir()
    torch.save(experts["beta"], pickled)  # a whole pickled module, as the original experts
    data = {
        t: _labelled_images(root / f"data_{t}", seed=i, rows=(12, 6))
        for i, t in enumerate(("alpha", "beta"))
    }
    return {
        "root": root,
        "dirs": dirs,
        "models": {"base": base, **experts},
        "pickled": pickled,
        "data": data,
    }


def _ref(ref, **options) -> ModelRef:
    return ModelRef.model_validate({"ref": str(ref), "format": "open_clip", **options})


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


# ------------------------------------------------------------------------- resolving, the lock


def test_local_open_clip_ref_is_imported_once_and_locked(pool, tmp_path):
    base_dir = _copy(pool["dirs"]["base"], tmp_path / "base")
    beta_dir = _copy(pool["dirs"]["beta"], tmp_path / "beta")  # no open_clip_config.json
    imports = tmp_path / "imports"
    base = resolve_model(_ref(base_dir), "models.base", import_root=imports)
    digest = sha256(base_dir / WEIGHTS)
    assert base.path == imports / f"base-{digest[:16]}"
    config = json.loads((base.path / "config.json").read_text())
    assert config["model_type"] == "open_clip_vision"
    assert config["open_clip_source"] == {"file": WEIGHTS, "sha256": digest}
    assert base.open_clip_source == {
        "format": "open_clip",
        "path": str(base_dir),
        "file": WEIGHTS,
        "sha256": digest,
        "config": str(base_dir / "open_clip_config.json"),
        "config_sha256": sha256(base_dir / "open_clip_config.json"),
        "trust_pickle": False,
    }
    assert base.kind == "local" and base.commit is None and base.reference == str(base_dir)
    assert set(base.files) == {"config.json", "model.safetensors"}

    written = {p.name: p.stat().st_mtime_ns for p in base.path.iterdir()}
    again = resolve_model(_ref(base_dir), "models.base", import_root=imports)
    assert again == base  # the import is reused, not rewritten
    assert {p.name: p.stat().st_mtime_ns for p in base.path.iterdir()} == written
    assert sorted(p.name for p in imports.iterdir()) == [base.path.name]  # no temporaries

    # an expert without its own config uses the base's; a weight file as the reference
    beta = resolve_model(
        _ref(beta_dir / WEIGHTS),
        "models.experts.beta",
        import_root=imports,
        base_config=base.open_clip_source["config"],
    )
    assert beta.open_clip_source["config"] == base.open_clip_source["config"]
    assert beta.path.name == f"experts.beta-{sha256(beta_dir / WEIGHTS)[:16]}"
    assert check_pool(base, {"beta": beta}) == "open-clip-vision"

    lock_path = tmp_path / "models.lock.json"
    lock = write_lock(lock_path, base, {"beta": beta}, extra={"architecture": "open-clip-vision"})
    assert read_lock(lock_path) == lock
    assert lock["base"]["open_clip_source"]["sha256"] == digest
    assert models_from_lock(lock) == (base, {"beta": beta})
    assert verify_lock(lock) == []

    # the source changes: the lock says so, and the next resolve imports it anew
    model = pool["models"]["base"]
    state = {k: v + 1.0 if k == "visual.proj" else v for k, v in model.state_dict().items()}
    _save(_clip(state), base_dir)
    problems = verify_lock(read_lock(lock_path))
    assert len(problems) == 1 and "models.base" in problems[0], problems
    assert f"open_clip source {base_dir / WEIGHTS} has sha256" in problems[0]
    changed = resolve_model(_ref(base_dir), "models.base", import_root=imports)
    assert changed.path != base.path and changed.open_clip_source["sha256"] != digest


def test_lock_of_other_models_keeps_its_layout(tmp_path):
    pool = factories.clip_zoo(tmp_path / "clip")
    model = resolve_model(ModelRef.model_validate(str(pool.base)), "models.base")
    assert model.open_clip_source is None
    assert list(model.to_dict()) == [
        "role",
        "reference",
        "kind",
        "repo_id",
        "revision",
        "commit",
        "path",
        "trust_remote_code",
        "files",
    ]
    assert ResolvedModel.from_dict(model.to_dict()) == model


def test_hub_open_clip_repo_from_offline_cache(pool, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "model_info", _no_network)
    calls = []
    real = hub.snapshot_download

    def recording(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return real(repo_id, **kwargs)

    monkeypatch.setattr(hub, "snapshot_download", recording)
    cache, imports = tmp_path / "hf", tmp_path / "imports"
    snapshot, commit = hub_cache(cache, "owner/tiny-open-clip", pool["dirs"]["base"])
    base = resolve_model(
        _ref("owner/tiny-open-clip"), "models.base", cache_dir=cache, import_root=imports
    )
    assert (base.kind, base.repo_id, base.commit) == ("hub", "owner/tiny-open-clip", commit)
    assert base.reference == "owner/tiny-open-clip"
    assert Path(base.open_clip_source["path"]).resolve() == snapshot.resolve()
    assert base.open_clip_source["file"] == WEIGHTS
    assert base.path.parent == imports
    ((_, kwargs),) = calls
    assert kwargs["allow_patterns"][:2] == ["open_clip_config.json", WEIGHTS]
    assert kwargs["ignore_patterns"] == []
    assert not any(
        "*" in p and p.endswith((".bin", ".pt", ".pth", ".safetensors"))
        for p in kwargs["allow_patterns"]
    )

    # a repository with only open_clip_pytorch_model.bin (a state dict): the second default
    source = tmp_path / "bin_only"
    source.mkdir()
    shutil.copyfile(
        pool["dirs"]["base"] / "open_clip_config.json", source / "open_clip_config.json"
    )
    torch.save(pool["models"]["alpha"].state_dict(), source / "open_clip_pytorch_model.bin")
    hub_cache(cache, "owner/bin-only", source)
    calls.clear()
    expert = resolve_model(
        _ref("owner/bin-only@main"), "models.experts.alpha", cache_dir=cache, import_root=imports
    )
    assert [kw["allow_patterns"][1] for _, kw in calls] == [WEIGHTS, "open_clip_pytorch_model.bin"]
    assert expert.open_clip_source["file"] == "open_clip_pytorch_model.bin"
    assert expert.revision == "main" and check_pool(base, {"alpha": expert}) == "open-clip-vision"

    # a weight file the repository does not have: a clear error naming the key
    with pytest.raises(FeatCalError) as info:
        resolve_model(
            _ref("owner/bin-only", file="other.safetensors"),
            "models.experts.alpha",
            cache_dir=cache,
            import_root=imports,
        )
    message = str(info.value)
    assert "\n" not in message and "models.experts.alpha" in message
    assert "other.safetensors" in message and "models.experts.alpha.file" in message


def _no_network(*args, **kwargs):
    raise AssertionError("the tests must not reach the Hub")


# ----------------------------------------------------------------------------- zero-shot head


def _images(count: int, seed: int = 3) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (40, 36, 3), dtype=np.uint8)) for _ in range(count)
    ]


@torch.no_grad()
def _reference_logits(base: CLIP, tower: CLIP, images: list[Image.Image]) -> torch.Tensor:
    """open_clip's own zero-shot classifier: base text tower, the evaluated vision tower."""
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=TEXT["context_length"])
    per_class = []
    for name in CLASSES:
        text = base.encode_text(tokenizer([t.format(name) for t in TEMPLATES]), normalize=True)
        per_class.append(F.normalize(text.mean(dim=0), dim=-1))
    classes = torch.stack(per_class)
    transform = image_transform(32, is_train=False, mean=PREPROCESS["mean"], std=PREPROCESS["std"])
    pixels = torch.stack([transform(image.convert("RGB")) for image in images])
    features = tower.encode_image(pixels, normalize=True)
    return base.logit_scale.exp() * features @ classes.T


def test_zero_shot_head_matches_open_clip(pool, tmp_path, monkeypatch):
    imports = tmp_path / "imports"
    base = resolve_model(_ref(pool["dirs"]["base"]), "models.base", import_root=imports)
    alpha = resolve_model(_ref(pool["dirs"]["alpha"]), "models.experts.alpha", import_root=imports)
    cache = tmp_path / "heads"
    head = OpenCLIPZeroShotHead(pool["dirs"]["base"], base.path, CLASSES, TEMPLATES, cache)
    images = _images(5)
    models = pool["models"]
    with torch.no_grad():
        for directory, tower in ((alpha.path, models["alpha"]), (base.path, models["base"])):
            logits = head.classifier(directory, torch.device("cpu"))(**head.preprocess(images))
            expected = _reference_logits(models["base"], tower, images)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    files = list(cache.glob("*.safetensors"))
    assert len(files) == 1

    # the cache is reused (no text tower run), also by the head built from the lock record
    def no_text_tower(*args, **kwargs):
        raise AssertionError("the text tower ran although the class embeddings are cached")

    monkeypatch.setattr(CLIP, "encode_text", no_text_tower)
    again = OpenCLIPZeroShotHead.from_source_record(
        base.open_clip_source, base.path, CLASSES, TEMPLATES, cache
    )
    torch.testing.assert_close(again.class_embeddings(), head.class_embeddings())
    result = evaluate(
        alpha.path, again, pool["data"]["alpha"], "test", batch_size=4, progress=False
    )
    assert 0.0 <= result["accuracy"] <= 1.0 and result["examples"] == 6
    assert list(cache.glob("*.safetensors")) == files

    # head calibration refits exp(logit_scale) · class embeddings for another tower
    rows = list(
        datasets.load_from_disk(str(pool["data"]["alpha"]))["train"].select(range(8))["image"]
    )
    weight, bias = calibrate_head(again, alpha.path, base.path, rows, lam=0.1)
    assert weight.shape == (len(CLASSES), MODEL_CFG["embed_dim"]) and bias.shape == (3,)


def test_zero_shot_head_refuses_another_tower(pool, tmp_path):
    base = resolve_model(_ref(pool["dirs"]["base"]), "models.base", import_root=tmp_path)
    hf = factories.clip_zoo(tmp_path / "hf", tasks=("alpha",))
    head = OpenCLIPZeroShotHead(pool["dirs"]["base"], base.path, CLASSES, TEMPLATES)
    with pytest.raises(FeatCalError, match=r"hf-clip-vision checkpoint but the .* open-clip"):
        head.parts(hf.experts["alpha"], torch.device("cpu"))
    with pytest.raises(FeatCalError, match="open_clip zero-shot head needs an open-clip-vision"):
        OpenCLIPZeroShotHead(pool["dirs"]["base"], hf.base, CLASSES, TEMPLATES)


# ------------------------------------------------------------------------------------ the run


def _params(pool, tmp_path: Path, experts: dict | None = None) -> dict:
    dirs, data = pool["dirs"], pool["data"]
    return {
        "run": {"name": "open-clip", "results_dir": str(tmp_path / "results"), "seed": 1},
        "models": {
            "base": {"ref": str(dirs["base"]), "format": "open_clip"},
            "experts": experts
            or {
                "alpha": {"ref": str(dirs["alpha"]), "format": "open_clip"},
                "beta": {"ref": str(dirs["beta"] / WEIGHTS), "format": "open_clip"},
            },
        },
        "tasks": {
            "alpha": {
                "calibration": {"path": str(data["alpha"]), "split": "train"},
                "evaluation": {"path": str(data["alpha"]), "split": "test"},
                "class_names": CLASSES,
                "templates": TEMPLATES,
            },
            "beta": {  # the default template
                "calibration": {"path": str(data["beta"]), "split": "train"},
                "evaluation": {"path": str(data["beta"]), "split": "test"},
                "class_names": CLASSES,
            },
        },
        "featcal": {"num_per_task": 8, "batch_size": 4},
        "evaluation": {"batch_size": 4},
    }


def _write(tmp_path: Path, params: dict) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_featcal_run_on_an_open_clip_pool(pool, tmp_path, prefect_api, monkeypatch):
    proc = factories.run_featcal(tmp_path, _write(tmp_path, _params(pool, tmp_path)), prefect_api)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = tmp_path / "results"
    lock = json.loads((results / "models.lock.json").read_text())
    assert lock["architecture"] == "open-clip-vision"
    source = lock["base"]["open_clip_source"]
    assert source["sha256"] == sha256(pool["dirs"]["base"] / WEIGHTS)
    imported = Path(lock["base"]["path"])
    assert imported.parts[:3] == ("data", "models", "open_clip")  # below the working directory
    assert (tmp_path / imported / "model.safetensors").is_file()
    assert lock["experts"]["beta"]["open_clip_source"]["config"] == source["config"]
    record = json.loads((results / "calibrated" / "featcal.json").read_text())
    assert record["architecture"] == "open-clip-vision"
    assert [b["index"] for b in record["blocks"]] == [0, 1]
    evaluation = json.loads((results / "evaluation.json").read_text())
    for task in ("alpha", "beta"):
        row = evaluation[task]
        assert set(row) == {"base", "expert", "merged", "calibrated"}
        for result in row.values():
            assert 0.0 <= result["accuracy"] <= 1.0 and result["examples"] == 6
    assert len(list((results / "heads").glob("open-clip-zeroshot-*.safetensors"))) == 2

    from featcal_core.provenance.lineage import trace

    monkeypatch.chdir(tmp_path)  # the lock's import paths are relative to the working directory
    chain = trace(results / "calibrated")
    assert chain["problems"] == [], chain["problems"]
    assert chain["chain"]["base"]["open_clip_source"]["status"] == "ok"


# --------------------------------------------------------------------------------- bad inputs


def _download_fails(tmp_path: Path, params: dict, capsys, *needles: str) -> str:
    path = _write(tmp_path, params)
    capsys.readouterr()
    assert main(["download", "--params", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the INFO log lines
    assert err.startswith("featcal: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "results" / "models.lock.json").exists()
    return err


def test_pickled_expert_needs_trust_pickle(pool, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    experts = {
        "alpha": {"ref": str(pool["dirs"]["alpha"]), "format": "open_clip"},
        "beta": {"ref": str(pool["pickled"]), "format": "open_clip"},
    }
    params = _params(pool, tmp_path, experts)
    _download_fails(
        tmp_path,
        params,
        capsys,
        "models.experts.beta",
        str(pool["pickled"]),
        "arbitrary code",
        "models.experts.beta.trust_pickle: true",
    )
    imports = tmp_path / "data" / "models" / "open_clip"
    names = sorted(p.name for p in imports.iterdir())
    assert not [n for n in names if n.startswith(".") or n.startswith("experts.beta")], names

    params["models"]["experts"]["beta"]["trust_pickle"] = True
    assert main(["download", "--params", str(_write(tmp_path, params))]) == 0
    lock = read_lock(tmp_path / "results" / "models.lock.json")
    assert lock["experts"]["beta"]["open_clip_source"]["trust_pickle"] is True
    assert verify_lock(lock) == []


def test_missing_weight_file_fails_clearly(pool, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty_expert"
    empty.mkdir()
    experts = {
        "alpha": {"ref": str(empty), "format": "open_clip"},
        "beta": {"ref": str(pool["dirs"]["beta"]), "format": "open_clip"},
    }
    _download_fails(
        tmp_path,
        _params(pool, tmp_path, experts),
        capsys,
        "models.experts.alpha",
        str(empty / WEIGHTS),
        "models.experts.alpha.file",
    )
    experts["alpha"] = {
        "ref": str(pool["dirs"]["alpha"]),
        "format": "open_clip",
        "file": "missing.safetensors",
    }
    _download_fails(
        tmp_path,
        _params(pool, tmp_path, experts),
        capsys,
        str(pool["dirs"]["alpha"] / "missing.safetensors"),
        "does not exist",
    )


@pytest.mark.parametrize(
    ("base", "needles"),
    [
        ({"ref": "owner/name", "format": "openclip"}, ("models.base.format", "open_clip")),
        (
            {"ref": "owner/name", "trust_pickle": True},
            ("models.base.trust_pickle", "format: open_clip"),
        ),
        ({"ref": "owner/name", "file": "x.safetensors"}, ("models.base.file", "format: open_clip")),
        (
            {"ref": "owner/name", "format": "open_clip", "file": "weights.ckpt"},
            ("models.base.file", ".safetensors"),
        ),
        (
            {"ref": "owner/name", "format": "open_clip", "trust_remote_code": True},
            ("models.base.trust_remote_code", "remove trust_remote_code"),
        ),
    ],
)
def test_bad_open_clip_references_name_the_key(pool, tmp_path, base, needles):
    params = _params(pool, tmp_path)
    params["models"]["base"] = base
    with pytest.raises(FeatCalError) as info:
        load_params(_write(tmp_path, params))
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_open_clip_references_in_params(pool, tmp_path):
    params = load_params(_write(tmp_path, _params(pool, tmp_path)))
    base, beta = params.models.base, params.models.experts["beta"]
    assert (base.format, base.kind, beta.kind) == ("open_clip", "local", "local")
    assert beta.path == pool["dirs"]["beta"] / WEIGHTS  # a local weight file is a local reference
    assert base.to_yaml() == {"ref": str(pool["dirs"]["base"]), "format": "open_clip"}
    settings = params.calibration_settings()["models"]
    assert settings["base"] == {"ref": str(pool["dirs"]["base"]), "format": "open_clip"}
    hub = ModelRef.model_validate(
        {"ref": "laion/CLIP-ViT-B-32-laion2B-s34B-b79K", "format": "open_clip"}
    )
    assert (hub.kind, hub.repo_id, hub.file) == (
        "hub",
        "laion/CLIP-ViT-B-32-laion2B-s34B-b79K",
        None,
    )
