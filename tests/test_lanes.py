"""The fast lane (`./scripts/test --fast`, `pytest -m "not slow"`) selects no test that uses the
`prefect_api` fixture: tests/conftest.py marks every such test slow, so the lane never waits on a
Prefect server. Collection only: this pytest run's own items when it collected the whole test
directory (`./scripts/test`, with or without `--fast`), otherwise a `--collect-only` subprocess
over the test files that name the fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

ROOT = Path(__file__).parents[1]
TESTS = ROOT / "tests"

#: a pytest plugin that prints the selected and the deselected tests that use `prefect_api`
PROBE = """
def pytest_deselected(items):
    for item in items:
        if "prefect_api" in getattr(item, "fixturenames", ()):
            print("deselected:", item.nodeid)


def pytest_collection_finish(session):
    print("probe: collected", len(session.items))
    for item in session.items:
        if "prefect_api" in getattr(item, "fixturenames", ()):
            print("selected:", item.nodeid)
"""


def _uses_prefect_api(item) -> bool:
    return "prefect_api" in getattr(item, "fixturenames", ())


def _marks_of(item):
    """A matcher for `-m` expressions: the marks the item has."""
    return lambda name, /, **kwargs: item.get_closest_marker(name) is not None


def _collected_every_file(config) -> bool:
    start = config.invocation_params.dir
    for arg in config.args:
        path = (start / arg.split("::")[0]).resolve()
        if path.is_dir() and (path == TESTS or path in TESTS.parents):
            return True
    return False


def test_every_test_that_uses_prefect_api_is_marked_slow_and_left_out_by_not_slow(request):
    config = request.config
    if not _collected_every_file(config):
        pytest.skip("this pytest run did not collect the whole test directory: see the last test")
    users = [item for item in request.session.items if _uses_prefect_api(item)]
    unmarked = [item.nodeid for item in users if item.get_closest_marker("slow") is None]
    assert unmarked == [], "use prefect_api but are not marked slow:\n" + "\n".join(unmarked)
    markexpr = config.option.markexpr
    if markexpr:  # the marks come before `-m` deselects
        expression = Expression.compile(markexpr)
        leaked = [item.nodeid for item in users if not expression.evaluate(_marks_of(item))]
        assert leaked == [], f"selected although -m {markexpr!r}:\n" + "\n".join(leaked)


def test_the_slow_lists_name_existing_files_and_tests():
    from conftest import SLOW_FILES, SLOW_TESTS

    missing = [name for name in SLOW_FILES if not (TESTS / name).is_file()]
    for entry in SLOW_TESTS:
        name, test = entry.split("::")
        path = TESTS / name
        if not path.is_file() or f"def {test.split('[')[0]}(" not in path.read_text():
            missing.append(entry)
    assert missing == []


def test_a_not_slow_collection_leaves_out_every_test_that_uses_prefect_api(request, tmp_path):
    if _collected_every_file(request.config):
        pytest.skip("the first test checks this pytest run's own items")
    files = sorted(
        str(path.relative_to(ROOT))
        for path in TESTS.glob("test_*.py")
        if path.name != Path(__file__).name and "prefect_api" in path.read_text()
    )
    assert files
    (tmp_path / "lane_probe.py").write_text(PROBE)
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-s", "-p", "no:cacheprovider"]
    cmd += ["-p", "lane_probe", "-m", "not slow", *files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: every test deselected
    lines = proc.stdout.splitlines()
    assert any(line.startswith("probe: collected") for line in lines), proc.stdout
    selected = [line for line in lines if line.startswith("selected:")]
    assert selected == [], "use prefect_api but are not marked slow:\n" + "\n".join(selected)
    assert any(line.startswith("deselected:") for line in lines), proc.stdout  # the probe sees them
