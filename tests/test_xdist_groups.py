"""The test layout itself: under `--dist loadgroup` the xdist_group marks that tests/conftest.py adds
really group the tests (pytest 9.2 with pytest-xdist 3.8 dropped them silently, and every module
fixture was then built once per worker)."""

from __future__ import annotations

import pytest


def test_loadgroup_keeps_a_file_on_one_worker(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run under pytest-xdist --dist loadgroup")
    assert request.node.nodeid.endswith("@test_xdist_groups.py"), request.node.nodeid
