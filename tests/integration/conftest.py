"""Single-process gloo group (world size 1) and tiny models saved to disk, shared by the tests."""

import pytest

from verl_longstraw.testing import verl_harness as testing
from verl_longstraw.tiny import REPRESENTATIVES


@pytest.fixture(scope="session")
def dist():
    testing.init_dist()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: testing.save_tiny_model(f, str(root / f)) for f in REPRESENTATIVES}  # one family per adapter
