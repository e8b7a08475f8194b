"""The `longstraw` engine backend: veRL's FSDP2 engine with capture-once, replay-per-response passes.

Model building, FSDP2 wrapping, offload, checkpoints, the reference model and weight export
are veRL's (`FSDPEngineWithLMHead`). Only the computation of a `forward_backward_batch` call differs:

- the unit of work: the rows of the whole call (this rank's share of a mini-batch: all of veRL's micro-batches)
  form prefix trees (`regroup.prefix_trees`: one per sampling temperature; the plan shares every prefix of at least
  `longstraw.min_shared_tokens` tokens, whatever produced it: a GRPO group's prompt, a system prompt across groups,
  per-turn samples, branched rollouts), run by `tree_log_probs` / `tree_backward`, under context parallelism by
  the R ranks of the CP group together. Only where the pre-flight estimate says such a walk would not fit are the
  micro-batches' own trees walked instead. veRL's micro-batches still set each row's loss term: the loss function
  is called per micro-batch, as veRL's loop calls it.
- forward (log-probs): one log-prob walk per unit, returned as veRL's nested `log_probs`/`entropy` over
  prompt + response.
- training: one replay per response, or two passes (`losses`: the `LossStrategy` of a call).

Context and expert parallelism (`longstraw.context_parallel_size`, `longstraw.expert_parallel`) are applied at veRL's
hooks by `parallelize`: the ("dp", "cp") mesh, the experts split over the CP group, the loss scaled by R and the
experts' gradients divided back. The metrics of a call are `metrics`'.

Before the first capture of a step, a pre-flight check compares the estimate of the step's largest
unit (`verl_longstraw.estimate.estimate_plan` of its plan) with `longstraw.memory_budget_gb` or the device's free
memory (`verl_longstraw.preflight.choose_units`).
"""

import copy
import functools
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name, get_torch_device
from verl.utils.metric import Metric
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

from verl_longstraw import GroupResult, GroupStats, tree_backward, tree_log_probs
from verl_longstraw.adapters import Adapter, adapter_for, model_on_meta
from verl_longstraw.estimate import GIB, MemoryEstimate, estimate_plan
from verl_longstraw.model_terms import ParameterCounts, count_units, expert_shard_bytes, unsharded_bytes
from verl_longstraw.parallel import comm, experts
from verl_longstraw.parallel.fsdp2 import average_over_replicas, held_unsharded, sync_gradients
from verl_longstraw.plan import Plan, tree_plan
from verl_longstraw.preflight import Budget, choose_units, over_budget

from . import metrics, parallelize
from .config import STRATEGY, as_longstraw_config, check_supported, unserved_role_error
from .losses import LossStrategy, SingleForward, UnitLoss, UnitWalks, loss_strategy
from .regroup import Tree, WalkRows, check_positions, prefix_trees, sample_uids


@EngineRegistry.register(model_type="language_model", backend=STRATEGY, device=["cuda", "npu", "cpu"])
class LongStrawEngine(FSDPEngineWithLMHead):
    """FSDP2 engine whose forward/backward captures each prompt once and replays its responses."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        self.longstraw = as_longstraw_config(getattr(engine_config, "longstraw", None))
        check_supported(engine_config, where="engine")
        if self.longstraw.context_parallel_size > 1:  # a family without a sharded form: refused before building
            meta = model_on_meta(model_config.hf_config)
            adapter_for(meta).check_context_parallel(self.longstraw.context_parallel_size)
            if self.longstraw.expert_parallel:  # an old transformers, no plan, experts not divisible by R
                experts.check_expert_parallel(meta, self.longstraw.context_parallel_size)
        # veRL's FSDP engine builds only for fsdp/fsdp2 (it reads engine_config.strategy).
        engine_config = copy.copy(engine_config)
        object.__setattr__(engine_config, "strategy", "fsdp2")
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)

    @property
    def _device(self) -> str:
        device_id = get_device_id()
        return str(device_id) if get_device_name() == "cpu" else f"{get_device_name()}:{device_id}"

    # ---- context and expert parallelism (``parallelize``): what veRL's worker dispatches by ----

    @property
    def cp_size(self) -> int:
        return self.longstraw.context_parallel_size

    def _init_device_mesh(self):
        """veRL's meshes; with context parallelism also the ("dp", "cp") mesh, and FSDP's mesh becomes
        the CP group (shard inside it; CP groups are replicas, averaged by `average_over_replicas`)."""
        super()._init_device_mesh()
        self.cp_mesh = parallelize.context_parallel_mesh(self.cp_size, self.engine_config.fsdp_size)
        if self.cp_mesh is not None:
            self.device_mesh = self.cp_mesh["cp"]

    def _build_fsdp_module(self, module):
        """veRL's FSDP2 wrapping and weight loading; with ``longstraw.expert_parallel`` the routed experts split
        over the CP mesh (FSDP2's mesh) outside it (``parallelize.build_expert_parallel``)."""
        if not self.longstraw.expert_parallel:
            return super()._build_fsdp_module(module)
        return parallelize.build_expert_parallel(module, self.device_mesh, super()._build_fsdp_module)

    def get_data_parallel_rank(self):
        return super().get_data_parallel_rank() if self.cp_mesh is None else self.cp_mesh["dp"].get_local_rank()

    def get_data_parallel_size(self):
        return super().get_data_parallel_size() // self.cp_size

    def get_data_parallel_group(self):
        return super().get_data_parallel_group() if self.cp_mesh is None else self.cp_mesh.get_group("dp")

    def get_context_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """The CP group of this rank (R consecutive ranks), None without context parallelism."""
        return None if self.cp_mesh is None else self.cp_mesh.get_group("cp")

    def is_mp_src_rank_with_outputs(self):
        return self.cp_mesh is None or self.cp_mesh["cp"].get_local_rank() == 0

    def _autocast(self):
        dtype = self._compute_dtype()
        if dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=get_device_name(), dtype=dtype)

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False) -> dict:
        """Same contract as veRL's FSDP engine: veRL's micro-batches (``prepare_micro_batches``), each one's loss
        evaluated by ``loss_function`` on that micro-batch, one output per micro-batch.

        The walk is not per micro-batch: the rows of the whole call (this rank's share of a mini-batch, or of a
        log-prob batch) form one set of prefix trees (``_walk_units``), split into the micro-batches' trees only
        where the pre-flight estimate says one walk would not fit (``_preflight``). Each row's loss term is the one
        its micro-batch gives it (veRL's loss is called per micro-batch with that row live), so every policy loss
        and ``loss_agg_mode`` gets veRL's micro-batched gradient, normalisers local to a micro-batch included.

        Parameters are held unsharded for the walk and gradients reduce-scattered once at its end. Context
        parallel: FSDP2's per-layer hooks run as configured, each backward reduce-scatters in the CP group, and the
        CP groups (replicas) average their gradient shards once at the end. Resets the device's peak-memory counter
        first, so `longstraw/peak_memory_gb` (and veRL's `perf/max_memory_*` read after it) cover this call only.
        """
        get_torch_device().reset_peak_memory_stats()
        tu.assign_non_tensor(data, sp_size=1)
        if "loss_mask" in data.keys():
            batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
            torch.distributed.all_reduce(
                batch_num_tokens, op=torch.distributed.ReduceOp.SUM, group=self.get_data_parallel_group()
            )
            tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        uids = sample_uids(data)
        micro_batches, indices = prepare_micro_batches(
            data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True
        )
        walk = WalkRows([mb.to(get_device_id()) for mb in micro_batches])
        for micro_batch in walk.micro_batches:
            self._check_request(micro_batch)
            check_positions(micro_batch)
        strategy = self._loss_strategy(loss_function, forward_only)
        star_tokens = metrics.star_tokens_forwarded(walk.micro_batches, strategy.modes, self.longstraw.knobs,
                                                    self.cp_size, comm.group_rank(self.get_context_parallel_group()))
        units, preflight = self._preflight(self._walk_units(walk), forward_only)
        walk_metrics: dict[str, Metric] = {}
        stats = GroupStats()
        training_experts = self.longstraw.expert_parallel and not forward_only
        expert_gradients = parallelize.expert_gradients(self.module) if training_experts else {}
        started = time.perf_counter()
        with held_unsharded(self.module) if self.cp_mesh is None else nullcontext():
            outputs = self._walk(walk, units, loss_function, strategy, stats, walk_metrics)
            if self.cp_mesh is None and not forward_only:
                sync_gradients(self.module, self._device, self._compute_dtype())
        seconds = time.perf_counter() - started
        if self.cp_mesh is not None:
            parallelize.unscale_expert_gradients(expert_gradients, self.cp_size)
            if not forward_only and self.get_data_parallel_size() > 1:
                average_over_replicas(self.module, self.get_data_parallel_group())
        result = postprocess_batch_func(output_lst=outputs, indices=indices, data=data)
        walk_metrics.update(metrics.call_metrics(walk, uids, stats.model_flops, seconds, star_tokens, preflight))
        result["metrics"].update(walk_metrics)
        return result

    def _loss_strategy(self, loss_function: Optional[Callable], forward_only: bool) -> LossStrategy:
        """The call's ``losses.LossStrategy`` (``losses.loss_strategy``), walking units as this engine does."""
        walks = UnitWalks(self._unit_log_probs, self._unit_backward, self._autocast, self._scale_loss,
                          self.get_data_parallel_group())
        return loss_strategy(walks, loss_function, forward_only, self.longstraw.single_forward,
                             self.longstraw.knobs.prompt_grad)

    def _unit_plan(self, unit: Tree) -> Plan:
        """This rank's plan of a prefix tree with the engine's knobs (``plan.tree_plan``), built once per step and
        kept on the unit: the pre-flight estimate and every walk of the step read it (passed as ``plan=``)."""
        if unit.plan is None:
            unit.plan = tree_plan(unit.sequences, unit.score_starts, self.longstraw.knobs, self.cp_size,
                                  comm.group_rank(self.get_context_parallel_group()))
        return unit.plan

    def _walk_units(self, walk: WalkRows) -> list[Callable[[], list[Tree]]]:
        """The units of this call's walk, in the order the pre-flight check tries them, each made when tried: the
        prefix trees of all its rows, then each micro-batch's trees."""

        def per_micro_batch() -> list[Tree]:
            return [t for m, mb in enumerate(walk.micro_batches) for t in prefix_trees([mb], walk.first[m])]

        return [lambda: prefix_trees(walk.micro_batches), per_micro_batch]

    @functools.cached_property
    def _unit_counts(self) -> ParameterCounts:
        """Parameters per FSDP2 unit (fixed once the model is built)."""
        return count_units(self.module)

    @functools.cached_property
    def _expert_dtype(self) -> torch.dtype:
        """The dtype of the expert-parallel experts' shards and gradients (the model's: outside FSDP2's mixed
        precision)."""
        return next(iter(experts.expert_parameters(self.module))).dtype

    def _compute_dtype(self) -> torch.dtype:
        return getattr(self, "_autocast_dtype", torch.bfloat16)

    def _preflight(self, candidates: list[Callable[[], list[Tree]]], forward_only: bool) -> tuple[list[Tree], int]:
        """The units this rank walks, and its step's estimated device bytes (``preflight.choose_units``): the
        largest unit's estimate (`estimate_plan` of the unit's plan, crediting veRL's gradient checkpointing when
        it is on) plus the parameters and gradients it holds unsharded (`model_terms.unsharded_bytes`), against
        `longstraw.memory_budget_gb` or the device's free memory (no check without `longstraw.preflight`).
        ``candidates``: ``_walk_units``'s."""
        reduce_dtype = PrecisionType.to_dtype((self.engine_config.mixed_precision or {}).get("reduce_dtype", "fp32"))
        expert_parallel = self.longstraw.expert_parallel
        params, grads = unsharded_bytes(self._unit_counts, self.cp_size, self._compute_dtype(), reduce_dtype,
                                        training=not forward_only, expert_parallel=expert_parallel)
        model_bytes = params + grads
        if expert_parallel and not forward_only:  # the expert shards' gradients (the shards are resident)
            model_bytes += expert_shard_bytes(self._unit_counts, self.cp_size, self._expert_dtype).gradients
        adapter = adapter_for(self.module)
        verdict = None
        if self.longstraw.preflight:
            def verdict(unit: Tree, estimate: MemoryEstimate) -> Optional[str]:
                return self._over_budget(unit, estimate, model_bytes)
        return choose_units(candidates, lambda unit: self._estimate(adapter, unit, forward_only), model_bytes, verdict)

    def _over_budget(self, unit: Tree, estimate: MemoryEstimate, model_bytes: int) -> Optional[str]:
        """Why ``unit``'s walk does not fit (``preflight.over_budget``: ``estimate`` plus ``model_bytes`` against
        `longstraw.memory_budget_gb` or the device's free memory, naming the knobs); None when it fits."""
        budget_gb = self.longstraw.memory_budget_gb
        budget = (Budget(int(budget_gb * GIB), "longstraw.memory_budget_gb") if budget_gb is not None
                  else Budget(_free_device_bytes(), "free device memory"))
        held = "two FSDP units" if self.cp_size > 1 else "the whole model (held for the walk at R = 1)"
        return over_budget(estimate, model_bytes, budget, lambda: _describe(unit), held, PREFLIGHT_KNOBS)

    def _estimate(self, adapter: Adapter, unit: Tree, forward_only: bool) -> MemoryEstimate:
        """The memory estimate of one unit's walk on this rank with the engine's knobs and compute dtype (a
        forward-only step is sized as a detached one, which holds more than a log-prob walk)."""
        knobs = self.longstraw.knobs
        return estimate_plan(
            adapter.config, self._unit_plan(unit), "detached" if forward_only else knobs.prompt_grad,
            self._compute_dtype(), adapter=adapter, state_grad_on_host=knobs.state_grad_on_host,
            checkpointed=self.model_config.enable_gradient_checkpointing and not forward_only,
            device_type=get_device_name(), expert_parallel=self.longstraw.expert_parallel,
            state_on_host=knobs.state_on_host,
        )

    def _walk(self, walk: WalkRows, units: list[Tree], loss_function: Optional[Callable], strategy: LossStrategy,
              stats: GroupStats, walk_metrics: dict[str, Metric]) -> list[dict]:
        """Log-probs (and entropy) of every row of ``walk`` (on the device) by walking ``units``, each micro-batch's
        loss, and, when training, the gradient, as ``strategy`` takes them (``losses``). Returns veRL's
        per-micro-batch outputs (loss, its metrics, the model output when asked); what the walks cost is recorded
        into ``stats``, the walk's own metrics (``metrics.walk_metrics``) go into ``walk_metrics``. The backward has
        already run when this returns: the returned losses are detached values."""
        first = walk.micro_batches[0]
        calculate_entropy = tu.get_non_tensor_data(data=first, key="calculate_entropy", default=False)
        return_model_output = tu.get_non_tensor_data(data=first, key="return_model_output", default=False)
        with (comm.trace_collectives() as collectives,
              parallelize.trace_experts(self.longstraw.expert_parallel) as expert_bytes):
            log_probs, entropy = strategy.walk(units, walk, loss_function, calculate_entropy, stats)
            outputs, loss_grads = [], []
            for m, micro_batch in enumerate(walk.micro_batches):
                rows = walk.of(m)
                output, grads = strategy.micro_batch_loss(
                    micro_batch, [log_probs[row] for row in rows],
                    None if entropy is None else [entropy[row] for row in rows], loss_function, return_model_output)
                outputs.append(output)
                loss_grads.append(grads)
            strategy.backward(units, loss_grads, stats)
        single = None if strategy.forward_only else isinstance(strategy, SingleForward)
        walk_metrics.update(metrics.walk_metrics(stats, len(units), single, collectives, expert_bytes))
        return outputs

    def _check_request(self, micro_batch: TensorDict) -> None:
        for key in ("use_fused_kernels", "calculate_sum_pi_squared", "distillation_use_topk"):
            if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
                raise ValueError(f"strategy=longstraw does not support {key}=True; turn it off for this actor.")

    def _unit_log_probs(self, unit: Tree, with_entropy: bool, stats: GroupStats) -> GroupResult:
        """The log-prob walk of one unit's plan (``_unit_plan``) with the engine's knobs and CP group."""
        return tree_log_probs(
            self.module, unit.sequences, unit.score_starts, temperature=unit.temperature,
            return_entropy=with_entropy, stats=stats, cp_group=self.get_context_parallel_group(),
            knobs=self.longstraw.knobs, plan=self._unit_plan(unit),
        )

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss each rank backpropagates (``parallelize.scale_loss``: veRL's gradient scaler, times R)."""
        return parallelize.scale_loss(loss, getattr(self, "scaler", None), self.cp_size)

    def _unit_backward(self, unit: Tree, loss_fn: UnitLoss, with_entropy: bool, stats: GroupStats) -> GroupResult:
        """The backward walk of one unit's plan (``_unit_plan``) with the engine's knobs, CP group and compute
        dtype."""
        with self._autocast():
            return tree_backward(
                self.module, unit.sequences, unit.score_starts, loss_fn, temperature=unit.temperature,
                with_entropy=with_entropy, stats=stats, cp_group=self.get_context_parallel_group(),
                knobs=self.longstraw.knobs, plan=self._unit_plan(unit),
            )


@EngineRegistry.register(model_type="value_model", backend=STRATEGY, device=["cuda", "npu", "cpu"])
class LongStrawValueModel(BaseEngine):
    """Not an engine: makes `critic.strategy=longstraw` (veRL builds critics as model type
    "value_model") fail naming the fix, not with veRL's bare "Unknown backend: longstraw"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unserved_role_error("critic.strategy")


PREFLIGHT_KNOBS = ("The knobs are actor_rollout_ref.actor.longstraw.{chunk_size, response_chunk_size, "
                   "context_parallel_size, state_grad_on_host, prompt_grad, replay_tokens, memory_budget_gb}; "
                   "longstraw.preflight=false skips this check.")


def _describe(unit: Tree) -> str:
    """What a unit is, for an error message: its rows and lengths."""
    return (f"the prefix tree of {len(unit.rows)} rows (longest {max(len(s) for s in unit.sequences)} tokens, "
            f"prompts of {min(unit.score_starts)}-{max(unit.score_starts)} tokens)")


def _free_device_bytes() -> int:
    """Bytes the step may still take on this device: free device memory plus what the caching
    allocator holds unused (on the CPU platform: the host's available memory)."""
    device = get_torch_device()
    free, _ = device.mem_get_info()
    return int(free) + max(int(device.memory_reserved()) - int(device.memory_allocated()), 0)
