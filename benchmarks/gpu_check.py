"""One-command GPU check of what a real GPU run uses: equivalence (plain, bf16, autocast, FSDP2), then
memory and time at growing prompt length, under a hard time budget.

    python benchmarks/gpu_check.py            # one GPU, stops inside 8 minutes on an H200 (--budget-seconds)
    python benchmarks/gpu_check.py --tiny     # CPU smoke run at tiny sizes (tests/test_gpu_check.py)

Stages (each gets a share of ``--budget-seconds``, 480 s by default; ``--<stage>-seconds`` override it):
1. equivalence: tiny random models of every family (glm_moe_dsa with ``index_topk`` below the prompt, so
   DSA's sparse top-k selection runs) against the float32 standard full-sequence path: replay log-probs
   (``group_log_probs``) and chunked exact gradients (``group_backward``) of the model in float32 (within
   TOLERANCE), cast to bfloat16, and in float32 under ``torch.autocast(bfloat16)`` as veRL's engine runs
   it. The bfloat16 rows pass when no worse than the standard path's own error in the same dtype / under
   the same autocast, in the same run (``verl_longstraw.testing.no_worse_than_standard``);
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
5. report: JSON and markdown under ``benchmarks/results/``, rewritten after every stage: the rows, the
   longest P that fits per path, which kernels ran per stage (prefix-attention calls per path, the
   gated delta rule's kernel: flash-linear-attention or plain torch) and the torch / CUDA / fla versions.
A case (one row) that overruns its time is interrupted (SIGALRM) and recorded as ``{"skipped": "time
limit"}``, one that runs out of device memory as ``"out of memory"``, any other failure as ``"error"``.
Needs torch and transformers only (flash-linear-attention when installed).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import importlib.metadata
import json
import logging
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from verl_longstraw import group_backward, group_log_probs
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.machine import describe, machine

try:  # the engine's FSDP2 helpers; their package loads veRL, which a bare GPU box may lack (the FSDP2 stage says so)
    from verl_longstraw.integration.fsdp2 import held_unsharded, sync_gradients
except ImportError:
    held_unsharded = sync_gradients = None
from verl_longstraw.memory import parameter_meter
from verl_longstraw.ops import gated_delta_rule as gdn
from verl_longstraw.ops.attention import ATTENTION_PATHS, prefix_causal_attention, prefix_causal_attention_reference
from verl_longstraw.ops.blocked_attention import OwnKeyRule
from verl_longstraw.ops.fused_attention import fused_kernel_dtype, fused_partial_backward, fused_partial_forward
from verl_longstraw.testing import (
    full_log_probs,
    grads_of,
    make_group,
    max_abs_error,
    no_worse_than_standard,
    relative_error,
    replay_errors,
    standard_grads,
    weighted_loss,
)
from verl_longstraw.tiny import FAMILIES, VOCAB, tiny_model, use_reference_kernels

ROOT = Path(__file__).resolve().parents[1]
TINY_FAMILY = {"qwen3_like": "qwen3", "glm5_like": "glm_moe_dsa"}  # metered CPU standard GDN is slow
TOLERANCE = 1e-4  # float32: max |log p| error and gradient relative L2
# DSA's top-k selection below the prompt length; 16 indexer heads make exact score ties improbable
OVERRIDES = {"glm_moe_dsa": {"index_topk": 24, "index_n_heads": 16}}
SHARES = {"equivalence": 0.25, "fsdp2": 0.15, "ops": 0.1, "scale": 0.5}  # of the budget after RESERVE_SECONDS
RESERVE_SECONDS = 30.0  # imports, CUDA start, report and teardown
AUTOCAST = "autocast_bfloat16"
# the attention op of a real layer: (query heads, key heads, query/key dim, value dim); MLA absorbed (latent + rope)
OP_SHAPES = {"qwen3.5-27b attention": (24, 4, 256, 256), "glm-5 mla absorbed": (64, 1, 576, 512)}
TINY_OP_SHAPES = {"attention": (4, 2, 32, 32), "mla absorbed": (4, 1, 40, 32)}
OP_NAMES = ("out", "q", "k_prefix", "v_prefix", "k_self", "v_self")


class CaseTimeout(TimeoutError):
    """A case ran past its time limit (raised by the SIGALRM handler of ``attempt``)."""


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(deadline: float, fn: Callable):
    """(``fn()``, None), or (None, why) with why "time limit" when it is interrupted at ``deadline`` (monotonic
    seconds; SIGALRM raises CaseTimeout in the main thread, which a running kernel or backward call
    delays until it returns), "out of memory" or "error: ..." (traceback on stderr)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None, "time limit"
    expired = []

    def alarm(signum, frame):
        expired.append(True)
        raise CaseTimeout(f"past its {left:.1f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, left, 0.5)  # repeats: raised again where one was swallowed (__del__)
            return fn(), None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    except CaseTimeout:
        why = "time limit"
    except torch.OutOfMemoryError:
        why = "out of memory"
    except Exception as error:  # one failing case must not end a one-shot GPU run
        why = "time limit" if expired else f"error: {type(error).__name__}: {error}"[:500]
        if not expired:
            traceback.print_exc()
    free_memory()
    return None, why


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
        log_probs = group_log_probs(model, prompt, responses, chunk_size=chunk_size)
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

    if held_unsharded is None:
        raise ImportError("the FSDP2 stage runs the engine's helpers (verl_longstraw.integration), which need veRL")

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


def equivalence_case(models: dict, family: str, name: str, device: torch.device, prompt, responses,
                     chunk_size: int) -> dict:
    """One equivalence row's errors and verdict (``models`` caches the family's float32 model between its dtypes)."""
    if family not in models:
        models.clear()
        with device:
            models[family] = tiny_model(family, **OVERRIDES.get(family, {}))
    reference = models[family]
    if name == AUTOCAST:
        errors = errors_in(reference, reference, prompt, responses, chunk_size, under_autocast(device))
        return error_row(errors, no_worse_than_standard(errors, torch.bfloat16))
    dtype = getattr(torch, name)
    errors = replay_errors(reference, dtype, prompt, responses, weighted_loss, chunk_size)
    if dtype == torch.float32:
        return error_row(errors, errors["log_prob"] < TOLERANCE and errors["grad"] < TOLERANCE)
    return error_row(errors, no_worse_than_standard(errors, dtype))


def equivalence(device: torch.device, families: tuple[str, ...], prompt_len: int, deadline: float) -> list[dict]:
    """Replay vs the float32 standard path, per family and dtype (float32, bfloat16, float32 under bfloat16
    autocast), with the standard path's own errors in that dtype / under that autocast."""
    rows = []
    prompt, responses = make_group(VOCAB, prompt_len, (prompt_len // 10 + 1, 1, prompt_len // 5), device=device)
    cases = [(family, name) for family in families for name in ("float32", "bfloat16", AUTOCAST)]
    models: dict = {}
    for index, (family, name) in enumerate(cases):
        case = functools.partial(equivalence_case, models, family, name, device, prompt, responses, prompt_len // 3)
        started = time.monotonic()
        row, why = attempt(case_deadline(deadline, len(cases) - index), case)
        rows.append({"family": family, "dtype": name, **(row or {"skipped": why}),
                     "seconds": time.monotonic() - started})
    return rows


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
            dist.destroy_process_group()


def fsdp2_wrap(model, device: torch.device):
    """``model`` with each decoder layer and the root fully_shard-ed under veRL's mixed-precision policy."""
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp2_case(family: str, device: torch.device, prompt, responses, chunk_size: int) -> dict:
    with device:
        reference = tiny_model(family, **OVERRIDES.get(family, {}))
    model = fsdp2_wrap(copy.deepcopy(reference), device)
    errors = errors_in(reference, model, prompt, responses, chunk_size, under_fsdp2(device))
    return error_row(errors, no_worse_than_standard(errors, torch.bfloat16))


def fsdp2(device: torch.device, families: tuple[str, ...], prompt_len: int, deadline: float) -> list[dict]:
    """Exact replay on a single-rank FSDP2 model (bfloat16 parameters, float32 reduction) vs the unwrapped float32
    standard path, bounded by the standard path's error on the same wrapped model under the same policy."""
    rows = []
    prompt, responses = make_group(VOCAB, prompt_len, (prompt_len // 10 + 1, 1, prompt_len // 5), device=device)
    with process_group(device):
        for index, family in enumerate(families):
            case = functools.partial(fsdp2_case, family, device, prompt, responses, prompt_len // 3)
            started = time.monotonic()
            row, why = attempt(case_deadline(deadline, len(families) - index), case)
            rows.append({"family": family, "policy": "param bfloat16, reduce float32", **(row or {"skipped": why}),
                         "seconds": time.monotonic() - started})
    return rows


def op_inputs(shape: tuple[int, int, int, int], seg_len: int, prefix_len: int, device: torch.device) -> list:
    """float64 (q, k_prefix, v_prefix, k_self, v_self) of one sequence, values already rounded to bfloat16."""
    q_heads, kv_heads, dim, v_dim = shape
    gen = torch.Generator(device).manual_seed(0)
    shapes = [(q_heads, seg_len, dim), (kv_heads, prefix_len, dim), (kv_heads, prefix_len, v_dim),
              (kv_heads, seg_len, dim), (kv_heads, seg_len, v_dim)]
    return [torch.randn(1, *s, generator=gen, device=device).bfloat16().double() for s in shapes]


def with_grads(fn: Callable, inputs: list, weight: torch.Tensor, dtype: torch.dtype) -> tuple[dict, float, int | None]:
    """(output and input gradients of sum(fn(*inputs in dtype) * weight), seconds, peak CUDA bytes or None)."""
    xs = [x.to(dtype).requires_grad_() for x in inputs]
    sync = torch.cuda.synchronize if weight.is_cuda else (lambda: None)
    if weight.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    started = time.perf_counter()
    out, grads = fn(xs, weight.to(dtype))
    sync()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if weight.is_cuda else None
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
        grad_q = sum(g[0].float() for g in grads).to(q.dtype)
        joined = [torch.cat([g[i] for g in grads], dim=-2) for i in range(1, 5)]
        return out, (grad_q, *joined)
    return run


def op_case(name: str, shape: tuple, op: str, seg_len: int, prefix_len: int, device: torch.device) -> dict:
    """One op on bfloat16 inputs against the float64 reference on the same values, with the standard path's own
    errors (SDPA with an explicit mask, bfloat16); seconds and peak memory of the op and of the standard path."""
    inputs = op_inputs(shape, seg_len, prefix_len, device)
    scale = shape[2] ** -0.5
    weight = torch.randn(1, shape[0], seg_len, shape[3], generator=torch.Generator(device).manual_seed(1),
                         device=device, dtype=torch.float64)
    reference, _, _ = with_grads(autograd_op(prefix_causal_attention_reference, scale), inputs, weight, torch.float64)
    run = pass_q_two_ranks(scale) if op == "pass_q_two_ranks" else autograd_op(prefix_causal_attention, scale)
    ATTENTION_PATHS.clear()
    result, seconds, peak = with_grads(run, inputs, weight, torch.bfloat16)
    paths = dict(ATTENTION_PATHS)
    standard, standard_seconds, standard_peak = with_grads(
        autograd_op(prefix_causal_attention_reference, scale), inputs, weight, torch.bfloat16)
    def error(x: torch.Tensor, k: str) -> float:  # relative L2 against the float64 reference
        return float((x.double() - reference[k]).norm() / reference[k].norm())

    errors = {k: error(result[k], k) for k in OP_NAMES} | {f"standard_{k}": error(standard[k], k) for k in OP_NAMES}
    return {"shape": name, "op": op, "T": seg_len, "P": prefix_len, "paths": paths, "errors": errors,
            "passed": no_worse_than_standard(errors, torch.bfloat16), "seconds": seconds,
            "standard_seconds": standard_seconds, "peak_bytes": peak, "standard_peak_bytes": standard_peak}


def ops(device: torch.device, tiny: bool, deadline: float) -> list[dict]:
    """The prefix-attention ops at a real layer's shapes (bfloat16, forward + backward): the dispatch
    (``prefix_causal_attention``: the fused flash kernels, or for MLA the blocked op with half matmul operands) and
    the context-parallel pass-Q arithmetic on two key shards (fused kernels only), each against float64."""
    seg_len, prefix_len = (16, 48) if tiny else (1024, 8192)
    shapes = TINY_OP_SHAPES if tiny else OP_SHAPES
    op_names = ("prefix_causal_attention", "pass_q_two_ranks")
    cases = [(name, shape, op) for name, shape in shapes.items() for op in op_names
             if op != "pass_q_two_ranks" or shape[2] == shape[3]]  # pass-Q's fused path: value dim == key dim
    rows = []
    for index, (name, shape, op) in enumerate(cases):
        case = functools.partial(op_case, name, shape, op, seg_len, prefix_len, device)
        row, why = attempt(case_deadline(deadline, len(cases) - index), case)
        rows.append(row or {"shape": name, "op": op, "skipped": why})
    return rows


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


def scale_model(name: str, config, tiny: bool, device: torch.device, dtype: torch.dtype):
    if tiny:
        with device:
            return tiny_model(TINY_FAMILY[name])
    return build(config, device, dtype)


def scale(device: torch.device, tiny: bool, deadline: float) -> list[dict]:
    """Peak memory and seconds per (model, G, path, P); P doubles until OOM or the time limit."""
    rows = []
    configs = scale_configs(tiny)
    start_len, max_len = (128, 1024) if tiny else (4096, 1 << 21)
    response_len, chunk_size = (16, 64) if tiny else (256, 8192)
    dtype = torch.float32 if tiny else torch.bfloat16  # CPU bf16 Gated DeltaNet is too slow for a smoke test
    for model_index, (name, config) in enumerate(configs.items()):
        model_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(configs) - model_index)
        model, why = attempt(model_deadline, functools.partial(scale_model, name, config, tiny, device, dtype))
        if model is None:
            rows.append({"model": name, "fits": None, "skipped": why})
            continue
        for group_size in (2, 8):
            for index, path in enumerate(("standard", "exact", "detached")):
                series_left = 6 - 3 * (group_size == 8) - index  # this and the later series of this model
                series_deadline = time.monotonic() + (model_deadline - time.monotonic()) / series_left
                prompt_len, last_seconds = start_len, 0.0
                while prompt_len <= max_len and time.monotonic() + 2.5 * last_seconds < series_deadline:
                    prompt, responses = make_group(config.vocab_size, prompt_len, [response_len] * group_size,
                                                   seed=prompt_len, device=device)
                    row = {"model": name, "G": group_size, "path": path, "P": prompt_len, "T": response_len}
                    run = functools.partial(measure, model, path, prompt, responses, chunk_size, device)
                    measured, why = attempt(series_deadline, run)
                    if measured is None:
                        rows.append({**row, "fits": False} if why == "out of memory" else
                                    {**row, "fits": None, "skipped": why})
                        break
                    peak, seconds = measured
                    estimate = estimate_memory(config, prompt_len, group_size, response_len, chunk_size,
                                               "exact" if path == "standard" else path, dtype)
                    rows.append({**row, "fits": True, "peak_bytes": peak, "seconds": seconds,
                                 "estimated_total_bytes": estimate.total_bytes if path != "standard" else None})
                    last_seconds = seconds
                    prompt_len *= 2
                model.zero_grad(set_to_none=True)
        del model
        free_memory()
    return rows


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
    """torch, CUDA, transformers, flash-linear-attention and triton versions; whether fla's kernel is importable."""

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "flash-linear-attention": version("flash-linear-attention"), "triton": version("triton"),
        # imports fla (and triton) only on CUDA, as the gated delta rule does
        "fla_kernel_importable": device.type == "cuda" and gdn._fla_chunk_gated_delta_rule() is not None,
    }


def error_cells(r: dict) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']} | | |"
    lp = f"{r['log_prob_error']:.2e} ({r['standard_log_prob_error']:.2e})"
    grad = f"{r['grad_rel_l2']:.2e} ({r['standard_grad_rel_l2']:.2e})"
    return f"{lp} | {grad} | {r['passed']} |"


def markdown(result: dict) -> str:
    lines = ["# GPU check", "", f"device: {result['device']}, total {result['seconds']:.0f} s "
             f"(budget {result['budget_seconds']:.0f} s), seconds per stage done: "
             f"{ {k: round(v, 1) for k, v in result['stage_seconds'].items()} }", "",
             f"Machine: {describe(result['machine'])}", "", f"Versions: {result['versions']}", "",
             "## Kernels per stage", "", "| stage | prefix attention (calls per path) | gated delta rule |",
             "|---|---|---|"]
    for stage, kernels in result["kernels"].items():
        lines.append(f"| {stage} | {kernels['attention']} | {'; '.join(kernels['gated_delta_rule']) or '-'} |")
    header = "max abs log-prob error (standard path's) | gradient rel L2 (standard's) | passed |"
    lines += ["", "## Equivalence vs the float32 standard path", "", f"| family | dtype | {header}",
              "|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['dtype']} | {error_cells(r)}" for r in result.get("equivalence", [])]
    lines += ["", "## FSDP2 (1 rank, bfloat16 parameters, float32 reduce, autocast) vs the float32 standard path", "",
              f"| family | {header}", "|---|---|---|---|"]
    lines += [f"| {r['family']} | {error_cells(r)}" for r in result.get("fsdp2", [])]
    lines += ["", "## Attention ops, bfloat16 forward + backward, vs float64 (relative L2 of output and input "
              "gradients; standard: SDPA with a mask in bfloat16)", "",
              "| shape | op | T | P | paths | largest error / standard's | passed | s (standard s) | peak GiB "
              "(standard) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("ops", []):
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['op']} | | | skipped: {r['skipped']} | | | | |")
            continue
        worst = max(r["errors"][k] / max(r["errors"][f"standard_{k}"], 1e-30) for k in OP_NAMES)
        peak = ("-" if r["peak_bytes"] is None else
                f"{r['peak_bytes'] / 2**30:.2f} ({r['standard_peak_bytes'] / 2**30:.2f})")
        lines.append(f"| {r['shape']} | {r['op']} | {r['T']} | {r['P']} | {r['paths']} | {worst:.2f} | {r['passed']} | "
                     f"{r['seconds']:.3f} ({r['standard_seconds']:.3f}) | {peak} |")
    lines += ["", f"## Peak memory ({result['memory_metric']}) and seconds", "",
              "| model | G | path | P | peak GiB | seconds | fits |", "|---|---|---|---|---|---|---|"]
    for r in result.get("scale", []):
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r.get('G', '')} | {r.get('path', '')} | {r.get('P', '')} | "
                         f"skipped: {r['skipped']} | | |")
            continue
        peak = f"{r['peak_bytes'] / 2**30:.3f}" if r["fits"] else "OOM"
        secs = f"{r['seconds']:.2f}" if r["fits"] else ""
        lines.append(f"| {r['model']} | {r['G']} | {r['path']} | {r['P']} | {peak} | {secs} | {r['fits']} |")
    lines += ["", "## Longest P that fits", "", "| model | G | path | longest P |", "|---|---|---|---|"]
    for r in result.get("longest_fitting_P", []):
        lines.append(f"| {r['model']} | {r['G']} | {r['path']} | {r['P']} |")
    return "\n".join(lines) + "\n"


def longest_fitting(rows: list[dict]) -> list[dict]:
    longest: dict = {}
    for r in rows:
        if "G" in r:
            key = (r["model"], r["G"], r["path"])
            longest[key] = max(longest.get(key, 0), r["P"] if r["fits"] else 0)
    return [{"model": m, "G": g, "path": p, "P": n} for (m, g, p), n in longest.items()]


def write_report(result: dict, out: Path, stem: str, started: float) -> None:
    result["seconds"] = time.monotonic() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, CPU allowed (smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--budget-seconds", type=float, default=480.0, help="the whole run stops within this")
    for stage, share in SHARES.items():
        parser.add_argument(f"--{stage}-seconds", type=float, default=None,
                            help=f"this stage's time (default {100 * share:.0f} percent of the budget after a reserve)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    end = started + max(args.budget_seconds - RESERVE_SECONDS, 0.1 * args.budget_seconds)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    families = ("qwen3", "qwen3_5", "deepseek_v3", "glm_moe_dsa") if args.tiny else FAMILIES
    fsdp2_families = ("qwen3", "glm_moe_dsa") if args.tiny else FAMILIES
    prompt_len = 64 if args.tiny else 301
    stem = "gpu_check_tiny" if args.tiny else "gpu_check"
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "machine": machine(),
        "versions": versions(device), "budget_seconds": args.budget_seconds,
        "memory_metric": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "bytes saved for backward",
        "stage_seconds": {},  # per stage done
        "kernels": {},  # per stage: prefix_causal_attention calls per path, gated delta rule kernel paths
    }
    stages = {
        "equivalence": lambda deadline: equivalence(device, families, prompt_len, deadline),
        "fsdp2": lambda deadline: fsdp2(device, fsdp2_families, prompt_len, deadline),
        "ops": lambda deadline: ops(device, args.tiny, deadline),
        "scale": lambda deadline: scale(device, args.tiny, deadline),
    }
    recorder = KernelRecorder()
    for index, (stage, run) in enumerate(stages.items()):
        seconds = getattr(args, f"{stage}_seconds")
        if seconds is None:  # its share of the time left (what earlier stages left unused goes to the later ones)
            seconds = (end - time.monotonic()) * SHARES[stage] / sum(list(SHARES.values())[index:])
        stage_started = time.monotonic()
        with recorder.stage(result, stage):
            result[stage] = run(min(end, stage_started + seconds))
        result["stage_seconds"][stage] = time.monotonic() - stage_started
        if stage == "scale":
            result["longest_fitting_P"] = longest_fitting(result["scale"])
        write_report(result, args.out, stem, started)  # partial results survive a later stage's crash or kill
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
