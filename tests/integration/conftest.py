"""Single-process gloo group (world size 1) and tiny models saved to disk, shared by the tests."""

import pytest

from verl_longstraw.testing import verl_harness as testing


@pytest.fixture(scope="session")
def dist():
    testing.init_dist()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    families = ("qwen3", "qwen3_next", "deepseek_v3", "gpt_oss", "nemotron_h", "granitemoehybrid", "kimi_linear",
                "lfm2", "jamba")
    return {f: testing.save_tiny_model(f, str(root / f)) for f in families}
