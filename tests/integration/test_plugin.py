"""The verl.plugins entry point: clean import, registrations, loud failures, config validation."""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest


def test_entry_point_imports_and_registers():
    (ep,) = [e for e in entry_points(group="verl.plugins") if e.name == "longstraw"]
    ep.load()
    from verl.plugin.platform import get_platform
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.workers.engine import EngineRegistry

    assert set(EngineRegistry._engines["language_model"]["longstraw"]) == {"cuda", "npu", "cpu"}
    assert "longstraw_sync" in TRAINER_REGISTRY
    assert get_platform().device_name == "cpu"  # this machine has no accelerator
    assert get_platform().communication_backend_name() == "gloo"


def test_broken_plugin_import_is_loud():
    code = "import sys; sys.modules['verl_longstraw.integration.engine'] = None; import verl"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "verl_longstraw plugin failed to import" in proc.stderr
    assert "Traceback" in proc.stderr


def test_config_rejects_unknown_and_inconsistent_settings():
    from verl_longstraw.integration.config import LongStrawConfig, as_longstraw_config, check_supported

    with pytest.raises(ValueError, match="prompt_grad"):
        LongStrawConfig(prompt_grad="approx")
    with pytest.raises(ValueError, match="chunk_size"):
        LongStrawConfig(chunk_size=0)
    with pytest.raises(ValueError, match="Unknown key"):
        as_longstraw_config({"prompt_grad": "exact", "chunk": 4})
    with pytest.raises(ValueError, match="use_fused_kernels"):
        check_supported({"use_fused_kernels": True})


def test_balance_groups_keeps_groups_whole():
    from verl_longstraw.integration.trainer import balance_groups, group_of_key

    keys = [f"uid{g}_{s}_0" for g in range(4) for s in range(4)]
    parts = balance_groups([group_of_key(k) for k in keys], [float(i % 5 + 1) for i in range(16)], 2)
    assert sorted(len(p) for p in parts) == [8, 8]
    for part in parts:
        assert len({group_of_key(keys[i]) for i in part}) == 2
