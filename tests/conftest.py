import logging
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
