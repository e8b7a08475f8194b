#!/usr/bin/env bash
# Dry runs of the cluster recipes' shapes on fake CUDA tensors (python -m verl_longstraw.dryrun), each one raw output
# file under benchmarks/results/dryrun/ headed by its command, the date and this CPU (lscpu's model name): a dry run,
# not a GPU measurement. The 4-layer runs take under a minute on a 2-core CPU; the full 64 layers about 5.5 (2.1M,
# detached, beside other work), 8 (4.46M, detached) and 11.5 (2.1M, exact) minutes.
#
#   bash benchmarks/dryrun.sh            # every run below
#   bash benchmarks/dryrun.sh NAME ...   # the named ones
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PY:-.venv-cpu/bin/python}"
OUT=benchmarks/results/dryrun
RECIPE_27B=(--model Qwen3.5-27B --prompt-len 2097152 --chunk-size 65536 --cp-size 8 --checkpointed)
declare -A RUNS=(
    # qwen35_27b_1m: 2^21-token prompt, G = 8 x 8192, 8 ranks of 96 GB, exact, state gradients on the host
    [qwen35_27b_2m_exact]="${RECIPE_27B[*]} --state-grad-on-host"
    [qwen35_27b_2m_detached]="${RECIPE_27B[*]} --prompt-grad detached"
    # the paper's 4.46M with the prompt frozen (detached), 8 ranks
    [qwen35_27b_4m_detached]="--model Qwen3.5-27B --prompt-len 4456448 --chunk-size 65536 --cp-size 8 --checkpointed --prompt-grad detached"
    # the longest prompt the qwen35_27b_1m step fits exact on 8 x 96 GB by the estimate (the recipe's knobs); 269
    # steps, about 30 quiet minutes at the 2.1M exact run's rate (not yet run to its end)
    [qwen35_27b_longest_exact]="--model Qwen3.5-27B --prompt-len 5832704 --chunk-size 65536 --cp-size 8 --checkpointed --state-grad-on-host"
    # Qwen3.5-397B-A17B LoRA with expert parallelism over its 16-rank CP group, as the recipe ships (balanced
    # routing); about 17 minutes beside other work
    [qwen35_397b_ep_lora]="--model Qwen3.5-397B-A17B --recipe qwen35_397b_ep_lora"
    # its first 4 layers (3 Gated DeltaNet, 1 full attention): about a minute
    [qwen35_397b_ep_lora_4layers]="--model Qwen3.5-397B-A17B --recipe qwen35_397b_ep_lora --layers 4"
    # GLM-5.2 LoRA with EP = CP = 32 as the recipe ships, first 4 layers (3 dense, 1 MoE; 2 run the DSA indexer,
    # 2 share it) at a 2^18-token prompt: the full recipe does not finish on a CPU (README: the DSA scorer's op count)
    [glm52_ep_lora_4layers_256k]="--model GLM-5.2 --recipe glm52_ep_lora --layers 4 --prompt-len 262144"
    # its first 4 layers (3 Gated DeltaNet, 1 full attention): under a minute each
    [qwen35_27b_4layers_2m_exact]="${RECIPE_27B[*]} --layers 4 --state-grad-on-host"
    [qwen35_27b_4layers_2m_detached]="${RECIPE_27B[*]} --layers 4 --prompt-grad detached"
    # the same layers at 8M positions on 8 ranks (the config's 2^23 positions: a prompt of 2^23 - 8192 and 8192-token
    # responses), exact with the sums on the host: what breaks only at millions of positions (int32 indexing,
    # 2^31-element tensors, chunk counts) shows in these layers' ops
    [qwen35_27b_4layers_8m_exact]="--model Qwen3.5-27B --layers 4 --prompt-len 8380416 --chunk-size 65536 --cp-size 8 --checkpointed --state-grad-on-host"
    # state_on_host (issue 42): the recipes as they ship (FSDP2 + AdamW), the rows in (fake) pinned host memory;
    # 2.1M on 4 ranks of 96 GB, and the 8M recipe's first 4 layers on 8 (its 64 layers: hours on a 2-core CPU)
    [qwen35_27b_2m_4gpu_host]="--model Qwen3.5-27B --recipe qwen35_27b_2m_4gpu_host"
    [qwen35_27b_8m_host_4layers]="--model Qwen3.5-27B --recipe qwen35_27b_8m_host --layers 4"
    # the walks alone of the 4-rank shape's first 4 layers, the knob off and on: whether the 4-rank estimate's excess
    # is the knob's (about a minute each)
    [qwen35_27b_4layers_2m_4ranks]="--model Qwen3.5-27B --prompt-len 2097152 --chunk-size 65536 --cp-size 4 --checkpointed --state-grad-on-host --layers 4 --no-fsdp2"
    [qwen35_27b_4layers_2m_4ranks_host]="--model Qwen3.5-27B --prompt-len 2097152 --chunk-size 65536 --cp-size 4 --checkpointed --state-grad-on-host --layers 4 --no-fsdp2 --state-on-host"
    # the same layers in one process at 2^18 tokens: the chunk's layer runs 8x the tokens of a CP rank's
    [qwen35_27b_4layers_256k_one_process]="--model Qwen3.5-27B --layers 4 --prompt-len 262144 --chunk-size 65536 --checkpointed --state-grad-on-host"
)
names=("$@")
((${#names[@]})) || names=(qwen35_27b_4layers_2m_exact qwen35_27b_4layers_2m_detached qwen35_27b_4layers_256k_one_process
                          qwen35_27b_2m_exact qwen35_27b_2m_detached qwen35_27b_4m_detached)
mkdir -p "$OUT"
for name in "${names[@]}"; do
    args="${RUNS[$name]:?unknown run $name (one of ${!RUNS[*]})}"
    {
        echo "# python -m verl_longstraw.dryrun $args"
        echo "# $(date -u +%Y-%m-%dT%H:%MZ); CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
        # shellcheck disable=SC2086
        "$PY" -W ignore -m verl_longstraw.dryrun $args 2>&1 || echo "# exit status $?"
    } | tee "$OUT/$name.txt"
done
