"""Recipe overlays (configs/recipe/*.yaml): each composes through Hydra the way its launcher applies it,
passes veRL's validate_config with its own GPU counts, converts to veRL's dataclasses and comments every knob.

- the cluster recipes (recipes/clusters/<name>/launch.sh) on the shipped longstraw_grpo config; their
  launch scripts parse (`bash -n`) and apply the same overlay. Composed and validated, never run (no GPU
  cluster); validate_config reads no model files, so the model path is a placeholder.
- the CPU main job (recipes/kv_retrieval/run.sh), composed from the exact command line the script runs
  (its DRY_RUN mode), for both strategies: longstraw on longstraw_grpo, fsdp2 on veRL's ppo_trainer.
"""

import os
import re
import shlex
import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir, initialize_config_module
from omegaconf import open_dict
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

from verl_longstraw.configs import config_dir
from verl_longstraw.integration.config import LongStrawActorConfig

REPO = Path(__file__).resolve().parents[2]
CLUSTERS = REPO / "recipes" / "clusters"
CLUSTER_RECIPES = {
    # name: (nnodes, prompt tokens, response tokens, prompt_grad)
    "qwen35_27b_1m": (1, 1048576, 8192, "detached"),
    "glm5_mla_multinode": (16, 262144, 8192, "exact"),
}


def _compose(overrides, config_dir_=None):
    """Compose like `main_ppo --config-path DIR --config-name longstraw_grpo` (config_dir_ given) or like
    `main_ppo` on veRL's own ppo_trainer (None)."""
    if config_dir_ is not None:
        with initialize_config_dir(config_dir=config_dir_, version_base=None):
            return compose(config_name="longstraw_grpo", overrides=overrides)
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def _validate(cfg):
    """veRL's own config check, as main_ppo runs it."""
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def test_every_overlay_is_tested():
    assert {p.stem for p in (config_dir() / "recipe").glob("*.yaml")} == {*CLUSTER_RECIPES, "kv_retrieval"}


@pytest.mark.parametrize("name", sorted(CLUSTER_RECIPES))
def test_cluster_recipe_composes_and_validates(name):
    nnodes, prompt, response, prompt_grad = CLUSTER_RECIPES[name]
    cfg = _compose([f"+recipe={name}", "actor_rollout_ref.model.path=/placeholder/model"], str(config_dir()))
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

    _validate(cfg)

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


def _main_job_command(tmp_path: Path, strategy: str) -> list[str]:
    """The main_ppo arguments recipes/kv_retrieval/run.sh runs (DRY_RUN=1 prints them, %q-quoted), with
    this interpreter's environment as its VENV."""
    env = dict(os.environ, DRY_RUN="1", VENV=sys.prefix, WORKDIR=str(tmp_path / "wd"), STRATEGY=strategy,
               BATCH="2", NUM_PAIRS="100", LR="1e-4", STEPS="3")
    out = subprocess.run(["bash", str(REPO / "recipes" / "kv_retrieval" / "run.sh")], env=env, text=True,
                         capture_output=True, timeout=120, check=True).stdout
    line = next(line for line in out.splitlines() if "verl.trainer.main_ppo" in line)
    args = shlex.split(line)
    return args[args.index("verl.trainer.main_ppo") + 1 :]


def _compose_command(args: list[str]):
    """Compose a main_ppo command line: `--config-path D --config-name N` or `--config-dir D` + overrides."""
    options, overrides, rest = {}, [], iter(args)
    for arg in rest:
        if arg.startswith("--"):
            options[arg] = next(rest)
        else:
            overrides.append(arg)
    if "--config-dir" in options:
        return _compose([*overrides, f"hydra.searchpath=[file://{options['--config-dir']}]"])
    assert options["--config-name"] == "longstraw_grpo"
    return _compose(overrides, options["--config-path"])


@pytest.mark.parametrize("strategy", ["longstraw", "fsdp2"])
def test_main_job_composes_and_validates(tmp_path, strategy):
    args = _main_job_command(tmp_path, strategy)
    assert "+recipe=kv_retrieval" in args
    cfg = _compose_command(args)
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    # the overlay's settings
    assert cfg.algorithm.adv_estimator == "grpo" and rollout.name == "vllm" and rollout.n == 8
    assert cfg.trainer.device == "cpu" and cfg.trainer.resume_mode == "auto" and not actor.use_kl_loss
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert actor.fsdp_config.mixed_precision.param_dtype == "fp32"  # bf16 is slow on AVX2-only CPUs
    # run.sh's knobs
    wd = tmp_path / "wd"
    assert actor.strategy == cfg.actor_rollout_ref.ref.strategy == strategy and actor.optim.lr == 1e-4
    assert cfg.data.train_batch_size == actor.ppo_mini_batch_size == 2
    assert (cfg.data.max_prompt_length, rollout.max_model_len) == (100 * 4 + 64, 100 * 4 + 128)
    assert cfg.data.train_files == f"{wd}/data/train.parquet" and cfg.actor_rollout_ref.model.path == f"{wd}/model"
    assert cfg.trainer.default_local_dir == f"{wd}/checkpoints" and cfg.trainer.total_training_steps == 3
    assert Path(cfg.reward.custom_reward_function.path).is_file()
    assert cfg.trainer.v1.trainer_mode == ("longstraw_sync" if strategy == "longstraw" else "sync")

    _validate(cfg)
    actor_dc = omega_conf_to_dataclass(actor)
    assert isinstance(actor_dc, LongStrawActorConfig) == (strategy == "longstraw")


@pytest.mark.parametrize("name", sorted([*CLUSTER_RECIPES, "kv_retrieval"]))
def test_every_overlay_knob_is_commented(name):
    """Each `key: value` line has a comment directly above it, or belongs to a commented block
    (consecutive lines with no blank line between them, as in the offload and mixed-precision groups)."""
    lines = (config_dir() / "recipe" / f"{name}.yaml").read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z_]\w*:\s*\S", line):
            continue
        j = i - 1
        while j >= 0 and lines[j].strip() and not lines[j].lstrip().startswith("#"):
            j -= 1  # walk up a block of fields with no blank line in between
        if j < 0 or not lines[j].lstrip().startswith("#"):
            uncommented.append(line.strip())
    assert not uncommented, f"configs/recipe/{name}.yaml fields without a comment: {uncommented}"


@pytest.mark.parametrize("name", sorted(CLUSTER_RECIPES))
def test_launch_script_parses_and_applies_the_recipe(name):
    script = CLUSTERS / name / "launch.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert '--config-path "$("$PYTHON" -m verl_longstraw.configs)" --config-name longstraw_grpo' in text
    assert f"+recipe={name}" in text and "ray start" in text
    assert (CLUSTERS / name / "README.md").is_file()
