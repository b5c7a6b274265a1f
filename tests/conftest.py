import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    logging.getLogger("featcal_core").setLevel(logging.INFO)
    yield


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One local `prefect server` (its own database) shared by the tests that start many flow
    processes (each would otherwise start Prefect's temporary server); yields its API URL."""
    from flows.serve import local_server

    saved = os.environ.get("PREFECT_HOME")
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-server"))
    server = local_server()
    try:
        api_url = server.__enter__()  # the server process keeps this PREFECT_HOME
    finally:  # the tests themselves keep theirs
        if saved is None:
            os.environ.pop("PREFECT_HOME", None)
        else:
            os.environ["PREFECT_HOME"] = saved
    try:
        yield api_url
    finally:
        server.__exit__(None, None, None)


#: files whose tests share no module fixture and each run long: pytest-xdist may send their tests
#: to different workers. Every other file's tests stay together on one worker (`--dist loadgroup`),
#: so its module fixtures are built once.
SPREAD = {"test_pipeline.py", "test_serve.py", "test_demo.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
