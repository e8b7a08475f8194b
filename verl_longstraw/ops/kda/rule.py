"""Kimi Delta Attention (KDA): the gated delta rule with one decay per key channel, an initial state in and the
final state out.

Shapes: ``q``, ``k`` [B, S, H, Dk]; ``v`` [B, S, H, Dv]; ``g`` [B, S, H, Dk] log-decay per key channel (<= 0);
``beta`` [B, S, H]; states [B, H, Dk, Dv]. Per head and token, q and k L2-normalised and q scaled by Dk**-0.5::

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + k_t^T (beta_t * (v_t - k_t S_t))
    o_t = q_t S_t

Arithmetic is float32; the output has q's dtype, the final state is float32.

``kda_rule`` runs the model's own chunked rule (``model_kda_rules``: transformers' ``chunk_kimi_delta_attention``
of the model's module, which transformers binds to flash-linear-attention's ``chunk_kda`` where that is installed,
and is the plain torch chunked form otherwise); ``chunked_rule`` picks it for half-precision inputs and the plain
torch form for float32 / float64 (whose arithmetic fla's TF32 dots would not keep), as ``ops.gated_delta.rule``
does for Gated DeltaNet. The module's ``recurrent_kimi_delta_attention`` (the token-by-token recurrence) is the
reference the tests compare it with. Both are differentiable in every input including the
initial state. ``kda_reference`` is the same recurrence in the inputs' dtype (the model's rules compute in float32).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from ...errors import UnsupportedModelError

DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
CHUNK_LEN = 64  # transformers' chunk_kimi_delta_attention default (and fla's)


class KdaRules(NamedTuple):
    """The model module's chunked rule and its token-by-token recurrence."""

    chunked: DeltaRule
    recurrent: DeltaRule


def model_kda_rules(mixer: nn.Module) -> KdaRules:
    """The rules the module of ``mixer`` (a transformers KDA mixer) calls: its module's ``chunk_kimi_delta_attention``
    and ``recurrent_kimi_delta_attention`` globals (transformers >= 5.10; ``test_model_kda_rules_are_the_models``
    pins them)."""
    module = sys.modules[type(mixer).__module__]
    names = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
    rules = [getattr(module, name, None) for name in names]
    if None in rules:
        raise UnsupportedModelError(
            f"{module.__name__} lacks {' / '.join(n for n, r in zip(names, rules, strict=True) if r is None)}: this "
            "transformers release's Kimi Delta Attention is not supported (transformers>=5.10 has it)"
        )
    return KdaRules(*rules)


def chunked_rule(mixer: nn.Module, dtype: torch.dtype) -> DeltaRule:
    """The chunked rule replay runs for inputs of ``dtype`` in ``mixer``'s model: for float16 / bfloat16 the model's
    own (``model_kda_rules``: flash-linear-attention's ``chunk_kda`` where transformers bound it), otherwise the
    plain torch chunked form that binding wraps (float32 arithmetic, float64 for float64 inputs)."""
    chunked = model_kda_rules(mixer).chunked
    return chunked if dtype in (torch.float16, torch.bfloat16) else plain_torch_form(chunked)


def plain_torch_form(rule: DeltaRule) -> DeltaRule:
    """The torch function behind transformers' hub-kernel binding ``rule``: through the ``kernels`` package's
    function module where that package is installed (transformers 5.25 requires it; its ``Func`` module calls the
    binding it closes over as ``func``), then the binding's ``functools.wraps`` (``__wrapped__``). UnsupportedModelError
    when a ``kernels`` module holds no such binding."""
    if isinstance(rule, nn.Module):
        bound = inspect.getclosurevars(type(rule).forward).nonlocals.get("func")
        if not callable(bound):
            raise UnsupportedModelError(
                f"{type(rule).__module__}.{type(rule).__qualname__}: this kernels release's function module does not "
                "close over the transformers function it wraps (func): its plain torch form cannot be found")
        rule = bound
    return inspect.unwrap(rule)


def kda_rule(rule: DeltaRule, q, k, v, g, beta, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rule`` (a ``KdaRules`` member) continuing ``initial_state`` [B, H, Dk, Dv], q and k L2-normalised in the
    rule: (output [B, S, H, Dv], final state [B, H, Dk, Dv] float32)."""
    return rule(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                use_qk_l2norm_in_kernel=True)


def kda_reference(q, k, v, g, beta, chunk_size: int = CHUNK_LEN, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **_: object
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence of the module docstring one token at a time, in the inputs' dtype (float64 stays float64),
    under the signature of transformers' ``chunk_kimi_delta_attention`` (``chunk_size`` unused): (output [B, S, H,
    Dv], final state [B, H, Dk, Dv] or None). What a test puts in the model's place to compare a sharded rule
    with a recurrence independent of the model's chunked one."""
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    batch, _, heads, k_dim = k.shape
    state = initial_state if initial_state is not None else k.new_zeros(batch, heads, k_dim, v.shape[-1])
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None]
        delta = beta[:, t, :, None] * (v[:, t] - (k[:, t, :, :, None] * state).sum(-2))
        state = state + k[:, t, :, :, None] * delta[..., None, :]
        outputs.append((q[:, t, :, :, None] * state).sum(-2))
    return torch.stack(outputs, dim=1), (state if output_final_state else None)


def kda_torch_saved_bytes(batch: int, tokens: int, heads: int, k_dim: int, v_dim: int) -> int:
    """Bytes transformers' torch ``chunk_kimi_delta_attention`` saves for the backward over ``batch`` sequences of
    ``tokens`` (each padded to whole chunks of C = ``CHUNK_LEN``), float32, its inputs computed in the graph. Per
    padded token and head: the per-channel decay mask [C, Dk] three times (built, and sliced per chunk for the
    queries), keys, queries and their decays (12 of [Dk]), values (2 of [Dv]); per chunk and head: the row-by-row
    solve of the chunk's triangular system (row i saves i x i + i), the chunk matrices (5/2 of [C, C]) and the
    start state [Dk, Dv]. Measured by ``tests/ops/test_kda.py``."""
    padded = tokens + (-tokens % CHUNK_LEN)
    chunks, c = padded // CHUNK_LEN, CHUNK_LEN
    per_token = 3 * c * k_dim + 12 * k_dim + 2 * v_dim
    solve = (c - 1) * c * (2 * c - 1) // 6 + (c - 1) * c // 2
    per_chunk = solve + 5 * c * c // 2 + k_dim * v_dim
    return 4 * batch * heads * (padded * per_token + chunks * per_chunk)
