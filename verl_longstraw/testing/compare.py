"""The standard path LongStraw is compared with, and the comparisons (tests, benchmarks, gpu_check).

The standard path is one full forward (and backward) per ``prompt ++ response``; tiny models of
every family are in ``verl_longstraw.tiny``. Nothing here is used by training. Torch only.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from types import MethodType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from verl_longstraw import Knobs, group_backward, group_log_probs
from verl_longstraw.ops.gated_delta.rule import gated_delta_rule_reference
from verl_longstraw.ops.kda.rule import kda_reference

Grads = dict[str, torch.Tensor]
LossFn = Callable[[int, torch.Tensor], torch.Tensor]

# A low-precision replay is as accurate as the standard path when its error against the float32
# standard path is at most STANDARD_ERROR_FACTOR x the error the standard path makes in the same
# dtype on the same machine (the error depends on the CPU's kernels: bf16 deepseek_v3 standard
# log-probs err by 0.055 on AVX2 and AVX-512 alike, its replay by 0.054 on AVX2 and 0.0027 with
# AVX-512), or below ERROR_FLOOR_EPS x the dtype's eps (guards a standard error that is ~0 by chance;
# measured errors on the tiny models are >= 0.25 eps). Measured replay/standard error ratios: 0.05-1.06.
STANDARD_ERROR_FACTOR = 1.5
ERROR_FLOOR_EPS = 0.125


def full_log_probs(model, prompt: torch.Tensor, response: torch.Tensor, temperature: float = 1.0):
    """Float32 log-probs [T] and entropies [T] of ``response`` [T] from one forward over
    ``prompt`` [P] ++ ``response``, without a KV cache (as veRL's training forward; from transformers 5.25 a
    hybrid model's cache makes its token count on the default device, which gpu_check's bare-machine test sets to
    meta)."""
    logits = model(torch.cat([prompt, response])[None], use_cache=False).logits[0].float() / temperature
    log_probs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, response[:, None])[:, 0], entropy


def standard_grads(model, prompt: torch.Tensor, responses: Sequence[torch.Tensor], loss_fn: LossFn) -> Grads:
    """Gradient of sum_i loss_fn(i, logps_i) computed the standard way (``model``'s .grad is overwritten)."""
    model.zero_grad(set_to_none=True)
    for i, response in enumerate(responses):
        loss_fn(i, full_log_probs(model, prompt, response)[0]).backward()
    return grads_of(model)


def grads_of(model) -> Grads:
    """Copies of every parameter's .grad by name (zeros where a parameter got none)."""
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def relative_error(a: Grads, b: Grads) -> float:
    """Relative L2 error of gradient set ``a`` against reference ``b`` over all parameters."""
    num = sum((a[n].double() - b[n].double()).pow(2).sum() for n in b)
    den = sum(v.double().pow(2).sum() for v in b.values())
    return float((num / den).sqrt())


def max_abs_error(values: Sequence[torch.Tensor], references: Sequence[torch.Tensor]) -> float:
    """Largest |value - reference| over paired tensors (e.g. per-response log-probs [T_i])."""
    return max(float((v.double() - r.double()).abs().max()) for v, r in zip(values, references, strict=True))


def weighted_loss(i: int, log_probs: torch.Tensor) -> torch.Tensor:
    """A GRPO-like per-response loss of log-probs [T]: advantage-signed, position-weighted
    log-likelihood (a scalar on ``log_probs``' device)."""
    advantage = 1.0 if i % 2 == 0 else -0.5
    weights = torch.linspace(0.5, 1.5, len(log_probs), dtype=log_probs.dtype, device=log_probs.device)
    return -advantage * (weights * log_probs).mean()


def make_group(vocab: int, prompt_len: int, response_lens: Sequence[int], seed: int = 0,
               device: torch.device | str = "cpu"):
    """Random token ids (prompt [prompt_len], responses [[T_i] for T_i in response_lens]), drawn on
    the CPU (the same ids for every device) and placed on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (prompt_len, *response_lens)
    ids = [torch.randint(0, vocab, (n,), generator=gen, device=gen.device).to(device) for n in lengths]
    return ids[0], ids[1:]


def replay_errors(model, dtype: torch.dtype, prompt, responses, loss_fn: LossFn, chunk_size: int | None) -> dict:
    """Errors against ``model``'s float32 standard path of ``model`` cast to ``dtype``: of the replay
    (log-probs, chunked exact gradients) and of the standard path itself in ``dtype``.

    Returns floats: ``log_prob`` and ``standard_log_prob`` (max |log p| error), ``grad`` and
    ``standard_grad`` (relative L2 gradient error). ``model`` is float32 and is left unchanged.
    """
    expected = standard_grads(model, prompt, responses, loss_fn)
    cast = copy.deepcopy(model).to(dtype)
    standard = standard_grads(cast, prompt, responses, loss_fn)
    with torch.no_grad():
        expected_lp = [full_log_probs(model, prompt, r)[0] for r in responses]
        standard_lp = [full_log_probs(cast, prompt, r)[0] for r in responses]
    log_probs = group_log_probs(cast, prompt, responses, knobs=Knobs(chunk_size=chunk_size)).log_probs
    cast.zero_grad(set_to_none=True)
    group_backward(cast, prompt, responses, loss_fn, knobs=Knobs(prompt_grad="exact", chunk_size=chunk_size))
    return {
        "log_prob": max_abs_error(log_probs, expected_lp),
        "standard_log_prob": max_abs_error(standard_lp, expected_lp),
        "grad": relative_error(grads_of(cast), expected),
        "standard_grad": relative_error(standard, expected),
    }


def no_worse_than_standard(errors: dict[str, float], dtype: torch.dtype) -> bool:
    """Whether every error ``errors[k]`` of LongStraw's path in ``dtype`` is at most
    STANDARD_ERROR_FACTOR x ``errors[f"standard_{k}"]`` (the standard path's in the same dtype on
    the same machine) or below ERROR_FLOOR_EPS x ``dtype``'s eps; e.g. ``replay_errors``' output."""
    floor = ERROR_FLOOR_EPS * torch.finfo(dtype).eps
    keys = [k for k in errors if not k.startswith("standard_")]
    return all(errors[k] <= max(STANDARD_ERROR_FACTOR * errors[f"standard_{k}"], floor) for k in keys)


def _reference_chunk_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, **_):
    """transformers' ``chunk_gated_delta_rule`` call over the token-by-token reference recurrence (float32
    arithmetic, float64 for float64 inputs; shapes in ``ops.gated_delta.rule``)."""
    out, state = gated_delta_rule_reference(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)
    return out, (state if output_final_state else None)


def _linear_attention_kernels(model) -> list[tuple[object, str]]:
    """(owner, attribute) of each place ``model``'s standard path looks its Gated DeltaNet kernel up: the
    ``torch_chunk_gated_delta_rule`` global of a layer's transformers module (transformers 5.19 binds fla's kernel
    there at import whenever fla imports, TF32 dots included) and a layer's ``chunk_gated_delta_rule`` attribute
    (earlier transformers set it in ``__init__``)."""
    places: dict[int, tuple[object, str]] = {}
    for module in model.modules():
        python_module = sys.modules[type(module).__module__]
        if hasattr(python_module, "torch_chunk_gated_delta_rule"):
            places[id(python_module)] = (python_module, "torch_chunk_gated_delta_rule")
        if hasattr(module, "chunk_gated_delta_rule"):
            places[id(module)] = (module, "chunk_gated_delta_rule")
    return list(places.values())


def _widen_dtype(value: object) -> object:
    """float64 for the dtype float32, anything else (tensors included) as it is."""
    return torch.float64 if value is torch.float32 else value


def _widen(value: object) -> object:
    """float64 for the dtype float32 and for a float32 tensor (a copy), anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return value.to(torch.float64)
    return _widen_dtype(value)


def _is_functional(func) -> bool:
    """Whether operator ``func`` neither writes into nor returns a view of any argument (its schema marks no
    argument with alias information): only then may a float32 argument be replaced by a float64 copy."""
    return all(argument.alias_info is None for argument in func._schema.arguments)


class _Float64Throughout(TorchDispatchMode):
    """Every float32 an operator is asked for (a cast, a factory's or a reduction's dtype) becomes float64, and so
    does every float32 tensor a functional operator reads (a float32 buffer a model keeps, e.g. transformers 5.17's
    rotary ``inv_freq`` of a model built in float64). Views and in-place operators see their arguments as they are,
    so a write through a view still lands in its base."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        widen = _widen if _is_functional(func) else _widen_dtype
        return func(*tree_map(widen, args), **tree_map(widen, kwargs or {}))


@contextlib.contextmanager
def float64_throughout() -> Iterator[None]:
    """Inside, a float64 model computes in float64 everywhere: every float32 that an operator is asked for (the
    ``.to(torch.float32)`` of transformers' RMSNorms, routers and rotary tables, the float32 accumulators of its
    Gated DeltaNet, Mamba2 and KDA kernels, LongStraw's float32 scoring and state-gradient sums) is float64, and so
    is the default dtype. A float64 comparison of two paths (replay or context parallel against the standard path
    or one process) then measures their algorithms, not where a float32 rounding of nearly equal values happens
    to flip (1e-8 to 8e-8 relative in the gradients otherwise).

    A ``TorchDispatchMode``: it acts on ATen operators, so the autograd backward (which runs the same modes on
    the CPU) is float64 too. Tests only; the model must already be float64."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64Throughout():
            yield
    finally:
        torch.set_default_dtype(default)


KDA_RULE = "chunk_kimi_delta_attention"  # the global transformers' Kimi Delta Attention forward calls


def _reference_kda_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, **_):
    """transformers' ``chunk_kimi_delta_attention`` call over the token-by-token recurrence
    ``ops.kda.rule.kda_reference`` in float32 arithmetic (float64 for float64 inputs), as the model's rule computes:
    (output [B, S, H, Dv] in q's dtype, final state [B, H, Dk, Dv] or None)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    state = None if initial_state is None else initial_state.to(dtype)
    out, final = kda_reference(*(t.to(dtype) for t in (q, k, v, g, beta)), initial_state=state,
                               output_final_state=output_final_state,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return out.to(q.dtype), final


def _kda_mixers(model) -> list[torch.nn.Module]:
    """The Kimi Delta Attention mixers of ``model``: modules whose forward calls their transformers module's
    ``chunk_kimi_delta_attention`` global."""
    return [module for module in model.modules()
            if hasattr(sys.modules[type(module).__module__], KDA_RULE)
            and KDA_RULE in inspect.unwrap(type(module).forward).__code__.co_names]


def _forward_with_reference_kda(self, *args, **kwargs):
    """A KDA mixer's own forward with its module's ``chunk_kimi_delta_attention`` global set to the reference
    recurrence while it runs (replay calls the rule outside the forward: ``mixers.Kda.forward``)."""
    python_module = sys.modules[type(self).__module__]
    found = getattr(python_module, KDA_RULE)
    setattr(python_module, KDA_RULE, _reference_kda_rule)
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        setattr(python_module, KDA_RULE, found)


@contextlib.contextmanager
def reference_linear_attention(model) -> Iterator[None]:
    """Inside, the model's own (standard-path) Gated DeltaNet and Kimi Delta Attention are the token-by-token
    reference recurrences (algorithms independent of the chunked ones replay uses), restored on exit: gpu_check's
    standard path then never runs fla's TF32 kernels, whatever transformers picked. Gated DeltaNet: every model of
    the same transformers module is affected while inside (replay runs ``ops.gated_delta.rule``); KDA: the forward
    of ``model``'s mixers (replay calls the model's rule outside it). Copies made inside keep the reference."""
    places = _linear_attention_kernels(model)
    found = [(owner, name, getattr(owner, name)) for owner, name in places]
    for owner, name in places:
        setattr(owner, name, _reference_chunk_rule)
    mixers = _kda_mixers(model)
    for mixer in mixers:  # bound to the instance, so a deep copy binds it to the copy
        mixer.forward = MethodType(_forward_with_reference_kda, mixer)
    try:
        yield
    finally:
        for owner, name, kernel in found:
            setattr(owner, name, kernel)
        for mixer in mixers:
            del mixer.forward


def errors_against_exact(values: dict[str, torch.Tensor], standard: dict[str, torch.Tensor],
                         exact: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative L2 errors against ``exact`` (the same computation in float64 on the same inputs) of the path under
    test's ``values`` and of the standard path's (or reference's) ``standard``, in the tested dtype, by name:
    ``{name: error, f"standard_{name}": error}``, the input of ``no_worse_than_standard``. Each name's tensors
    have one shape (any dtype); a name whose exact tensor is all zeros or empty (a gradient through a softmax over
    one key) is measured on the largest exact norm of the set, the computation's scale. Float32 paths of the same
    arithmetic as their reference measured 0.4-1.3x its error (chunked scoring, the chunked Gated DeltaNet against
    transformers'), AVX2 and AVX-512 alike."""
    norms = {name: float(tensor.double().norm()) for name, tensor in exact.items()}
    if not any(norms.values()):
        raise ValueError("errors_against_exact: every exact tensor is zero; give at least one nonzero output")
    errors = {}
    for name, tensor in exact.items():
        for key, path in ((name, values), (f"standard_{name}", standard)):
            if path[name].shape != tensor.shape:
                raise ValueError(f"errors_against_exact: {key} has shape {tuple(path[name].shape)}, exact "
                                 f"{tuple(tensor.shape)}; pass the same output of each path")
            errors[key] = float((path[name].double() - tensor.double()).norm()) / (norms[name] or max(norms.values()))
    return errors


def value_error_message(fn: Callable[[], object]) -> str:
    """The message of the ValueError ``fn()`` raises, or "no error" (bad-input tests run on every CP rank)."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"
