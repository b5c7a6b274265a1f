"""The download-experts step: resolving local and Hub models, pool checks, the lock file.

No network: Hub references are served from a hand-built Hugging Face cache in offline mode, or
`snapshot_download` is replaced by a fake.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

from factories import TINY_CLIP, bert_zoo, clip_zoo, reshard, to_transformers4_layout
from featcal_core.architectures import detect
from featcal_core.data.synthetic import build_pool
from featcal_core.errors import FeatCalError
from featcal_core.params import ModelRef
from featcal_core.provenance import hub
from featcal_core.provenance.lock import (
    lock_digest,
    models_from_lock,
    read_lock,
    verify_lock,
    write_lock,
)
from featcal_core.provenance.resolve import ResolvedModel, check_pool, resolve_model


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ref(text: str) -> ModelRef:
    return ModelRef.model_validate(text)


def hub_cache(
    cache: Path, repo_id: str, source: Path, ref_name: str = "main", commit: str | None = None
) -> tuple[Path, str]:
    """Lay `source`'s files out as huggingface_hub caches a download of `repo_id`.

    models--owner--name/blobs/<sha256>, snapshots/<commit>/<file> → ../../blobs/<sha256>,
    refs/<ref_name> holding the commit (default: sha1 of the repo id). Returns the snapshot
    folder and the commit.
    """
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        if file.is_file():
            digest = sha256(file)
            shutil.copyfile(file, storage / "blobs" / digest)
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (storage / "refs" / ref_name).parent.mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref_name).write_text(commit)
    return snapshot, commit


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return clip_zoo(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return bert_zoo(tmp_path_factory.mktemp("bert"), tasks=("gamma",))


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "model_info", _no_network)


@pytest.fixture
def no_sleep(monkeypatch):
    delays = []
    monkeypatch.setattr(hub.time, "sleep", delays.append)
    return delays


def _no_network(*args, **kwargs):
    raise AssertionError("the tests must not reach the Hub")


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


# --------------------------------------------------------------------------------- local models


def test_local_model_resolves_in_place(clip):
    model = resolve_model(ref(str(clip.base)), "models.base")
    assert model.kind == "local" and model.commit is None
    assert model.path == clip.base  # used in place, not copied
    assert model.reference == str(clip.base)
    assert model.files == {
        "config.json": sha256(clip.base / "config.json"),
        "model.safetensors": sha256(clip.base / "model.safetensors"),
    }


def test_local_sharded_model_hashes_index_and_shards(clip, tmp_path):
    expert = copy_model(clip.experts["alpha"], tmp_path / "sharded")
    reshard(expert, shards=3)
    model = resolve_model({"kind": "local", "path": expert}, "models.experts.alpha")
    names = sorted(model.files)
    assert names == sorted(
        ["config.json", "model.safetensors.index.json"]
        + [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    )
    assert all(model.files[name] == sha256(expert / name) for name in names)
    assert model.reference == str(expert)


def test_missing_local_directory_names_reference_and_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        FeatCalError, match=r"models\.experts\.gamma.*'\./not/there' does not exist"
    ):
        resolve_model(ref("./not/there"), "models.experts.gamma")


def test_local_directory_without_config_is_reported(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeatCalError, match=r"config\.json is missing; models\.base"):
        resolve_model(ref(str(tmp_path / "empty")), "models.base")


# ----------------------------------------------------------------------------------- Hub models


def test_hub_model_from_offline_cache(clip, tmp_path, offline):
    snapshot, commit = hub_cache(tmp_path / "hf", "owner/tiny-clip", clip.base)
    model = resolve_model(ref("owner/tiny-clip"), "models.base", cache_dir=tmp_path / "hf")
    assert model.kind == "hub" and model.repo_id == "owner/tiny-clip" and model.revision is None
    assert model.path.resolve() == snapshot.resolve()
    assert model.commit == commit
    assert model.files == {
        "config.json": sha256(clip.base / "config.json"),
        "model.safetensors": sha256(clip.base / "model.safetensors"),
    }
    # a pinned commit and a branch name give the same snapshot
    pinned = resolve_model(
        ref(f"owner/tiny-clip@{commit}"), "models.base", cache_dir=tmp_path / "hf"
    )
    assert pinned.commit == commit and pinned.reference == f"owner/tiny-clip@{commit}"
    assert pinned.files == model.files


def test_hub_model_on_a_named_revision(clip, tmp_path, offline):
    _, commit = hub_cache(tmp_path / "hf", "owner/tiny-clip", clip.base, ref_name="v1")
    model = resolve_model(ref("owner/tiny-clip@v1"), "models.base", cache_dir=tmp_path / "hf")
    assert model.commit == commit and model.revision == "v1"


def test_unknown_hub_model_offline_is_clear(tmp_path, offline):
    (tmp_path / "hf").mkdir()
    with pytest.raises(FeatCalError) as info:
        resolve_model(ref("owner/unknown"), "models.experts.mnist", cache_dir=tmp_path / "hf")
    message = str(info.value)
    assert "\n" not in message
    assert "models.experts.mnist" in message and "'owner/unknown'" in message
    assert "offline" in message and "HF_HUB_OFFLINE=0" in message
    assert "hf download owner/unknown" in message


def test_hub_snapshot_without_safetensors_is_refused(tmp_path, offline):
    source = tmp_path / "pickled"
    source.mkdir()
    (source / "config.json").write_text("{}")
    hub_cache(tmp_path / "hf", "owner/pickled", source)
    with pytest.raises(FeatCalError, match=r"owner/pickled.*no safetensors weights"):
        resolve_model(ref("owner/pickled"), "models.base", cache_dir=tmp_path / "hf")


def _pickled_main(tmp_path: Path, repo_id: str) -> None:
    """main of `repo_id` in the cache as openai/clip-vit-base-patch32 has it: config and
    pickled weights only."""
    source = tmp_path / "pickled"
    source.mkdir(exist_ok=True)
    (source / "config.json").write_text("{}")
    (source / "pytorch_model.bin").write_bytes(b"pickle")
    hub_cache(tmp_path / "hf", repo_id, source)


def test_safetensors_conversion_pull_request_is_used_from_the_cache(clip, tmp_path, offline):
    """main holds pickled weights only; the cached refs/pr/66 (the conversion bot's pull
    request) holds the safetensors: resolved there, and the lock records that revision."""
    _pickled_main(tmp_path, "openai/clip")
    snapshot, commit = hub_cache(
        tmp_path / "hf", "openai/clip", clip.base, ref_name="refs/pr/66", commit="c" * 40
    )
    hub_cache(
        tmp_path / "hf", "openai/clip", tmp_path / "pickled", ref_name="refs/pr/70", commit="d" * 40
    )  # a later pull request without safetensors: not it
    model = resolve_model(ref("openai/clip"), "models.base", cache_dir=tmp_path / "hf")
    assert model.revision == "refs/pr/66" and model.commit == commit
    assert model.path.resolve() == snapshot.resolve()
    assert model.files["model.safetensors"] == sha256(clip.base / "model.safetensors")
    lock = write_lock(tmp_path / "lock.json", model, {})
    assert lock["base"]["revision"] == "refs/pr/66"
    # a pinned revision is taken as given: no fallback, and the message says what to do
    with pytest.raises(FeatCalError) as info:
        resolve_model(ref("openai/clip@refs/pr/70"), "models.base", cache_dir=tmp_path / "hf")
    assert "no safetensors weights in its top folder at refs/pr/70" in str(info.value)
    assert "owner/name@refs/pr/N" in str(info.value)


def test_safetensors_conversion_pull_request_from_the_hub(clip, tmp_path, monkeypatch):
    """Online: the Hub lists the conversion bot's open pull requests; the newest is used (its
    snapshot then comes from the cache, as a download would leave it)."""
    from huggingface_hub import Discussion, HfApi

    _pickled_main(tmp_path, "openai/clip")
    hub_cache(tmp_path / "hf", "openai/clip", clip.base, ref_name="refs/pr/66", commit="c" * 40)
    asked = []

    def discussions(self, repo_id, **kwargs):
        asked.append((repo_id, kwargs))
        for num, author in ((12, "someone"), (66, "SFconvertbot"), (3, "SFconvertbot")):
            yield Discussion(
                title="Adding `safetensors` variant of this model",
                status="open",
                num=num,
                repo_id=repo_id,
                repo_type="model",
                author=author,
                is_pull_request=True,
                created_at=None,
                endpoint="",
            )

    def snapshot(repo_id, revision=None, cache_dir=None, **kwargs):
        ref_file = Path(cache_dir) / "models--openai--clip" / "refs" / (revision or "main")
        return str(Path(cache_dir) / "models--openai--clip" / "snapshots" / ref_file.read_text())

    monkeypatch.setattr(HfApi, "get_repo_discussions", discussions)
    monkeypatch.setattr(hub, "snapshot_download", snapshot)
    monkeypatch.setattr(hub, "model_info", _no_network)
    model = resolve_model(ref("openai/clip"), "models.base", cache_dir=tmp_path / "hf")
    assert model.revision == "refs/pr/66" and model.commit == "c" * 40
    assert asked == [
        (
            "openai/clip",
            {
                "author": "SFconvertbot",
                "discussion_type": "pull_request",
                "discussion_status": "open",
            },
        )
    ]


def _response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api"))


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("connection reset"),
        TimeoutError("read timed out"),
        HfHubHTTPError("503 Service Unavailable", response=_response(503)),
    ],
    ids=["connection", "timeout", "http-503"],
)
def test_transient_errors_are_retried(clip, tmp_path, monkeypatch, no_sleep, error):
    snapshot, commit = hub_cache(tmp_path / "hf", "owner/tiny-clip", clip.base)
    calls = []

    def flaky(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if len(calls) < 3:
            raise error
        return str(snapshot)

    monkeypatch.setattr(hub, "snapshot_download", flaky)
    monkeypatch.setattr(hub, "model_info", _no_network)
    model = resolve_model(ref("owner/tiny-clip@main"), "models.base", retries=3, backoff=1.0)
    assert len(calls) == 3
    assert no_sleep == [1.0, 2.0]  # exponential backoff
    assert model.commit == commit
    repo_id, kwargs = calls[0]
    assert repo_id == "owner/tiny-clip" and kwargs["revision"] == "main"
    assert "*.safetensors" in kwargs["allow_patterns"] and "*.json" in kwargs["allow_patterns"]
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in kwargs["allow_patterns"])


def test_unreachable_hub_fails_clearly_after_retries(monkeypatch, no_sleep):
    calls = []

    def down(repo_id, **kwargs):
        calls.append(repo_id)
        # what snapshot_download raises when the Hub is unreachable and nothing is cached
        raise LocalEntryNotFoundError("cannot find the snapshot") from httpx2.ConnectError(
            "refused"
        )

    monkeypatch.setattr(hub, "snapshot_download", down)
    with pytest.raises(FeatCalError) as info:
        resolve_model(ref("owner/tiny-clip"), "models.experts.mnist", retries=1, backoff=0.5)
    assert len(calls) == 2 and no_sleep == [0.5]
    message = str(info.value)
    assert "models.experts.mnist" in message and "'owner/tiny-clip'" in message
    assert "after 2 attempt(s)" in message and "hf download owner/tiny-clip" in message


def test_missing_repository_is_not_retried(monkeypatch, no_sleep):
    calls = []

    def missing(repo_id, **kwargs):
        calls.append(repo_id)
        raise RepositoryNotFoundError("404 Repository Not Found", response=_response(404))

    monkeypatch.setattr(hub, "snapshot_download", missing)
    with pytest.raises(FeatCalError, match=r"models\.base: Hub model 'owner/nope'.*does not exist"):
        resolve_model(ref("owner/nope"), "models.base")
    assert len(calls) == 1 and no_sleep == []


# ------------------------------------------------------------------------------------- the pool


def local(path: Path, role: str) -> ResolvedModel:
    return resolve_model(ref(str(path)), role)


def test_check_pool_accepts_matching_experts(clip, tmp_path):
    old_layout = copy_model(clip.experts["beta"], tmp_path / "beta4")
    to_transformers4_layout(old_layout)  # same tower under a "vision_model." prefix
    base = local(clip.base, "models.base")
    experts = {
        "alpha": local(clip.experts["alpha"], "models.experts.alpha"),
        "beta": local(old_layout, "models.experts.beta"),
    }
    name = check_pool(base, experts)
    assert name == detect(json.loads((clip.base / "config.json").read_text())).name


def test_check_pool_rejects_expert_of_another_architecture(clip, bert):
    base = local(clip.base, "models.base")
    experts = {
        "alpha": local(clip.experts["alpha"], "models.experts.alpha"),
        "gamma": local(bert.experts["gamma"], "models.experts.gamma"),
    }
    with pytest.raises(FeatCalError, match=r"models\.experts\.gamma is a \S+ model but the base"):
        check_pool(base, experts)


def test_check_pool_rejects_shape_mismatch(clip, tmp_path):
    wide = build_pool(tmp_path / "wide", "clip", {**TINY_CLIP, "intermediate_size": 48}, ("w",))
    base = local(clip.base, "models.base")
    experts = {"wide": local(wide.experts["w"], "models.experts.wide")}
    with pytest.raises(
        FeatCalError, match=r"models\.experts\.wide .*has shape \[48\], the base has \[64\]"
    ):
        check_pool(base, experts)


# ------------------------------------------------------------------------------------- the lock


def test_lock_round_trip_and_verify(clip, tmp_path):
    base_dir = copy_model(clip.base, tmp_path / "base")
    expert_dir = copy_model(clip.experts["alpha"], tmp_path / "alpha")
    base = local(base_dir, "models.base")
    experts = {"alpha": local(expert_dir, "models.experts.alpha")}
    path = tmp_path / "data" / "models.lock.json"

    lock = write_lock(path, base, experts, extra={"architecture": "clip"})
    assert read_lock(path) == lock
    assert lock["architecture"] == "clip"
    assert lock["base"]["files"]["model.safetensors"] == sha256(base_dir / "model.safetensors")
    assert (
        lock["experts"]["alpha"]["kind"] == "local" and lock["experts"]["alpha"]["commit"] is None
    )
    assert lock["lock_digest"] == lock_digest(lock)
    assert not list(path.parent.glob(".*tmp*"))  # the temporary file was renamed into place

    again = write_lock(path, base, experts, extra={"architecture": "clip"})
    assert again["lock_digest"] == lock["lock_digest"]  # stable for the same content
    other = write_lock(tmp_path / "other.json", base, {}, extra={"architecture": "clip"})
    assert other["lock_digest"] != lock["lock_digest"]

    back_base, back_experts = models_from_lock(lock)
    assert back_base == base and back_experts == experts
    assert verify_lock(read_lock(path)) == []

    weights = expert_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    (base_dir / "config.json").unlink()
    problems = verify_lock(read_lock(path))
    assert len(problems) == 2
    assert any("models.base" in p and "config.json is missing" in p for p in problems)
    assert any(
        "models.experts.alpha" in p and "model.safetensors has sha256" in p for p in problems
    )


def test_edited_lock_is_detected(clip, tmp_path):
    base = local(clip.base, "models.base")
    path = tmp_path / "models.lock.json"
    lock = write_lock(path, base, {"alpha": local(clip.experts["alpha"], "models.experts.alpha")})
    edited = json.loads(path.read_text())
    edited["experts"]["alpha"]["commit"] = "0" * 40
    path.write_text(json.dumps(edited))
    with pytest.raises(FeatCalError, match="lock_digest does not match"):
        read_lock(path)
    assert any("lock_digest" in p for p in verify_lock(edited))
    assert verify_lock(lock) == []


def test_read_lock_missing_file(tmp_path):
    with pytest.raises(FeatCalError, match="run the download-experts step"):
        read_lock(tmp_path / "models.lock.json")


# ------------------------------------------------------------------------------------- the task


def test_download_task_locks_a_mixed_pool(clip, tmp_path, offline):
    from featcal.tasks.download import download_models

    snapshot, commit = hub_cache(tmp_path / "hf", "owner/tiny-clip", clip.base)
    models = {
        "base": "owner/tiny-clip",
        "experts": {"alpha": str(clip.experts["alpha"]), "beta": str(clip.experts["beta"])},
    }
    path = tmp_path / "data" / "models.lock.json"
    lock = download_models.fn(models, path, cache_dir=tmp_path / "hf")
    assert read_lock(path) == lock
    assert lock["base"]["commit"] == commit and lock["base"]["kind"] == "hub"
    assert Path(lock["base"]["path"]).resolve() == snapshot.resolve()
    assert sorted(lock["experts"]) == ["alpha", "beta"]
    assert lock["experts"]["beta"]["role"] == "models.experts.beta"
    assert lock["architecture"] == detect(json.loads((clip.base / "config.json").read_text())).name
    assert verify_lock(lock) == []


def test_download_task_stops_before_locking_a_bad_pool(clip, bert, tmp_path):
    from featcal.tasks.download import download_models

    models = {"base": str(clip.base), "experts": {"gamma": str(bert.experts["gamma"])}}
    path = tmp_path / "models.lock.json"
    with pytest.raises(FeatCalError, match=r"models\.experts\.gamma"):
        download_models.fn(models, path)
    assert not path.exists()


def test_merge_and_calibrate_take_hub_ids(clip, tmp_path, monkeypatch, capsys):
    """`featcal merge` / `calibrate` with Hub ids where folders go (offline, from the cache):
    the same merged weights as from the folders."""
    from huggingface_hub import constants

    from featcal_cli.main import main

    cache = tmp_path / "hf"
    hub_cache(cache, "owner/base", clip.base)
    for task, path in clip.experts.items():
        hub_cache(cache, f"owner/expert-{task}", path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read when fetching
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "model_info", _no_network)

    experts = [f"--expert={t}=owner/expert-{t}" for t in clip.experts]
    assert (
        main(
            [
                "merge",
                "--base",
                "owner/base",
                *experts,
                "--method",
                "task_arithmetic",
                "--out",
                str(tmp_path / "from_hub"),
                "--no-progress",
            ]
        )
        == 0
    )
    local = [f"--expert={t}={p}" for t, p in clip.experts.items()]
    assert (
        main(
            [
                "merge",
                "--base",
                str(clip.base),
                *local,
                "--method",
                "task_arithmetic",
                "--out",
                str(tmp_path / "from_folders"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert sha256(tmp_path / "from_hub" / "model.safetensors") == sha256(
        tmp_path / "from_folders" / "model.safetensors"
    )
    calib = [f"--calib={t}={p}" for t, p in clip.calib.items()]
    assert (
        main(
            [
                "calibrate",
                "--base",
                "owner/base",
                "--merged",
                str(tmp_path / "from_hub"),
                *experts,
                *calib,
                "--out",
                str(tmp_path / "calibrated"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (tmp_path / "calibrated" / "model.safetensors").is_file()
    # an id that is neither a folder nor cached: the download step's one line, naming the flag
    assert (
        main(
            [
                "merge",
                "--base",
                "owner/missing",
                *experts,
                "--method",
                "task_arithmetic",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert not (tmp_path / "x").exists()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        "featcal: error: --base: Hub model 'owner/missing' is not in the local Hugging Face cache"
    ), err
