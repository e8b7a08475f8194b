"""Recipe overlays (configs/recipe/*.yaml): each composes through Hydra the way its launcher applies it,
passes veRL's validate_config with its own GPU counts, converts to veRL's dataclasses and comments every knob.

- the cluster recipes (recipes/clusters/<folder>/launch.sh) on the shipped longstraw_grpo config, with the
  engine's context-parallel layout check for their GPU counts; their launch scripts parse (`bash -n`) and, run
  dry with a stand-in interpreter, compose to the same overlay and node count. Composed and validated, never
  run (no GPU cluster); validate_config reads no model files, so the model path is a placeholder.
- the per-GPU memory tables in recipes/clusters/*/README.md: each block is recomputed from
  verl_longstraw.gpu_table (recipes/clusters/memory_table.py) and must match the README text exactly.
- the CPU main job (recipes/kv_retrieval/run.sh), composed from the exact command line the script runs
  (its DRY_RUN mode), for both strategies: longstraw on longstraw_grpo, fsdp2 on veRL's ppo_trainer.
"""

import importlib.util
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

from verl_longstraw import models
from verl_longstraw.configs import config_dir
from verl_longstraw.integration.config import LongStrawActorConfig, check_context_parallel

REPO = Path(__file__).resolve().parents[2]
CLUSTERS = REPO / "recipes" / "clusters"
CLUSTER_RECIPES = {
    # name: (folder under recipes/clusters, nnodes, prompt tokens, response tokens, context_parallel_size, fsdp_size)
    "qwen35_27b_1m": ("qwen35_27b_1m", 1, 2**21, 8192, 8, -1),
    "qwen35_27b_4m": ("qwen35_27b_1m", 2, 17 * 2**18, 8192, 16, -1),  # the 4.46M-position stress variant
    # the prompt state in host memory (state_on_host): 8M positions on one node, 2.1M on four GPUs
    "qwen35_27b_8m_host": ("qwen35_27b_1m", 1, 127 * 2**16, 8192, 8, -1),
    "qwen35_27b_2m_4gpu_host": ("qwen35_27b_1m", 1, 2**21, 8192, 4, -1),
    "glm5_mla_multinode": ("glm5_mla_multinode", 4, 2**21, 8192, 8, 8),
    "qwen35_27b_1m_lora": ("qwen35_27b_1m", 1, 2**21, 8192, 8, -1),  # LoRA variants
    "glm5_lora": ("glm5_mla_multinode", 4, 2**21, 8192, 32, -1),
    # expert parallelism over the CP group (EP = CP)
    "glm52_ep_lora": ("glm52_ep", 4, 2**21, 8192, 32, -1),
    "qwen35_397b_ep_lora": ("qwen35_moe_ep", 2, 2**21, 8192, 16, -1),
    "qwen35_122b_ep": ("qwen35_moe_ep", 2, 2**21, 8192, 16, -1),
}
EXPERT_PARALLEL = {"glm52_ep_lora", "qwen35_397b_ep_lora", "qwen35_122b_ep"}
STATE_ON_HOST = {"qwen35_27b_8m_host", "qwen35_27b_2m_4gpu_host"}  # the prompt state's rows in host memory
GPUS_PER_NODE = {"qwen35_27b_2m_4gpu_host": 4}  # 8 for the others
# the trainer's shards on the GPU (no FSDP2 CPUOffloadPolicy): no full-model gradients or moments to offload
ON_GPU = {"qwen35_27b_1m_lora", "glm52_ep_lora", "qwen35_397b_ep_lora"}


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
    _, nnodes, prompt, response, cp_size, fsdp_size = CLUSTER_RECIPES[name]
    cfg = _compose([f"+recipe={name}", "actor_rollout_ref.model.path=/placeholder/model"], str(config_dir()))
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert actor.strategy == "longstraw" and cfg.actor_rollout_ref.ref.strategy == "longstraw"
    assert cfg.trainer.v1.trainer_mode == "longstraw_sync" and cfg.algorithm.adv_estimator == "grpo"
    gpus = GPUS_PER_NODE.get(name, 8)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (nnodes, gpus)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (prompt, response)
    assert rollout.max_model_len == prompt + response
    knobs = actor.longstraw
    assert (knobs.prompt_grad, knobs.context_parallel_size, knobs.state_grad_on_host) == ("exact", cp_size, True)
    assert knobs.get("expert_parallel", False) == (name in EXPERT_PARALLEL)  # EP = CP: the CP group's size
    assert knobs.state_on_host == (name in STATE_ON_HOST)
    assert prompt % knobs.chunk_size == 0 and knobs.chunk_size % cp_size == 0  # whole chunks, equal slices
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing  # the README tables count it
    # context parallelism: the FSDP shard group is the CP group (actor and the reference policy, which
    # inherits the knobs), whole GRPO groups per micro-batch, and whole CP groups' worth of groups per step
    n, world = rollout.n, nnodes * gpus
    assert cfg.actor_rollout_ref.ref.longstraw.context_parallel_size == cp_size
    for role in (actor, cfg.actor_rollout_ref.ref):
        assert role.fsdp_config.fsdp_size == fsdp_size
        check_context_parallel(cp_size, world, role.fsdp_config.fsdp_size)
    assert actor.ppo_micro_batch_size_per_gpu == n and not actor.use_dynamic_bsz and not actor.shuffle
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == n
    assert rollout.log_prob_micro_batch_size_per_gpu == n
    assert cfg.data.train_batch_size % (world // cp_size) == 0
    assert actor.ppo_max_token_len_per_gpu == n * (prompt + response)

    _validate(cfg)

    actor_dc = omega_conf_to_dataclass(actor)
    assert isinstance(actor_dc, LongStrawActorConfig)
    assert actor_dc.engine.longstraw == actor_dc.longstraw
    assert actor_dc.longstraw.context_parallel_size == cp_size and actor_dc.longstraw.state_grad_on_host
    assert actor_dc.longstraw.chunk_size == knobs.chunk_size and actor_dc.longstraw.prompt_grad == "exact"
    assert actor_dc.longstraw.preflight and actor_dc.longstraw.memory_budget_gb is None
    lora = cfg.actor_rollout_ref.model.lora_rank
    assert (lora > 0) == name.endswith("_lora")  # the LoRA variants: veRL builds a peft model
    assert actor_dc.engine.offload_policy != (name in ON_GPU)
    assert actor_dc.engine.mixed_precision["reduce_dtype"] == "fp32"
    assert actor_dc.longstraw.expert_parallel == (name in EXPERT_PARALLEL)
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
    assert isinstance(ref_dc, LongStrawActorConfig) and ref_dc.longstraw == actor_dc.longstraw


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
def test_launch_script_parses_and_applies_the_recipe(tmp_path, name):
    """launch.sh and the shared launcher it runs parse, and its dry run (LONGSTRAW_DRY_RUN=1, a stand-in
    interpreter that records the trainer's and the dry run's arguments) composes to this recipe with its node count
    and then dry-runs the recipe's step on the model's config."""
    folder, nnodes, prompt, *_ = CLUSTER_RECIPES[name]
    script, shared = CLUSTERS / folder / "launch.sh", CLUSTERS / "launch_recipe.sh"
    for path in (script, shared):
        subprocess.run(["bash", "-n", str(path)], check=True)
    assert "launch_recipe.sh" in script.read_text()
    text = shared.read_text()
    assert '--config-path "$("$PYTHON" -m verl_longstraw.configs)" --config-name longstraw_grpo' in text
    assert "ray start" in text and (CLUSTERS / folder / "README.md").is_file()

    args_file, dry_run_file = tmp_path / "main_ppo_args", tmp_path / "dryrun_args"
    python = tmp_path / "python"
    python.write_text(f"""#!/usr/bin/env bash
if [[ "$1 $2" == "-m verl_longstraw.configs" ]]; then echo {shlex.quote(str(config_dir()))}; exit; fi
[[ "$1 $2" == "-m verl.trainer.main_ppo" ]] && shift 2 && printf '%s\\n' "$@" > {shlex.quote(str(args_file))}
[[ "$1 $2" == "-m verl_longstraw.dryrun" ]] && shift 2 && printf '%s\\n' "$@" > {shlex.quote(str(dry_run_file))}
exit 0
""")
    python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(python), LONGSTRAW_DRY_RUN="1", ROLE="head", RECIPE=name,
               MODEL_PATH="/placeholder/model", TRAIN_FILES="/placeholder/train.parquet")
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60, capture_output=True)
    args = args_file.read_text().splitlines()
    assert f"+recipe={name}" in args and ["--cfg", "job"] == args[-2:]
    cfg = _compose_command(args[:-2])
    assert (cfg.trainer.nnodes, cfg.data.max_prompt_length) == (nnodes, prompt)
    assert dry_run_file.read_text().split() == ["--config", "/placeholder/model", "--recipe", name]


def _memory_table():
    """recipes/clusters/memory_table.py as a module (recipes/ is not a package)."""
    spec = importlib.util.spec_from_file_location("memory_table", CLUSTERS / "memory_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_memory_tables_match_the_estimate():
    """Every table block in recipes/clusters/*/README.md is what memory_table.py prints now (from
    verl_longstraw.gpu_table), character for character; every cluster recipe has its table, the GLM-5 recipe
    one on GLM-5.2's dims (the DSA indexer on 21 of 78 layers), GLM-5.2's and Qwen3.5-122B's EP recipes one on
    141 GB GPUs too."""
    memory_table = _memory_table()
    assert set(memory_table.MODELS) == set(memory_table.GPU_BYTES) == set(memory_table.SWEEPS) == set(CLUSTER_RECIPES)
    tabled = set()
    for readme in sorted(CLUSTERS.glob("*/README.md")):
        text = readme.read_text()
        for block in memory_table.BLOCK.finditer(text):
            expected = memory_table.rendered(block["args"]) + "\n"
            assert block["body"] == expected, (
                f"{readme.relative_to(REPO)}: the block of `memory_table.py {block['args']}` is stale; run "
                "`python recipes/clusters/memory_table.py --write`"
            )
            tabled.add(block["args"])
        assert memory_table.rewrite(text) == text
    assert tabled == {f"{flag}{name}" for name in CLUSTER_RECIPES for flag in ("", "--sweep ")} | {
        "--model GLM-5.2 glm5_mla_multinode", "--gpu-gb 141 glm52_ep_lora", "--gpu-gb 141 qwen35_122b_ep"}
    layout = models.glm5_2().indexer_types  # GLM-5.2's table is on its layout
    assert (layout.count("full"), len(layout)) == (21, 78)


def test_every_recipes_sequences_fit_its_models_positions():
    """A recipe's prompt plus response fit the positions of the model its tables are on (``memory_table.MODELS``),
    which the engine and the dry run check before a step: the 8M recipe once asked 2^23 + 8192."""
    memory_table = _memory_table()
    for name, (_, _, prompt, response, _, _) in CLUSTER_RECIPES.items():
        positions = models.CONFIGS[memory_table.MODELS[name]]().max_position_embeddings
        assert prompt + response <= positions, (name, prompt + response, positions)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_counts_are_verls_fsdp2_units(tied):
    """model_terms.parameter_counts (the tables' model rows) counts the units veRL's FSDP2 wrapping selects, in
    forward order, and the rest as the root's."""
    from verl.utils.fsdp_utils import _select_fsdp2_wrap_targets

    from verl_longstraw.model_terms import parameter_counts
    from verl_longstraw.tiny import tiny_model

    model = tiny_model("qwen3_5", tie_word_embeddings=tied)
    units = _select_fsdp2_wrap_targets(model, model._no_split_modules)
    counts = parameter_counts(model.config)
    assert counts.units == tuple(sum(p.numel() for p in m.parameters()) for m in units)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert len(counts.units) == model.config.num_hidden_layers + (0 if tied else 2)
