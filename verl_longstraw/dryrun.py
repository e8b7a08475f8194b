"""Dry run: what one rank does in one GRPO training step, at a real model's width, depth and length, on fake CUDA
tensors (shapes only: no GPU, no memory, no arithmetic; ``fake_cuda``), checked against the pre-flight estimate.

    python -m verl_longstraw.dryrun --model Qwen3.5-27B --prompt-len 2097152 --cp-size 8 --checkpointed
    python -m verl_longstraw.dryrun --config path/to/config.json --prompt-len 65536 --layers 4
    python -m verl_longstraw.dryrun --config /models/Qwen3.5-27B --recipe qwen35_27b_1m   # a recipe's step

The model is built on the meta device from its config (``--model``: a name of ``models.CONFIGS``; ``--config``: a
config.json) in the model dtype and its parameters become fake CUDA tensors. Rank ``--rank`` of a fake process
group of ``--cp-size`` ranks (torch's "fake" backend: collectives return at once) then runs the core walks the
engine runs for one group: the log-prob walk (``group_log_probs``, no autograd) and the update walk
(``group_backward``, exact or detached, ``--chunk-size`` chunks), as the real code does on CUDA: the attention
path each layer takes, half-precision matmuls, the kernels' own fake (meta) implementations. Token ids are real CPU
tensors, so validation, the plan and every host-side check read real data. A kernel with no fake implementation
(flash-linear-attention's Triton kernels are not installed here) is replaced by the torch reference the code falls
back to: the report names the path each kind of layer took.

Measured (``Measured``): the device bytes the walks allocate (``fake_cuda.DeviceBytes``; not the parameters, made
before, nor their gradients, which are the optimizer's: each is taken out of the peaks it was alive at, from the op
that made it, and dropped once autograd hands it over), the peak of each phase (capture / replay / recompute),
the largest tensor; the FLOPs of each phase (torch's formulas, ``fake_cuda.FakeCuda.flops``) beside ``flops.py``'s
count; the collective bytes of each phase (``parallel.comm``'s trace); its own seconds. The estimate
(``estimate.estimate_memory`` of the same walk) is printed beside, and the exit status is non-zero when the
estimate does not bound the measured peak, or the peak does not fit ``--gpu-gb``.

``--recipe NAME`` takes the step's knobs from a ``configs/recipe`` overlay as its launch.sh composes it
(``LONGSTRAW_DRY_RUN=1 bash recipes/clusters/<recipe>/launch.sh`` runs it on the model's config.json after printing
the config); a flag given beside it replaces that knob.

A progress line on stderr counts the walk steps of the plan (built once, read by both walks and the count).

LoRA (``--lora-rank``, ``--lora-targets``; a recipe's ``lora_rank``) wraps the model as veRL does
(``model_terms.Lora.wrap``: peft, the base frozen): only the adapters' gradients are made. Expert parallelism
(``--expert-parallel``; a recipe's ``longstraw.expert_parallel``) splits the routed experts over the fake CP group
as the engine does (``parallel.experts.apply_expert_parallel``: E / R per rank, tokens exchanged by transformers'
all-to-all, whose bytes each phase reports). Its one host sync per MoE layer, the per-rank split sizes, reads
routing a fake router does not have: ``routed`` answers it with balanced routing, as the estimate assumes (each
rank sends 1/R of its (token, expert) pairs to every rank), or with ``--routing-skew S`` this rank's experts
receiving S times their share from every rank. Without expert parallelism MoE layers run transformers' default
``grouped_mm`` experts, whose shapes do not depend on the routing.

``--fsdp2`` (a recipe's default) runs the whole step as the engine does: the model loaded in its ``model_dtype``,
sharded over the CP group as veRL wraps it (``parallel.fsdp2.shard_as_verl``: decoder layers, embedding and lm_head
units, mixed precision, ``offload_policy``; the routed experts outside FSDP2 under expert parallelism), the AdamW
moments a previous step left on the device, the walks, then AdamW's step; every device byte counts and the per-GPU
table (``gpu_table.gpu_table``) stands beside it. FSDP2's all-gathers and reduce-scatters are not traced per phase
(the collective column is the CP walk's), and veRL's gradient clipping (a host read of the norm) is left out.

Not in this dry run (yet): prefix trees.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from . import Knobs, fake_cuda, group_backward, group_log_probs, timemodel
from .estimate import GIB, MemoryEstimate, estimate_memory
from .gpu_table import GpuTable, gpu_table
from .model_terms import Lora, Training, recipe_training
from .models import CONFIGS
from .ops.attention.prefix import ATTENTION_PATHS
from .ops.gated_delta import rule as gated_delta_rule
from .parallel import comm, experts, fsdp2, transformers_ep
from .plan import Plan, star_plan
from .state import host
from .timing import observe_phases

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
OPTIMIZER_PHASE = "update optimizer step"  # Measured.phase_bytes' key of the optimizer step (Step.fsdp2)


@dataclass(frozen=True)
class Step:
    """The walk of one rank: a prompt of ``prompt_len`` tokens, ``group_size`` responses of ``response_len``,
    on rank ``rank`` of ``cp_size``; LoRA adapters per ``lora`` (rank 0: none); the routed experts split over the
    ranks where ``expert_parallel``, this rank's experts receiving ``routing_skew`` times their balanced share of
    the (token, expert) pairs (1: balanced; ``routed``). ``fsdp2``: the whole step as the engine runs it, the model
    loaded in ``model_dtype`` and sharded by FSDP2 over the CP group as veRL wraps it (``parallel.fsdp2.shard_as_verl``:
    computing in ``dtype``, reducing in ``reduce_dtype``, ``offload_policy``: veRL's), then AdamW's step
    (``optimizer_offload``: its moments come back to the device for it, as veRL loads them); without it the walks
    alone, on parameters of ``dtype`` whose bytes are not counted."""

    prompt_len: int
    group_size: int = 8
    response_len: int = 8192
    chunk_size: int | None = 65536
    prompt_grad: str = "exact"
    cp_size: int = 1
    rank: int = 0
    checkpointed: bool = False
    state_grad_on_host: bool = False
    state_on_host: bool = False
    dtype: torch.dtype = torch.bfloat16
    lora: Lora = Lora()
    expert_parallel: bool = False
    routing_skew: float = 1.0
    response_chunk_size: int | None = None
    fsdp2: bool = False
    model_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    offload_policy: bool = False
    optimizer_offload: bool = False

    def __post_init__(self) -> None:
        if not 1.0 <= self.routing_skew <= self.cp_size:
            raise ValueError(f"--routing-skew {self.routing_skew:g}: a rank's experts receive between their share "
                             f"(1) and every pair of the {self.cp_size} ranks ({self.cp_size}); pass a value in it")
        if self.expert_parallel and not self.lora.rank:
            raise ValueError("--expert-parallel with trainable experts (no LoRA): a CPU-only torch aborts in "
                             "autograd on a fake CUDA DTensor (transformers' expert forward takes each trainable "
                             "expert weight's local shard with autograd; C++ wants CUDA's device guard); the dry run "
                             "runs expert parallelism with LoRA (frozen experts): add --lora-rank")
        if self.routing_skew != 1.0 and not self.expert_parallel:
            raise ValueError("--routing-skew: the routing is read only under expert parallelism; add "
                             "--expert-parallel or leave the skew out")

    @property
    def knobs(self) -> Knobs:
        return Knobs(chunk_size=self.chunk_size, response_chunk_size=self.response_chunk_size,
                     prompt_grad=self.prompt_grad, state_grad_on_host=self.state_grad_on_host,
                     state_on_host=self.state_on_host)

    @property
    def training(self) -> Training:
        """The step as the per-GPU table (``gpu_table.gpu_table``) reads it."""
        return Training(self.prompt_len, self.group_size, self.response_len, self.chunk_size, self.prompt_grad,
                        self.cp_size, self.state_grad_on_host, self.offload_policy, self.optimizer_offload,
                        param_dtype=self.dtype, reduce_dtype=self.reduce_dtype, checkpointing=self.checkpointed,
                        lora=self.lora, model_dtype=self.model_dtype, expert_parallel=self.expert_parallel,
                        response_chunk_size=self.response_chunk_size, state_on_host=self.state_on_host)

    @functools.cached_property
    def plan(self) -> Plan:
        """The walk's plan on its rank (``plan.star_plan``), built once: both walks, the progress count and the time
        model read it."""
        return star_plan(self.prompt_len, [self.response_len] * self.group_size, self.knobs, self.cp_size, self.rank)


@dataclass
class Measured:
    """What the dry run measured on its rank: per phase ("log_probs capture", "update replay", ...) the peak device
    bytes alive (``phase_bytes``: the walk's own, parameters and gradients excluded; with ``Step.fsdp2`` every
    device byte of the step: shards, unsharded units, gradients, the walk), the FLOPs counted by torch
    (``phase_flops``), the collective bytes (``phase_collective_bytes``, the CP walk's) and the token bytes sent
    to the experts' all-to-alls (``phase_expert_bytes``: forward, and backward of the phase's forwards); over
    the step the peak (``peak_bytes``), the largest tensor (bytes; elements, with the op that made it),
    ``flops.py``'s count of the same walks (``model_flops``), the attention paths taken (``ATTENTION_PATHS``
    counts), the parameters that got a gradient (``trained``, by name), the host bytes (``state.host.host_memory``:
    the state-gradient sums and their staging buffer, fake host tensors counted, never allocated), with
    ``Step.fsdp2`` the device bytes at the optimizer step's peak (``optimizer_bytes``), and the seconds the dry run
    took."""

    phase_bytes: dict[str, int] = field(default_factory=dict)
    phase_flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    phase_collective_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    phase_expert_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak_bytes: int = 0
    host_peak_bytes: int = 0
    largest_tensor_bytes: int = 0
    largest_tensor_numel: int = 0
    largest_tensor_made_by: tuple | None = None
    model_flops: float = 0.0
    attention_paths: dict[str, int] = field(default_factory=dict)
    trained: set[str] = field(default_factory=set)
    optimizer_bytes: int = 0
    seconds: float = 0.0

    @property
    def walk_peak_bytes(self) -> int:
        """The most device bytes of any walk phase (the optimizer step's left out)."""
        return max(b for phase, b in self.phase_bytes.items() if phase != OPTIMIZER_PHASE)


def model_config(name_or_path: str, layers: int | None = None) -> transformers.PretrainedConfig:
    """The text config of a ``models.CONFIGS`` name or a config.json path; with ``layers`` the first ``layers``
    decoder layers only (every config list as long as the layers, e.g. ``layer_types``, cut with them)."""
    if name_or_path in CONFIGS:
        config = CONFIGS[name_or_path]()
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(name_or_path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--model/--config {name_or_path!r}: not one of {sorted(CONFIGS)} and not a readable "
                             f"config.json ({exc})") from exc
    config = config.get_text_config()
    if layers is not None:
        total = config.num_hidden_layers
        if not 1 <= layers <= total:
            raise SystemExit(f"--layers {layers}: the model has {total} decoder layers; pass 1 to {total}")
        for key, value in list(vars(config).items()):
            if isinstance(value, (list, tuple)) and len(value) == total:
                setattr(config, key, type(value)(value[:layers]))
        config.num_hidden_layers = layers
    return config


def fake_model(config: transformers.PretrainedConfig, dtype: torch.dtype, mode: fake_cuda.FakeCuda,
               checkpointed: bool, lora: Lora | None = None) -> torch.nn.Module:
    """The causal LM of ``config`` in ``dtype`` with fake CUDA parameters, in train mode; transformers' default
    attention and experts implementations (as a GPU user gets them); per-layer activation checkpointing as veRL
    turns it on (non-reentrant) where ``checkpointed``; LoRA adapters as veRL adds them (``Lora.wrap``: a peft
    model, the base frozen), in ``dtype`` as FSDP2's mixed precision computes them (peft makes them float32)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = (lora or Lora()).wrap(model).to(dtype)  # peft's float32 adapters too, as FSDP2's param_dtype runs them
    fake_cuda.materialize(model, mode)
    model.train()
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class _Progress:
    """A progress line on ``stream`` over a dry run's ``total`` walk steps: redrawn at each step on a terminal,
    else a line at each tenth of the steps (a log file stays short)."""

    def __init__(self, total: int, stream=None) -> None:
        stream = stream or sys.stderr
        self.total, self.done, self.stream, self.start = total, 0, stream, time.perf_counter()
        self.live = getattr(stream, "isatty", lambda: False)()

    def step(self, name: str) -> None:
        """Step ``name`` ("update recompute", ...) begins."""
        self.done += 1
        if not self.live and self.done * 10 // self.total == (self.done - 1) * 10 // self.total:
            return
        seconds = int(time.perf_counter() - self.start)
        line = f"[dry run] step {self.done}/{self.total} ({name}), {seconds // 60}m{seconds % 60:02d}s"
        print(f"\r{line}" if self.live else line, end="" if self.live else "\n", file=self.stream, flush=True)

    def finish(self) -> None:
        if self.live:
            print(file=self.stream, flush=True)


class _Meters:
    """The per-phase meters of a dry run: ``walk`` names the walk running ("log_probs", "update")."""

    def __init__(self, measured: Measured, mode: fake_cuda.FakeCuda, progress: _Progress,
                 expert_parallel: bool) -> None:
        self.measured, self.mode, self.walk, self.progress = measured, mode, "", progress
        self.expert_parallel = expert_parallel
        self.expert_sends: list[tuple[str, list[int]]] = []  # (phase, its sends): a backward appends after the phase

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        name = f"{self.walk} {phase}"
        self.progress.step(name)
        flops = self.mode.flops
        sent = experts.trace_all_to_all() if self.expert_parallel else contextlib.nullcontext([])
        with self.mode.meter.phase(name), comm.trace_collectives() as records, sent as sends:
            yield
        self.expert_sends.append((name, sends))
        self.measured.phase_flops[name] += self.mode.flops - flops
        self.measured.phase_collective_bytes[name] += sum(
            numel * torch.empty((), dtype=getattr(torch, dtype)).element_size() for _, _, numel, dtype in records)


    def expert_bytes(self) -> dict[str, int]:
        """The experts' all-to-all bytes of each phase, its backward's included (read once the walks are done)."""
        out: dict[str, int] = defaultdict(int)
        for name, sends in self.expert_sends:
            out[name] += sum(sends)
        return out


def split_sizes(pairs: int, world: int, rank: int, skew: float) -> list[int]:
    """The per-rank split sizes of one MoE layer's token exchange on rank ``rank`` of ``world`` with ``pairs``
    (token, expert) pairs, as the dispatcher reads them: the pairs this rank sends to each rank, then those it
    receives from each (every rank taken to hold ``pairs``). Balanced (``skew`` 1): 1/R to and from every rank.
    Skewed: this rank's experts are sent ``skew`` times their share by every rank (``skew`` / R of its pairs), the
    rest going evenly to the others."""
    hot = min(pairs, round(skew * pairs / world))
    rest, others = pairs - hot, world - 1
    send = [rest // others + (i < rest % others) for i in range(others)] if others else []
    send.insert(rank, hot)
    return send + [hot] * world


@contextlib.contextmanager
def routed(mode: fake_cuda.FakeCuda, world: int, rank: int, skew: float = 1.0) -> Iterator[None]:
    """Within the block, every expert-parallel MoE layer's token dispatch (``transformers_ep.token_dispatch``)
    reads the split sizes of ``split_sizes`` where it would read the routing's counts (its one host sync: a fake
    router has no values); exactly those reads (``FakeCuda.answering``)."""
    dispatcher, attribute = transformers_ep.token_dispatch()
    original = getattr(dispatcher, attribute)

    def dispatch(self, hidden_states, top_k_index, *args, **kwargs):
        with mode.answering(split_sizes(top_k_index.numel(), world, rank, skew)):
            return original(self, hidden_states, top_k_index, *args, **kwargs)

    setattr(dispatcher, attribute, dispatch)
    try:
        yield
    finally:
        setattr(dispatcher, attribute, original)


def _paths() -> Counter[str]:
    """Calls of each attention path and gated delta rule path so far in this process."""
    rule = {f"gated_delta_rule {path}": calls for path, calls in gated_delta_rule.RULE_PATHS.items()}
    return Counter(ATTENTION_PATHS) + Counter(rule)


def dry_run(config: transformers.PretrainedConfig, step: Step, seed: int = 0) -> Measured:
    """Run ``step``'s log-prob and update walks of ``config``'s model on fake CUDA tensors (module docstring);
    returns what was measured."""
    measured = Measured()
    device_bytes = fake_cuda.DeviceBytes()
    mode = fake_cuda.FakeCuda(device_bytes)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (step.prompt_len,), generator=gen)
    responses = [torch.randint(0, config.vocab_size, (step.response_len,), generator=gen)
                 for _ in range(step.group_size)]
    plan = step.plan
    walked = [s for mode_ in ("log_probs", step.prompt_grad) for s in plan.steps(mode_) if s.call is not None]
    progress = _Progress(len(walked))
    meters = _Meters(measured, mode, progress, step.expert_parallel)
    paths_before = _paths()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        group = world = None
        if step.cp_size > 1 or step.fsdp2:  # FSDP2's mesh needs a default group, of one rank without CP
            world = stack.enter_context(fake_cuda.fake_process_group(step.cp_size, step.rank))
            group = world if step.cp_size > 1 else None
        stack.enter_context(fake_cuda.fake_cuda_runtime())
        stack.enter_context(gated_delta_rule.fla_stand_in(gated_delta_rule.fla_shapes))
        stack.enter_context(host.host_stand_in(lambda shape, dtype: fake_cuda.fake_empty(mode, shape, dtype, "cpu")))
        model = fake_model(config, step.model_dtype if step.fsdp2 else step.dtype, mode, step.checkpointed, step.lora)
        if step.fsdp2:
            with experts.experts_set_aside(model) if step.expert_parallel else contextlib.nullcontext(), mode:
                fsdp2.shard_as_verl(model, init_device_mesh("cuda", (step.cp_size,)), step.dtype, step.reduce_dtype,
                                    step.offload_policy)
        if step.expert_parallel:
            experts.apply_expert_parallel(model, group)
            stack.enter_context(routed(mode, step.cp_size, step.rank, step.routing_skew))
        device_bytes.watch = {tuple(_local(p).shape) for p in model.parameters()}  # where a gradient may be
        stack.enter_context(mode)
        gradients: set[int] = set()  # serials of the storages that became parameter gradients
        names = {param: name for name, param in model.named_parameters()}
        trains = [p for p in model.parameters() if p.requires_grad]

        def hand_over(param: torch.nn.Parameter) -> None:  # the optimizer's bytes, not the walk's
            gradients.add(device_bytes.serial(_local(param.grad)))
            measured.trained.add(names[param])
            param.grad = None

        hooks = [] if step.fsdp2 else [p.register_post_accumulate_grad_hook(hand_over) for p in trains]
        optimizer = torch.optim.AdamW(trains) if step.fsdp2 else None  # veRL's
        if optimizer is not None and not (step.optimizer_offload or step.offload_policy):
            for p in trains:  # the moments a previous step left on the device (AdamW makes them at its first step)
                p.grad = torch.zeros_like(p)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        baseline = 0 if step.fsdp2 else device_bytes.current  # with FSDP2 every device byte of the step counts
        device_bytes.reset_peak()
        host.host_memory.reset_peak()
        stack.enter_context(observe_phases(meters))
        held = fsdp2.held_unsharded(model) if step.fsdp2 and step.cp_size == 1 else contextlib.nullcontext()
        with held:  # the engine's FSDP2 without CP: every unit gathered once, gradients reduce-scattered at the end
            meters.walk = "log_probs"
            log_probs = group_log_probs(model, prompt, responses, cp_group=group, knobs=step.knobs, plan=plan)
            del log_probs
            meters.walk = "update"
            result = group_backward(model, prompt, responses, lambda i, lp: lp.sum() / len(lp), cp_group=group,
                                    knobs=step.knobs, plan=plan)
            if step.fsdp2 and step.cp_size == 1:
                fsdp2.sync_gradients(model, "cuda", step.dtype)
        progress.finish()
        measured.model_flops = result.stats.model_flops
        del result
        for hook in hooks:
            hook.remove()
        if step.fsdp2:
            measured.trained = {names[p] for p in trains if p.grad is not None}
            with device_bytes.phase(OPTIMIZER_PHASE):  # offloaded moments come back for it (veRL loads them)
                optimizer.step()
            measured.optimizer_bytes = device_bytes.phases[OPTIMIZER_PHASE]
            del optimizer
        measured.host_peak_bytes = host.host_memory.peak
    measured.phase_expert_bytes = meters.expert_bytes()
    measured.seconds = time.perf_counter() - start
    measured.phase_bytes = {name: device_bytes.phase_without(name, gradients) - baseline
                            for name in device_bytes.phases}
    # the step's peak less the gradients alive at it, and no phase's below it: where the handed-over gradients
    # peaked elsewhere, a phase's own peak (less its gradients) is the higher of the two
    measured.peak_bytes = max(device_bytes.peak_without(gradients) - baseline, *measured.phase_bytes.values())
    measured.largest_tensor_bytes = device_bytes.largest
    measured.largest_tensor_numel = device_bytes.largest_numel
    measured.largest_tensor_made_by = device_bytes.largest_made_by
    measured.attention_paths = dict(_paths() - paths_before)
    return measured


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard: an expert-parallel weight or its gradient)."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():  # autograd's to_local of a cuda DTensor wants CUDA's device guard: a CPU build has none
        return tensor.to_local()


def estimate(config: transformers.PretrainedConfig, step: Step) -> MemoryEstimate:
    """The pre-flight estimate of ``step``'s update walk (the larger of the two) on its rank."""
    return estimate_memory(config, step.prompt_len, step.group_size, step.response_len, chunk_size=step.chunk_size,
                           prompt_grad=step.prompt_grad, dtype=step.dtype, cp_size=step.cp_size,
                           state_grad_on_host=step.state_grad_on_host, rank=step.rank,
                           checkpointed=step.checkpointed, device_type="cuda",
                           expert_parallel=step.expert_parallel, response_chunk_size=step.response_chunk_size,
                           state_on_host=step.state_on_host)


def modelled_work(config: transformers.PretrainedConfig, step: Step) -> dict[str, dict[str, float]]:
    """The time model's work (``timemodel.phase_work``) of each phase the dry run measures, keyed as ``Measured``'s
    ("log_probs capture", "update replay", ...)."""
    out = {}
    for walk, mode in (("log_probs", "log_probs"), ("update", step.prompt_grad)):
        work = timemodel.phase_work(config, step.plan, mode, step.dtype, state_grad_on_host=step.state_grad_on_host,
                                    frozen_base=step.lora.rank > 0, checkpointed=step.checkpointed,
                                    state_on_host=step.state_on_host)
        out |= {f"{walk} {phase}": amounts for phase, amounts in work.items() if amounts["layer_calls"]}
    return out


def report(name: str, step: Step, measured: Measured, predicted: MemoryEstimate, gpu_bytes: float,
           work: dict[str, dict[str, float]], gpu: str, table: GpuTable | None = None) -> str:
    """The dry run's table: per phase the peak GiB, TFLOPs (torch's count) and collective GiB beside the time
    model's (``work``: ``modelled_work``) and its seconds on ``gpu`` at its assumed efficiencies; then the step's
    peak beside the estimate (with ``Step.fsdp2``: the whole step's beside the per-GPU ``table``), the largest
    tensor, the attention paths and the verdicts."""
    lora = f", LoRA rank {step.lora.rank} on {step.lora.target_modules}" if step.lora.rank else ""
    split = (f", experts split over the {step.cp_size} ranks, routing skew {step.routing_skew:g}"
             if step.expert_parallel else "")
    segments = f" in segments of {step.response_chunk_size}" if step.response_chunk_size else ""
    lines = [f"{name}: P = {step.prompt_len}, G = {step.group_size} x {step.response_len}{segments}, chunk "
             f"{step.chunk_size}, "
             f"{step.prompt_grad}, rank {step.rank} of {step.cp_size}, checkpointed {step.checkpointed}, "
             f"state_grad_on_host {step.state_grad_on_host}, state_on_host {step.state_on_host}, "
             f"{str(step.dtype).removeprefix('torch.')}"
             f"{lora}{split}"
             " (fake CUDA tensors: a dry run, not a GPU measurement)", "",
             f"| phase | peak GiB | TFLOPs (torch) | collective GiB | time model: collective GiB | expert all-to-all "
             f"GiB | s on {gpu} |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    rates = timemodel.ASSUMED.rates(timemodel.DEVICES[gpu])
    for phase, peak in measured.phase_bytes.items():
        if phase == OPTIMIZER_PHASE:
            lines.append(f"| {phase} | {peak / GIB:.2f} | | | | | |")
            continue
        lines.append(f"| {phase} | {peak / GIB:.2f} | {measured.phase_flops[phase] / 1e12:.1f} | "
                     f"{measured.phase_collective_bytes[phase] / GIB:.2f} | {work[phase]['collective'] / GIB:.2f} | "
                     f"{measured.phase_expert_bytes[phase] / GIB:.2f} | {timemodel.seconds(work[phase], rates):.0f} |")
    update_flops = sum(f for p, f in measured.phase_flops.items() if p.startswith("update"))
    if table is None:
        ratio = predicted.total_bytes / max(measured.peak_bytes, 1)
        verdict = (f"walk peak {measured.peak_bytes / GIB:.2f} GiB, estimate {predicted.total_bytes / GIB:.2f} GiB "
                   f"(estimate / dry run = {ratio:.3f})")
    else:
        walk_peak = measured.walk_peak_bytes
        offload = (f"; offload_policy {step.offload_policy}, optimizer_offload {step.optimizer_offload}, model "
                   f"{str(step.model_dtype).removeprefix('torch.')}")
        verdict = (f"with FSDP2{offload}: walks' peak {walk_peak / GIB:.2f} GiB (shards, unsharded units, gradients, "
                   f"moments, the walk), per-GPU table {table.peak / GIB:.2f} (table / dry run = "
                   f"{table.peak / max(walk_peak, 1):.3f}); optimizer step {measured.optimizer_bytes / GIB:.2f} GiB, "
                   f"table {table.optimizer_step / GIB:.2f} (table / dry run = "
                   f"{table.optimizer_step / max(measured.optimizer_bytes, 1):.3f})")
    lines += ["",
              f"{verdict}; update walk {update_flops / 1e12:.1f} TFLOPs counted by torch, "
              f"{measured.model_flops / 1e12:.1f} by flops.py",
              f"host {measured.host_peak_bytes / GIB:.2f} GiB, estimate {predicted.host_bytes / GIB:.2f} GiB (state-"
              "gradient sums and their staging buffer, with state_on_host the prompt state's rows: fake host "
              "tensors, counted, not allocated)",
              f"largest tensor {measured.largest_tensor_bytes / GIB:.2f} GiB; most elements "
              f"{measured.largest_tensor_numel}"
              f"{' (2^31 or more)' if measured.largest_tensor_numel >= 2**31 else ''}: "
              f"{_made_by(measured.largest_tensor_made_by)}",
              f"attention paths: {dict(sorted(measured.attention_paths.items()))}",
              f"dry run {measured.seconds:.1f} s; the seconds are the time model's (verl_longstraw.timemodel: a "
              "model at assumed efficiencies, without FSDP2's gathers and the experts' all-to-alls), not the dry "
              "run's"]
    return "\n".join(lines)


def _made_by(made_by: tuple | None) -> str:
    if made_by is None:
        return "none made"
    op, shape, dtype = made_by
    return f"{op} -> {list(shape)} {str(dtype).removeprefix('torch.')}"


def recipe_step(name: str) -> Step:
    """The step of rank 0 in recipe ``name`` (``configs.compose_recipe``, ``model_terms.recipe_training``): its
    lengths, LongStraw knobs, checkpointing, LoRA, expert parallelism and FSDP2 settings, the whole step (FSDP2)."""
    from .configs import compose_recipe

    try:
        run = recipe_training(compose_recipe(name))
        return Step(run.prompt_len, run.group_size, run.response_len, run.chunk_size, run.prompt_grad, run.cp_size,
                    0, run.checkpointing, run.state_grad_on_host, run.state_on_host, run.param_dtype, run.lora,
                    run.expert_parallel,
                    response_chunk_size=run.response_chunk_size, fsdp2=True, model_dtype=run.model_dtype,
                    reduce_dtype=run.reduce_dtype, offload_policy=run.offload_policy,
                    optimizer_offload=run.optimizer_offload)
    except ValueError as exc:
        raise SystemExit(f"--recipe {name}: {exc}") from exc


def step_of(args: argparse.Namespace) -> Step:
    """The step the command line asks for: ``--recipe``'s knobs (or ``Step``'s defaults) with each flag given in
    place of its own."""
    base = recipe_step(args.recipe) if args.recipe else None
    if base is None and args.prompt_len is None:
        raise SystemExit("--prompt-len: required without --recipe (or name a recipe: --recipe qwen35_27b_1m)")
    base = base or Step(args.prompt_len)
    given = {"prompt_len": args.prompt_len, "group_size": args.group_size, "response_len": args.response_len,
             "chunk_size": args.chunk_size, "prompt_grad": args.prompt_grad, "cp_size": args.cp_size,
             "rank": args.rank, "checkpointed": args.checkpointed, "state_grad_on_host": args.state_grad_on_host,
             "state_on_host": args.state_on_host,
             "dtype": DTYPES[args.dtype] if args.dtype else None, "expert_parallel": args.expert_parallel,
             "routing_skew": args.routing_skew, "response_chunk_size": args.response_chunk_size,
             "fsdp2": args.fsdp2}
    if args.lora_rank is not None or args.lora_targets is not None:
        targets = base.lora.target_modules  # peft reads a string as a pattern: a list of names stays a tuple
        if args.lora_targets:
            targets = "all-linear" if args.lora_targets == "all-linear" else tuple(args.lora_targets.split(","))
        given["lora"] = Lora(base.lora.rank if args.lora_rank is None else args.lora_rank, targets)
    try:
        return dataclasses.replace(base, **{key: value for key, value in given.items() if value is not None})
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``main``'s)."""
    parser = argparse.ArgumentParser(prog="python -m verl_longstraw.dryrun", description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", choices=sorted(CONFIGS), help="a named model (verl_longstraw.models)")
    model.add_argument("--config", help="a transformers config.json (file or directory)")
    parser.add_argument("--layers", type=int, help="the first N decoder layers only (default: all)")
    parser.add_argument("--recipe", help="take the step's knobs from a configs/recipe overlay, as its launch.sh "
                                         "composes it (the flags below: the rest, or the recipe's in its place)")
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--response-len", type=int)
    parser.add_argument("--chunk-size", type=int)
    parser.add_argument("--response-chunk-size", type=int, help="replay longer responses as chains of this many "
                        "tokens (the knob response_chunk_size)")
    parser.add_argument("--prompt-grad", choices=("exact", "detached"))
    parser.add_argument("--cp-size", type=int)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--checkpointed", action="store_true", default=None, help="per-layer activation checkpointing")
    parser.add_argument("--state-grad-on-host", action="store_true", default=None)
    parser.add_argument("--state-on-host", action="store_true", default=None,
                        help="the prompt state's rows in host memory, streamed a layer at a time")
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--lora-rank", type=int, help="LoRA adapters of this rank, the base frozen (0: none)")
    parser.add_argument("--lora-targets", help="the LoRA target modules, comma-separated (default: all-linear)")
    parser.add_argument("--expert-parallel", action="store_true", default=None,
                        help="split the routed experts over the CP group (parallel.experts)")
    parser.add_argument("--routing-skew", type=float,
                        help="this rank's experts receive S times their balanced share (default 1: balanced)")
    parser.add_argument("--fsdp2", action="store_true", default=None,
                        help="the whole step: FSDP2 over the CP group as veRL wraps it, then AdamW's step (a recipe's "
                             "default)")
    parser.add_argument("--no-fsdp2", dest="fsdp2", action="store_false", help="the walks alone")
    parser.add_argument("--gpu-gb", type=float, default=96.0, help="device memory in GB (10^9 bytes)")
    parser.add_argument("--gpu", choices=sorted(timemodel.DEVICES), default="H20",
                        help="the GPU the time model prices each phase on")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = model_config(args.model or args.config, args.layers)
    step = step_of(args)
    measured = dry_run(config, step)
    predicted = estimate(config, step)
    table = gpu_table(config, step.training, int(args.gpu_gb * 1e9)) if step.fsdp2 else None
    name = args.model or args.config
    if args.recipe:
        name += f" ({args.recipe})"
    if args.layers:
        name += f" (first {args.layers} layers)"
    print(report(name, step, measured, predicted, args.gpu_gb * 1e9, modelled_work(config, step), args.gpu, table))
    bounded = bounds(measured, predicted, table)
    fits = measured.peak_bytes <= args.gpu_gb * 1e9
    print(f"estimate bounds the dry run: {bounded}; {'step' if table else 'walk'} fits {args.gpu_gb:g} GB: {fits}")
    return 0 if bounded and fits else 1


def bounds(measured: Measured, predicted: MemoryEstimate, table: GpuTable | None) -> bool:
    """Whether the estimate bounds the dry run: the walk's estimate its peak, or with FSDP2 the per-GPU ``table``
    the walks' peak and the optimizer step's."""
    if table is None:
        return predicted.total_bytes >= measured.peak_bytes
    return table.peak >= measured.walk_peak_bytes and table.optimizer_step >= measured.optimizer_bytes


if __name__ == "__main__":
    sys.exit(main())
