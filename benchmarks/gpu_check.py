"""One-command GPU check of what a real GPU run uses: equivalence (plain, bf16, autocast, FSDP2), then
memory and time at growing prompt length, under a hard time budget.

    python benchmarks/gpu_check.py            # one GPU, stops inside 8 minutes on an H200 (--budget-seconds)
    python benchmarks/gpu_check.py --tiny     # CPU smoke run at tiny sizes (tests/test_gpu_check.py)

Stages (each gets a share of ``--budget-seconds``, 480 s by default; ``--<stage>-seconds`` override it):
1. equivalence: tiny random models of every family and of every ``tiny.VARIANTS`` model type (the MoE blocks,
   DeepSeek-V3.2, Nemotron-H's Mamba2, Kimi Linear's KDA, gpt-oss's sliding windows and sinks; glm_moe_dsa and
   deepseek_v32 with ``index_topk`` below the prompt, so DSA's sparse top-k selection runs), and of each
   ``CONFIG_VARIANTS`` case (glm_moe_dsa with GLM-5.2's shared indexer layers), against the float32 standard
   full-sequence path: replay log-probs (``group_log_probs``) and chunked exact gradients (``group_backward``) of
   the model in float32 (within TOLERANCE), cast to bfloat16, and in float32 under ``torch.autocast(bfloat16)``
   as veRL's engine runs it. The bfloat16 rows pass when no worse than the standard path's own error in the same
   dtype / under the same autocast, in the same run (``verl_longstraw.testing.no_worse_than_standard``);
2. fsdp2: a world-size-1 process group (gloo on CPU, nccl on CUDA), every decoder layer and the root
   ``fully_shard``-ed with veRL's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``;
   as the engine does, parameters held unsharded (``held_unsharded``) under autocast, exact
   ``group_backward``, gradients reduce-scattered (``sync_gradients``); full gradients and log-probs
   compared with the unwrapped float32 standard path, bounded by the standard path's error on the same
   wrapped model under the same policy;
3. ops: the prefix-attention ops at a real layer's shapes (Qwen3.5-27B attention, GLM-5 MLA absorbed; P 8192,
   T 1024), bfloat16 forward + backward against float64 on the same values, bounded by the standard path's
   (SDPA with a mask) own error, with seconds and peak memory of both: the dispatch (fused flash kernels; the
   blocked op with half matmul operands for MLA) and context-parallel pass-Q's arithmetic on two key shards;
4. scale: random-init layer stacks at real widths (Qwen3.5-27B: hidden 5120, 3 Gated DeltaNet + 1
   full-attention layer; GLM-5: MLA, hidden 6144, 3 layers), bfloat16; for standard / exact
   (chunked) / detached and G in {2, 8}, P doubles until the path runs out of memory or time (each
   (model, G, path) series gets an equal share of the stage's time); peak
   memory is ``torch.cuda.max_memory_allocated`` (on CPU: bytes saved for backward, SavedTensorMeter);
5. report: JSON and markdown under ``--out`` (``benchmarks/results/`` by default), written at the start and
   rewritten after every row (the markdown of each stage is printed when it ends): the rows, the longest P
   that fits per path, which kernels ran per stage (prefix-attention calls per path, the gated delta rule's
   kernel: flash-linear-attention or plain torch), the python / torch / CUDA / transformers / triton / fla
   versions, stage errors, stages not run and why, and the stages that compared nothing.
The standard path's Gated DeltaNet in the equivalence and FSDP2 stages is the token-by-token reference
(``verl_longstraw.testing.reference_linear_attention``: transformers would take fla's TF32 kernel whenever fla
imports), and float32 runs without TF32 (``torch.backends.cudnn.allow_tf32`` is on by default).
A case (one row) that overruns its time is interrupted (SIGALRM) and recorded as ``{"skipped": "time
limit"}``, one that runs out of device memory (cuBLAS / cuDNN allocation failures included) as ``"out of
memory"``, any other failure as ``"error: ..."`` with its traceback. A sticky CUDA error (an illegal memory
access, after which every CUDA call raises) ends its stage, and the later stages are recorded as not run; a
failure outside a case ends its stage only. The clock starts before the imports. The script exits non-zero
when a stage compared nothing (every row skipped or failed), naming the stage(s) on stderr and in the report.
Needs torch and transformers only (flash-linear-attention when installed, warmed at each shape before a case's
clock starts); from a checkout with nothing installed: ``PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out
DIR`` (``benchmarks/device_run.sh`` on a lent GPU machine, see ``benchmarks/README.md``).
"""

from __future__ import annotations

# ruff: noqa: E402  (the clock and the checkout's place on sys.path come before the imports they cover)
import sys
import time

IMPORTS_STARTED = time.monotonic()  # the run's clock: the budget counts the imports (10-20 s on a GPU machine)

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `python3 benchmarks/gpu_check.py` imports this checkout's package, installed or not

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
from typing import Any

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from verl_longstraw import group_backward, group_log_probs
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.machine import describe, machine
from verl_longstraw.memory import parameter_meter
from verl_longstraw.ops import gated_delta_rule as gdn
from verl_longstraw.ops.attention import ATTENTION_PATHS, prefix_causal_attention, prefix_causal_attention_reference
from verl_longstraw.ops.blocked_attention import OwnKeyRule
from verl_longstraw.ops.fused_attention import fused_kernel_dtype, fused_partial_backward, fused_partial_forward
from verl_longstraw.parallel.fsdp2 import held_unsharded, sync_gradients  # torch only: runs without veRL
from verl_longstraw.testing import (
    full_log_probs,
    grads_of,
    make_group,
    max_abs_error,
    no_worse_than_standard,
    reference_linear_attention,
    relative_error,
    replay_errors,
    standard_grads,
    weighted_loss,
)
from verl_longstraw.tiny import FAMILIES, VARIANTS, VOCAB, tiny_config, tiny_model, use_reference_kernels

TINY_FAMILY = {"qwen3_like": "qwen3", "glm5_like": "glm_moe_dsa"}  # metered CPU standard GDN is slow
TOLERANCE = 1e-4  # float32: max |log p| error and gradient relative L2
# DSA's top-k selection below the prompt length; 16 indexer heads make exact score ties improbable
OVERRIDES = {family: {"index_topk": 24, "index_n_heads": 16} for family in ("glm_moe_dsa", "deepseek_v32")}
# gpt_oss with every expert routed (top-4 of 4): its router's top-2 is so near ties in the tiny model that a bf16
# rounding flips tokens' experts on either path, and the max over groups then compares luck (AMD EPYC CPU, P 301,
# three groups, replay / standard: autocast gradient error 0.060 / 0.037, FSDP2 0.072 / 0.044; per group the sign of
# the difference varies, plain bf16 max log-prob error 0.084 / 0.066, 0.062 / 0.029, 0.004 / 0.102). Every expert
# routed: 0.0025 / 0.0023 log-prob, 0.0060 / 0.0050 gradient under autocast. Routing exactness is the float32 tests'.
OVERRIDES["gpt_oss"] = {"num_experts_per_tok": 4}
# equivalence cases besides one per family: name -> (family, config fields set on top of the family's OVERRIDES).
# GLM-5.2's DSA layout (transformers' GlmMoeDsaConfig.indexer_types) on the 3-layer tiny model: the first layer runs
# its indexer, the other two reuse its top-k selection ("shared": no indexer, no indexer keys in the prompt state)
CONFIG_VARIANTS = {"glm_moe_dsa_shared_indexer": ("glm_moe_dsa", {"indexer_types": ["full", "shared", "shared"]})}
# Groups (random prompts and responses) per row for families whose half-precision error is dominated by discrete
# top-k selection: a near-tie that rounds the other way swaps a selected key and moves that token's log-prob by
# orders of magnitude more than rounding does, on either path, so one group's max errors compare the paths' luck
# more than their arithmetic (tiny glm_moe_dsa under FSDP2, seeds 0-3: replay/standard log-prob error 2.9, 1.0,
# 1.6, 0.8). Such a row compares each path's largest error over the groups.
SELECTION_GROUPS = {"glm_moe_dsa": 3, "deepseek_v32": 3}  # per family, its CONFIG_VARIANTS cases included
SHARES = {"equivalence": 0.25, "fsdp2": 0.15, "ops": 0.1, "scale": 0.5}  # of the budget after RESERVE_SECONDS
RESERVE_SECONDS = 30.0  # CUDA teardown, the last report and a backward that overruns its case (the imports are on
# the clock already)
AUTOCAST = "autocast_bfloat16"
# the attention op of a real layer: (query heads, key heads, query/key dim, value dim); MLA absorbed (latent + rope)
OP_SHAPES = {"qwen3.5-27b attention": (24, 4, 256, 256), "glm-5 mla absorbed": (64, 1, 576, 512)}
TINY_OP_SHAPES = {"attention": (4, 2, 32, 32), "mla absorbed": (4, 1, 40, 32)}
OP_NAMES = ("out", "q", "k_prefix", "v_prefix", "k_self", "v_self")
STAGES = tuple(SHARES)
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


class CaseTimeout(BaseException):
    """A case ran past its time limit (raised by the SIGALRM handler of ``attempt``); a BaseException, as
    KeyboardInterrupt, so that library code's ``except Exception`` does not swallow it."""


class DeviceLost(RuntimeError):
    """The device failed so that every later call on it fails too (a sticky CUDA error): the stage ends, and the
    later stages, which run on the same device, are recorded as not run."""


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks; DeviceLost when CUDA fails on that (a sticky error of the case
    before surfaces here)."""
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception as error:
            raise DeviceLost(f"freeing CUDA memory failed: {type(error).__name__}: {error}"[:500]) from error


def failure_fields(error: Exception) -> dict:
    """The row fields of a case that raised ``error``: ``{"skipped": "out of memory"}`` (torch.OutOfMemoryError,
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
    ``record`` ends the stage) is decided by freeing memory after the failure where CUDA is available (it fails
    after a sticky error, whatever the message said), else by the message.

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
    except Exception as error:  # one failing case must not end a one-shot GPU run
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


def case_deadline(deadline: float, cases_left: int) -> float:
    """When a case must stop: it may take half the stage's remaining time (all of it when it is the last), so a slow
    first case (CUDA start, triton compiling fla's kernels) still runs and no case starves all later ones."""
    return time.monotonic() + (deadline - time.monotonic()) / min(max(cases_left, 1), 2)


def errors_in(reference, model, prompt, responses, chunk_size: int, run: Callable) -> dict:
    """Errors against ``reference``'s float32 standard path (unwrapped, no autocast) of ``model``'s replay
    (``log_prob``, ``grad``: max |log p| error, gradient relative L2) and of ``model``'s own standard path
    (``standard_log_prob``, ``standard_grad``), each run as ``run(model, fn)`` -> (fn's log-probs, full gradients)."""
    expected = standard_grads(reference, prompt, responses, weighted_loss)
    with torch.no_grad():
        expected_lp = [full_log_probs(reference, prompt, r)[0] for r in responses]

    def standard():
        standard_grads(model, prompt, responses, weighted_loss)
        with torch.no_grad():
            return [full_log_probs(model, prompt, r)[0] for r in responses]

    def replay():
        log_probs = group_log_probs(model, prompt, responses, chunk_size=chunk_size).log_probs
        group_backward(model, prompt, responses, weighted_loss, prompt_grad="exact", chunk_size=chunk_size)
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


def case_config(case: str) -> tuple[str, dict]:
    """(family, tiny-config overrides) of equivalence / FSDP2 case ``case``: a family with its ``OVERRIDES``, or a
    ``CONFIG_VARIANTS`` entry's family with its fields on top of them."""
    family, fields = CONFIG_VARIANTS.get(case, (case, {}))
    return family, {**OVERRIDES.get(family, {}), **fields}


def row_groups(case: str, prompt_len: int, device: torch.device) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The (prompt, responses) groups one row of ``case`` compares on (``SELECTION_GROUPS`` of its family; one
    otherwise): a prompt of ``prompt_len`` tokens and three responses of about a tenth, one and a fifth of it."""
    lengths = (prompt_len // 10 + 1, 1, prompt_len // 5)
    return [make_group(VOCAB, prompt_len, lengths, seed=seed, device=device)
            for seed in range(SELECTION_GROUPS.get(case_config(case)[0], 1))]


def largest_errors(groups: list, errors_of: Callable[[torch.Tensor, list[torch.Tensor]], dict]) -> dict:
    """Each error of ``errors_of(prompt, responses)`` at its largest over ``groups``."""
    per_group = [errors_of(prompt, responses) for prompt, responses in groups]
    return {k: max(errors[k] for errors in per_group) for k in per_group[0]}


def equivalence_case(models: dict, case: str, name: str, device: torch.device, groups: list,
                     chunk_size: int) -> dict:
    """One equivalence row's errors (largest over ``groups``, ``row_groups``) and verdict for ``case`` (a family or a
    ``CONFIG_VARIANTS`` name) in dtype ``name``; ``models`` caches the case's float32 model between its dtypes. The
    standard path's Gated DeltaNet is the reference recurrence (``reference_linear_attention``)."""
    if case not in models:
        models.clear()
        family, overrides = case_config(case)
        with device:
            models[case] = tiny_model(family, **overrides)
    reference = models[case]
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


def fla_shapes(case: str, dtype: torch.dtype) -> set[tuple]:
    """The (key heads, value heads, key dim, value dim, dtype) at which replay runs the gated delta rule of
    ``case``'s tiny model (``case_config``) in ``dtype`` (empty for a model without Gated DeltaNet layers)."""
    family, overrides = case_config(case)
    config = tiny_config(family, **overrides)
    if not hasattr(config, "linear_num_value_heads"):
        return set()
    return {(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim, dtype)}


WARMED_FLA_SHAPES: set[tuple] = set()


def fla_in_use(device: torch.device) -> bool:
    """Whether the gated delta rule runs flash-linear-attention's kernel for half-precision inputs on ``device``
    (CUDA, fla imports)."""
    return device.type == "cuda" and gdn._fla_chunk_gated_delta_rule() is not None


def warm_fla(device: torch.device, shapes: set[tuple]) -> None:
    """Run the gated delta rule forward and backward once, with and without an initial state, at each of
    ``shapes`` (``fla_shapes``) not run yet (on fla's kernel where ``fla_in_use``): triton compiles and autotunes
    it (about 90 configs per shape on a cold cache) before a case's clock starts."""
    for heads, v_heads, k_dim, v_dim, dtype in sorted(shapes - WARMED_FLA_SHAPES, key=str):
        gen = torch.Generator(device).manual_seed(0)
        sizes = [((heads, k_dim), dtype), ((heads, k_dim), dtype), ((v_heads, v_dim), dtype),
                 ((v_heads,), torch.float32), ((v_heads,), dtype)]  # q, k, v, g, beta [1, tokens, ...] as models pass
        q, k, v, g, beta = (torch.randn(1, FLA_WARM_TOKENS, *size, generator=gen, device=device, dtype=size_dtype)
                            for size, size_dtype in sizes)
        g, beta = -g.abs(), beta.sigmoid()  # log-decay <= 0, 0 < beta < 1
        state = torch.zeros(1, v_heads, k_dim, v_dim, device=device)
        for initial_state in (None, state.requires_grad_()):
            inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta)]
            out, final = gdn.gated_delta_rule(*inputs, initial_state=initial_state)
            (out.float().sum() + final.sum()).backward()
        WARMED_FLA_SHAPES.add((heads, v_heads, k_dim, v_dim, dtype))
    if device.type == "cuda":
        torch.cuda.synchronize()


def warmed_attempt(device: torch.device, shapes: set[tuple], deadline: float, cases_left: int, fn: Callable):
    """``attempt(fn)`` at its ``case_deadline``, taken after fla is warmed at ``shapes`` (``warm_fla``, within the
    stage's ``deadline``, where ``fla_in_use``); a failed warm-up is the case's failure."""
    if fla_in_use(device) and shapes - WARMED_FLA_SHAPES:
        _, failure = attempt(deadline, functools.partial(warm_fla, device, shapes))
        if failure is not None:
            return None, {**failure, "skipped": f"warming fla: {failure['skipped']}"}
    return attempt(case_deadline(deadline, cases_left), fn)


def equivalence(device: torch.device, families: tuple[str, ...], prompt_len: int, deadline: float,
                record: Callable[[dict], None]) -> None:
    """Replay vs the float32 standard path, per case (each of ``families``, then each ``CONFIG_VARIANTS`` entry) and
    dtype (float32, bfloat16, float32 under bfloat16 autocast), with the standard path's own errors in that dtype /
    under that autocast; each row ``record``-ed, its ``family`` the case's name."""
    rows = [(case, name) for case in (*families, *CONFIG_VARIANTS) for name in ("float32", "bfloat16", AUTOCAST)]
    models: dict = {}
    for index, (case, name) in enumerate(rows):
        groups = row_groups(case, prompt_len, device)
        run = functools.partial(equivalence_case, models, case, name, device, groups, prompt_len // 3)
        shapes = set() if name == "float32" else fla_shapes(case, torch.bfloat16)  # autocast: bf16 GDN inputs
        started = time.monotonic()
        row, failure = warmed_attempt(device, shapes, deadline, len(rows) - index, run)
        record({"family": case, "dtype": name, "groups": len(groups), **(row or failure),
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
    """One FSDP2 row's errors (largest over ``groups``, ``row_groups``) and verdict for ``case`` (``case_config``);
    the standard path's Gated DeltaNet is the reference recurrence."""
    family, overrides = case_config(case)
    with device:
        reference = tiny_model(family, **overrides)
    with reference_linear_attention(reference):
        model = fsdp2_wrap(copy.deepcopy(reference), device)
        errors = largest_errors(groups, lambda prompt, responses: errors_in(
            reference, model, prompt, responses, chunk_size, under_fsdp2(device)))
    return error_row(errors, no_worse_than_standard(errors, torch.bfloat16))


def fsdp2(device: torch.device, families: tuple[str, ...], prompt_len: int, deadline: float,
          record: Callable[[dict], None]) -> None:
    """Exact replay on a single-rank FSDP2 model (bfloat16 parameters, float32 reduction) vs the unwrapped float32
    standard path, bounded by the standard path's error on the same wrapped model under the same policy."""
    with process_group(device):
        for index, family in enumerate(families):
            groups = row_groups(family, prompt_len, device)
            case = functools.partial(fsdp2_case, family, device, groups, prompt_len // 3)
            started = time.monotonic()
            row, failure = warmed_attempt(device, fla_shapes(family, torch.bfloat16), deadline, len(families) - index,
                                          case)
            record({"family": family, "policy": "param bfloat16, reduce float32", "groups": len(groups),
                    **(row or failure),
                    "seconds": time.monotonic() - started})


def op_inputs(shape: tuple[int, int, int, int], seg_len: int, prefix_len: int, device: torch.device) -> list:
    """float64 (q, k_prefix, v_prefix, k_self, v_self) of one sequence, values already rounded to bfloat16."""
    q_heads, kv_heads, dim, v_dim = shape
    gen = torch.Generator(device).manual_seed(0)
    shapes = [(q_heads, seg_len, dim), (kv_heads, prefix_len, dim), (kv_heads, prefix_len, v_dim),
              (kv_heads, seg_len, dim), (kv_heads, seg_len, v_dim)]
    return [torch.randn(1, *s, generator=gen, device=device).bfloat16().double() for s in shapes]


def with_grads(fn: Callable, inputs: list, weight: torch.Tensor, dtype: torch.dtype) -> tuple[dict, float, int | None]:
    """(output and input gradients of sum(fn(*inputs in dtype) * weight), seconds, peak CUDA bytes above those
    allocated when it starts (its inputs included), or None off CUDA)."""
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
    return dict(zip(OP_NAMES, (out, *grads), strict=True)), seconds, peak


def autograd_op(op: Callable, scale: float) -> Callable:
    def run(xs, weight):
        out = op(*xs, scale)
        return out.detach(), torch.autograd.grad((out * weight).sum(), xs)
    return run


def pass_q_two_ranks(scale: float) -> Callable:
    """What ``parallel.attention``'s fused pass-Q computes on two ranks, in one process: the prefix rows and the own
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


def op_case(name: str, shape: tuple, op: str, seg_len: int, prefix_len: int, device: torch.device) -> dict:
    """One op on bfloat16 inputs against the float64 reference on the same values, with the standard path's own
    errors (SDPA with an explicit mask, bfloat16) and ``error_ratio`` (the largest of the op's errors over the
    standard's); seconds and peak memory of the op and of the standard path, each timed on its second run (the
    first builds kernels and cuDNN plans); ``paths``: the timed run's prefix_causal_attention calls per path."""
    inputs = op_inputs(shape, seg_len, prefix_len, device)
    scale = shape[2] ** -0.5
    weight = torch.randn(1, shape[0], seg_len, shape[3], generator=torch.Generator(device).manual_seed(1),
                         device=device, dtype=torch.float64)
    reference, _, _ = with_grads(autograd_op(prefix_causal_attention_reference, scale), inputs, weight, torch.float64)
    run = pass_q_two_ranks(scale) if op == "pass_q_two_ranks" else autograd_op(prefix_causal_attention, scale)
    standard_run = autograd_op(prefix_causal_attention_reference, scale)
    for warm_up in (run, standard_run):
        with_grads(warm_up, inputs, weight, torch.bfloat16)
    before = ATTENTION_PATHS.copy()  # the stage's record (KernelRecorder) keeps every case's calls
    result, seconds, peak = with_grads(run, inputs, weight, torch.bfloat16)
    paths = dict(ATTENTION_PATHS - before)
    standard, standard_seconds, standard_peak = with_grads(standard_run, inputs, weight, torch.bfloat16)
    def error(x: torch.Tensor, k: str) -> float:  # relative L2 against the float64 reference
        return float((x.double() - reference[k]).norm() / reference[k].norm())

    errors = {k: error(result[k], k) for k in OP_NAMES} | {f"standard_{k}": error(standard[k], k) for k in OP_NAMES}
    ratio = max(errors[k] / max(errors[f"standard_{k}"], 1e-30) for k in OP_NAMES)
    return {"shape": name, "op": op, "T": seg_len, "P": prefix_len, "paths": paths, "errors": errors,
            "error_ratio": ratio, "passed": no_worse_than_standard(errors, torch.bfloat16), "seconds": seconds,
            "standard_seconds": standard_seconds, "peak_bytes": peak, "standard_peak_bytes": standard_peak}


def ops(device: torch.device, tiny: bool, deadline: float, record: Callable[[dict], None]) -> None:
    """The prefix-attention ops at a real layer's shapes (bfloat16, forward + backward): the dispatch
    (``prefix_causal_attention``: the fused flash kernels, or for MLA the blocked op with half matmul operands) and
    the context-parallel pass-Q arithmetic on two key shards (fused kernels only), each against float64."""
    seg_len, prefix_len = (16, 48) if tiny else (1024, 8192)
    shapes = TINY_OP_SHAPES if tiny else OP_SHAPES
    op_names = ("prefix_causal_attention", "pass_q_two_ranks")
    cases = [(name, shape, op) for name, shape in shapes.items() for op in op_names
             if op != "pass_q_two_ranks" or shape[2] == shape[3]]  # pass-Q's fused path: value dim == key dim
    for index, (name, shape, op) in enumerate(cases):
        case = functools.partial(op_case, name, shape, op, seg_len, prefix_len, device)
        row, failure = attempt(case_deadline(deadline, len(cases) - index), case)
        record(row or {"shape": name, "op": op, **failure})


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


def run_path(model, path: str, prompt, responses, chunk_size: int) -> None:
    if path == "standard":
        standard_grads(model, prompt, responses, weighted_loss)
    else:
        model.zero_grad(set_to_none=True)
        group_backward(model, prompt, responses, weighted_loss, prompt_grad=path, chunk_size=chunk_size)


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
    total bytes of the same group."""
    peak, seconds = measure(model, path, prompt, responses, chunk_size, device)
    estimate = None if path == "standard" else estimate_memory(
        config, len(prompt), len(responses), len(responses[0]), chunk_size, path, dtype).total_bytes
    return {"fits": True, "peak_bytes": peak, "seconds": seconds, "estimated_total_bytes": estimate}


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


def scale(device: torch.device, tiny: bool, deadline: float, record: Callable[[dict], None]) -> None:
    """Peak memory and seconds per (model, G, path, P); P doubles until OOM or the time limit. On CUDA each (model, G,
    path) series first runs once at WARM_PROMPT_LEN, outside its steps' clock: triton compiles fla's kernels at the
    shapes that path uses (the standard path's as transformers calls them), cuBLAS and cuDNN build their plans."""
    configs = scale_configs(tiny)
    start_len, max_len = (128, 1024) if tiny else (4096, 1 << 21)
    response_len, chunk_size = (16, 64) if tiny else (256, 8192)
    dtype = torch.float32 if tiny else torch.bfloat16  # CPU bf16 Gated DeltaNet is too slow for a smoke test
    for model_index, (name, config) in enumerate(configs.items()):
        model_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(configs) - model_index)
        model, failure = attempt(model_deadline, functools.partial(scale_model, name, config, tiny, device, dtype))
        if model is None:
            record({"model": name, "fits": None, **failure})
            continue
        for group_size in (2, 8):
            for index, path in enumerate(("standard", "exact", "detached")):
                head = {"model": name, "G": group_size, "path": path, "T": response_len}
                failure = None
                if device.type == "cuda":  # within the model's time, before the series' clock starts
                    warm = make_group(config.vocab_size, WARM_PROMPT_LEN, [response_len] * group_size, device=device)
                    _, failure = attempt(model_deadline, functools.partial(run_path, model, path, *warm, chunk_size))
                if failure is not None:
                    record({**head, "P": WARM_PROMPT_LEN, "warm_up": True, "fits": None, **failure})
                series_left = 6 - 3 * (group_size == 8) - index  # this and the later series of this model
                series_deadline = time.monotonic() + (model_deadline - time.monotonic()) / series_left
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
                        record({**head, "P": prompt_len, **({"fits": False} if out_of_memory else
                                                            {"fits": None, **failure})})
                    else:
                        record({**head, "P": prompt_len, **row})
                        seconds.append(row["seconds"])
                        prompt_len *= 2
                model.zero_grad(set_to_none=True)
        del model
        free_memory()


class KernelRecorder(logging.Handler):
    """Which kernels ran in a stage: ``attention`` (prefix_causal_attention calls per path, ATTENTION_PATHS) and
    ``gated_delta_rule`` (the paths the gated delta rule logged: flash-linear-attention or plain torch, and why)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.gated_delta_rule: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.gated_delta_rule.add(record.getMessage().removeprefix("gated delta rule: "))

    @contextlib.contextmanager
    def stage(self, result: dict, name: str):
        ATTENTION_PATHS.clear()
        self.gated_delta_rule.clear()
        gdn._log_kernel_path.cache_clear()  # it logs each path once per process: once per stage here
        gdn.logger.addHandler(self)
        level = gdn.logger.level
        gdn.logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            gdn.logger.removeHandler(self)
            gdn.logger.setLevel(level)
            result["kernels"][name] = {"attention": dict(ATTENTION_PATHS),
                                       "gated_delta_rule": sorted(self.gated_delta_rule)}


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


def error_cells(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']} | | |"
    lp = f"{r['log_prob_error']:.2e} ({r['standard_log_prob_error']:.2e})"
    grad = f"{r['grad_rel_l2']:.2e} ({r['standard_grad_rel_l2']:.2e})"
    return f"{lp} | {grad} | {r['passed']} |"


ERROR_HEADER = "max abs log-prob error (standard path's) | gradient rel L2 (standard's) | passed |"


def family_cell(r: dict) -> str:
    """A row's family, with the number of groups its errors are the largest over when that is more than one."""
    groups = r.get("groups", 1)
    return r["family"] if groups == 1 else f"{r['family']} (largest of {groups} groups)"


def equivalence_markdown(rows: list[dict]) -> list[str]:
    return ["## Equivalence vs the float32 standard path", "", f"| family | dtype | {ERROR_HEADER}",
            "|---|---|---|---|---|", *(f"| {family_cell(r)} | {r['dtype']} | {error_cells(r)}" for r in rows)]


def fsdp2_markdown(rows: list[dict]) -> list[str]:
    return ["## FSDP2 (1 rank, bfloat16 parameters, float32 reduce, autocast) vs the float32 standard path", "",
            f"| family | {ERROR_HEADER}", "|---|---|---|---|",
            *(f"| {family_cell(r)} | {error_cells(r)}" for r in rows)]


def ops_markdown(rows: list[dict]) -> list[str]:
    lines = ["## Attention ops, bfloat16 forward + backward, vs float64 (relative L2 of output and input "
             "gradients; standard: SDPA with a mask in bfloat16)", "",
             "| shape | op | T | P | paths | largest error / standard's | passed | s (standard s) | peak GiB above "
             "inputs (standard) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['op']} | | | skipped: {r['skipped']} | | | | |")
            continue
        peak = ("-" if r["peak_bytes"] is None else
                f"{r['peak_bytes'] / 2**30:.2f} ({r['standard_peak_bytes'] / 2**30:.2f})")
        lines.append(f"| {r['shape']} | {r['op']} | {r['T']} | {r['P']} | {r['paths']} | {r['error_ratio']:.2f} | "
                     f"{r['passed']} | {r['seconds']:.3f} ({r['standard_seconds']:.3f}) | {peak} |")
    return lines


def scale_markdown(rows: list[dict], memory_metric: str) -> list[str]:
    lines = [f"## Peak memory ({memory_metric}) and seconds", "",
             "| model | G | path | P | peak GiB | seconds | fits |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            warm = " (warm-up)" if r.get("warm_up") else ""
            lines.append(f"| {r['model']} | {r.get('G', '')} | {r.get('path', '')} | {r.get('P', '')}{warm} | "
                         f"skipped: {r['skipped']} | | |")
            continue
        peak = f"{r['peak_bytes'] / 2**30:.3f}" if r["fits"] else "OOM"
        secs = f"{r['seconds']:.2f}" if r["fits"] else ""
        lines.append(f"| {r['model']} | {r['G']} | {r['path']} | {r['P']} | {peak} | {secs} | {r['fits']} |")
    lines += ["", "## Longest P that fits", "", "| model | G | path | longest P |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['G']} | {r['path']} | {r['P']} |" for r in longest_fitting(rows)]
    return lines


def stage_markdown(result: dict, stage: str) -> list[str]:
    """``stage``'s section of the report: its rows, and what stopped it (an error outside its cases, a lost
    device) or why it did not run."""
    rows = result[stage]
    lines = {"equivalence": equivalence_markdown, "fsdp2": fsdp2_markdown, "ops": ops_markdown}[stage](rows) \
        if stage != "scale" else scale_markdown(rows, result["memory_metric"])
    if stage in result["not_run"]:
        lines += ["", f"**Not run**: {result['not_run'][stage]}"]
    if stage in result["stage_errors"]:
        lines += ["", "**Stopped by an error outside its cases:**", "", "```", result["stage_errors"][stage], "```"]
    return lines


def markdown(result: dict) -> str:
    lines = ["# GPU check", "", f"device: {result['device']}, total {result['seconds']:.0f} s "
             f"(budget {result['budget_seconds']:.0f} s), seconds per stage done: "
             f"{ {k: round(v, 1) for k, v in result['stage_seconds'].items()} }", "",
             f"Machine: {describe(result['machine'])}", "", f"Versions: {result['versions']}", ""]
    if result["stages_that_compared_nothing"]:
        lines += [f"**Stages that compared nothing** (every row skipped or failed, or not run): "
                  f"{', '.join(result['stages_that_compared_nothing'])}", ""]
    lines += ["## Kernels per stage", "", "| stage | prefix attention (calls per path) | gated delta rule |",
              "|---|---|---|"]
    for stage, kernels in result["kernels"].items():
        lines.append(f"| {stage} | {kernels['attention']} | {'; '.join(kernels['gated_delta_rule']) or '-'} |")
    for stage in STAGES:
        lines += ["", *stage_markdown(result, stage)]
    return "\n".join(lines) + "\n"


def longest_fitting(rows: list[dict]) -> list[dict]:
    longest: dict = {}
    for r in rows:
        if "G" in r:
            key = (r["model"], r["G"], r["path"])
            longest[key] = max(longest.get(key, 0), r["P"] if r["fits"] else 0)
    return [{"model": m, "G": g, "path": p, "P": n} for (m, g, p), n in longest.items()]


def compared_anything(stage: str, rows: list[dict]) -> bool:
    """Whether ``stage``'s rows hold a result: a scale row that fit or ran out of memory, another stage's row that
    was not skipped."""
    if stage == "scale":
        return any(r.get("fits") is not None for r in rows)
    return any("skipped" not in r for r in rows)


class Report:
    """The run's ``result``, written as ``<stem>.json`` and ``<stem>.md`` under ``out`` when made and rewritten
    after every row (``recorder``) and stage, each file replaced whole (a kill leaves the last complete one)."""

    def __init__(self, result: dict, out: Path, stem: str, started: float):
        self.result, self.out, self.stem, self.started = result, out, stem, started
        self.write()

    def write(self) -> None:
        result = self.result
        result["seconds"] = time.monotonic() - self.started
        result["longest_fitting_P"] = longest_fitting(result["scale"])
        done = [s for s in STAGES if s in result["stage_seconds"] or s in result["not_run"]]
        result["stages_that_compared_nothing"] = [s for s in done if not compared_anything(s, result[s])]
        self.out.mkdir(parents=True, exist_ok=True)
        for suffix, text in ((".json", json.dumps(result, indent=1)), (".md", markdown(result))):
            path = self.out / f"{self.stem}{suffix}"
            staged = path.with_name(f"{path.name}.partial")
            staged.write_text(text)
            staged.replace(path)

    def recorder(self, stage: str) -> Callable[[dict], None]:
        """``record(row)`` for ``stage``: appends the row to ``result[stage]`` and rewrites the report, then raises
        DeviceLost when the row's failure lost the device (``"device_lost"``), which ends the stage."""

        def record(row: dict) -> None:
            self.result[stage].append(row)
            self.write()
            if "device_lost" in row:
                raise DeviceLost(row["device_lost"])

        return record


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


def main(argv: list[str] | None = None, started: float | None = None) -> dict:
    """Run the stages within the budget and return the result, also written under ``--out`` (module docstring).
    ``started``: the monotonic time the budget counts from (the script passes IMPORTS_STARTED), now by default."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, CPU allowed (smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--budget-seconds", type=float, default=480.0,
                        help="the whole run, imports included, stops within this")
    for stage, share in SHARES.items():
        parser.add_argument(f"--{stage}-seconds", type=float, default=None,
                            help=f"this stage's time (default {100 * share:.0f} percent of the budget after a reserve)")
    args = parser.parse_args(argv)
    started = time.monotonic() if started is None else started
    end = started + max(args.budget_seconds - RESERVE_SECONDS, 0.1 * args.budget_seconds)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    families = ("qwen3", "qwen3_5", "deepseek_v3", "glm_moe_dsa") if args.tiny else (*FAMILIES, *VARIANTS)
    fsdp2_families = ("qwen3", "glm_moe_dsa") if args.tiny else (*FAMILIES, *VARIANTS)
    prompt_len = 64 if args.tiny else 301
    stem = "gpu_check_tiny" if args.tiny else "gpu_check"
    lost = None  # why the device cannot run the later stages
    try:
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    except Exception as error:
        device_name, lost = "unusable", f"CUDA failed at the start: {type(error).__name__}: {error}"[:500]
    result = {
        "device": device_name, "machine": machine(), "versions": versions(device),
        "budget_seconds": args.budget_seconds,
        "memory_metric": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "bytes saved for backward",
        "stage_seconds": {},  # per stage done
        "kernels": {},  # per stage: prefix_causal_attention calls per path, gated delta rule kernel paths
        "stage_errors": {},  # per stage stopped by an error outside its cases: its traceback
        "not_run": {},  # per stage not run: why
        **{stage: [] for stage in STAGES},  # the rows
    }
    report = Report(result, args.out, stem, started)
    stages = {
        "equivalence": lambda deadline, record: equivalence(device, families, prompt_len, deadline, record),
        "fsdp2": lambda deadline, record: fsdp2(device, fsdp2_families, prompt_len, deadline, record),
        "ops": lambda deadline, record: ops(device, args.tiny, deadline, record),
        "scale": lambda deadline, record: scale(device, args.tiny, deadline, record),
    }
    recorder = KernelRecorder()
    with float32_without_tf32():
        for index, (stage, run) in enumerate(stages.items()):
            if lost is not None:
                result["not_run"][stage] = f"every stage runs on the {device.type} device, lost before: {lost}"
                report.write()
                continue
            seconds = getattr(args, f"{stage}_seconds")
            if seconds is None:  # its share of the time left (what earlier stages left unused goes to the later ones)
                seconds = (end - time.monotonic()) * SHARES[stage] / sum(list(SHARES.values())[index:])
            stage_started = time.monotonic()
            try:
                with recorder.stage(result, stage):
                    run(min(end, stage_started + seconds), report.recorder(stage))
            except DeviceLost as error:
                lost = str(error)
                result["stage_errors"][stage] = f"DeviceLost: {error}"
            except Exception as error:  # outside its cases (NCCL start, building configs): this stage ends, not the run
                text = "".join(traceback.format_exception(error))
                print(text, file=sys.stderr, flush=True)
                result["stage_errors"][stage] = text[-TRACEBACK_CHARS:]
            result["stage_seconds"][stage] = time.monotonic() - stage_started
            report.write()
            print("\n".join(stage_markdown(result, stage)) + "\n", flush=True)
    return result


def exit_status(result: dict) -> int:
    """The script's exit status: 1 when a stage compared nothing (named on stderr, as in the report), else 0."""
    empty = result["stages_that_compared_nothing"]
    if empty:
        print(f"gpu_check: stage(s) that compared nothing (every row skipped or failed, or not run): "
              f"{', '.join(empty)}", file=sys.stderr, flush=True)
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(exit_status(main(started=IMPORTS_STARTED)))
