"""Single-process gloo group (world size 1) and tiny models saved to disk, shared by the tests."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


@pytest.fixture(scope="session")
def dist():
    harness.init_dist(port=29531)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {f: harness.save_tiny_model(f, str(root / f)) for f in ("qwen3", "qwen3_next", "deepseek_v3")}
