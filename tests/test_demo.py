"""`featcal demo --synthetic`: builds (then reuses) a synthetic pool and calibrates it."""

from __future__ import annotations

import json

from featcal_cli.main import main


def test_demo_builds_then_reuses_the_pool(tmp_path, capsys):
    work = tmp_path / "demo"
    assert main(["demo", "--synthetic", "--work", str(work), "--tasks", "2"]) == 0
    printed = capsys.readouterr().out
    assert "| block | drift before | drift after | change |" in printed
    record = json.loads((work / "calibrated" / "featcal.json").read_text())
    assert len(record["blocks"]) == 4
    stamp = (work / "pool" / "pool.json").stat().st_mtime_ns
    assert main(["demo", "--synthetic", "--work", str(work), "--tasks", "2"]) == 0
    assert (work / "pool" / "pool.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
