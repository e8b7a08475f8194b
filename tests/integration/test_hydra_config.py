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
