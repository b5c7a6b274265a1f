"""`featcal params export`: any params file as the full params.yaml DVC's stages read."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from featcal_cli.main import main
from featcal_core.params import dump, load_params

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "params" / "paper-clip-vit-b32.yaml"


def _dvc_param_keys() -> set[str]:
    """Every key (section or dotted value) dvc.yaml's stages name under `params:`."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {key for stage in stages.values() for key in stage.get("params", [])}


def _has(tree: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def test_export_writes_every_section_dvc_reads(tmp_path):
    short = yaml.safe_load(PAPER.read_text())
    keys = _dvc_param_keys()
    missing_before = sorted(k for k in keys if not _has(short, k))
    assert missing_before, "the paper file already names every section: the test shows nothing"
    out = tmp_path / "params.yaml"
    assert (
        main(
            [
                "params",
                "export",
                "--params",
                str(PAPER),
                "--set",
                "featcal.alpha=0.5",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    written = yaml.safe_load(out.read_text())
    assert [k for k in sorted(keys) if not _has(written, k)] == []
    assert _has(written, "run.results_dir")  # dvc.yaml's ${run.results_dir}
    assert written["featcal"]["alpha"] == 0.5
    expected = load_params(PAPER, ["featcal.alpha=0.5"])
    assert load_params(out) == expected
    assert out.read_text() == dump(expected)


def test_export_keeps_an_existing_file_with_other_settings(tmp_path, capsys):
    out = tmp_path / "params.yaml"
    out.write_text("# mine\nrun: {name: mine}\n")
    assert main(["params", "export", "--params", str(PAPER), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} exists with other settings" in err and "--overwrite" in err
    assert out.read_text() == "# mine\nrun: {name: mine}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]  # no temporary left

    assert main(["params", "export", "--params", str(PAPER), "--out", str(out), "--overwrite"]) == 0
    assert load_params(out) == load_params(PAPER)
    before = out.stat().st_mtime_ns
    # the same settings again (a file of the same settings, whatever its layout): left as it is
    assert main(["params", "export", "--params", str(PAPER), "--out", str(out)]) == 0
    assert out.stat().st_mtime_ns == before


def test_export_to_stdout_and_bad_input(tmp_path, capsys):
    assert main(["params", "export", "--params", str(PAPER), "--out", "-"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == yaml.safe_load(dump(load_params(PAPER)))
    assert (
        main(
            [
                "params",
                "export",
                "--params",
                str(tmp_path / "nope.yaml"),
                "--out",
                str(tmp_path / "p.yaml"),
            ]
        )
        == 2
    )
    assert "nope.yaml: file not found" in capsys.readouterr().err
    assert (
        main(
            [
                "params",
                "export",
                "--params",
                str(PAPER),
                "--set",
                "featcal.alpha=-1",
                "--out",
                str(tmp_path / "p.yaml"),
            ]
        )
        == 2
    )
    assert "featcal.alpha" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()
    assert main(["params", "export", "--params", str(PAPER), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["import", ""])
def test_params_needs_a_known_action(action, capsys):
    assert main(["params", action, "--params", str(PAPER)]) == 2
    assert "featcal params" in capsys.readouterr().err
