"""One stage of ``benchmarks/gpu_check.py``, in a process of its own (that supervisor starts it; its docstring has
the run as a whole):

    python benchmarks/gpu_check_stages.py --stage ops --part PART.json --until T [--tiny] [--families ...]
                                          [--skip-file KEYS.json]

Stages:
- ops: the prefix-attention ops at a real layer's shapes (Qwen3.5-27B attention, GLM-5 MLA absorbed, gpt-oss's
  full layers with sinks and its 128-token sliding window with sinks; T 1024 after P 8192, a window's P its W - 1
  rows), bfloat16 forward + backward against float64 on the same values, bounded by the standard path's own error
  (SDPA with a mask on a pinned backend, recorded; gpt-oss: the model's own eager attention), with seconds and
  peak memory of both: the dispatch (fused flash kernels; the blocked op with half matmul operands for MLA;
  ``window_attention``) and context-parallel pass-Q's arithmetic on two key shards;
- scale: random-init layer stacks at real widths (Qwen3.5-27B: hidden 5120, 3 Gated DeltaNet + 1 full-attention
  layer; GLM-5: MLA, hidden 6144, 3 layers), bfloat16; for standard / exact (chunked) / detached and G in {2, 8},
  and at G = 8 exact with the state-gradient sums in pinned host memory (``exact_host``) and with the prompt state
  there too, streamed a layer at a time (``exact_streamed``: the streamed walk timed against ``exact_host``, the
  resident one), P doubles until the path runs out of memory or time (each (model, G, path) series an equal share
  of the stage); peak memory is ``torch.cuda.max_memory_allocated`` (on CPU: bytes saved for backward,
  SavedTensorMeter), a host row's host bytes ``state.host.host_memory``'s peak, each beside the estimate's;
- equivalence: tiny random models of every case (``CASES_NEWEST_FIRST``: every family, every ``tiny.VARIANTS``
  model type and each ``CONFIG_VARIANTS`` entry) against the float32 standard full-sequence path: replay log-probs
  (``group_log_probs``) and chunked exact gradients (``group_backward``) of the model cast to bfloat16, in float32
  under ``torch.autocast(bfloat16)`` as veRL's engine runs it (both no worse than the standard path's own error
  there, ``testing.compare.no_worse_than_standard``), and in float32 (within TOLERANCE); the half-precision rows
  route every token to every expert (``every_expert``), the float32 rows keep the model's routing;
- fsdp2: a world-size-1 process group (gloo on CPU, nccl on CUDA), every decoder layer and the root
  ``fully_shard``-ed with veRL's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; as the
  engine does, parameters held unsharded (``held_unsharded``) under autocast, exact ``group_backward``, gradients
  reduce-scattered (``sync_gradients``); full gradients and log-probs compared with the unwrapped float32 standard
  path, bounded by the standard path's error on the same wrapped model under the same policy.
Rows run newest case first and bfloat16 -> autocast -> float32 (the float32 rows run on CUDA the code the CPU tests
already ran). The standard path's Gated DeltaNet and Kimi Delta Attention in the equivalence and FSDP2 stages are
the token-by-token references (``testing.compare.reference_linear_attention``: transformers would take fla's TF32
kernels whenever fla imports), and float32 runs without TF32. flash-linear-attention, where it imports on CUDA,
is warmed at each shape a row runs before the row's clock starts.

A row that overruns its time is interrupted (SIGALRM) and recorded as ``{"skipped": "time limit"}``, one out of
device memory (cuBLAS / cuDNN allocation failures included) as ``"out of memory"``, any other failure as ``"error:
..."`` with its traceback. A sticky CUDA error (after which every CUDA call raises) ends the stage. Each row carries
its ``key`` (``gpu_check.row_key``); ``--skip-file`` names keys not to run (a rerun's rows already compared).

The part (JSON at ``--part``, replaced whole after every row): ``stage``, ``device``, ``machine`` (one line),
``versions``, ``planned`` (the keys this process will run, in order), ``rows``, ``kernels`` (prefix-attention calls
per path, the gated delta rule's kernel), ``stage_error`` (a failure outside the rows) and ``seconds``.
"""

from __future__ import annotations

# ruff: noqa: E402  (the clock and the checkout's place on sys.path come before the imports they cover)
import sys
import time

STARTED = time.monotonic()

from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's package, installed or not, and gpu_check

import argparse
import contextlib
import copy
import functools
import gc
import importlib.metadata
import json
import logging
import platform
import signal
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import transformers
from gpu_check import EQUIVALENCE_DTYPES, STAGES, row_key  # stdlib only
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from verl_longstraw import Knobs, group_backward, group_log_probs
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.machine import describe, machine
from verl_longstraw.memory import parameter_meter
from verl_longstraw.ops.attention.blocked import OwnKeyRule
from verl_longstraw.ops.attention.fused import fused_kernel_dtype, fused_partial_backward, fused_partial_forward
from verl_longstraw.ops.attention.prefix import (
    ATTENTION_PATHS,
    prefix_causal_attention,
    prefix_causal_attention_reference,
)
from verl_longstraw.ops.attention.window import window_attention, window_attention_reference
from verl_longstraw.ops.gated_delta import rule as gdn
from verl_longstraw.ops.kda.rule import kda_rule
from verl_longstraw.parallel.fsdp2 import held_unsharded, sync_gradients  # torch only: runs without veRL
from verl_longstraw.state.host import host_memory
from verl_longstraw.testing.compare import (
    full_log_probs,
    grads_of,
    make_group,
    max_abs_error,
    no_worse_than_standard,
    reference_linear_attention,
    relative_error,
    replay_errors,
    weighted_loss,
)
from verl_longstraw.tiny import DENSE_VARIANTS, TINY_CONFIGS, VOCAB, tiny_config, tiny_model, use_reference_kernels

# cases besides one per model type: name -> (family, config fields set on top of the family's overrides).
# GLM-5.2's DSA layout (transformers' GlmMoeDsaConfig.indexer_types) on the 3-layer tiny model: the first layer runs
# its indexer, the other two reuse its top-k selection ("shared": no indexer, no indexer keys in the prompt state)
CONFIG_VARIANTS = {"glm_moe_dsa_shared_indexer": ("glm_moe_dsa", {"indexer_types": ["full", "shared", "shared"]})}
# Equivalence and FSDP2 cases, newest first: the tiny families in the registry's order reversed (adapters/__init__
# imports them in the order they landed), each config variant before its family, the other dense model types
# (DENSE_VARIANTS: qwen3's code path) left out; so a run cut short has checked what no earlier run has.
CASES_NEWEST_FIRST = tuple(case for family in reversed(TINY_CONFIGS) if family not in DENSE_VARIANTS
                           for case in (*(v for v, (f, _) in CONFIG_VARIANTS.items() if f == family), family))

TINY_FAMILY = {"qwen3_like": "qwen3", "glm5_like": "glm_moe_dsa"}  # metered CPU standard GDN is slow
TOLERANCE = 1e-4  # float32: max |log p| error and gradient relative L2
# DSA's top-k selection below the prompt length; 16 indexer heads make exact score ties improbable
OVERRIDES = {family: {"index_topk": 24, "index_n_heads": 16} for family in ("glm_moe_dsa", "deepseek_v32")}
# Groups (random prompts and responses) per row for families whose half-precision error is dominated by discrete
# top-k selection: a near-tie that rounds the other way swaps a selected key and moves that token's log-prob by
# orders of magnitude more than rounding does, on either path, so one group's max errors compare the paths' luck
# more than their arithmetic (tiny glm_moe_dsa under FSDP2, seeds 0-3: replay/standard log-prob error 2.9, 1.0,
# 1.6, 0.8). Such a row compares each path's largest error over the groups.
SELECTION_GROUPS = {"glm_moe_dsa": 3, "deepseek_v32": 3}  # per family, its CONFIG_VARIANTS cases included
# config fields that hold a MoE model's routed expert count (the first present is read)
EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts")
AUTOCAST = EQUIVALENCE_DTYPES[1]
# the prompt of the equivalence and FSDP2 rows (responses of 31, 1 and 60 tokens; DSA's top-k of 24 selects below
# it). Their half-precision verdicts compare the largest log-prob error over the responses' tokens: at 128 (39 tokens)
# that is luck (kimi_linear autocast, seeds 0-3: replay / standard 2.3, 0.7, 1.0, 1.3; Intel Xeon with AMX), at 301
# (92 tokens) 1.2, 1.0, 0.8, 1.0
PROMPT_LEN = 301
SDPA_BACKENDS = {"cuda": ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"), "cpu": ("FLASH_ATTENTION", "MATH")}
OP_NAMES = ("out", "q", "k_prefix", "v_prefix", "k_self", "v_self")
# failures that are out of device memory: the caching allocator's (torch.OutOfMemoryError) and cuBLAS / cuDNN
# workspace allocations (a RuntimeError)
OUT_OF_MEMORY_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
# failures after which every CUDA call in the process raises again (the CUDA context is lost); where CUDA is
# available, ``attempt`` confirms it by a synchronize
STICKY_CUDA_MESSAGES = ("illegal memory access", "misaligned address", "device-side assert",
                        "unspecified launch failure", "CUDA error")
REARM_SECONDS = 0.5  # a time limit raised where it was swallowed (a __del__) is raised again this much later
STEP_GROWTH = 4.0  # the scale stage's predictor: a series' step time per doubling of P (attention's P^2)
WARM_PROMPT_LEN = 64  # each scale series runs once at this prompt length before its clock starts
FLA_WARM_TOKENS = 128
TRACEBACK_CHARS = 4000  # the end of a failure's traceback kept in its row


@dataclass(frozen=True)
class OpCase:
    """One ops row: ``op`` ("prefix_causal_attention", "pass_q_two_ranks" or "window_attention", the last with
    learned sinks and ``window`` keys, None: every earlier key) at ``shape`` (query heads, key heads, query/key dim,
    value dim) for T queries after ``prefix_len`` rows."""

    shape_name: str
    shape: tuple[int, int, int, int]
    op: str
    prefix_len: int
    window: int | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The output and the inputs whose gradients the row compares."""
        return (*OP_NAMES, "sinks") if self.op == "window_attention" else OP_NAMES


def op_cases(tiny: bool) -> list[OpCase]:
    """The ops rows at real widths (T 1024 after P 8192; a sliding window's P is its W - 1 kept rows), or tiny."""
    p = 48 if tiny else 8192
    attention, mla, gpt_oss = ((4, 2, 32, 32), (4, 1, 40, 32), (4, 2, 16, 16)) if tiny else (
        (24, 4, 256, 256), (64, 1, 576, 512), (64, 8, 64, 64))
    window = 8 if tiny else 128
    prefix = "" if tiny else "qwen3.5-27b "
    return [OpCase(f"{prefix}attention", attention, "prefix_causal_attention", p),
            OpCase(f"{prefix}attention", attention, "pass_q_two_ranks", p),  # pass-Q's fused path: value dim == key's
            OpCase("glm-5 mla absorbed" if not tiny else "mla absorbed", mla, "prefix_causal_attention", p),
            OpCase("gpt-oss full + sinks", gpt_oss, "window_attention", p),
            OpCase(f"gpt-oss window {window} + sinks", gpt_oss, "window_attention", window - 1, window)]


class CaseTimeout(BaseException):
    """A row ran past its time limit (raised by the SIGALRM handler of ``attempt``); a BaseException, as
    KeyboardInterrupt, so that library code's ``except Exception`` does not swallow it."""


class DeviceLost(RuntimeError):
    """The device failed so that every later call on it fails too (a sticky CUDA error): the stage ends."""


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks; DeviceLost when CUDA fails on that (a sticky error of the row
    before surfaces here)."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as error:
            raise DeviceLost(f"freeing CUDA memory failed: {type(error).__name__}: {error}"[:500]) from error


def failure_fields(error: Exception) -> dict:
    """The row fields of a row that raised ``error``: ``{"skipped": "out of memory"}`` (torch.OutOfMemoryError,
    cuBLAS / cuDNN allocation failures), else ``{"skipped": "error: <type>: <message>", "traceback": <its end>}``
    (printed to stderr) with ``"device_lost": <message>`` besides for a sticky CUDA error (STICKY_CUDA_MESSAGES)."""
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, torch.OutOfMemoryError) or any(m in message for m in OUT_OF_MEMORY_MESSAGES):
        return {"skipped": "out of memory"}
    text = "".join(traceback.format_exception(error))
    print(text, file=sys.stderr, flush=True)
    fields = {"skipped": f"error: {message}"[:500], "traceback": text[-TRACEBACK_CHARS:]}
    if any(m in message for m in STICKY_CUDA_MESSAGES):
        fields["device_lost"] = message[:500]
    return fields


def attempt(deadline: float, fn: Callable) -> tuple[Any, dict | None]:
    """(``fn()``, None), or (None, the row fields saying why there is no result): ``{"skipped": "time limit"}``
    when interrupted at ``deadline`` (monotonic seconds; SIGALRM raises CaseTimeout in the main thread, which a
    running kernel or CUDA backward delays until it returns), else ``failure_fields``. ``"device_lost"`` (then
    ``Part.record`` ends the stage) is decided by freeing memory after the failure where CUDA is available (it
    fails after a sticky error, whatever the message said), else by the message.

    The timer stops in its handler, so no second CaseTimeout fires in the ``finally`` / ``__exit__`` blocks the
    first unwinds; it is re-armed (REARM_SECONDS) only when that raise was swallowed (``sys.unraisablehook``: it
    hit a ``__del__`` or another callback that cannot raise)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None, {"skipped": "time limit"}
    expired: list[bool] = []

    def alarm(signum, frame):
        signal.setitimer(signal.ITIMER_REAL, 0)
        expired.append(True)
        raise CaseTimeout(f"past its {left:.1f} s")

    def swallowed(unraisable) -> None:
        if isinstance(unraisable.exc_value, CaseTimeout):
            signal.setitimer(signal.ITIMER_REAL, REARM_SECONDS)
        else:
            previous_hook(unraisable)

    previous_handler = signal.signal(signal.SIGALRM, alarm)
    previous_hook, sys.unraisablehook = sys.unraisablehook, swallowed
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, left)
            return fn(), None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_handler)
            sys.unraisablehook = previous_hook
    except CaseTimeout:
        failure = {"skipped": "time limit"}
    except Exception as error:  # one failing row must not end a one-shot GPU run
        # a time limit that surfaced as another exception (raised inside an import, a context manager's exit)
        failure = {"skipped": "time limit"} if expired else failure_fields(error)
    try:
        free_memory()
    except DeviceLost as lost:
        failure.setdefault("device_lost", str(lost))
    else:
        if torch.cuda.is_available():  # CUDA still answers: not sticky (e.g. an invalid launch configuration)
            failure.pop("device_lost", None)
    return None, failure


def case_deadline(deadline: float, rows_left: int) -> float:
    """When a row must stop: it may take half the stage's remaining time (all of it when it is the last), so a slow
    first row (CUDA start, triton compiling fla's kernels) still runs and no row starves all later ones."""
    return time.monotonic() + (deadline - time.monotonic()) / min(max(rows_left, 1), 2)


# -- equivalence and FSDP2 ------------------------------------------------------------------------------------------

def every_expert(config: transformers.PretrainedConfig) -> dict:
    """Config fields that route every token to every routed expert of ``config``'s model ({} without routed
    experts): its top-k set to its expert count (the first of EXPERT_COUNT_FIELDS it has). A tiny random router's
    top-k is so near ties that a half-precision rounding flips tokens' experts on either path, and a row then
    compares luck (gpt_oss on the CPU: autocast gradient error 0.060 routed vs 0.0060 with every expert)."""
    if getattr(config, "num_experts_per_tok", None) is None:
        return {}
    for name in EXPERT_COUNT_FIELDS:
        if getattr(config, name, None):
            return {"num_experts_per_tok": getattr(config, name)}
    raise ValueError(f"{config.model_type}: num_experts_per_tok without an expert count in {EXPERT_COUNT_FIELDS}; "
                     "add the field that holds it")


def case_config(case: str, half: bool) -> tuple[str, dict]:
    """(family, tiny-config overrides) of equivalence / FSDP2 case ``case``: a family with its ``OVERRIDES``, or a
    ``CONFIG_VARIANTS`` entry's family with its fields on top of them; for ``half``-precision rows with every
    expert routed (``every_expert``)."""
    family, fields = CONFIG_VARIANTS.get(case, (case, {}))
    overrides = {**OVERRIDES.get(family, {}), **fields}
    return family, {**overrides, **(every_expert(tiny_config(family, **overrides)) if half else {})}


def row_groups(case: str, prompt_len: int, device: torch.device) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The (prompt, responses) groups one row of ``case`` compares on (``SELECTION_GROUPS`` of its family; one
    otherwise): a prompt of ``prompt_len`` tokens and three responses of about a tenth, one and a fifth of it."""
    lengths = (prompt_len // 10 + 1, 1, prompt_len // 5)
    return [make_group(VOCAB, prompt_len, lengths, seed=seed, device=device)
            for seed in range(SELECTION_GROUPS.get(case_config(case, half=False)[0], 1))]


def largest_errors(groups: list, errors_of: Callable[[torch.Tensor, list[torch.Tensor]], dict]) -> dict:
    """Each error of ``errors_of(prompt, responses)`` at its largest over ``groups``."""
    per_group = [errors_of(prompt, responses) for prompt, responses in groups]
    return {k: max(errors[k] for errors in per_group) for k in per_group[0]}


def standard_backward(model, prompt: torch.Tensor, responses: list[torch.Tensor]) -> None:
    """The standard path's gradients of ``weighted_loss`` into ``model``'s .grad (one full sequence per response),
    no copies made."""
    model.zero_grad(set_to_none=True)
    for i, response in enumerate(responses):
        weighted_loss(i, full_log_probs(model, prompt, response)[0]).backward()


def errors_in(reference, model, prompt, responses, chunk_size: int, run: Callable) -> dict:
    """Errors against ``reference``'s float32 standard path (unwrapped, no autocast) of ``model``'s replay
    (``log_prob``, ``grad``: max |log p| error, gradient relative L2) and of ``model``'s own standard path
    (``standard_log_prob``, ``standard_grad``), each run as ``run(model, fn)`` -> (fn's log-probs, full gradients)."""
    standard_backward(reference, prompt, responses)
    expected = grads_of(reference)
    with torch.no_grad():
        expected_lp = [full_log_probs(reference, prompt, r)[0] for r in responses]

    def standard():
        standard_backward(model, prompt, responses)
        with torch.no_grad():
            return [full_log_probs(model, prompt, r)[0] for r in responses]

    def replay():
        log_probs = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=chunk_size)).log_probs
        group_backward(model, prompt, responses, weighted_loss, knobs=Knobs(prompt_grad="exact", chunk_size=chunk_size))
        return log_probs

    errors = {}
    for prefix, fn in (("standard_", standard), ("", replay)):
        log_probs, grads = run(model, fn)
        errors[f"{prefix}log_prob"] = max_abs_error(log_probs, expected_lp)
        errors[f"{prefix}grad"] = relative_error(grads, expected)
    return errors


def under_autocast(device: torch.device) -> Callable:
    """``run`` for ``errors_in``: ``fn`` under bfloat16 autocast, as veRL's engine runs the model."""

    def run(model, fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = fn()
        return out, grads_of(model)

    return run


def under_fsdp2(device: torch.device) -> Callable:
    """``run`` for ``errors_in`` on a fully_shard-ed model, as the engine runs one group per rank: held unsharded
    under autocast, gradients reduce-scattered by ``sync_gradients``; returns full (unsharded) gradients."""

    def run(model, fn):
        model.zero_grad(set_to_none=True)  # the sharded gradients: reshard registers the sharded parameters
        with held_unsharded(model), torch.autocast(device.type, dtype=torch.bfloat16):
            out = fn()
            sync_gradients(model, device.type, torch.bfloat16)
        grads = {n: p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape, dtype=p.dtype, device=device)
                 for n, p in model.named_parameters()}
        return out, grads

    return run


def error_row(errors: dict, passed: bool) -> dict:
    return {"log_prob_error": errors["log_prob"], "grad_rel_l2": errors["grad"],
            "standard_log_prob_error": errors["standard_log_prob"], "standard_grad_rel_l2": errors["standard_grad"],
            "passed": passed}


def equivalence_case(models: dict, case: str, name: str, device: torch.device, groups: list,
                     chunk_size: int) -> dict:
    """One equivalence row's errors (largest over ``groups``, ``row_groups``) and verdict for ``case`` in dtype
    ``name``; ``models`` caches the case's float32 model (every expert routed in the half-precision rows) between its
    dtypes. The standard path's linear attention is the reference recurrence (``reference_linear_attention``)."""
    half = name != "float32"
    if (case, half) not in models:
        models.clear()
        family, overrides = case_config(case, half)
        with device:
            models[case, half] = tiny_model(family, **overrides)
    reference = models[case, half]
    with reference_linear_attention(reference):
        if name == AUTOCAST:
            errors = largest_errors(groups, lambda prompt, responses: errors_in(
                reference, reference, prompt, responses, chunk_size, under_autocast(device)))
            return error_row(errors, no_worse_than_standard(errors, torch.bfloat16))
        dtype = getattr(torch, name)
        errors = largest_errors(groups, lambda prompt, responses: replay_errors(
            reference, dtype, prompt, responses, weighted_loss, chunk_size))
    if dtype == torch.float32:
        return error_row(errors, errors["log_prob"] < TOLERANCE and errors["grad"] < TOLERANCE)
    return error_row(errors, no_worse_than_standard(errors, dtype))


def fla_warmups(case: str, dtype: torch.dtype) -> set[tuple]:
    """The linear-attention rules replay runs for ``case``'s half-precision tiny model in ``dtype``: ("gated_delta",
    key heads, value heads, key dim, value dim, dtype) and ("kda", heads, head dim, dtype) (empty for a model without
    such layers)."""
    family, overrides = case_config(case, half=True)
    config = tiny_config(family, **overrides)
    if config.model_type == "kimi_linear":
        return {("kda", config.linear_num_heads, config.linear_head_dim, dtype)}
    if hasattr(config, "linear_num_value_heads"):
        return {("gated_delta", config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                 config.linear_value_head_dim, dtype)}
    return set()


WARMED_FLA: set[tuple] = set()


def fla_in_use(device: torch.device) -> bool:
    """Whether half-precision linear-attention rules run flash-linear-attention's kernels on ``device`` (CUDA, fla
    imports: the gated delta rule calls it, transformers binds KDA's chunked rule to it)."""
    return device.type == "cuda" and gdn._fla_chunk_gated_delta_rule() is not None


def token_inputs(device: torch.device, dtype: torch.dtype, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """Random [1, FLA_WARM_TOKENS, *shape] tensors in ``dtype`` (a fixed seed)."""
    gen = torch.Generator(device).manual_seed(0)
    return [torch.randn(1, FLA_WARM_TOKENS, *shape, generator=gen, device=device, dtype=dtype) for shape in shapes]


def warm_gated_delta(device: torch.device, heads: int, v_heads: int, k_dim: int, v_dim: int,
                     dtype: torch.dtype) -> None:
    """The gated delta rule forward and backward with and without an initial state, as replay calls it."""
    q, k, v, beta = token_inputs(device, dtype, (heads, k_dim), (heads, k_dim), (v_heads, v_dim), (v_heads,))
    (g,) = token_inputs(device, torch.float32, (v_heads,))
    g, beta = -g.abs(), beta.sigmoid()  # log-decay <= 0, 0 < beta < 1
    state = torch.zeros(1, v_heads, k_dim, v_dim, device=device)
    for initial_state in (None, state.requires_grad_()):
        inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
        out, final = gdn.gated_delta_rule(*inputs, initial_state=initial_state)
        (out.float().sum() + final.sum()).backward()


def warm_kda(device: torch.device, heads: int, dim: int, dtype: torch.dtype) -> None:
    """Kimi Delta Attention's chunked rule (the model module's, as transformers bound it) forward and backward from
    an initial state, as replay calls it."""
    from transformers.models.kimi_linear import modeling_kimi_linear

    q, k, v, g, beta = token_inputs(device, dtype, (heads, dim), (heads, dim), (heads, dim), (heads, dim), (heads,))
    inputs = [x.requires_grad_() for x in (q, k, v, -g.abs(), beta.sigmoid())]
    state = torch.zeros(1, heads, dim, dim, device=device, requires_grad=True)
    out, final = kda_rule(modeling_kimi_linear.chunk_kimi_delta_attention, *inputs, state)
    (out.float().sum() + final.sum()).backward()


def warm_fla(device: torch.device, warmups: set[tuple]) -> None:
    """Run each rule of ``warmups`` (``fla_warmups``) not run yet forward and backward, on fla's kernels where
    ``fla_in_use``: triton compiles and autotunes them (about 90 configs per shape on a cold cache) before a row's
    clock starts."""
    for warmup in sorted(warmups - WARMED_FLA, key=str):
        (warm_gated_delta if warmup[0] == "gated_delta" else warm_kda)(device, *warmup[1:])
        WARMED_FLA.add(warmup)
    if device.type == "cuda":
        torch.cuda.synchronize()


def warmed_attempt(device: torch.device, warmups: set[tuple], deadline: float, rows_left: int, fn: Callable):
    """``attempt(fn)`` at its ``case_deadline``, taken after fla is warmed for ``warmups`` (``warm_fla``, within the
    stage's ``deadline``, where ``fla_in_use``); a failed warm-up is the row's failure."""
    if fla_in_use(device) and warmups - WARMED_FLA:
        _, failure = attempt(deadline, functools.partial(warm_fla, device, warmups))
        if failure is not None:
            return None, {**failure, "skipped": f"warming fla: {failure['skipped']}"}
    return attempt(case_deadline(deadline, rows_left), fn)


def equivalence(device: torch.device, options: SimpleNamespace, deadline: float, part: Part) -> None:
    """Replay vs the float32 standard path per case (newest first) and dtype (bfloat16, autocast, float32), with
    the standard path's own errors in that dtype / under that autocast; each row ``part.record``-ed, its ``family``
    the case's name."""
    rows = part.plan([(case, name) for case in options.cases for name in EQUIVALENCE_DTYPES],
                     lambda row: {"family": row[0], "dtype": row[1]})
    models: dict = {}
    for index, (case, name) in enumerate(rows):
        groups = row_groups(case, options.prompt_len, device)
        run = functools.partial(equivalence_case, models, case, name, device, groups, options.prompt_len // 3)
        warmups = set() if name == "float32" else fla_warmups(case, torch.bfloat16)  # autocast: bf16 rule inputs
        started = time.monotonic()
        row, failure = warmed_attempt(device, warmups, deadline, len(rows) - index, run)
        part.record({"family": case, "dtype": name, "groups": len(groups), **(row or failure),
                     "seconds": time.monotonic() - started})


@contextlib.contextmanager
def process_group(device: torch.device):
    """A world-size-1 process group (gloo on CPU, nccl on CUDA) through a file store, destroyed on exit; an already
    initialized group (e.g. the tests') is used as it is."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as folder:
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{folder}/store",
                                rank=0, world_size=1)
        try:
            yield
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # e.g. NCCL after a sticky CUDA error: the error that ended the stage stays the one told
                traceback.print_exc()


def fsdp2_wrap(model, device: torch.device):
    """``model`` with each decoder layer and the root fully_shard-ed under veRL's mixed-precision policy."""
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp2_case(case: str, device: torch.device, groups: list, chunk_size: int) -> dict:
    """One FSDP2 row's errors (largest over ``groups``, ``row_groups``) and verdict for ``case`` (``case_config``,
    every expert routed); the standard path's linear attention is the reference recurrence."""
    family, overrides = case_config(case, half=True)
    with device:
        reference = tiny_model(family, **overrides)
    with reference_linear_attention(reference):
        model = fsdp2_wrap(copy.deepcopy(reference), device)
        errors = largest_errors(groups, lambda prompt, responses: errors_in(
            reference, model, prompt, responses, chunk_size, under_fsdp2(device)))
    return error_row(errors, no_worse_than_standard(errors, torch.bfloat16))


def fsdp2(device: torch.device, options: SimpleNamespace, deadline: float, part: Part) -> None:
    """Exact replay on a single-rank FSDP2 model (bfloat16 parameters, float32 reduction) vs the unwrapped float32
    standard path, bounded by the standard path's error on the same wrapped model under the same policy."""
    cases = part.plan(list(options.cases), lambda case: {"family": case})
    with process_group(device):
        for index, case in enumerate(cases):
            groups = row_groups(case, options.prompt_len, device)
            run = functools.partial(fsdp2_case, case, device, groups, options.prompt_len // 3)
            started = time.monotonic()
            row, failure = warmed_attempt(device, fla_warmups(case, torch.bfloat16), deadline, len(cases) - index, run)
            part.record({"family": case, "policy": "param bfloat16, reduce float32", "groups": len(groups),
                         **(row or failure), "seconds": time.monotonic() - started})


# -- ops ------------------------------------------------------------------------------------------------------------

def op_inputs(case: OpCase, seg_len: int, device: torch.device) -> list:
    """float64 (q, k_prefix, v_prefix, k_self, v_self[, sinks]) of one sequence, values already rounded to
    bfloat16."""
    q_heads, kv_heads, dim, v_dim = case.shape
    gen = torch.Generator(device).manual_seed(0)
    shapes = [(1, q_heads, seg_len, dim), (1, kv_heads, case.prefix_len, dim), (1, kv_heads, case.prefix_len, v_dim),
              (1, kv_heads, seg_len, dim), (1, kv_heads, seg_len, v_dim)]
    if case.op == "window_attention":
        shapes.append((q_heads,))
    return [torch.randn(*s, generator=gen, device=device).bfloat16().double() for s in shapes]


def with_grads(fn: Callable, inputs: list, weight: torch.Tensor, dtype: torch.dtype,
               names: tuple[str, ...]) -> tuple[dict, float, int | None]:
    """(output and input gradients of sum(fn(*inputs in dtype) * weight) by ``names``, seconds, peak CUDA bytes
    above those allocated when it starts (its inputs included), or None off CUDA)."""
    xs = [x.to(dtype).requires_grad_() for x in inputs]
    sync = torch.cuda.synchronize if weight.is_cuda else (lambda: None)
    sync()
    if weight.is_cuda:
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    started = time.perf_counter()
    out, grads = fn(xs, weight.to(dtype))
    sync()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() - allocated if weight.is_cuda else None
    return dict(zip(names, (out, *grads), strict=True)), seconds, peak


def autograd_op(op: Callable, scale: float) -> Callable:
    def run(xs, weight):
        out = op(*xs, scale)
        return out.detach(), torch.autograd.grad((out * weight).sum(), xs)
    return run


def pass_q_two_ranks(scale: float) -> Callable:
    """What ``ops.attention.cp``'s fused pass-Q computes on two ranks, in one process: the prefix rows and the own
    keys split in halves, each half's fused partial attention of all queries (``OwnKeyRule`` of rank r), merged by
    logsumexp; each half's kernel backward given the merged output and logsumexp (the ring identity)."""
    def run(xs, weight):
        q, k_prefix, v_prefix, k_self, v_self = (x.detach() for x in xs)
        dtype = fused_kernel_dtype(q.device, q.dtype, q.shape[1], k_self.shape[1], q.shape[-1], v_self.shape[-1])
        half_p, half_t = k_prefix.shape[-2] // 2, q.shape[-2] // 2
        shards = [(slice(0, half_p), slice(0, half_t)), (slice(half_p, None), slice(half_t, None))]
        rules = [OwnKeyRule(0, True), OwnKeyRule(half_t, True)]
        keys = [(k_prefix[..., p, :], v_prefix[..., p, :], k_self[..., t, :], v_self[..., t, :]) for p, t in shards]
        parts = [fused_partial_forward(q, *kv, scale, dtype, rule) for kv, rule in zip(keys, rules, strict=True)]
        lse = torch.logsumexp(torch.stack([part_lse for _, part_lse, _ in parts]), dim=0)
        out = sum(o * (part_lse - lse).exp().unsqueeze(-1) for o, part_lse, _ in parts).to(q.dtype)
        grads = [fused_partial_backward(weight, q, *kv, out, lse, scale, dtype, rule, extras)
                 for kv, rule, (_, _, extras) in zip(keys, rules, parts, strict=True)]
        grad_q = sum(g[0] for g in grads).to(q.dtype)  # float32 shares, rounded once
        joined = [torch.cat([g[i] for g in grads], dim=-2) for i in range(1, 5)]
        return out, (grad_q, *joined)
    return run


def windowed(window: int | None) -> Callable:
    """``window_attention`` with ``window`` as an op of (q, k_prefix, v_prefix, k_self, v_self, sinks, scale)."""
    def op(q, k_prefix, v_prefix, k_self, v_self, sinks, scale):
        return window_attention(q, k_prefix, v_prefix, k_self, v_self, scale, window, sinks)
    return op


def windowed_reference(window: int | None) -> Callable:
    def op(q, k_prefix, v_prefix, k_self, v_self, sinks, scale):
        return window_attention_reference(q, k_prefix, v_prefix, k_self, v_self, scale, window, sinks)
    return op


def gpt_oss_eager(window: int | None) -> Callable:
    """gpt-oss's standard path as an op of ``windowed``'s arguments: transformers' ``eager_attention_forward`` of
    the model (scores, sinks and softmax in the inputs' dtype) over the prefix rows and the segment's keys with the
    model's additive mask (the segment's query i at position P + i sees key j when i - W < j - P <= i)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    def op(q, k_prefix, v_prefix, k_self, v_self, sinks, scale):
        past, length = k_prefix.shape[-2], q.shape[-2]
        offset = (torch.arange(past, past + length, device=q.device)[:, None]
                  - torch.arange(past + length, device=q.device))
        visible = (offset >= 0) & (offset < window if window is not None else True)
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible,
                                                                                      torch.finfo(q.dtype).min)
        module = SimpleNamespace(num_key_value_groups=q.shape[1] // k_self.shape[1], sinks=sinks, training=False)
        out, _ = eager_attention_forward(module, q, torch.cat([k_prefix, k_self], dim=-2),
                                         torch.cat([v_prefix, v_self], dim=-2), mask[None, None], scale)
        return out.transpose(1, 2)
    return op


class PinnedSdpa:
    """A run of the SDPA baseline on one backend: the first of SDPA_BACKENDS[device] that takes its inputs (the
    mem-efficient and cuDNN kernels round P as the fused op does; the math backend keeps float32 inside, a better
    baseline by 1.35-1.4x in bfloat16), kept for every later call and named by ``backend``."""

    def __init__(self, run: Callable, device: torch.device):
        self.run, self.candidates, self.backend = run, SDPA_BACKENDS[device.type], None

    def __call__(self, xs, weight):
        for name in (self.backend,) if self.backend else self.candidates:
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    out = self.run(xs, weight)
            except RuntimeError as error:
                if "No available kernel" not in str(error) or name == self.candidates[-1]:
                    raise
                continue
            self.backend = name
            return out
        raise AssertionError("unreachable: the last backend raises")


def op_case(case: OpCase, seg_len: int, device: torch.device) -> dict:
    """One op on bfloat16 inputs against the float64 reference on the same values, with the standard path's own
    errors (``standard``: SDPA with an explicit mask on a pinned backend, or gpt-oss's eager attention; bfloat16) and
    ``error_ratio`` (the largest of the op's relative errors over the standard's); ``abs_errors``: the largest
    absolute differences from float64; seconds and peak memory of the op and of the standard path, each timed on its
    second run (the first builds kernels and cuDNN plans); ``paths``: the timed run's prefix-attention calls per
    path."""
    inputs = op_inputs(case, seg_len, device)
    scale = case.shape[2] ** -0.5
    weight = torch.randn(1, case.shape[0], seg_len, case.shape[3], generator=torch.Generator(device).manual_seed(1),
                         device=device, dtype=torch.float64)
    names = case.names
    if case.op == "window_attention":
        reference_op, standard_name = windowed_reference(case.window), "gpt_oss eager_attention_forward"
        run, standard_run = autograd_op(windowed(case.window), scale), autograd_op(gpt_oss_eager(case.window), scale)
    else:
        reference_op = prefix_causal_attention_reference
        run = pass_q_two_ranks(scale) if case.op == "pass_q_two_ranks" else autograd_op(prefix_causal_attention, scale)
        standard_run = PinnedSdpa(autograd_op(prefix_causal_attention_reference, scale), device)
    with sdpa_kernel(SDPBackend.MATH):  # float64: the math backend only
        reference, _, _ = with_grads(autograd_op(reference_op, scale), inputs, weight, torch.float64, names)
    for warm_up in (run, standard_run):
        with_grads(warm_up, inputs, weight, torch.bfloat16, names)
    before = ATTENTION_PATHS.copy()  # the stage's record (KernelRecorder) keeps every row's calls
    result, seconds, peak = with_grads(run, inputs, weight, torch.bfloat16, names)
    paths = dict(ATTENTION_PATHS - before)
    standard, standard_seconds, standard_peak = with_grads(standard_run, inputs, weight, torch.bfloat16, names)
    if isinstance(standard_run, PinnedSdpa):
        standard_name = f"sdpa {standard_run.backend}"

    def error(x: torch.Tensor, k: str) -> float:  # relative L2 against the float64 reference
        return float((x.double() - reference[k]).norm() / reference[k].norm())

    errors = {k: error(result[k], k) for k in names} | {f"standard_{k}": error(standard[k], k) for k in names}
    abs_errors = {k: float((result[k].double() - reference[k]).abs().max()) for k in names} | {
        f"standard_{k}": float((standard[k].double() - reference[k]).abs().max()) for k in names}
    ratio = max(errors[k] / max(errors[f"standard_{k}"], 1e-30) for k in names)
    return {"shape": case.shape_name, "op": case.op, "window": case.window, "T": seg_len, "P": case.prefix_len,
            "paths": paths, "standard": standard_name, "errors": errors, "abs_errors": abs_errors,
            "error_ratio": ratio, "passed": no_worse_than_standard(errors, torch.bfloat16), "seconds": seconds,
            "standard_seconds": standard_seconds, "peak_bytes": peak, "standard_peak_bytes": standard_peak}


def ops(device: torch.device, options: SimpleNamespace, deadline: float, part: Part) -> None:
    """The prefix-attention ops at a real layer's shapes (bfloat16, forward + backward), each against float64."""
    seg_len = 16 if options.tiny else 1024
    cases = part.plan(op_cases(options.tiny), lambda case: {"shape": case.shape_name, "op": case.op})
    for index, case in enumerate(cases):
        row, failure = attempt(case_deadline(deadline, len(cases) - index),
                               functools.partial(op_case, case, seg_len, device))
        part.record(row or {"shape": case.shape_name, "op": case.op, **failure})


# -- scale ----------------------------------------------------------------------------------------------------------

def scale_configs(tiny: bool) -> dict[str, transformers.PretrainedConfig]:
    """Real-width (or, with ``tiny``, small) random-init stacks with few layers and a small vocabulary."""
    if tiny:
        return {name: tiny_model(family).config for name, family in TINY_FAMILY.items()}
    qwen = transformers.Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=5120, intermediate_size=17408, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=24, num_key_value_heads=4,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=1 << 22, tie_word_embeddings=False,
    )
    glm = transformers.GlmMoeDsaConfig(
        vocab_size=4096, hidden_size=6144, intermediate_size=12288, num_hidden_layers=3, num_attention_heads=64,
        num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, n_routed_experts=16, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, index_topk=1 << 22, index_n_heads=32, index_head_dim=128,
        max_position_embeddings=1 << 22, tie_word_embeddings=False,
    )
    return {"qwen3_5_27b_dims": qwen, "glm5_dims": glm}


def build(config, device: torch.device, dtype: torch.dtype):
    use_reference_kernels(config)
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for module in model.modules():  # keep random-init activations in range at real widths
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    return model.train()


SCALE_PATHS = {2: ("standard", "exact", "detached"),
               8: ("standard", "exact", "detached", "exact_host", "exact_streamed")}
# the knobs of each replay path besides ``prompt_grad`` and ``chunk_size``
PATH_KNOBS = {"exact": {}, "detached": {}, "exact_host": {"state_grad_on_host": True},
              "exact_streamed": {"state_grad_on_host": True, "state_on_host": True}}
HOST_PATHS = ("exact_host", "exact_streamed")  # the paths that keep bytes in host memory


def path_knobs(path: str, chunk_size: int) -> Knobs:
    """The ``Knobs`` of a replay ``path`` (a ``PATH_KNOBS`` key)."""
    return Knobs(prompt_grad=path.partition("_")[0], chunk_size=chunk_size, **PATH_KNOBS[path])


def run_path(model, path: str, prompt, responses, chunk_size: int) -> None:
    """One group's gradients on ``path`` ("standard" or a ``PATH_KNOBS`` key: "exact", "detached", "exact_host":
    exact with ``state_grad_on_host``, "exact_streamed": and ``state_on_host``) into ``model``'s .grad."""
    if path == "standard":
        standard_backward(model, prompt, responses)
    else:
        model.zero_grad(set_to_none=True)
        group_backward(model, prompt, responses, weighted_loss, knobs=path_knobs(path, chunk_size))


def measure(model, path: str, prompt, responses, chunk_size: int, device: torch.device) -> tuple[int, float]:
    """(peak bytes, seconds) of one group on ``path``."""
    model.zero_grad(set_to_none=True)  # the last group's gradients are not this one's peak
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        run_path(model, path, prompt, responses, chunk_size)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), time.perf_counter() - start
    start = time.perf_counter()
    with parameter_meter(model) as meter:
        run_path(model, path, prompt, responses, chunk_size)
    return meter.peak, time.perf_counter() - start


def scale_step(model, config, path: str, prompt, responses, chunk_size: int, device: torch.device,
               dtype: torch.dtype) -> dict:
    """One scale row's results: ``measure``'s peak bytes and seconds, and for the replay paths ``estimate_memory``'s
    total bytes of the same group; a ``HOST_PATHS`` row: the host bytes asked at the peak and the estimate's."""
    host_memory.reset_peak()
    host_before = host_memory.live
    peak, seconds = measure(model, path, prompt, responses, chunk_size, device)
    row = {"fits": True, "peak_bytes": peak, "seconds": seconds, "estimated_total_bytes": None}
    if path != "standard":
        knobs = path_knobs(path, chunk_size)
        estimate = estimate_memory(config, len(prompt), len(responses), len(responses[0]), chunk_size,
                                   knobs.prompt_grad, dtype, state_grad_on_host=knobs.state_grad_on_host,
                                   state_on_host=knobs.state_on_host)
        row["estimated_total_bytes"] = estimate.total_bytes
        if path in HOST_PATHS:
            row |= {"host_peak_bytes": host_memory.peak - host_before, "estimated_host_bytes": estimate.host_bytes}
    return row


def next_step_seconds(seconds: list[float]) -> float:
    """Predicted seconds of a series' next step (P doubled) from its steps so far: STEP_GROWTH x the last one, or
    the growth between the last two where that is larger; 0 before the first."""
    if not seconds:
        return 0.0
    growth = seconds[-1] / seconds[-2] if len(seconds) > 1 and seconds[-2] > 0 else STEP_GROWTH
    return seconds[-1] * max(STEP_GROWTH, growth)


def scale_model(name: str, config, tiny: bool, device: torch.device, dtype: torch.dtype):
    if tiny:
        with device:
            return tiny_model(TINY_FAMILY[name])
    return build(config, device, dtype)


def scale(device: torch.device, options: SimpleNamespace, deadline: float, part: Part) -> None:
    """Peak memory and seconds per (model, G, path, P); P doubles until OOM or the time limit. On CUDA each (model, G,
    path) series first runs once at WARM_PROMPT_LEN, outside its steps' clock: triton compiles fla's kernels at the
    shapes that path uses (the standard path's as transformers calls them), cuBLAS and cuDNN build their plans."""
    configs = scale_configs(options.tiny)
    start_len, max_len = (128, 1024) if options.tiny else (4096, 1 << 21)
    response_len, chunk_size = (16, 64) if options.tiny else (256, 8192)
    dtype = torch.float32 if options.tiny else torch.bfloat16  # CPU bf16 Gated DeltaNet is too slow for a smoke test
    planned = part.plan([(name, g, path) for name in configs for g, paths in SCALE_PATHS.items() for path in paths],
                        lambda run: {"model": run[0], "G": run[1], "path": run[2]})
    series: dict[str, list[tuple[int, str]]] = {}
    for name, g, path in planned:
        series.setdefault(name, []).append((g, path))
    for model_index, (name, runs) in enumerate(series.items()):
        config = configs[name]
        model_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(series) - model_index)
        model, failure = attempt(model_deadline, functools.partial(scale_model, name, config, options.tiny, device,
                                                                   dtype))
        if model is None:
            for group_size, path in runs:
                part.record({"model": name, "G": group_size, "path": path, "fits": None, **failure})
            continue
        for index, (group_size, path) in enumerate(runs):
            head = {"model": name, "G": group_size, "path": path, "T": response_len}
            failure = None
            if device.type == "cuda":  # within the model's time, before the series' clock starts
                warm = make_group(config.vocab_size, WARM_PROMPT_LEN, [response_len] * group_size, device=device)
                _, failure = attempt(model_deadline, functools.partial(run_path, model, path, *warm, chunk_size))
            if failure is not None:
                part.record({**head, "P": WARM_PROMPT_LEN, "warm_up": True, "fits": None, **failure})
            series_deadline = time.monotonic() + (model_deadline - time.monotonic()) / (len(runs) - index)
            prompt_len, seconds = start_len, []
            while (failure is None and prompt_len <= max_len
                   and time.monotonic() + next_step_seconds(seconds) < series_deadline):
                prompt, responses = make_group(config.vocab_size, prompt_len, [response_len] * group_size,
                                               seed=prompt_len, device=device)
                step = functools.partial(scale_step, model, config, path, prompt, responses, chunk_size, device,
                                         dtype)
                row, failure = attempt(series_deadline, step)
                if row is None:
                    out_of_memory = failure["skipped"] == "out of memory"
                    part.record({**head, "P": prompt_len, **({"fits": False} if out_of_memory else
                                                             {"fits": None, **failure})})
                else:
                    part.record({**head, "P": prompt_len, **row})
                    seconds.append(row["seconds"])
                    prompt_len *= 2
            model.zero_grad(set_to_none=True)
        del model
        free_memory()


# -- the process ----------------------------------------------------------------------------------------------------

class KernelRecorder(logging.Handler):
    """Which kernels ran in the stage: ``attention`` (prefix_causal_attention calls per path, ATTENTION_PATHS) and
    ``gated_delta_rule`` (the paths the gated delta rule logged: flash-linear-attention or plain torch, and why)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.gated_delta_rule: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.gated_delta_rule.add(record.getMessage().removeprefix("gated delta rule: "))

    @contextlib.contextmanager
    def recording(self, part: Part):
        gdn.logger.addHandler(self)
        level = gdn.logger.level
        gdn.logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            gdn.logger.removeHandler(self)
            gdn.logger.setLevel(level)
            part.kernels = {"attention": dict(ATTENTION_PATHS), "gated_delta_rule": sorted(self.gated_delta_rule)}


def versions(device: torch.device) -> dict:
    """python, torch, CUDA, transformers, flash-linear-attention and triton versions; whether fla's kernel imports."""

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "flash-linear-attention": version("flash-linear-attention"), "triton": version("triton"),
        "fla_kernel_importable": fla_in_use(device),  # imports fla (and triton) only on CUDA, as the rule does
    }


class Part:
    """This stage's rows and facts, written to ``path`` as JSON after every row (replaced whole: a killed process
    leaves the last complete one)."""

    def __init__(self, path: Path, stage: str, device: torch.device, device_name: str,
                 skip: frozenset[str] = frozenset()):
        self.path, self.stage, self.skip = path, stage, skip
        self.facts = {"stage": stage, "device": device_name, "machine": describe(machine()),
                      "versions": versions(device)}
        self.planned: list[str] = []
        self.rows: list[dict] = []
        self.kernels: dict = {}
        self.stage_error: str | None = None
        self.write()

    def write(self) -> None:
        text = json.dumps({**self.facts, "planned": self.planned, "rows": self.rows, "kernels": self.kernels,
                           "stage_error": self.stage_error, "seconds": time.monotonic() - STARTED}, indent=1)
        staged = self.path.with_name(f"{self.path.name}.partial")
        staged.write_text(text)
        staged.replace(self.path)

    def plan(self, items: list, fields: Callable[[Any], dict]) -> list:
        """Of ``items`` (the stage's rows, in order; ``fields(item)``: the row fields ``row_key`` names a row by),
        those whose key is not skipped: the rows this process will run, planned before the first runs."""
        keyed = [(row_key(self.stage, fields(item)), item) for item in items]
        kept = [(key, item) for key, item in keyed if key not in self.skip]
        self.planned = [key for key, _ in kept]
        self.write()
        return [item for _, item in kept]

    def record(self, row: dict) -> None:
        """Add ``row`` (its ``key`` set here) and rewrite the part; DeviceLost when the row's failure lost the
        device (``"device_lost"``), which ends the stage."""
        self.rows.append({"key": row_key(self.stage, row), **row})
        self.write()
        if "device_lost" in row:
            raise DeviceLost(row["device_lost"])


@contextlib.contextmanager
def float32_without_tf32() -> Iterator[None]:
    """float32 matmuls and cuDNN convolutions in full float32 inside (torch lets cuDNN use TF32 by default),
    restored on exit, so that the float32 rows compare float32 arithmetic. Through the ``allow_tf32`` flags: they
    set cuDNN's convolutions and RNNs alike, where reading them after the per-op ``fp32_precision`` setters raises."""
    found = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = found


RUNNERS = {"ops": ops, "scale": scale, "equivalence": equivalence, "fsdp2": fsdp2}


def run_stage(stage: str, part_path: Path, until: float, tiny: bool = False,
              cases: tuple[str, ...] = CASES_NEWEST_FIRST, skip: frozenset[str] = frozenset()) -> Part:
    """Run ``stage`` until the monotonic time ``until`` into the part at ``part_path`` (module docstring), on CUDA
    unless ``tiny`` (CPU, small sizes); ``cases``: the equivalence / FSDP2 cases, newest first; ``skip``: row keys
    not to run."""
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    try:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        lost = None
    except Exception as error:
        device_name, lost = "unusable", f"CUDA failed at the start: {type(error).__name__}: {error}"[:500]
    part = Part(part_path, stage, device, device_name, skip)
    if lost is not None:
        part.stage_error = lost
        part.write()
        return part
    options = SimpleNamespace(tiny=tiny, cases=cases, prompt_len=PROMPT_LEN)
    recorder = KernelRecorder()
    try:
        with float32_without_tf32(), recorder.recording(part):
            RUNNERS[stage](device, options, until, part)
    except DeviceLost as error:
        part.stage_error = f"DeviceLost: {error}"
    except Exception as error:  # outside its rows (NCCL start, building configs): the stage ends
        text = "".join(traceback.format_exception(error))
        print(text, file=sys.stderr, flush=True)
        part.stage_error = text[-TRACEBACK_CHARS:]
    part.write()
    return part


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=STAGES, required=True)
    parser.add_argument("--part", type=Path, required=True, help="the JSON this stage writes")
    parser.add_argument("--until", type=float, required=True, help="the stage's deadline, time.monotonic() seconds")
    parser.add_argument("--tiny", action="store_true", help="CPU, small sizes")
    parser.add_argument("--families", nargs="+", choices=CASES_NEWEST_FIRST, default=CASES_NEWEST_FIRST)
    parser.add_argument("--skip-file", type=Path, help="JSON list of row keys not to run")
    args = parser.parse_args(argv)
    skip = frozenset(json.loads(args.skip_file.read_text())) if args.skip_file else frozenset()
    cases = tuple(case for case in CASES_NEWEST_FIRST if case in args.families)
    run_stage(args.stage, args.part, args.until, args.tiny, cases, skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
