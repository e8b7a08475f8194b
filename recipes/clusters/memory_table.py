"""Per-GPU memory tables of the cluster recipes, printed from ``verl_longstraw.gpu_table``: the tables in
recipes/clusters/*/README.md are this script's output, and tests/integration/test_cluster_recipes.py
checks that they still are.

    python recipes/clusters/memory_table.py qwen35_27b_1m            # the recipe's per-GPU table
    python recipes/clusters/memory_table.py --sweep qwen35_27b_4m    # the same step under other knobs
    python recipes/clusters/memory_table.py --model GLM-5.2 glm5_mla_multinode   # the step with other dims
    python recipes/clusters/memory_table.py --gpu-gb 141 glm52_ep_lora   # on GPUs of another size
    python recipes/clusters/memory_table.py --write                  # rewrite the README blocks

A README block is the output of the command in its opening comment, up to ``<!-- end -->``:
``<!-- python recipes/clusters/memory_table.py [--sweep] [--model MODEL] [--gpu-gb GB] NAME -->``.

Each overlay is composed on ``longstraw_grpo`` (as its launch.sh applies it) and the table reads the
composed config: prompt/response lengths, ``rollout.n``, ``actor.longstraw.*`` (``expert_parallel`` included),
``fsdp_config``'s offload, model dtype and mixed precision, gradient checkpointing, GPUs per node. A recipe does not
name the model's dimensions (the model path is the user's), so ``MODELS`` names each recipe's model, whose dims
``verl_longstraw.models.CONFIGS`` states (``--model`` puts another's in its place); ``GPU_BYTES`` the GPU's memory
(``--gpu-gb`` another).
A sweep of a model with routed experts has two sets of columns: FSDP2 alone, and expert parallelism over the CP group
(``Training.expert_parallel``), whatever the recipe sets.
Memory is in GiB (2^30 bytes); GPU sizes are vendors' GB (10^9 bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from functools import cache
from pathlib import Path

import torch
from omegaconf import DictConfig

from verl_longstraw.adapters import adapter_on_meta
from verl_longstraw.configs import compose_recipe
from verl_longstraw.estimate import GIB
from verl_longstraw.gpu_table import GpuTable, gpu_table
from verl_longstraw.model_terms import VERL_DTYPE_NAMES, Lora, Training, parameter_counts, recipe_training
from verl_longstraw.models import CONFIGS

CLUSTERS = Path(__file__).resolve().parent
BLOCK = re.compile(  # a README block: the opening comment names the command, the body (no comments) its output
    r"(?P<head><!-- python recipes/clusters/memory_table.py (?P<args>[^>]*?) -->\n)(?P<body>(?:(?!<!--).)*?)"
    r"(?P<tail><!-- end -->)",
    re.S,
)


MODELS = {  # each recipe's model (a CONFIGS name)
    "qwen35_27b_1m": "Qwen3.5-27B", "qwen35_27b_4m": "Qwen3.5-27B", "qwen35_27b_1m_lora": "Qwen3.5-27B",
    "qwen35_27b_8m_host": "Qwen3.5-27B", "qwen35_27b_2m_4gpu_host": "Qwen3.5-27B",
    "glm5_mla_multinode": "GLM-5", "glm5_lora": "GLM-5", "glm52_ep_lora": "GLM-5.2",
    "qwen35_397b_ep_lora": "Qwen3.5-397B-A17B", "qwen35_122b_ep": "Qwen3.5-122B-A10B",
}
GPU_BYTES = {  # 96 GB (H20); H200 141 GB
    "qwen35_27b_1m": 96e9, "qwen35_27b_4m": 96e9, "qwen35_27b_1m_lora": 96e9, "qwen35_27b_8m_host": 96e9,
    "qwen35_27b_2m_4gpu_host": 96e9, "glm5_mla_multinode": 141e9,
    "glm5_lora": 141e9, "glm52_ep_lora": 96e9, "qwen35_397b_ep_lora": 96e9, "qwen35_122b_ep": 96e9,
}
SWEEPS: dict[str, list[dict]] = {  # other knobs for the same step (Training fields), per recipe
    "qwen35_27b_1m": [
        *({"chunk_size": c} for c in (16384, 32768, 131072, 262144)),
        {"state_grad_on_host": False},
        {"checkpointing": False},
        {"state_on_host": True},
    ],
    "qwen35_27b_4m": [
        *({"chunk_size": c} for c in (32768, 131072, 262144)),
        *({"cp_size": 8, "chunk_size": c} for c in (65536, 131072, 262144)),
        {"cp_size": 8, "chunk_size": 131072, "prompt_grad": "detached"},
        {"cp_size": 8, "state_on_host": True},
    ],
    "qwen35_27b_8m_host": [
        {"state_on_host": False},
        *({"chunk_size": c} for c in (32768, 131072)),
    ],
    "qwen35_27b_2m_4gpu_host": [
        {"state_on_host": False},
        *({"chunk_size": c} for c in (32768, 131072)),
    ],
    "qwen35_27b_1m_lora": [
        {"offload_policy": True, "optimizer_offload": True},
        *({"chunk_size": c} for c in (32768, 131072)),
    ],
    "glm5_mla_multinode": [
        *({"chunk_size": c} for c in (16384, 32768, 131072)),
        {"offload_policy": False, "optimizer_offload": False},
        {"cp_size": 32, "chunk_size": 262144},  # one CP group over all 4 nodes: FSDP shards over 32
    ],
    "glm5_lora": [
        *({"chunk_size": c} for c in (32768, 131072, 262144)),
        {"lora": Lora(64, "all-linear")},  # adapters on every expert too
        {"cp_size": 8, "chunk_size": 65536},  # the full-parameter recipe's layout: four 8-rank CP groups
        {"offload_policy": False, "optimizer_offload": False},
    ],
    "glm52_ep_lora": [
        *({"chunk_size": c} for c in (32768, 131072)),
        {"replay_tokens": 1},
        {"model_dtype": torch.float32},  # the experts resident in fp32
    ],
    "qwen35_397b_ep_lora": [
        *({"chunk_size": c} for c in (32768, 131072)),
        {"model_dtype": torch.float32},
    ],
    "qwen35_122b_ep": [
        *({"chunk_size": c} for c in (32768, 131072)),
        {"optimizer_offload": False},
        {"model_dtype": torch.bfloat16},  # bf16 weights, gradients and moments, no fp32 master copy
    ],
}


@cache
def _model(model: str) -> tuple:
    """(config, adapter on the meta device) of ``model`` (a CONFIGS name), built once per process."""
    config = CONFIGS[model]()
    return config, adapter_on_meta(config)


@cache
def _parameters(model: str, lora: Lora):
    """``model``'s parameter counts under ``lora``, built once per process."""
    return parameter_counts(_model(model)[0], lora)


def memory(name: str, cfg: DictConfig, model: str, gpu_bytes: float | None = None, **change) -> GpuTable:
    """The per-GPU memory of recipe ``name`` (composed: ``cfg``) on ``model``'s dims (a CONFIGS name) and GPUs of
    ``gpu_bytes`` (the recipe's, GPU_BYTES, by default), with ``change`` to its Training knobs."""
    config, adapter = _model(model)
    run = dataclasses.replace(recipe_training(cfg), **change)
    return gpu_table(config, run, int(gpu_bytes or GPU_BYTES[name]), cfg.trainer.n_gpus_per_node, adapter,
                     _parameters(model, run.lora))


def markdown(table: GpuTable) -> str:
    """``table``'s rows as a markdown table in GiB (2 decimals), with the totals against the GPU's memory."""

    def gib(n: int) -> str:
        return f"{n / GIB:.2f}"

    lines = ["| per GPU | device GiB | host GiB |", "|---|---:|---:|"]
    lines += [f"| {item} | {gib(device)} | {gib(host)} |" for item, device, host in table.rows]
    verdict = "fits" if table.peak <= table.gpu_bytes else "does NOT fit"
    lines.append(f"| **total at the peak** (the rows above the unsharded ones, FSDP2's unsharded bytes at the peak's "
                 f"moment and the walk's then: {gib(table.walk_at_peak)} GiB of the state, gradients, saves less the "
                 f"state's views and transient held at that moment; the rows below them are the walk's own peak) | "
                 f"**{gib(table.peak)}** | **{gib(table.host)}** |")
    lines.append(f"| GPU memory ({table.gpu_bytes / 1e9:g} GB): {verdict}, "
                 f"{gib(abs(table.gpu_bytes - table.peak))} GiB {'left' if table.peak <= table.gpu_bytes else 'over'}"
                 f" | {gib(table.gpu_bytes)} | |")
    lines.append(f"| host memory per node ({table.gpus_per_node} ranks) | | {gib(table.host * table.gpus_per_node)} |")
    lines.append(f"| engine pre-flight estimate: the walk's peak, the most FSDP2 holds unsharded at any moment and "
                 f"any expert-shard gradients above, compared with the free device memory at the start of the step | "
                 f"{gib(table.preflight)} | |")
    return "\n".join(lines)


def describe(run: Training) -> str:
    """The knobs of ``run`` in one line."""
    return (f"P = {run.prompt_len} prompt tokens, G = {run.group_size} responses of T = {run.response_len}, "
            f"R = {run.cp_size}, chunk_size {run.chunk_size}"
            + (f", response_chunk_size {run.response_chunk_size}" if run.response_chunk_size else "")
            + f", prompt_grad {run.prompt_grad}, state_grad_on_host "
            f"{run.state_grad_on_host}, offload_policy {run.offload_policy}, optimizer_offload "
            f"{run.optimizer_offload}, {str(run.param_dtype)[6:]} params / {str(run.reduce_dtype)[6:]} reduce, "
            f"gradient checkpointing {run.checkpointing}"
            + (f", LoRA rank {run.lora.rank} on {run.lora.target_modules}" if run.lora.rank else "")
            + (f", {VERL_DTYPE_NAMES[run.model_dtype]} model" if run.model_dtype != torch.float32 else "")
            + (", expert parallelism over the CP group" if run.expert_parallel else "")
            + (", state_on_host True" if run.state_on_host else ""))


def table(name: str, model: str | None = None, gpu_gb: float | None = None) -> str:
    """The recipe's per-GPU table (markdown) on ``model``'s dims (the recipe's model, MODELS, by default) and GPUs
    of ``gpu_gb`` GB (the recipe's by default), headed by the model and the knobs it was computed for."""
    cfg, model = compose_recipe(name), model or MODELS[name]
    gpu_bytes = gpu_gb * 1e9 if gpu_gb else GPU_BYTES[name]
    nodes = f"{cfg.trainer.nnodes} x {cfg.trainer.n_gpus_per_node} GPUs of {gpu_bytes / 1e9:g} GB"
    knobs = describe(recipe_training(cfg))
    return f"{model} ({name}, {nodes}): {knobs}.\n\n{markdown(memory(name, cfg, model, gpu_bytes))}"


def sweep(name: str, model: str | None = None, gpu_gb: float | None = None) -> str:
    """The recipe's step on ``model``'s dims and GPUs (as ``table``) under the knobs of ``SWEEPS[name]``: device peak
    and host per rank (markdown); for a model with routed experts both under FSDP2 alone and under expert
    parallelism over the CP group (n/a with one rank per group)."""
    cfg, model = compose_recipe(name), model or MODELS[name]
    gpu_bytes = gpu_gb * 1e9 if gpu_gb else None
    layouts = [False, True] if _parameters(model, Lora()).expert_total else [None]  # None: the recipe's

    def columns(change: dict, expert_parallel: bool | None) -> str:
        if expert_parallel is None:
            m = memory(name, cfg, model, gpu_bytes, **change)
        elif expert_parallel and change.get("cp_size", recipe_training(cfg).cp_size) < 2:
            return "n/a | n/a | n/a | n/a"
        else:
            m = memory(name, cfg, model, gpu_bytes, **change, expert_parallel=expert_parallel)
        state_host = f"{m.state_host * m.gpus_per_node / GIB:.2f}" if m.state_host else "-"
        return f"{m.peak / GIB:.2f} | {m.host / GIB:.2f} | {state_host} | {'yes' if m.peak <= m.gpu_bytes else 'no'}"

    header = "device peak GiB | host GiB per rank | prompt state on the host (state_on_host), GiB per node | fits"
    heads = [header] if layouts == [None] else [f"FSDP2 alone: {header}", f"expert parallelism over the CP group: "
                                                                          f"{header}"]
    lines = [f"{model} ({name}), changed from the recipe's knobs:", "",
             f"| knobs | {' | '.join(heads)} |", "|---|" + "---:|---:|---:|---|" * len(heads)]
    for change in [{}, *SWEEPS[name]]:
        knobs = ", ".join(f"{k}={v}" for k, v in change.items()) or "(the recipe)"
        lines.append(f"| {knobs} | {' | '.join(columns(change, layout) for layout in layouts)} |")
    return "\n".join(lines)


def command_line() -> argparse.ArgumentParser:
    """The command line of this script (a README block's opening comment holds one, without ``--write``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", default=sorted(MODELS), help="recipe overlay names (all by default)")
    parser.add_argument("--sweep", action="store_true", help="the step under other knobs instead of the table")
    parser.add_argument("--model", choices=sorted(CONFIGS), help="these dims instead of each recipe's model")
    parser.add_argument("--gpu-gb", type=float, help="GPUs of this many GB instead of each recipe's")
    parser.add_argument("--write", action="store_true", help="rewrite the blocks of recipes/clusters/*/README.md")
    return parser


def output(args: argparse.Namespace) -> str:
    """What the command line ``args`` prints: each recipe's table, or sweep with ``--sweep``."""
    return "\n\n".join((sweep if args.sweep else table)(name, args.model, args.gpu_gb) for name in args.recipes)


@cache
def rendered(args: str) -> str:
    """The output of ``memory_table.py ARGS`` (one recipe), as a README block holds it (once per process)."""
    return output(command_line().parse_args(args.split()))


def rewrite(text: str) -> str:
    """``text`` with every README block's body replaced by its command's current output."""
    return BLOCK.sub(lambda m: m["head"] + rendered(m["args"]) + "\n" + m["tail"], text)


def main() -> None:
    args = command_line().parse_args()
    if args.write:
        for readme in sorted(CLUSTERS.glob("*/README.md")):
            readme.write_text(rewrite(readme.read_text()))
        return
    print(output(args))


if __name__ == "__main__":
    main()
