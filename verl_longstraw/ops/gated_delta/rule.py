"""Gated delta rule (Gated DeltaNet) with an initial recurrent state in and the final state out.

Shapes: ``q``, ``k`` [B, S, H, Dk] (H key heads); ``v`` [B, S, HV, Dv]; ``g`` [B, S, HV] log-decay
(<= 0); ``beta`` [B, S, HV]; states [B, HV, Dk, Dv]. HV value heads, a multiple of H (grouped value
heads, GVA: Qwen3-Next, Qwen3.5): value head j reads key head ``j // (HV // H)``, as if q and k were
``repeat_interleave``d to HV heads first (the plain torch paths do that after the L2 norm;
flash-linear-attention >= 0.5 takes the grouped heads natively). Per value head and token, with q
scaled by Dk**-0.5 (q and k L2-normalised first when ``use_qk_l2norm``)::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t^T (beta_t * (v_t - k_t S_t))
    o_t = q_t S_t

the convention of transformers' ``torch_recurrent_gated_delta_rule`` /
``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5) and of flash-linear-attention's
``chunk_gated_delta_rule``. Arithmetic, the L2 norm included, is float32 (float64 for float64
inputs); the output has the dtype of ``v``, the final state the compute dtype.

``gated_delta_rule_reference`` is the token-by-token recurrence. ``gated_delta_rule`` is the
chunked (WY / UT-transform) form in plain torch, differentiable in every input including the
initial state, and dispatches to flash-linear-attention for half-precision CUDA inputs.
flash-linear-attention (and with it triton) is imported only then, so CPU processes never
load it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

_L2NORM_EPS = 1e-6
_FLA_DTYPES = (torch.bfloat16, torch.float16)
logger = logging.getLogger(__name__)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim (transformers' and fla's ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _value_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Value heads per key head (HV // H); a ValueError unless q, k have the same H and HV is a multiple of it."""
    heads, v_heads = k.shape[2], v.shape[2]
    if q.shape[2] != heads or heads < 1 or v_heads % heads:
        raise ValueError(f"q, k have {q.shape[2]}, {heads} heads and v {v_heads}: q and k need the same number of key "
                         f"heads H, v a multiple HV of it (value head j reads key head j // (HV // H))")
    return v_heads // heads


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast to the compute dtype, put heads before the sequence, normalise and scale q, k, repeat them per value head.

    Returns q, k [B, HV, S, Dk] (key head ``j // (HV // H)`` for value head j); v [B, HV, S, Dv];
    g, beta [B, HV, S]; state [B, HV, Dk, Dv] (zeros when ``initial_state`` is None).
    """
    groups = _value_groups(q, k, v)
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype).transpose(1, 2) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    if initial_state is None:
        batch, heads, _, dk = k.shape
        state = torch.zeros(batch, heads, dk, v.shape[-1], dtype=dtype, device=v.device)
    else:
        state = initial_state.to(dtype)
    return q, k, v, g, beta, state


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence. Returns (out [B, S, HV, Dv] in v's dtype, final state [B, HV, Dk, Dv]).

    ``q``, ``k`` [B, S, H, Dk]; ``v`` [B, S, HV, Dv]; ``g``, ``beta`` [B, S, HV]; ``initial_state``
    [B, HV, Dk, Dv] or None (zeros); HV a multiple of H (module docstring).
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm)
    outs = []
    for t in range(q.shape[2]):
        k_t = k[:, :, t]
        state = state * g[:, :, t, None, None].exp()
        delta = (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, state)) * beta[:, :, t, None]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape).transpose(1, 2)
    return out.to(out_dtype), state


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form on prepared inputs ([B, HV, S, ...], see ``_prepare``). Returns (out [B, S, HV, Dv], state).

    Inside a chunk with cumulative log-decay ``c`` and decay ``D_ij = exp(c_i - c_j)`` (j <= i),
    the UT transform ``T = (I + tril(diag(beta) K K^T * D, -1))^-1`` gives the corrected values
    ``u = T (beta v)`` and the keys reading the chunk's start state ``w = T (beta exp(c) k)``;
    then ``v_new = u - w S``, ``o = (q exp(c)) S + (Q K^T * D) v_new`` and
    ``S' = exp(c_last) S + (k exp(c_last - c))^T v_new``. Padding tokens (k = v = g = beta = 0)
    leave the state unchanged, so any S works.
    """
    batch, heads, seq_len, _ = k.shape
    dv = v.shape[-1]
    pad = -seq_len % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n_chunks = (seq_len + pad) // chunk_size
    q, k, v = (x.reshape(batch, heads, n_chunks, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, n_chunks, chunk_size) for x in (g, beta))

    cum = g.cumsum(-1)
    above_diagonal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(above_diagonal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    ut_system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)
    u = torch.linalg.solve_triangular(ut_system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut_system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    intra = q @ k.transpose(-1, -2) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_decayed = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    outs = []
    for i in range(n_chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    if not outs:
        return v.new_zeros(batch, 0, heads, dv), state
    out = torch.stack(outs, dim=2).reshape(batch, heads, n_chunks * chunk_size, dv)[:, :, :seq_len]
    return out.transpose(1, 2), state


FLA_CHUNK = 64  # flash-linear-attention's chunk length (fixed in its kernels)
_STAND_INS: list[Callable] = []
RULE_PATHS: Counter[str] = Counter()  # calls of gated_delta_rule per path it took ("fla", "fla_shapes", "torch")


class FlaShapes(torch.autograd.Function):
    """flash-linear-attention's ``chunk_gated_delta_rule`` as shapes only, for a dry run's fake CUDA tensors
    (``verl_longstraw.dryrun``; fla's Triton kernels have no fake implementation): the tensors it returns, saves for
    backward and makes in between, with their shapes and dtypes, read in fla's ``ChunkGatedDeltaRuleFunction``
    (fla-org/flash-linear-attention, fla/ops/gated_delta_rule/chunk.py, 2025): it saves the L2-normed q, k (and
    their float32 inverse norms), v, the float32 chunk-local cumulative decay, beta and the triangular solve A
    [B, T, HV, 64] in k's dtype; the forward and the backward each make the WY factors w [B, T, HV, Dk], u like v,
    the chunk states h [B, T / 64, HV, Dk, Dv] in k's dtype and the new values like v (the backward also dh in
    float32, dv and the gradients). Values are never computed: ``torch.empty``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        batch, tokens, heads, _ = q.shape
        v_heads = v.shape[2]
        rstd = q.new_empty(batch, tokens, heads, dtype=torch.float32) if use_qk_l2norm_in_kernel else None
        if use_qk_l2norm_in_kernel:
            q, k = torch.empty_like(q), torch.empty_like(k)
        g = g.new_empty(batch, tokens, v_heads, dtype=torch.float32)
        a = q.new_empty(batch, tokens, v_heads, FLA_CHUNK, dtype=torch.float32)
        a = torch.empty_like(a, dtype=k.dtype)
        _chunk_states(k, v)
        ctx.save_for_backward(q, rstd, k, None if rstd is None else torch.empty_like(rstd), v, g, beta, a,
                              initial_state)
        final = v.new_empty(batch, v_heads, q.shape[-1], v.shape[-1], dtype=torch.float32)
        return torch.empty_like(v), final

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, _, k, _, v, g, beta, _, initial_state = ctx.saved_tensors
        _chunk_states(k, v)
        dh = _chunk_states(k, v, torch.float32)
        del dh
        d_initial = None if initial_state is None else torch.empty_like(initial_state)
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
                torch.empty_like(beta), None, d_initial, None, None)


def _chunk_states(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """fla's transients of one pass: w, u, the chunk states h (returned) and the new values."""
    batch, tokens, _, k_dim = k.shape
    v_heads, v_dim = v.shape[2:]
    w = k.new_empty(batch, tokens, v_heads, k_dim)
    u, v_new = torch.empty_like(v), torch.empty_like(v)
    h = k.new_empty(batch, -(-tokens // FLA_CHUNK), v_heads, k_dim, v_dim, dtype=dtype or k.dtype)
    del w, u, v_new
    return h


def fla_shapes(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False):
    """``FlaShapes`` called as fla's ``chunk_gated_delta_rule`` is."""
    return FlaShapes.apply(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel)


@contextlib.contextmanager
def fla_stand_in(kernel: Callable) -> Iterator[None]:
    """Inside the block, CUDA inputs take ``kernel`` where they would take flash-linear-attention's
    ``chunk_gated_delta_rule`` (fla >= 0.5: grouped value heads natively): a dry run's ``fla_shapes``."""
    _STAND_INS.append(kernel)
    try:
        yield
    finally:
        _STAND_INS.remove(kernel)


def kernel_path(device_type: str, dtype: torch.dtype) -> str:
    """The path ``gated_delta_rule`` takes for inputs of ``dtype`` on a ``device_type`` device: "fla" (its CUDA
    kernel, or a dry run's ``fla_shapes``) for half-precision CUDA inputs where flash-linear-attention is installed,
    or where no GPU is visible to ask (a plan for GPUs made on a CPU host assumes the ``[gpu]`` extra); else
    "torch" (the plain chunked rule)."""
    if device_type != "cuda" or dtype not in _FLA_DTYPES:
        return "torch"
    if _STAND_INS or not torch.cuda.is_available():
        return "fla"
    return "fla" if _fla_chunk_gated_delta_rule() is not None else "torch"


def _fla_kernel() -> Callable | None:
    """The stand-in where one is set, else flash-linear-attention's kernel (None: not installed)."""
    return _STAND_INS[-1] if _STAND_INS else _fla_chunk_gated_delta_rule()


@functools.cache
def _fla_chunk_gated_delta_rule() -> Callable | None:
    """flash-linear-attention's kernel, or None when it is not installed or its import fails in any other way
    (a triton or driver mismatch raises at import; logged once, then treated as not installed). Call only for
    CUDA inputs."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    except Exception as error:  # installed but broken: the plain torch rule still computes the same values
        logger.warning("gated delta rule: flash-linear-attention is installed but failed to import (%s: %s); "
                       "using the plain torch chunked rule", type(error).__name__, error)
        return None
    return chunk_gated_delta_rule


@functools.cache
def _fla_takes_grouped_heads() -> bool:
    """Whether the installed flash-linear-attention takes q, k with fewer heads than v (GVA).

    Native GVA in ``chunk_gated_delta_rule`` came with fla 0.5.0 (fla-org/flash-linear-attention
    commit 8bcc1057, PR #812: its kernels read key head ``i_h // (HV // H)`` for value head
    ``i_h``, and sum dq, dk over each group). Older versions need q, k repeated to HV heads.
    """
    try:
        version = importlib.metadata.version("flash-linear-attention")
    except importlib.metadata.PackageNotFoundError:
        import fla

        version = getattr(fla, "__version__", "0")
    release = []
    for part in version.split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        release.append(int(digits) if digits else 0)
    return tuple(release) >= (0, 5)


@functools.cache
def _log_kernel_path(path: str, why: str, level: int = logging.INFO) -> None:
    """Say once per process which kernel the gated delta rule runs, and why."""
    logger.log(level, "gated delta rule: %s (%s)", path, why)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule. Returns (out [B, S, HV, Dv] in v's dtype, final state [B, HV, Dk, Dv]).

    ``q``, ``k`` [B, S, H, Dk]; ``v`` [B, S, HV, Dv]; ``g``, ``beta`` [B, S, HV]; ``initial_state``
    [B, HV, Dk, Dv] or None (zeros); HV a multiple of H, value head j reading key head j // (HV // H)
    (module docstring). The final state is float32 (float64 for float64 inputs). bf16/fp16 CUDA inputs go to
    flash-linear-attention when it is installed (its chunk size is fixed, ``chunk_size`` is
    ignored there); everything else takes the plain torch path. The path taken is logged once.
    """
    groups = _value_groups(q, k, v)
    path = kernel_path(q.device.type, q.dtype)  # the one decision, the estimate's too
    if path == "fla" and q.dtype == k.dtype == v.dtype:
        fla_kernel = _fla_kernel()
        _log_kernel_path("flash-linear-attention chunk kernel" + (" (shapes only)" if _STAND_INS else ""),
                         f"CUDA {q.dtype} inputs")
        RULE_PATHS["fla_shapes" if _STAND_INS else "fla"] += 1
        if groups > 1 and not _STAND_INS and not _fla_takes_grouped_heads():  # fla < 0.5: no GVA
            q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
        out, state = fla_kernel(
            q,
            k,
            v,
            g,
            beta,
            scale=q.shape[-1] ** -0.5,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
        return out.to(v.dtype), state.float()
    if path == "fla":
        _log_kernel_path("plain torch chunked rule", f"mixed input dtypes ({q.dtype}, {k.dtype}, {v.dtype})",
                         logging.WARNING)
    elif q.device.type == "cuda" and q.dtype in _FLA_DTYPES:
        _log_kernel_path("plain torch chunked rule", "flash-linear-attention is not installed: "
                         "pip install 'verl-longstraw[gpu]' for its CUDA kernel", logging.WARNING)
    else:
        _log_kernel_path("plain torch chunked rule", f"{q.device.type} {q.dtype} inputs")
    RULE_PATHS["torch"] += 1
    out_dtype = v.dtype
    out, state = _chunked(*_prepare(q, k, v, g, beta, initial_state, use_qk_l2norm), chunk_size)
    return out.to(out_dtype), state
