"""The shipped Llama settings of the paper (params/paper-llama.yaml: Llama-3.2-3B,
params/paper-llama-8b.yaml: Llama-3.1-8B, each with the five MergeBench experts) checked by
`featcal check` as a user runs it, against a loopback Hugging Face Hub (tests/mock_hub.py) that
serves stand-ins of every repository they name, in the repositories' layouts: tiny
Llama-architecture checkpoints (config.json, bfloat16 weights in model-0000N-of-0000M.safetensors
shards with model.safetensors.index.json, tokenizer and generation files, the base's original/
folder) and the MergeBench calibration sets as parquet files under the path the real
repositories use, each with a card whose `configs:` and `dataset_info` the check reads. The check
reads the repositories' listings, config.json and the dataset cards: no weights and no rows are
downloaded. The tasks' evaluation sets are not read at all (lm-evaluation-harness scores the
models on its own tasks' data): a note each. Planted mistakes (a wrong expert id, a revision that
does not exist, a revision without safetensors, a dataset split or column that does not exist, a
gated base without access) are one line each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from mock_hub import MockHub

from factories import TINY_LLAMA, reshard
from featcal_core.data.synthetic import word_tokenizer
from featcal_core.params import load_params

ROOT = Path(__file__).resolve().parents[1]
PAPERS = {
    "paper-llama": ROOT / "params" / "paper-llama.yaml",
    "paper-llama-8b": ROOT / "params" / "paper-llama-8b.yaml",
}
#: shards and tied embeddings of the real checkpoints (Llama-3.2-3B: 2 shards, lm_head tied to
#: the embeddings; Llama-3.1-8B: 4 shards, an lm_head of its own)
GEOMETRY = {"paper-llama": (2, True), "paper-llama-8b": (4, False)}

#: the calibration sets: MergeBench/<domain>_val's columns (merging/taskloader.py), one
#: data/train-00000-of-00001.parquet each
CALIBRATION_COLUMNS = {
    "MergeBench/instruction_val": ("instruction", "input", "output"),
    "MergeBench/math_val": ("query", "response"),
    "MergeBench/coding_val": ("instruction", "response"),
    "MergeBench/multilingual_val": ("inputs", "targets"),
    "MergeBench/safety_val": ("prompt", "response"),
}


def _rows(columns, n: int, seed: int) -> dict[str, list]:
    """n rows of short word texts for each column."""
    words = "the a movie good bad plot actor scene story fun".split()
    rng = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {}
    for column in columns:
        picks = torch.randint(0, len(words), (n, 4), generator=rng).tolist()
        texts = [" ".join(words[i] for i in pick) for pick in picks]
        rows[column] = texts
    return rows


def dataset_repo(folder: Path, columns, seed: int) -> Path:
    """A dataset repository as push_to_hub leaves it: data/train-00000-of-00001.parquet,
    .gitattributes, and a README card whose `configs:` names the split's files and whose
    `dataset_info` lists the features."""
    path = folder / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    data = datasets.Dataset.from_dict(_rows(columns, 6, seed))
    data.to_parquet(str(path))
    (folder / ".gitattributes").write_text("*.parquet filter=lfs diff=lfs merge=lfs -text\n")
    info = datasets.DatasetInfo(features=data.features)._to_yaml_dict()
    info["splits"] = [{"name": "train", "num_bytes": 100, "num_examples": 6}]
    card = {
        "dataset_info": info,
        "configs": [
            {"config_name": "default", "data_files": [{"split": "train", "path": "data/train-*"}]}
        ],
    }
    (folder / "README.md").write_text(f"---\n{yaml.safe_dump(card, sort_keys=False)}---\n")
    return folder


def llama_repo(folder: Path, state: dict, config, shards: int, extras: dict[str, bytes]) -> Path:
    """A LlamaForCausalLM checkpoint as the Hub holds it: config.json, generation_config.json,
    bfloat16 weights in `shards` model-0000N-of-0000M.safetensors files with
    model.safetensors.index.json, the tokenizer files, and `extras` (path → bytes)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    model.to(torch.bfloat16).save_pretrained(folder)
    word_tokenizer(pad=False).save_pretrained(folder)
    reshard(folder, shards)
    for name, data in extras.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def model_stand_ins(paper, root: Path) -> dict[str, Path]:
    """{Hub id: folder} of the paper file's base and experts: a tiny Llama base (the real one's
    sharding and tied embeddings) and each expert the base plus a small seeded delta."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shards, tied = GEOMETRY[paper.run.name]
    tokenizer = word_tokenizer(pad=False)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tied,
        rope_theta=500000.0,
        **TINY_LLAMA,
    )
    torch.manual_seed(0)
    base_state = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    base = paper.models.base.repo_id
    meta = b"stand-in: not read by featcal check"
    repos = {
        base: llama_repo(
            root / "base",
            base_state,
            config,
            shards,
            {
                ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
                "LICENSE.txt": meta,
                "README.md": meta,
                "USE_POLICY.md": meta,
                "original/consolidated.00.pth": meta,
                "original/params.json": b"{}",
                "original/tokenizer.model": meta,
            },
        )
    }
    for i, (task, ref) in enumerate(paper.models.experts.items()):
        gen = torch.Generator().manual_seed(100 + i)
        state = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in base_state.items()}
        extras = {".gitattributes": b"*.safetensors filter=lfs\n", "README.md": meta}
        repos[ref.repo_id] = llama_repo(root / task, state, config, shards, extras)
    return repos


def dataset_stand_ins(paper, root: Path) -> dict[str, Path]:
    """{Hub id: folder} of the calibration sets the paper file names."""
    return {
        spec.calibration.hub: dataset_repo(
            root / spec.calibration.hub, CALIBRATION_COLUMNS[spec.calibration.hub], seed=i
        )
        for i, spec in enumerate(paper.tasks.values())
    }


def serve(hub: MockHub, models: dict[str, Path], data: dict[str, Path]) -> None:
    for repo_id, folder in models.items():
        hub.add(repo_id, folder)
    for repo_id, folder in data.items():
        hub.add(repo_id, folder, repo_type="dataset")


def featcal_check(hub: MockHub, cache: Path, *args: str) -> subprocess.CompletedProcess:
    """`featcal check` as a user runs it, its Hub the loopback one, its caches fresh."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(hub.env(cache / "hub"), HF_DATASETS_CACHE=str(cache / "datasets"))
    cmd = [sys.executable, "-m", "featcal_cli.main", "check", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("featcal: error: ")]


def _downloads(hub: MockHub) -> list[str]:
    """The weights and rows the Hub served (GET of a safetensors, parquet or JSON-lines file)."""
    data = (".safetensors", ".parquet", ".jsonl", ".pth", ".bin")
    return [path for method, path in hub.requests if method == "GET" and path.endswith(data)]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """The paper files, their models' stand-ins (per file) and their datasets' (shared)."""
    root = tmp_path_factory.mktemp("paper_llama")
    papers = {name: load_params(path) for name, path in PAPERS.items()}
    models = {name: model_stand_ins(p, root / name) for name, p in papers.items()}
    data = dataset_stand_ins(papers["paper-llama"], root / "datasets")
    return papers, models, data


def test_the_paper_llama_files_check_against_stand_ins_without_downloading(stand_ins, tmp_path):
    papers, models, data = stand_ins
    with MockHub() as hub:
        for name, path in PAPERS.items():
            serve(hub, models[name], data)
            checked = featcal_check(hub, tmp_path / name, "--params", str(path))
            assert checked.returncode == 0, checked.stderr[-4000:]
            assert "no problems found (5 tasks)" in checked.stdout, checked.stdout
            assert _errors(checked.stderr) == []
            unread = [line for line in checked.stderr.splitlines() if "not read" in line]
            assert len(unread) == 5, checked.stderr[-4000:]
            assert all(line.startswith("featcal: note: tasks.") for line in unread), unread
        assert _downloads(hub) == [], _downloads(hub)
        asked = {path for _, path in hub.requests}
        assert any("/resolve/main/config.json" in path for path in asked)
        assert any(path.startswith("/datasets/MergeBench/math_val/resolve/") for path in asked)
        evaluation = {spec.evaluation.hub for spec in papers["paper-llama"].tasks.values()}
        assert not [path for path in asked if any(f"/{name}" in path for name in evaluation)]


def test_the_paper_llama_file_names_each_planted_mistake_in_one_line(stand_ins, tmp_path):
    papers, models, data = stand_ins
    paper = PAPERS["paper-llama"]
    pickled = tmp_path / "pt_only"
    pickled.mkdir()
    multilingual = models["paper-llama"]["MergeBench/Llama-3.2-3B_multilingual"]
    (pickled / "config.json").write_bytes((multilingual / "config.json").read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"pickle")
    planted = {
        # a wrong expert id
        "models.experts.math=MergeBench/Llama-3.2-3B_maths": (
            "models.experts.math",
            "repository MergeBench/Llama-3.2-3B_maths does not exist or is private",
        ),
        # a revision that does not exist
        "models.experts.coding=MergeBench/Llama-3.2-3B_coding@v1.0": (
            "models.experts.coding",
            "the revision does not exist in MergeBench/Llama-3.2-3B_coding",
        ),
        # a revision without the weights featcal reads
        "models.experts.multilingual=MergeBench/Llama-3.2-3B_multilingual@pt-only": (
            "models.experts.multilingual",
            "has no safetensors weights (only pytorch_model.bin)",
        ),
        # a dataset split that does not exist
        "tasks.math.calibration.split=validation": (
            "tasks.math.calibration.split",
            "has no split 'validation' (has ['train'])",
        ),
        # a column that does not exist
        "tasks.coding.calibration.text_column=prompt": (
            "tasks.coding.calibration",
            "has no text column 'prompt' (has ['instruction', 'response'])",
        ),
    }
    with MockHub() as hub:
        serve(hub, models["paper-llama"], data)
        hub.add("MergeBench/Llama-3.2-3B_multilingual", pickled, revision="pt-only")
        sets = [a for s in planted for a in ("--set", s)]
        checked = featcal_check(hub, tmp_path / "planted", "--params", str(paper), *sets)
        assert checked.returncode == 2, checked.stderr[-4000:]
        errors = _errors(checked.stderr)
        assert len(errors) == len(planted), "\n".join(errors)
        for key, words in planted.values():
            found = [line for line in errors if line.startswith(f"featcal: error: {key}: ")]
            assert len(found) == 1 and words in found[0], (key, errors)
        assert (
            checked.stderr.strip()
            .splitlines()[-1]
            .endswith(f"{len(planted)} problems; fix them and run again")
        )

        # the gated base, for an account that has not accepted Meta's license: one line
        hub.gated.add("meta-llama/Llama-3.2-3B")
        gated = featcal_check(hub, tmp_path / "gated", "--params", str(paper))
        assert gated.returncode == 2, gated.stderr[-4000:]
        assert _errors(gated.stderr) == [
            "featcal: error: models.base: Hub model 'meta-llama/Llama-3.2-3B' is gated and this "
            "account has no access; accept its terms on https://huggingface.co/meta-llama/"
            "Llama-3.2-3B and log in (`hf auth login` or HF_TOKEN)"
        ]
        assert _downloads(hub) == []


def test_another_vocabulary_and_a_base_without_tokenizer_are_named_before_any_download(
    stand_ins, tmp_path
):
    """What the run would refuse once the weights are there, named by `featcal check` from the
    small files alone: an expert whose tokenizer.json gives two tokens each other's ids (the
    same vocab_size in its config) and a base saved without tokenizer files, one line each."""
    papers, models, data = stand_ins
    paper = PAPERS["paper-llama"]
    other = shutil.copytree(
        models["paper-llama"]["MergeBench/Llama-3.2-3B_safety"], tmp_path / "other"
    )
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    bare = shutil.copytree(models["paper-llama"]["meta-llama/Llama-3.2-3B"], tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / name).unlink(missing_ok=True)
    with MockHub() as hub:
        serve(hub, models["paper-llama"], data)
        hub.add("org/other-vocabulary", other)
        hub.add("org/bare-base", bare)
        for setting, key, words in (
            (
                "models.experts.safety=org/other-vocabulary",
                "models.experts.safety",
                "its tokenizer.json vocabulary differs from the base's",
            ),
            ("models.base=org/bare-base", "models.base", "no tokenizer files"),
        ):
            checked = featcal_check(hub, tmp_path / key, "--params", str(paper), "--set", setting)
            assert checked.returncode == 2, checked.stderr[-4000:]
            errors = _errors(checked.stderr)
            assert len(errors) == 1 and errors[0].startswith(f"featcal: error: {key}: "), errors
            assert words in errors[0], errors
        assert _downloads(hub) == []


def test_the_8b_file_is_the_3b_file_on_the_8b_base():
    """paper-llama-8b.yaml differs from paper-llama.yaml only in the base, the experts (by
    MergeBench's naming rule, MergeBench/<base name>_<domain>) and the run's name."""
    small, large = (load_params(path) for path in PAPERS.values())
    for paper, base in ((small, "meta-llama/Llama-3.2-3B"), (large, "meta-llama/Llama-3.1-8B")):
        assert paper.models.base.repo_id == base
        name = base.split("/")[1]
        assert {t: r.repo_id for t, r in paper.models.experts.items()} == {
            t: f"MergeBench/{name}_{t}"
            for t in ("instruction", "math", "multilingual", "coding", "safety")
        }
    same = ("tasks", "merge", "featcal", "evaluation", "tracking", "repair", "select")
    for section in same:
        assert getattr(small, section) == getattr(large, section), section
    assert (small.run.name, large.run.name) == ("paper-llama", "paper-llama-8b")


@pytest.mark.parametrize("name", list(PAPERS))
def test_every_hub_id_says_where_it_was_found(name):
    """Each Hub id of the file sits under a comment (or beside one) that names a source page or
    says it is unconfirmed."""
    paper = load_params(PAPERS[name])
    lines = PAPERS[name].read_text().splitlines()
    ids = {paper.models.base.repo_id, *(r.repo_id for r in paper.models.experts.values())}
    for spec in paper.tasks.values():
        ids |= {spec.calibration.hub, spec.evaluation.hub}
    for repo_id in ids:
        at = next(i for i, line in enumerate(lines) if repo_id in line.partition("#")[0])
        above = at - 1
        while not lines[above].lstrip().startswith("#"):  # to the nearest comment block
            above -= 1
        block = [lines[at]]
        while above >= 0 and lines[above].lstrip().startswith("#"):
            block.append(lines[above])
            above -= 1
        comment = " ".join(line.partition("#")[2] for line in block)
        assert "https://" in comment or "unconfirmed" in comment or ".py" in comment, repo_id


def test_the_stand_in_layouts_are_what_the_check_reads(stand_ins):
    """The stand-ins hold the real repositories' file names (a regression guard for the test
    itself): sharded weights with an index, the tokenizer, the dataset files the cards name."""
    _, models, data = stand_ins
    base = models["paper-llama"]["meta-llama/Llama-3.2-3B"]
    names = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())
    assert {
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "original/params.json",
    } <= set(names), names
    index = json.loads((base / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied, as Llama-3.2-3B's
    eight = models["paper-llama-8b"]["MergeBench/Llama-3.1-8B_math"]
    assert (eight / "model-00004-of-00004.safetensors").is_file()
    card = (data["MergeBench/math_val"] / "README.md").read_text()
    assert "path: data/train-*" in card  # as push_to_hub writes it
    assert (data["MergeBench/math_val"] / "data" / "train-00000-of-00001.parquet").is_file()
