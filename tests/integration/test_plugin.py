"""The verl.plugins entry point: clean import, registrations, loud failures, config validation."""

import importlib.util
import pkgutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

REGISTERED = (
    "from verl.workers.engine.base import EngineRegistry\n"
    "assert EngineRegistry._engines['language_model'].get('longstraw'), 'longstraw engine not registered'\n"
)


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


def test_hub_kernels_are_off_unless_the_job_sets_them(monkeypatch):
    """Registering sets USE_HUB_KERNELS=0 where the job left it unset (veRL 0.9.1's meta-device ranks and
    transformers 5.25's kernelize do not mix) and keeps a value the job set."""
    from verl_longstraw.integration import plugin

    monkeypatch.delenv(plugin.HUB_KERNELS, raising=False)
    plugin.register()
    assert plugin.os.environ[plugin.HUB_KERNELS] == "0"
    monkeypatch.setenv(plugin.HUB_KERNELS, "1")
    plugin.register()
    assert plugin.os.environ[plugin.HUB_KERNELS] == "1"


def test_broken_plugin_import_is_loud():
    code = "import sys; sys.modules['verl_longstraw.integration.engine'] = None; import verl"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "verl_longstraw plugin failed to import" in proc.stderr
    assert "Traceback" in proc.stderr


def test_any_module_imported_first_registers_the_engine():
    """A fresh interpreter whose first import is any one module of the integration (what a user's
    launcher does, e.g. `from verl_longstraw.integration.config import LongStrawConfig`) imports it
    without an error logged and ends with the engine registered."""
    package = "verl_longstraw.integration"
    locations = importlib.util.find_spec(package).submodule_search_locations
    modules = [package] + [f"{package}.{m.name}" for m in pkgutil.iter_modules(locations)]
    failures = {}
    for batch in (modules[i : i + 2] for i in range(0, len(modules), 2)):  # two at a time: 2-core CI
        procs = {
            m: subprocess.Popen(
                [sys.executable, "-c", f"import {m}\n" + REGISTERED],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for m in batch
        }
        for m, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            if proc.returncode or "Traceback" in err:
                failures[m] = err[-3000:]
    assert len(modules) > 5 and not failures, failures


@pytest.mark.parametrize("torch_sees_cuda", [False, True], ids=["no-accelerator", "cuda-without-nvidia-smi"])
def test_cpu_platform_only_when_torch_sees_no_accelerator(torch_sees_cuda):
    """veRL's CUDA probe fails without nvidia-smi (containers) even when torch sees CUDA; the CPU
    platform must then stay unregistered. The plugin logs which way it went."""
    fake_cuda = (
        "torch.accelerator.current_accelerator = lambda check_available=False: torch.device('cuda')\n"
        "torch.cuda.is_available = lambda: True\n"
    )
    code = (
        "import logging, shutil, torch\n"
        "logging.basicConfig(format='%(levelname)s %(name)s %(message)s')\n"
        "logging.getLogger('verl_longstraw').setLevel(logging.INFO)\n"
        "shutil.which = lambda cmd, *args, **kwargs: None\n"  # no nvidia-smi on PATH
        + (fake_cuda if torch_sees_cuda else "")
        + "import verl\n"
        "from verl.plugin.platform import PlatformRegistry\n"
        "print('cpu registered:', 'cpu' in PlatformRegistry.registered_names())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"cpu registered: {not torch_sees_cuda}" in proc.stdout
    expected = "torch sees accelerator 'cuda'" if torch_sees_cuda else "registered the CPU platform"
    assert expected in proc.stderr, proc.stderr[-3000:]


def test_config_rejects_unknown_and_inconsistent_settings():
    from verl_longstraw.integration.config import LongStrawConfig, as_longstraw_config, check_supported

    with pytest.raises(ValueError, match="prompt_grad"):
        LongStrawConfig(prompt_grad="approx")
    with pytest.raises(ValueError, match="chunk_size"):
        LongStrawConfig(chunk_size=0)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.longstraw\.min_shared_tokens must be a positive"):
        LongStrawConfig(min_shared_tokens=0)
    with pytest.raises(ValueError, match="Unknown key"):
        as_longstraw_config({"prompt_grad": "exact", "chunk": 4})
    with pytest.raises(ValueError, match="use_fused_kernels"):
        check_supported({"use_fused_kernels": True})


def test_config_builds_the_knobs_once():
    """The config's knobs are one validated ``Knobs`` built with it (what the engine hands every walk), not a
    config key."""
    from verl_longstraw import Knobs
    from verl_longstraw.integration.config import KNOBS, LongStrawConfig, as_longstraw_config

    config = as_longstraw_config({"chunk_size": 8, "prompt_grad": "detached", "replay_tokens": 64})
    assert config.knobs == Knobs(chunk_size=8, min_shared_tokens=64, replay_tokens=64, prompt_grad="detached")
    assert "knobs" not in KNOBS and "knobs" not in dict(LongStrawConfig())


def test_critic_strategy_longstraw_names_the_fix(model_dirs):
    """The longstraw strategy serves the actor and the reference policy only: a critic asking for it
    fails when the shipped config is converted (as veRL's validate_config does), and under any other
    config when veRL builds the critic's engine, naming the fix (not veRL's bare "Unknown backend")."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import FSDPCriticConfig
    from verl.workers.engine import EngineRegistry

    fix = "serves the actor and the reference policy only.*critic.strategy=fsdp2"
    model = [
        f"critic.model.path={model_dirs['qwen3']}",
        "+critic.model.load_tokenizer=false",
        "critic.ppo_micro_batch_size_per_gpu=2",
    ]
    refused = _shipped_config([*model, "critic.strategy=longstraw"])
    accepted = _shipped_config([*model, "critic.strategy=fsdp2"])
    with pytest.raises(Exception, match=fix):  # Hydra wraps the ValueError in an InstantiationException
        omega_conf_to_dataclass(refused.critic)
    assert isinstance(omega_conf_to_dataclass(accepted.critic), FSDPCriticConfig)
    with pytest.raises(ValueError, match=fix):
        EngineRegistry.new(model_type="value_model", backend="longstraw")


def test_engine_refuses_context_parallel_for_window_layers(tmp_path):
    """gpt_oss (sliding-window and sink layers, no sharded form) with context_parallel_size=2 is refused when the
    engine is constructed, before any model is built or collective runs, naming the knob; R = 1 constructs."""
    from verl.workers.config import HFModelConfig

    from verl_longstraw import UnsupportedModelError
    from verl_longstraw.integration.engine import LongStrawEngine
    from verl_longstraw.testing import verl_harness as testing

    model_config = HFModelConfig(path=testing.save_tiny_model("gpt_oss", str(tmp_path / "gpt_oss")),
                                 load_tokenizer=False)
    engine_config = testing.actor_config("longstraw", "token-mean", False, 0.0, 1, context_parallel_size=2).engine
    with pytest.raises(UnsupportedModelError, match="gpt_oss: context_parallel_size=2 is not supported"):
        LongStrawEngine(model_config=model_config, engine_config=engine_config, optimizer_config=None,
                        checkpoint_config=None)


def test_longstraw_sync_settings_live_under_sync():
    """veRL knows the longstraw_sync mode as "sync" and reads trainer.v1.sync: the shipped config has no
    trainer.v1.longstraw_sync block, and the trainer refuses one instead of ignoring its settings."""
    from omegaconf import open_dict

    from verl_longstraw.integration.trainer import LongStrawTrainerSync

    cfg = _shipped_config()
    assert cfg.trainer.v1.trainer_mode == "longstraw_sync" and "longstraw_sync" not in cfg.trainer.v1
    with open_dict(cfg):
        cfg.trainer.v1.longstraw_sync = {"parameter_sync_step": 2}
    with pytest.raises(ValueError, match="move them to trainer.v1.sync"):
        LongStrawTrainerSync(cfg)


def _shipped_config(overrides: list[str] = ()):
    from hydra import compose, initialize_config_dir

    from verl_longstraw.configs import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return compose(config_name="longstraw_grpo", overrides=list(overrides))


def test_balance_groups_keeps_groups_whole():
    from verl_longstraw.integration.trainer import balance_groups, group_of_key

    keys = [f"uid{g}_{s}_0" for g in range(4) for s in range(4)]
    parts = balance_groups([group_of_key(k) for k in keys], [float(i % 5 + 1) for i in range(16)], 2)
    assert sorted(len(p) for p in parts) == [8, 8]
    for part in parts:
        assert len({group_of_key(keys[i]) for i in part}) == 2


def test_balance_groups_places_a_shared_prefix_together():
    """4 groups of 2 on 2 ranks, two system prompts (groups 0 and 2 begin with "a", 1 and 3 with "b"): each rank
    gets one prompt's groups, so its walk shares that prompt; without prefixes the groups go by workload alone."""
    from verl_longstraw.integration.trainer import balance_groups

    groups = [f"uid{g}" for g in range(4) for _ in range(2)]
    prefixes = ["a" if g % 2 == 0 else "b" for g in range(4) for _ in range(2)]
    workloads = [4.0, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0, 1.0]  # by workload alone: groups 0 + 3 and 1 + 2
    by_load = balance_groups(groups, workloads, 2)
    assert sorted(sorted({groups[i] for i in part}) for part in by_load) == [["uid0", "uid3"], ["uid1", "uid2"]]
    parts = balance_groups(groups, workloads, 2, prefixes)
    assert sorted(len(p) for p in parts) == [4, 4]
    assert sorted(sorted({prefixes[i] for i in part}) for part in parts) == [["a"], ["b"]]


def test_prompt_prefixes_cut_at_the_shared_length():
    import torch

    from verl_longstraw.integration.trainer import prompt_prefixes

    prompts = torch.nested.nested_tensor([torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2]), torch.tensor([5, 6, 7])],
                                         layout=torch.jagged)
    assert prompt_prefixes(prompts, 3) == [(1, 2, 3), (1, 2), (5, 6, 7)]
