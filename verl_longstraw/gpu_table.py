"""Per-GPU memory of one training step on rank 0 of a context-parallel (CP) group, as numbers: the model terms of
veRL's FSDP2 (and expert parallelism) beside the walk estimate's group terms.

``gpu_table`` sums ``model_terms`` (parameter and gradient shards, AdamW moments, the unsharded units, the routed
experts' resident shards) and ``estimate.estimate_memory`` (the prompt state, its gradient sums, the saves and
transients of the peak's step) into ``GpuTable``: labelled rows of (item, device bytes, host bytes), the device
peak (the moment whose walk bytes and FSDP2 unsharded units are the most together: a decoder layer's backward, a
scoring, a no-grad capture; ``model_terms.unsharded_moments``), the host bytes, the engine pre-flight's figure and the
device bytes at AdamW's step. The dry run (``verl_longstraw.dryrun``) compares its measured FSDP2 step with ``peak``
and ``optimizer_step``; the cluster recipes' tables (``recipes/clusters/memory_table.py``) render the rows as markdown.
"""

from __future__ import annotations

from dataclasses import dataclass

from .adapters import Adapter, adapter_on_meta
from .estimate import GIB, MemoryEstimate, estimate_memory
from .model_terms import (
    VERL_DTYPE_NAMES,
    ExpertShardBytes,
    ParameterCounts,
    Training,
    UnshardedMoments,
    expert_shard_bytes,
    parameter_counts,
    unsharded_bytes,
    unsharded_moments,
)
from .plan import chain_bounds


@dataclass(frozen=True)
class GpuTable:
    """Per-GPU memory of one training step on rank 0 of a CP group (the rank with the most rows), in bytes:
    ``rows`` of (item, device bytes, host bytes); ``peak`` the device total at the group's peak, ``host`` the host
    bytes per rank, ``preflight`` what the engine's pre-flight check compares with the device's free memory at the
    start of a step: the group terms, the unsharded units and, under expert parallelism, the expert shards' gradients
    (the resident shards are already outside the free memory); ``optimizer_step`` the device bytes at AdamW's step
    (after the walks: ``gpu_table``); ``gpu_bytes`` and ``gpus_per_node``: the GPUs' memory and the ranks per node
    the figures are for; ``state_host``: of ``host``, the prompt state's rows (``state_on_host``)."""

    rows: tuple[tuple[str, int, int], ...]
    peak: int
    host: int
    preflight: int
    gpu_bytes: int
    gpus_per_node: int
    optimizer_step: int = 0
    state_host: int = 0  # of ``host``: the prompt state's rows that ``state_on_host`` keeps there
    walk_at_peak: int = 0  # of ``peak``: the walk's bytes at the peak's moment (``MemoryEstimate.layer_peak_bytes``)


def gpu_table(
    config,
    run: Training,
    gpu_bytes: int,
    gpus_per_node: int = 8,
    adapter: Adapter | None = None,
    params: ParameterCounts | None = None,
) -> GpuTable:
    """Per-GPU memory of ``run`` for ``config``'s model on GPUs of ``gpu_bytes``: the model terms of FSDP2
    sharding over the R ranks of a CP group (``parameter_counts``), under ``run.expert_parallel`` of the routed
    experts' resident shards (``expert_shard_bytes``) and FSDP2 over the rest, and the group terms of
    ``estimate_memory`` (checkpointed when ``run.checkpointing``). ``adapter``/``params``:
    ``adapters.adapter_on_meta(config)`` and ``parameter_counts(config)`` when already built. The unsharded-gradient
    row is the most FSDP2's backward holds at once (the largest unit's gradients and its reduce-scatter input,
    ``model_terms.unsharded_bytes``). Not counted: the CUDA
    context, NCCL buffers, allocator fragmentation and the no-grad capture's transients (the pre-flight row's
    ``total_bytes`` counts them). ``optimizer_step``: at AdamW's step (torch's foreach implementation, which
    DTensors take) the device holds the parameter and gradient shards of what trains, its two moments (those that
    ``optimizer_offload`` keeps on the host come back for it, as veRL loads them) and one moment-sized temporary
    (``_foreach_sqrt`` of the second moment), the frozen shards and the buffers beside them; none of it with
    ``offload_policy``, whose step runs on the host, but for the expert shards (outside FSDP2) and the buffers."""
    adapter = adapter if adapter is not None else adapter_on_meta(config)
    n, r, ep = params if params is not None else parameter_counts(config, run.lora), run.cp_size, run.expert_parallel
    dtype, width = VERL_DTYPE_NAMES[run.model_dtype], run.model_dtype.itemsize
    fsdp_total = n.total - (n.expert_total if ep else 0)  # what FSDP2 shards
    shard = width * n.shard(r, ep)  # rank 0's: about N / R (ceil per parameter)
    trained_shard = width * n.trainable.shard(r, ep)
    lora = run.lora.rank > 0
    pair = n.largest_pair_without_experts if ep else n.largest_pair
    unsharded, grads = unsharded_bytes(n, r, run.param_dtype, run.reduce_dtype, training=True, expert_parallel=ep)
    experts = expert_shard_bytes(n, r, run.model_dtype) if ep else ExpertShardBytes(0, 0, 0)
    e = estimate_memory(config, run.prompt_len, run.group_size, run.response_len, run.chunk_size, run.prompt_grad,
                        run.param_dtype, adapter, r, run.state_grad_on_host, checkpointed=run.checkpointing,
                        replay_tokens=run.replay_tokens, expert_parallel=ep,
                        response_chunk_size=run.response_chunk_size, state_on_host=run.state_on_host)
    preflight = e.total_bytes + unsharded + grads + experts.gradients  # the engine's pre-flight figure
    moment, walk, (unsharded, grads) = _peak_moment(e, unsharded_moments(
        n, config.num_hidden_layers, r, run.param_dtype, run.reduce_dtype, expert_parallel=ep))

    def where(on_host: bool, nbytes: int) -> tuple[int, int]:
        return (0, nbytes) if on_host else (nbytes, 0)

    replay_peak = e.replay_saved_bytes >= e.prompt_backward_saved_bytes
    replayed = (f"one {run.response_len}-token response" if e.replay_batch == 1
                else f"a batch of {e.replay_batch} {run.response_len}-token responses")
    segments = chain_bounds(0, run.response_len, run.response_chunk_size, run.cp_size)
    if len(segments) > 1:  # the chain's last segment is the leaf replayed; the others are captured and recomputed
        replayed = (f"the last {segments[-1][1] - segments[-1][0]} tokens of a {run.response_len}-token response "
                    f"(response_chunk_size {run.response_chunk_size})")
    mode = "checkpointed" if run.checkpointing else "no checkpointing"
    held = e.backward_peak_saved_bytes
    marker = (" <- peak" + (f", of which held at the walk's peak moment {held / GIB:.2f}" if held is not None else ""))
    sharded = "N_FSDP" if ep else "N"
    if lora:
        training_rows = (
            (f"{dtype} gradient shards of the LoRA adapters: {width} B x N_LoRA / R (N_LoRA = "
             f"{n.trainable.total / 1e6:.1f}e6, rank {run.lora.rank}; the base is frozen)",
             *where(run.offload_policy, trained_shard)),
            (f"AdamW moments of the LoRA adapters: {2 * width} B x N_LoRA / R",
             *where(run.offload_policy or run.optimizer_offload, 2 * trained_shard)),
            ("reference policy: the actor with its LoRA adapters disabled (no copy)", 0, 0),
        )
    else:
        training_rows = (
            (f"{dtype} gradient shards: {width} B x {sharded} / R", *where(run.offload_policy, shard)),
            (f"AdamW moments: {2 * width} B x {sharded} / R",
             *where(run.offload_policy or run.optimizer_offload, 2 * shard)),
            ("reference model shards: 2 B x N / R (veRL keeps forward-only models on the host)", 0, 2 * n.total // r),
        )
    if not ep:
        expert_rows = ()
        parameters = f"N = {n.total / 1e9:.2f}e9 parameters, R = {r}"
    else:
        parameters = (f"N = {n.total / 1e9:.2f}e9 parameters, of which N_E = {n.expert_total / 1e9:.2f}e9 in routed "
                      f"experts outside FSDP2: N_FSDP = {fsdp_total / 1e9:.2f}e9, R = {r}")
        resident = (f"routed-expert shards (expert parallelism): {width} B x N_E / R in {dtype}, resident (E / R "
                    "experts of each MoE layer)")
        if n.trainable.expert_total:
            expert_rows = (
                (resident, experts.parameters, 0),
                (f"their gradients: {width} B x N_E / R (each the whole group's)", experts.gradients, 0),
                (f"AdamW moments of the expert shards: {2 * width} B x N_E / R",
                 *where(run.optimizer_offload, experts.moments)),
            )
        else:
            expert_rows = ((resident + "; frozen: no gradients or moments", experts.parameters, 0),)
    rows = (
        (f"{dtype} parameter shards: {width} B x {sharded} / R ({parameters})", *where(run.offload_policy, shard)),
        *training_rows,
        *expert_rows,
        (f"unsharded parameters at the peak's moment ({moment}): at most two consecutive FSDP units"
         f"{' less their routed experts' if ep else ''} (the largest pair: {pair / 1e9:.2f}e9 parameters) in "
         f"{str(run.param_dtype)[6:]}", unsharded, 0),
        (f"unsharded gradients ({str(run.param_dtype)[6:]}) at that moment{' less routed experts' if ep else ''} and "
         f"the {str(run.reduce_dtype)[6:]} reduce-scatter inputs FSDP2 holds then", grads, 0),
        (f"prompt state: rank 0's rows of the {run.prompt_len}-token prompt + fixed-size states (of which "
         f"chunk-boundary copies {e.boundary_bytes / GIB:.2f})" + (
             "; state_on_host: all of it pinned on the host, two layers' state on the device"
             if run.state_on_host else ""), e.state_bytes, e.host_state_bytes),
        ("float32 state-gradient sums" + (" (state_grad_on_host: pinned, with a staging buffer of the largest state "
                                          "tensor)" if run.state_grad_on_host else ""),
         e.device_state_grad_bytes, e.host_bytes - e.host_state_bytes),
        ("state gradients one layer's backward hands its state (model dtype)" + (
            ", and the one whose copy to the host is in flight" if run.state_grad_on_host else ""),
         e.state_leaf_grad_bytes + e.in_flight_bytes, 0),
        ("transient of the peak's moment beyond its saves: the scoring's row chunks and head-gradient sum, or one "
         "layer's backward (its attention's fused backward: key blocks, GQA expansion, float32 dq; its MLP's; "
         "pass-Q's float32 scores of one key block" + (
             f"; an MoE layer's all-to-all of {e.layer_call_tokens} tokens, send and receive: "
             f"{e.all_to_all_bytes / GIB:.2f}" if ep else "") + ")", e.backward_peak_transient_bytes or 0, 0),
        (f"saved for backward, replay of {replayed} ({mode}; pass-Q "
         f"{e.pass_q_bytes / GIB if replay_peak else 0:.2f})" + (marker if replay_peak else ""),
         e.replay_saved_bytes, 0),
        (f"saved for backward, recompute of one {run.chunk_size}-token prompt chunk ({mode}; pass-Q "
         f"{0 if replay_peak else e.pass_q_bytes / GIB:.2f})" + ("" if replay_peak else marker),
         e.prompt_backward_saved_bytes, 0),
    )
    group_rows = 6  # the state ... recompute rows: the estimate's terms, whose peak is ``e.total_bytes``
    peak = sum(device for _, device, _ in rows[:-group_rows]) + walk
    host = sum(h for _, _, h in rows)
    fsdp_step = 0 if run.offload_policy else shard + 4 * trained_shard  # gradients, two moments, a temporary
    optimizer_step = fsdp_step + experts.parameters + 4 * experts.gradients + n.buffer_bytes
    return GpuTable(rows, peak, host, preflight, gpu_bytes, gpus_per_node, optimizer_step, e.host_state_bytes, walk)


def _peak_moment(e: MemoryEstimate, fsdp: UnshardedMoments) -> tuple[str, int, tuple[int, int]]:
    """The step's peak moment: the one whose walk bytes (``e``'s per-moment figures) and FSDP2's unsharded
    (parameters, gradients) then (``fsdp``) are the most together; returns its name, the walk's bytes and FSDP2's."""
    moments = [(f"decoder layer {j}'s backward{kind}", walk, held)
               for kind, walks, helds in ((" after a scoring", e.layer_peak_bytes, fsdp.layers),
                                          ("", e.unscored_layer_peak_bytes, fsdp.unscored_layers))
               for j, (walk, held) in enumerate(zip(walks, helds, strict=True))]
    if moments:
        moments += [("a backward step's scoring or embedding", e.ends_peak_bytes, fsdp.ends),
                    ("a no-grad capture", e.capture_peak_bytes, fsdp.forward)]
    else:  # a walk without a backward step: its total beside the most FSDP2 holds
        moments = [("the walk's peak", e.total_bytes, fsdp.ends)]
    return max(moments, key=lambda moment: moment[1] + sum(moment[2]))
