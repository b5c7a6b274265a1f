"""One-line refusals of the CLI: params files that are no regular file or too large, shard sizes
beyond any file, `featcal params export` into a featcal folder, an input the params read or a
read-only filesystem, and offline mode named by the variable that turned it on."""

from __future__ import annotations

import builtins
import errno
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from huggingface_hub import constants as hf_constants

from factories import cli_fails
from featcal_cli.main import main
from featcal_core.errors import FeatCalError
from featcal_core.io.markers import MARKER
from featcal_core.io.outputs import guarded_directory, prepare_root, write_json
from featcal_core.io.shard_size import MAX_SHARD_BYTES, parse_shard_size
from featcal_core.params.loading import MAX_PARAMS_BYTES
from featcal_core.provenance import hub

PARAMS = Path(__file__).resolve().parents[1] / "params" / "text.yaml"
NINES = "9" * 400


def _params(tmp_path: Path, **extra) -> Path:
    """A small params file: Hub models (cached nowhere) and three local datasets."""
    data = {
        "run": {"name": "mine", "results_dir": str(tmp_path / "results")},
        "models": {
            "base": "owner/base",
            "experts": {"alpha": "owner/alpha"},
            "hub_cache": str(tmp_path / "hf"),
        },
        "tasks": {
            "alpha": {
                "calibration": {"path": str(tmp_path / "calib"), "split": "train"},
                "evaluation": {"path": str(tmp_path / "eval"), "split": "test"},
                "validation": {"path": str(tmp_path / "val")},
            }
        },
        **extra,
    }
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _tree(*roots: Path) -> dict[str, bytes]:
    return {
        str(p): p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()
    }


# ------------------------------------------------------------------ params files: bounded reads


def test_a_params_file_that_is_no_regular_file_is_refused(capsys):
    """A device (/dev/null reads as /dev/zero does: not a regular file) is never read: show,
    export and every command's --params."""
    cli_fails(["params", "show", "/dev/null"], capsys, "/dev/null", "not a regular file (a device)")
    for args in (["params", "export", "--out", "-"], ["check"], ["run"]):
        cli_fails([*args, "--params", "/dev/null"], capsys, "/dev/null: is not a regular file")


def test_a_params_file_over_the_limit_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as handle:  # sparse: quick to make
        handle.truncate(MAX_PARAMS_BYTES + 1)
    for args in (["params", "show", str(big)], ["params", "export", "--params", str(big)]):
        cli_fails([*args, "--out", "-"] if "export" in args else args, capsys, str(big), "4 MiB")
    ok = tmp_path / "ok.yaml"
    ok.write_text(PARAMS.read_text() + "#" * 1000 + "\n")
    assert main(["params", "show", str(ok)]) == 0


# ---------------------------------------------------------------------------------- shard size


def test_a_shard_size_beyond_any_file_is_one_line(tmp_path, capsys):
    assert parse_shard_size("1024TiB") == MAX_SHARD_BYTES
    for bad in (NINES, f"{NINES}.5", f"{NINES}GB", "1025TiB", 10**400):
        with pytest.raises(FeatCalError, match="--max-shard-size: .* above the largest"):
            parse_shard_size(bad)
    out = tmp_path / "out"
    base = ["--base", "./nope", "--out", str(out), "--max-shard-size", NINES]
    cli_fails(["merge", "--method", "average", *base], capsys, "--max-shard-size", "1024TiB")
    calibrate = ["--merged", "./m", "--expert", "a=./e", "--calib", "a=./c"]
    cli_fails(["calibrate", *base, *calibrate], capsys, "--max-shard-size", "1024TiB")
    export = ["params", "export", "--params", str(PARAMS), "--out", "-"]
    cli_fails([*export, "--set", f"run.max_shard_size={NINES}"], capsys, "run.max_shard_size")


# ------------------------------------------------------- params export: never into featcal's


def test_params_export_never_writes_into_a_featcal_folder(tmp_path, capsys):
    """--out a results folder's record (--overwrite or not), a new file there or in a marked
    subfolder, through a link to it, or inside a model folder featcal wrote: refused, every
    byte and every marker unchanged."""
    results = prepare_root(tmp_path / "results")
    write_json(results / "metrics.json", {"accuracy": 0.9})
    write_json(results / "heads" / "alpha.json", {"fitted": True})
    with guarded_directory(tmp_path / "merged", overwrite=False) as tmp:
        (tmp / "config.json").write_text("{}\n")
    (tmp_path / "link").symlink_to(results)
    before = _tree(results, tmp_path / "merged")
    export = ["params", "export", "--params", str(PARAMS)]
    for out, overwrite, what in (
        (results / "metrics.json", True, f"featcal results folder {results}"),
        (results / "metrics.json", False, f"featcal results folder {results}"),
        (results / MARKER, True, f"featcal results folder {results}"),
        (results / "params.yaml", False, f"featcal results folder {results}"),
        (results / "heads" / "params.yaml", True, f"folder featcal wrote {results / 'heads'}"),
        (tmp_path / "link" / "metrics.json", True, "featcal results folder"),
        (tmp_path / "merged" / "params.yaml", True, "folder featcal wrote"),
    ):
        args = [*export, "--out", str(out), *(["--overwrite"] if overwrite else [])]
        cli_fails(args, capsys, f"--out {out} ", what, "write params.yaml elsewhere")
        assert _tree(results, tmp_path / "merged") == before
    assert main([*export, "--out", str(tmp_path / "params.yaml")]) == 0


def test_params_export_never_writes_into_a_dataset_the_params_read(tmp_path, capsys):
    path = _params(tmp_path)
    for name in ("calib", "eval", "val"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "dataset_dict.json").write_text('{"splits": ["train"]}\n')
    before = _tree(tmp_path / "calib", tmp_path / "eval", tmp_path / "val")
    export = ["params", "export", "--params", str(path)]
    for name, out, key in (
        ("eval", "dataset_dict.json", "tasks.alpha.evaluation.path"),
        ("calib", "dataset_dict.json", "tasks.alpha.calibration.path"),
        ("val", "params.yaml", "tasks.alpha.validation.path"),
        ("eval", "train/params.yaml", "tasks.alpha.evaluation.path"),
    ):
        folder = tmp_path / name
        for overwrite in ([], ["--overwrite"]):
            args = [*export, "--out", str(folder / out), *overwrite]
            cli_fails(args, capsys, f"--out {folder / out} ", f"dataset {folder},", key)
        assert _tree(tmp_path / "calib", tmp_path / "eval", tmp_path / "val") == before
    assert not (tmp_path / "eval" / "train").exists()
    err = cli_fails(
        [*export, "--out", str(tmp_path / "eval" / "dataset_dict.json"), "--overwrite"],
        capsys,
        f"the dataset {tmp_path / 'eval'}",
        "choose another --out",
    )
    assert "left untouched" in err
    assert main([*export, "--out", str(tmp_path / "params.yaml")]) == 0


def test_params_export_never_writes_into_the_harness_task_folder(tmp_path, capsys):
    tasks = tmp_path / "lm_tasks"
    tasks.mkdir()
    (tasks / "toy.yaml").write_text("task: toy\n")
    harness = {"harness": {"tasks": ["toy"], "include_path": str(tasks)}}
    path = _params(tmp_path, evaluation=harness)
    out = tasks / "toy.yaml"
    export = ["params", "export", "--params", str(path), "--out", str(out), "--overwrite"]
    cli_fails(export, capsys, "evaluation.harness.include_path", f"task folder {tasks}")
    assert out.read_text() == "task: toy\n"


# ------------------------------------------------------------------ params export: read-only


def test_params_export_on_a_read_only_filesystem_names_out(tmp_path, capsys, monkeypatch):
    """Creating the temporary file fails with EROFS, and so does unlinking the (missing)
    temporary file, as on a read-only mount: the line names --out, never the temporary."""
    folder = tmp_path / "ro"
    folder.mkdir()
    real_open, real_unlink = builtins.open, os.unlink

    def read_only(path) -> bool:
        return Path(os.fsdecode(path)).parent == folder

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and read_only(file) and set(mode) & set("wax+"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
        return real_open(file, mode, *args, **kwargs)

    def fake_unlink(path, *args, **kwargs):
        if read_only(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "unlink", fake_unlink)
    out = folder / "params.yaml"
    err = cli_fails(
        ["params", "export", "--params", str(PARAMS), "--out", str(out)],
        capsys,
        f"cannot write --out {out}: Read-only file system",
        "choose a writable place",
    )
    assert ".featcal-tmp-" not in err
    assert list(folder.iterdir()) == []


def test_params_export_on_a_read_only_mount_names_out(tmp_path, capsys):
    mount = tmp_path / "ro"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        out = mount / "params.yaml"
        args = ["params", "export", "--params", str(PARAMS), "--out", str(out)]
        err = cli_fails(args, capsys, f"cannot write --out {out}: Read-only file system")
        assert ".featcal-tmp-" not in err
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# ------------------------------------------------------------------------------- offline mode


@pytest.fixture
def environment(monkeypatch):
    """No offline variable set, and huggingface_hub online at import; returns monkeypatch."""
    for name in (*hub.OFFLINE_VARIABLES, "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    return monkeypatch


@pytest.mark.parametrize(
    "env,cause",
    [
        ({}, None),
        ({"HF_HUB_OFFLINE": "0"}, None),
        ({"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"}, None),
        ({"HF_HUB_OFFLINE": "no", "TRANSFORMERS_OFFLINE": "1"}, None),
        ({"TRANSFORMERS_OFFLINE": "1"}, "TRANSFORMERS_OFFLINE=1"),
        ({"HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "true"}, "TRANSFORMERS_OFFLINE=true"),
        ({"HF_HUB_OFFLINE": "yes"}, "HF_HUB_OFFLINE=yes"),
        ({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "0"}, "HF_HUB_OFFLINE=1"),
    ],
)
def test_offline_mode_is_read_as_huggingface_hub_reads_it(environment, env, cause):
    for name, value in env.items():
        environment.setenv(name, value)
    assert hub.offline_cause() == cause
    # huggingface_hub's own rule (huggingface_hub.constants.HF_HUB_OFFLINE at import)
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    assert (cause is not None) == hf_constants._is_true(value)
    assert hub.datasets_offline_cause() == cause
    environment.setenv("HF_DATASETS_OFFLINE", "0")  # datasets: this one decides when set
    assert hub.datasets_offline_cause() is None


def _check_lines(path: Path, capsys) -> list[str]:
    capsys.readouterr()
    assert main(["check", "--params", str(path)]) == 2
    return [line for line in capsys.readouterr().err.splitlines() if "models.base" in line]


def test_check_names_the_variable_that_made_it_offline(environment, tmp_path, capsys):
    path = _params(tmp_path)
    environment.setenv("TRANSFORMERS_OFFLINE", "1")
    [line] = _check_lines(path, capsys)
    assert "offline mode is on (TRANSFORMERS_OFFLINE=1); unset TRANSFORMERS_OFFLINE" in line
    assert "HF_HUB_OFFLINE=1" not in line
    environment.setenv("HF_HUB_OFFLINE", "yes")
    [line] = _check_lines(path, capsys)
    assert "offline mode is on (HF_HUB_OFFLINE=yes); set HF_HUB_OFFLINE=0" in line


def test_check_is_online_when_hf_hub_offline_is_0(environment, tmp_path, capsys):
    """HF_HUB_OFFLINE=0 wins over TRANSFORMERS_OFFLINE=1 (as in huggingface_hub): the Hub is
    asked, and its answer is the problem, not offline mode."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    asked = []

    def model_info(self, repo_id, revision=None):
        asked.append(repo_id)
        response = httpx2.Response(404, request=httpx2.Request("GET", "https://hub/api"))
        raise RepositoryNotFoundError("404 not found", response=response)

    environment.setattr(HfApi, "model_info", model_info)
    environment.setenv("HF_HUB_OFFLINE", "0")
    environment.setenv("TRANSFORMERS_OFFLINE", "1")
    [line] = _check_lines(_params(tmp_path), capsys)
    assert "repository owner/base does not exist or is private" in line
    assert "offline" not in line and asked == ["owner/base", "owner/alpha"]


def test_a_download_offline_by_the_params_names_the_params_key(environment, tmp_path):
    from featcal_core.params import ModelRef
    from featcal_core.provenance.resolve import resolve_model

    environment.setenv("HF_HUB_OFFLINE", "0")
    (tmp_path / "hf").mkdir()
    with pytest.raises(FeatCalError) as info:
        resolve_model(
            ModelRef.model_validate("owner/unknown"),
            "models.base",
            cache_dir=tmp_path / "hf",
            offline=True,
        )
    message = str(info.value)
    assert "offline mode is on (models.hub_offline is true); set models.hub_offline: false" in (
        message
    )
    assert "HF_HUB_OFFLINE" not in message


def test_an_integer_of_thousands_of_digits_is_one_line(tmp_path, capsys):
    """Python refuses to read integers past 4300 digits (a traceback); params and flags refuse
    them as values featcal does not read, naming the file."""
    from featcal_core.params.base import MAX_DIGITS, read_value

    big = tmp_path / "big.yaml"
    big.write_text(f"run:\n  seed: {'7' * 5000}\n")
    cli_fails(["check", "--params", str(big)], capsys, str(big), f"at most {MAX_DIGITS} digits")
    with pytest.raises(yaml.YAMLError, match="at most"):
        read_value("9" * 5000)
    assert read_value("9" * MAX_DIGITS) == int("9" * MAX_DIGITS)
