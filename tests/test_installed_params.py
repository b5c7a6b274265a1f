"""The params files that ship with featcal (featcal_core.params.installed): the repository's
params/ folder, installed as featcal_core/params/files/ (tests/test_install.py checks the wheel).
`featcal params list` and `show`, and `--params NAME` from any folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from featcal_cli.main import main
from featcal_core.errors import FeatCalError
from featcal_core.params import load_params
from featcal_core.params.installed import installed_params, resolve_params

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "params" / "paper-clip-vit-b32.yaml"


def test_every_params_file_of_the_repository_ships(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # any folder
    shipped = installed_params()
    assert sorted(shipped) == sorted(p.stem for p in (ROOT / "params").glob("*.yaml"))
    assert shipped["paper-clip-vit-b32"].read_text() == PAPER.read_text()
    assert resolve_params("paper-clip-vit-b32") == shipped["paper-clip-vit-b32"]
    params = load_params("paper-clip-vit-b32")
    assert params.run.name == "paper-clip-vit-b32"
    # a file of the working directory wins; a name with .yaml or a folder is a path
    (tmp_path / "paper-clip-vit-b32").write_text(PAPER.read_text())
    assert resolve_params("paper-clip-vit-b32") == Path("paper-clip-vit-b32")
    assert resolve_params("paper-clip-vit-b32.yaml") == Path("paper-clip-vit-b32.yaml")
    assert resolve_params("sub/text") == Path("sub/text")


def test_params_list_and_show(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["params", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "paper-clip-vit-b32    featcal run --params paper-clip-vit-b32" in lines
    assert any(line.split()[0] == "compare-vision" and "featcal compare" in line for line in lines)
    assert len(lines) == len(list((ROOT / "params").glob("*.yaml")))
    assert main(["params", "show", "paper-clip-vit-b32"]) == 0
    assert capsys.readouterr().out == PAPER.read_text()  # as it is, comments included
    assert main(["params", "show", str(PAPER)]) == 0  # a path too
    assert capsys.readouterr().out == PAPER.read_text()
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_params_name_on_the_command_line_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["params", "export", "--params", "paper-clip-vit-b32", "--out", "-"]) == 0
    assert "name: paper-clip-vit-b32" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["params", "show"], "featcal params show needs the params file to print"),
        (["params", "show", "nope"], "featcal params show nope: no such params file"),
        (["params", "list", "--out", "x"], "featcal params list does not take --out"),
        (["params", "list", "text"], "featcal params list takes no name"),
        (["params", "export", "text"], "name the params file with --params (e.g. --params text)"),
        (["check", "--params", "mine"], "mine: file not found; pass its path"),
    ],
)
def test_wrong_uses_are_one_line(argv, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("featcal: error: ") and words in err, err
    assert "flows/params_example.yaml" not in err
    if "not found" in err or "no such" in err:
        assert "featcal params list" in err and "paper-clip-vit-b32" in err, err


def test_missing_params_file_points_to_the_installed_ones(tmp_path):
    with pytest.raises(FeatCalError, match="featcal params list") as info:
        load_params(tmp_path / "nope.yaml")
    assert "flows/params_example.yaml" not in str(info.value)
