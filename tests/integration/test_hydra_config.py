"""The shipped Hydra config composes on veRL's ppo_trainer and passes veRL's validation; the configs
folder is located the same way from Python and from the shell."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass, validate_config

from verl_longstraw.configs import config_dir
from verl_longstraw.integration.config import LongStrawActorConfig

OVERRIDES = [
    "actor_rollout_ref.model.path=/nonexistent",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "trainer.n_gpus_per_node=2",
]


CP2 = "actor_rollout_ref.actor.longstraw.context_parallel_size=2"


def _compose(extra=()):
    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return compose(config_name="longstraw_grpo", overrides=OVERRIDES + list(extra))


def test_config_dir_from_python_and_shell():
    printed = subprocess.run([sys.executable, "-m", "verl_longstraw.configs"], capture_output=True, text=True,
                             check=True).stdout
    assert printed == f"{config_dir()}\n" and config_dir().is_absolute()
    assert (config_dir() / "longstraw_grpo.yaml").is_file()


def test_config_composes_and_validates():
    cfg = _compose()
    assert cfg.actor_rollout_ref.actor.strategy == "longstraw"
    assert cfg.actor_rollout_ref.ref.strategy == "longstraw"
    assert cfg.trainer.v1.trainer_mode == "longstraw_sync"
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, LongStrawActorConfig)
    assert actor.engine.longstraw.prompt_grad == "exact" and actor.engine.strategy == "longstraw"


def test_bad_knob_fails_at_config_time():
    cfg = _compose(["actor_rollout_ref.actor.longstraw.prompt_grad=approx"])
    with pytest.raises(Exception, match="prompt_grad"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_shipped_config_declares_every_knob_with_its_default():
    from verl_longstraw.integration.config import KNOBS, LongStrawConfig

    declared = _compose().actor_rollout_ref.actor.longstraw
    assert set(declared) - {"_target_"} == set(KNOBS)
    assert {k: declared[k] for k in KNOBS} == {k: getattr(LongStrawConfig(), k) for k in KNOBS}
    cp_config = _compose([CP2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    cp = omega_conf_to_dataclass(cp_config.actor_rollout_ref.actor)
    assert cp.engine.longstraw.context_parallel_size == 2
    assert cp_config.actor_rollout_ref.ref.longstraw.context_parallel_size == 2  # the reference policy inherits it


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["actor_rollout_ref.actor.longstraw.context_parallel_size=0"], "context_parallel_size"),
        (["actor_rollout_ref.actor.longstraw.state_grad_on_host=maybe"], "state_grad_on_host"),
        (["actor_rollout_ref.actor.longstraw.memory_budget_gb=-1"], "memory_budget_gb"),
        (["actor_rollout_ref.actor.longstraw.replay_tokens=0"], "replay_tokens"),
        (["actor_rollout_ref.actor.longstraw.single_forward=sometimes"], "single_forward"),
        ([CP2, "actor_rollout_ref.actor.use_dynamic_bsz=true"], "use_dynamic_bsz"),
        ([CP2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
         r"ppo_micro_batch_size_per_gpu=4.*multiple of 8"),
        ([CP2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.shuffle=true"],
         "shuffle"),
        ([CP2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
          "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "ulysses_sequence_parallel_size"),
    ],
)
def test_context_parallel_settings_fail_at_config_time(overrides, field):
    """Settings the CP path cannot honour fail when the config is converted (as main_ppo does), naming the field."""
    with pytest.raises(Exception, match=field):  # Hydra wraps the ValueError in an InstantiationException
        omega_conf_to_dataclass(_compose(overrides).actor_rollout_ref.actor)


@pytest.mark.parametrize(
    "gpus, fsdp_size, cp, message",
    [
        (4, -1, 3, "does not divide the world size 4"),
        (4, -1, 2, r"fsdp_size=-1 shards over 4 ranks; set fsdp_size=2"),
        (8, 4, 2, r"fsdp_size=4 shards over 4 ranks; set fsdp_size=2"),
    ],
)
def test_context_parallel_layout_fails_before_any_worker_starts(gpus, fsdp_size, cp, message):
    """The trainer checks R against the world size and the FSDP shard group before building workers."""
    from verl_longstraw.integration.trainer import LongStrawTrainerSync

    cfg = _compose([f"trainer.n_gpus_per_node={gpus}", f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size}",
                    f"actor_rollout_ref.actor.longstraw.context_parallel_size={cp}"])
    with pytest.raises(ValueError, match=message):
        LongStrawTrainerSync(cfg)
