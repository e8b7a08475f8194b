"""Cluster recipes (recipes/clusters/*): each composes on the shipped longstraw_grpo config through Hydra,
passes veRL's validate_config with its own GPU counts, converts to veRL's dataclasses, comments every
knob, and its launch.sh parses (`bash -n`) and applies the same overlay.

The recipes are composed and validated here, never run (no GPU cluster). validate_config reads no
model files, so the model path is a placeholder.
"""

import re
import subprocess
from copy import deepcopy
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

import verl_longstraw.integration as integration
from verl_longstraw.integration.config import LongStrawActorConfig

CLUSTERS = Path(__file__).resolve().parents[2] / "recipes" / "clusters"
PKG_CONFIGS = str(Path(list(integration.__path__)[0]) / "configs")
RECIPES = {
    # name: (nnodes, prompt tokens, response tokens, prompt_grad)
    "qwen35_27b_1m": (1, 1048576, 8192, "detached"),
    "glm5_mla_multinode": (16, 262144, 8192, "exact"),
}


def _compose(name):
    # longstraw_grpo must stay the primary config: it sets hydra.searchpath, which Hydra rejects in
    # any config loaded through a defaults list. The recipe is an @package _global_ overlay.
    with initialize_config_dir(config_dir=PKG_CONFIGS, version_base=None):
        return compose(
            config_name="longstraw_grpo",
            overrides=[
                f"hydra.searchpath=[pkg://verl.trainer.config,file://{CLUSTERS}]",
                f"+{name}=recipe",
                "actor_rollout_ref.model.path=/placeholder/model",
            ],
        )


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_composes_and_validates(name):
    nnodes, prompt, response, prompt_grad = RECIPES[name]
    cfg = _compose(name)
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert actor.strategy == "longstraw" and cfg.actor_rollout_ref.ref.strategy == "longstraw"
    assert cfg.trainer.v1.trainer_mode == "longstraw_sync" and cfg.algorithm.adv_estimator == "grpo"
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (nnodes, 8)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (prompt, response)
    assert rollout.max_model_len == prompt + response
    assert actor.longstraw.prompt_grad == prompt_grad and actor.longstraw.chunk_size == response
    # one whole GRPO group per micro-batch and exactly one group per GPU per step
    n, n_gpus = rollout.n, nnodes * 8
    assert actor.ppo_micro_batch_size_per_gpu == n
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == n
    assert rollout.log_prob_micro_batch_size_per_gpu == n
    assert cfg.data.train_batch_size * n == n_gpus * n
    assert actor.ppo_max_token_len_per_gpu == n * (prompt + response)

    # veRL's own check, with the recipe's GPU counts as they are
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))

    actor_dc = omega_conf_to_dataclass(actor)
    assert isinstance(actor_dc, LongStrawActorConfig)
    assert actor_dc.engine.longstraw.prompt_grad == prompt_grad
    assert actor_dc.engine.longstraw.chunk_size == response
    assert actor_dc.engine.offload_policy and actor_dc.engine.mixed_precision["reduce_dtype"] == "bf16"
    rollout_dc = omega_conf_to_dataclass(rollout)
    assert rollout_dc.prompt_length == prompt and rollout_dc.response_length == response

    # the reference config as veRL's worker builds it (engine_workers.py renames log_prob_* first)
    ref = deepcopy(cfg.actor_rollout_ref.ref)
    with open_dict(ref):
        ref.ppo_mini_batch_size = actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    ref_dc = omega_conf_to_dataclass(ref)
    assert isinstance(ref_dc, LongStrawActorConfig) and ref_dc.longstraw.prompt_grad == prompt_grad


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_knob_is_commented(name):
    """Each `key: value` line has a comment directly above it, or belongs to a commented block
    (consecutive lines with no blank line between them, as in the offload and mixed-precision groups)."""
    lines = (CLUSTERS / name / "recipe.yaml").read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z_]\w*:\s*\S", line):
            continue
        j = i - 1
        while j >= 0 and lines[j].strip() and not lines[j].lstrip().startswith("#"):
            j -= 1  # walk up a block of fields with no blank line in between
        if j < 0 or not lines[j].lstrip().startswith("#"):
            uncommented.append(line.strip())
    assert not uncommented, f"{name}/recipe.yaml fields without a comment: {uncommented}"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_launch_script_parses_and_applies_the_recipe(name):
    script = CLUSTERS / name / "launch.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "--config-name longstraw_grpo" in text and f"+{name}=recipe" in text
    assert "hydra.searchpath=[pkg://verl.trainer.config,file://$CLUSTERS]" in text
    assert "ray start" in text
    assert (CLUSTERS / name / "README.md").is_file()
