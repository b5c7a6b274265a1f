"""`featcal check` (featcal_core.preflight): every model and dataset of a params file checked
before anything is downloaded; `featcal run` runs it first."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from test_pipeline import write_params
from test_resolve import hub_cache

from featcal_cli.main import main
from featcal_core.params import load_params
from featcal_core.preflight import check

PAPER = Path(__file__).resolve().parents[1] / "params" / "paper-clip-vit-b32.yaml"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """The tiny zero-shot CLIP setting of test_pipeline: base, experts alpha and beta, data."""
    return write_params(tmp_path_factory.mktemp("preflight"))


def _planted(good, tmp_path):
    """The good params with six planted mistakes, one line each expected."""
    data = yaml.safe_load(good.read_text())
    pickled = tmp_path / "pickled_expert"
    pickled.mkdir()
    shutil.copy(good.parent / "base" / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"pickle")
    data["models"]["experts"]["alpha"] = str(pickled)  # 1: pickled weights only
    data["models"]["experts"]["beta"] = str(tmp_path / "nowhere")  # 2: no such folder
    data["tasks"]["alpha"]["evaluation"]["split"] = "validation"  # 3: no such split
    data["tasks"]["beta"]["calibration"]["path"] = str(tmp_path / "no_data")  # 4: no dataset
    data["tasks"]["beta"]["evaluation"]["label_column"] = "target"  # 5: no such column
    del data["tasks"]["beta"]["class_names"]  # 6: int labels have no names, templates given
    data["tasks"]["beta"]["evaluation"]["image_column"] = "image"
    path = tmp_path / "planted.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_good_params_pass(good, capsys):
    assert main(["check", "--params", str(good)]) == 0
    out, err = capsys.readouterr()
    assert "no problems found (2 tasks)" in out and "error" not in err


def test_planted_mistakes_one_line_each_nothing_written(good, tmp_path, capsys):
    planted = _planted(good, tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["check", "--params", str(planted)]) == 2
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("featcal: error: ")]
    assert len(errors) == 5, "\n".join(lines)
    expected = {
        "models.experts.alpha": "has no safetensors weights (only pytorch_model.bin)",
        "models.experts.beta": "does not exist",
        "tasks.alpha.evaluation.split": "has no split 'validation' (available: ['train', 'test'])",
        "tasks.beta.calibration": "does not exist",
        "tasks.beta.evaluation": "no label column 'target'",
    }
    for key, words in expected.items():
        found = [line for line in errors if line.startswith(f"featcal: error: {key}: ")]
        assert len(found) == 1 and words in found[0], (key, errors)
    assert lines[-1].endswith("5 problems; fix them and run again")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written anywhere
    assert not (good.parent / "results").exists()

    # the missing class names show once the label column is right
    problems, _ = check(load_params(planted, ["tasks.beta.evaluation.label_column=label"]))
    assert [k for k, _ in problems if k.startswith("tasks.beta.")] == [
        "tasks.beta.calibration",
        "tasks.beta.class_names",
    ]


def test_run_stops_before_any_download(good, tmp_path, capsys):
    planted = _planted(good, tmp_path)
    data = yaml.safe_load(planted.read_text())
    data["run"]["results_dir"] = str(tmp_path / "results")
    planted.write_text(yaml.safe_dump(data))
    for command in ("run", "demo", "compare"):  # each runs the check before any download
        assert main([command, "--params", str(planted)]) == 2
        assert "5 problems" in capsys.readouterr().err
        assert not (tmp_path / "results").exists()


def test_hub_models_from_the_cache_offline(good, tmp_path, monkeypatch):
    """Offline: a Hub base found in the cache with its conversion pull request (a note), an
    expert that is not cached (a problem naming the fix)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(good.parent / "base" / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"pickle")
    hub_cache(cache, "openai/clip", pickled)
    hub_cache(cache, "openai/clip", good.parent / "base", ref_name="refs/pr/66", commit="c" * 40)
    params = load_params(good, ["models.base=openai/clip", "models.experts.beta=owner/missing"])
    problems, notes = check(params, cache_dir=cache)
    assert [k for k, _ in problems] == ["models.experts.beta"], problems
    assert "not in the local Hugging Face cache" in problems[0][1]
    assert "hf download owner/missing" in problems[0][1]
    assert (
        "models.base",
        "Hub model 'openai/clip' has pickled weights only on its default "
        "branch; the run uses its safetensors conversion refs/pr/66 (a pull request cached "
        "with safetensors weights)",
    ) in notes


def test_an_expert_of_another_family_is_named(good, tmp_path):
    from factories import bert_zoo

    bert = bert_zoo(tmp_path / "bert", tasks=("gamma",))
    params = load_params(good, [f"models.experts.alpha={bert.experts['gamma']}"])
    problems, _ = check(params)
    assert [k for k, _ in problems] == ["models.experts.alpha"], problems
    assert "the base a hf-clip-vision one" in problems[0][1]


def test_hub_online_unreachable_is_a_note_a_missing_repository_a_problem(good, monkeypatch):
    """Online: the Hub not answering is left to the download step (which retries), a missing
    repository is a problem worded as the download step words it."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from featcal_core.provenance import resolve

    monkeypatch.setattr(resolve.hf_constants, "HF_HUB_OFFLINE", False)

    def model_info(self, repo_id, revision=None):
        if repo_id == "owner/down":
            raise ConnectionError("connection reset")
        response = httpx2.Response(404, request=httpx2.Request("GET", "https://hub/api"))
        raise RepositoryNotFoundError("404 not found", response=response)

    monkeypatch.setattr(HfApi, "model_info", model_info)
    params = load_params(
        good, ["models.experts.alpha=owner/down", "models.experts.beta=owner/gone"]
    )
    problems, notes = check(params)
    assert [k for k, _ in problems] == ["models.experts.beta"], problems
    assert "repository owner/gone does not exist or is private" in problems[0][1]
    assert any(k == "models.experts.alpha" and "did not answer" in t for k, t in notes), notes


def test_the_paper_file_checks_unchanged_against_stand_in_hub_repositories(
    tmp_path, monkeypatch, capsys
):
    """params/paper-clip-vit-b32.yaml as shipped, offline, against a Hugging Face cache holding
    stand-ins in the real layouts: openai/clip-vit-base-patch32 with pickled weights only on main
    and its safetensors in refs/pr/66 (as on the Hub), the eight tanganke experts as
    CLIPVisionModel checkpoints with transformers 4.x `vision_model.` keys. No problem: the
    conversion pull request and the Hub datasets (not checkable offline) are notes. One expert
    missing from the cache: one line, exit 2."""
    from huggingface_hub import constants
    from test_paper_run import paper_model_cache

    paper = load_params(PAPER)
    cache = tmp_path / "hf"
    paper_model_cache(paper, tmp_path, cache)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    assert main(["check", "--params", str(PAPER)]) == 0
    out, err = capsys.readouterr()
    # the Hub datasets are not checkable offline: the headline says so, never "no problems found"
    assert "no problems found (8 tasks)" not in out
    assert (
        "no problems found in what was checked (8 tasks); 16 items not checked (16 offline)" in out
    )
    assert (
        "featcal: note: models.base: Hub model 'openai/clip-vit-base-patch32' has pickled "
        "weights only on its default branch; the run uses its safetensors conversion "
        "refs/pr/66" in err
    )
    assert err.count("not checked offline") == 16  # calibration and evaluation of 8 tasks

    # --strict: each item not checked is one problem line, exit 2
    assert main(["check", "--params", str(PAPER), "--strict"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 16 and all("--strict" in line for line in errors), errors

    shutil.rmtree(cache / "models--tanganke--clip-vit-base-patch32_dtd")
    assert main(["check", "--params", str(PAPER)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "featcal: error: models.experts.dtd: Hub "
        "model 'tanganke/clip-vit-base-patch32_dtd' "
        "is not in the local Hugging Face cache"
    )


def test_hub_datasets_checked_from_their_cards_without_downloading_rows(
    good, tmp_path, monkeypatch
):
    """Online, a Hub dataset's config, split, columns and zero-shot class names are checked from
    what datasets' builder reads (the card and the file listing; no rows): here repositories in
    the Hub's layout stand in for owner/signs and owner/plain, whose data files are not parquet
    at all, so any read of rows would fail."""
    import datasets
    from huggingface_hub import HfApi
    from PIL import Image

    import factories
    from featcal_core.provenance import resolve

    image = Image.new("RGB", (4, 4))
    signs = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(43)])}
    )
    plain = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    repos = {
        "owner/signs": factories.hub_dataset_repo(
            tmp_path / "signs", signs, {}, "default", broken=("train", "test")
        ),
        "owner/plain": factories.hub_dataset_repo(
            tmp_path / "plain",
            plain,
            {"train": {"image": [image], "label": [0]}},
            "default",
            broken=("test",),
        ),
    }
    real_builder = datasets.load_dataset_builder
    asked: list[str] = []  # every Hub lookup, by dataset

    def builder(name, config=None, **kw):
        asked.append(name)
        return real_builder(str(repos[name]), config, **kw)

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    monkeypatch.setattr(HfApi, "dataset_info", lambda self, repo, revision=None: asked.append(repo))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(resolve.hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))

    def checked(**tasks):
        data = yaml.safe_load(good.read_text())
        for task, spec in tasks.items():
            data["tasks"][task] = spec
        path = tmp_path / "hub.yaml"
        path.write_text(yaml.safe_dump(data))
        return check(load_params(path))

    signs_task = {
        "calibration": {"hub": "owner/signs", "split": "train"},
        "evaluation": {"hub": "owner/signs", "split": "test"},
        "prompt_set": "gtsrb",
    }
    problems, _ = checked(alpha=signs_task)
    assert problems == []  # 43 numbered classes: the set's 43 sign names
    assert asked == ["owner/signs", "owner/signs"]  # once (card, builder) for both roles
    problems, _ = checked(
        alpha={**signs_task, "evaluation": {"hub": "owner/signs", "split": "validation"}},
        beta={
            "calibration": {"hub": "owner/plain", "split": "train"},
            "evaluation": {"hub": "owner/plain", "split": "test", "label_column": "target"},
            "templates": ["a {}."],
        },
    )
    assert [key for key, _ in problems] == ["tasks.alpha.evaluation.split", "tasks.beta.evaluation"]
    assert (
        "has no split 'validation' (has ['train', 'test']); set tasks.alpha.evaluation.split"
        in problems[0][1]
    )
    assert "has no label column 'target' (has ['image', 'label'])" in problems[1][1]
    problems, _ = checked(
        beta={
            "calibration": {"hub": "owner/plain", "split": "train"},
            "evaluation": {"hub": "owner/plain", "split": "test"},
            "prompt_set": "dtd",
        }
    )
    assert problems == [
        (
            "tasks.beta.prompt_set",
            "the evaluation set's label column has no "
            "class names and prompt set 'dtd' gives none; set class_names (one per "
            "label)",
        )
    ]


def test_a_folder_that_is_no_model_is_one_line(good, tmp_path, capsys):
    data = yaml.safe_load(good.read_text())
    data["models"]["experts"]["alpha"] = "/etc"
    path = tmp_path / "etc.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["check", "--params", str(path)]) == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if e.startswith("featcal: error: ")]
    assert errors == [
        "featcal: error: models.experts.alpha: /etc is not a model folder (no config.json, no "
        "safetensors weights); point at a save_pretrained folder or a Hub model id"
    ]


def test_a_lora_adapter_expert_is_checked_over_its_base(good, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    from transformers import CLIPModel

    data = yaml.safe_load(good.read_text())
    model = CLIPModel.from_pretrained(data["models"]["base"])
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "lora")
    data["models"]["experts"]["alpha"] = str(tmp_path / "lora")
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["check", "--params", str(path)]) == 0, capsys.readouterr().err
    (tmp_path / "lora" / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    assert main(["check", "--params", str(path)]) == 2
    err = capsys.readouterr().err
    assert "models.experts.alpha" in err and "IA3" in err


def test_a_hub_expert_of_another_geometry_or_vocabulary_is_named_before_any_download(
    good, tmp_path, monkeypatch
):
    """Hub models' config.json files are compared as the run compares the checkpoints: an expert
    with a larger vocabulary (a fine-tune that added tokens) or another width is one line each,
    though no weights are there to open."""
    import json

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf"
    changes = {
        "base": {},
        "alpha": {"text_config": "vocab_size"},
        "beta": {"vision_config": "intermediate_size"},
    }
    for name, change in changes.items():
        edited = tmp_path / name
        shutil.copytree(good.parent / "base", edited)
        config = json.loads((edited / "config.json").read_text())
        for nested, key in change.items():  # the base is a CLIPModel: two nested configs
            config[nested][key] += 8
        (edited / "config.json").write_text(json.dumps(config))
        hub_cache(cache, f"org/{name}", edited)
    overrides = [
        "models.base=org/base",
        "models.experts.alpha=org/alpha",
        "models.experts.beta=org/beta",
    ]
    problems, _ = check(load_params(good, overrides), cache_dir=cache)
    found = dict(problems)
    assert sorted(found) == ["models.experts.alpha", "models.experts.beta"], problems
    assert "text_config.vocab_size" in found["models.experts.alpha"]
    assert "vision_config.intermediate_size" in found["models.experts.beta"]

    # the same configs with the base's geometry and vocabulary pass
    for name in ("alpha", "beta"):
        shutil.rmtree(tmp_path / name)
        shutil.copytree(tmp_path / "base", tmp_path / name)
        hub_cache(cache, f"org/{name}", tmp_path / name, commit="d" * 40)
    problems, _ = check(load_params(good, overrides), cache_dir=cache)
    assert problems == [], problems
