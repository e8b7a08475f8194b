"""Softmax attention over K/V rows (``Attention``: GQA, full, on one process or pass-Q over a CP group) and within a
sliding window or with learned sinks (``WindowAttention``, one process only).

State: K (after norm and RoPE) and V, one row per token [1, kv_heads, 1, head_dim]: every row (``Rows``), or for a
window W the last W - 1 (``Window``), what a later token can still see.

Costs: the path ``ops.attention.prefix.prefix_causal_attention`` takes and what it saves are the op's own
(``attention_path``, ``attention_saved_bytes``), pass-Q's ``ops.attention.cp.sharded_attention_saved_bytes``,
the window op's ``ops.attention.window.window_attention_saved_bytes``; the projections around them save
``ATTENTION_SAVES`` elements per token per unit of their widths (calibrated).
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..ops.attention import prefix as attention_ops
from ..ops.attention.cp import (
    BlockedPassQTransients,
    PassQPath,
    sharded_attention_path,
    sharded_attention_saved_bytes,
    sharded_blocked_transient_bytes,
    sharded_fused_backward_transient_bytes,
    sharded_prefix_attention,
)
from ..ops.attention.fused import fused_backward_transient_bytes, planned_fused_dtype
from ..ops.attention.prefix import AttentionCall, attention_path, attention_saved_bytes, prefix_causal_attention
from ..ops.attention.window import (
    window_attention,
    window_attention_fused_dtype,
    window_attention_saved_bytes,
)
from ..state import LayerState, Rows, Window
from .base import LayerCall, MixerOp, Saves, SegmentContext, apply_rope, upcast_row_bytes

ATTENTION_SAVES = 3.0  # q, rotated q/k, output and o_proj input, per token in units of the projection widths
STATE_ONLY_SAVES = 2.0  # without the output: the key path's norm input and output and the rotary tables, per token in
# units of the state row (a bound: layers without a key norm save less)
WINDOW_SAVES = 1.0  # the same around ``window_attention``, whose own saves hold the queries and outputs it reads


def attend(ctx: SegmentContext, q, k_prefix, v_prefix, k_self, v_self, scale: float, key_mask=None) -> torch.Tensor:
    """``ops.attention.prefix.prefix_causal_attention`` (shapes there, a batch-1 prefix shared by B sequences
    included) in one process, ``ops.attention.cp.sharded_prefix_attention`` (pass-Q) over the prompt state of every
    rank of a CP group."""
    if ctx.split is None:
        return prefix_causal_attention(q, k_prefix, v_prefix, k_self, v_self, scale, key_mask=key_mask,
                                       cache=ctx.scratch)
    s = ctx.split
    return sharded_prefix_attention(q, k_prefix, v_prefix, k_self, v_self, scale, ctx.group, s.query_sizes,
                                    s.prefix_sizes, s.consecutive, key_mask)


@lru_cache(maxsize=None)
def _fused_dtype(device_type: str, dtype: torch.dtype, q_heads: int, kv_heads: int, qk_dim: int,
                 v_dim: int) -> torch.dtype | None:
    return planned_fused_dtype(device_type, dtype, q_heads, kv_heads, qk_dim, v_dim)


class RowAttention(MixerOp):
    """What every attention over K/V ``Rows`` shares: the call shape (``q_heads`` query heads of ``qk_dim``, over
    ``kv_heads`` key heads, values of ``v_dim``), its path and saves in one process and under CP, its fused
    backward's transients and pass-Q's score block. Subclasses give the state, the forward and
    ``token_bytes``."""

    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    window: int | None = None  # keys each query sees (None: every earlier key)
    state_only_saves: float = STATE_ONLY_SAVES

    def token_bytes(self, act: int) -> float:
        """Bytes one token's projections save in the model dtype of ``act`` bytes (besides the op's saves)."""
        raise NotImplementedError

    def upcast_bytes(self, dtype: torch.dtype, need_output: bool) -> float:
        """Bytes per token the module's per-head norms save in half precision beyond what ``token_bytes`` and
        ``state_only_saves`` count (``base.upcast_row_bytes``; the key norm alone without ``need_output``); 0
        without such norms."""
        return 0.0

    def fused_dtype(self, call: LayerCall) -> torch.dtype | None:
        """The dtype the fused kernels compute this layer's inputs in, None where they do not take them."""
        return _fused_dtype(call.device_type, call.dtype, self.q_heads, self.kv_heads, self.qk_dim, self.v_dim)

    def masks_keys(self, call: LayerCall) -> bool:
        """Whether the call's attention reads a key mask (DSA's selection); False here."""
        return False

    def pass_q_path(self, call: LayerCall) -> PassQPath:
        """The path pass-Q takes for ``call`` under CP (``ops.attention.cp.sharded_attention_path``, which the op
        asks too)."""
        return sharded_attention_path(self.fused_dtype(call), call.queries, self.masks_keys(call))

    def attention_call(self, call: LayerCall) -> AttentionCall:
        """The ``prefix_causal_attention`` call of ``call`` (one process): its batch after a shared prefix."""
        return AttentionCall(call.batch, self.q_heads, self.kv_heads, self.qk_dim, self.v_dim, call.tokens,
                             call.prefix, call.batch > 1 and call.prefix > 0, False, call.dtype, self.fused_dtype(call))

    def saves(self, call: LayerCall) -> Saves:
        """Without ``need_output`` the key path's saves (``state_only_saves`` per token in units of the state
        row); else the projections' per-token saves and the op path's: ``attention_saved_bytes`` in one process
        (the mask shared by the layers of a call), pass-Q's local and gathered saves under CP (its outputs and
        queries are the gathered rows: this rank's are not counted twice). ``state_views``: the prefix buffer the
        path saves as views of the state's ``Rows``."""
        row, rows = self.row_nbytes(call.dtype), call.batch * call.tokens
        upcasts = rows * self.upcast_bytes(call.dtype, call.need_output)
        if not call.need_output:
            return Saves(int(self.state_only_saves * row * rows + upcasts))
        activations = rows * self.token_bytes(call.act) + upcasts
        buffer = row * call.state_len
        if call.cp_size > 1:
            fused = self.pass_q_path(call) == "fused"
            pass_q = sharded_attention_saved_bytes(call.dtype, self.q_heads, self.qk_dim, self.v_dim, call.queries,
                                                   call.cp_size, fused, buffer, row * call.tokens)
            counted_twice = call.tokens * self.q_heads * (self.qk_dim if fused else self.qk_dim + self.v_dim)
            return Saves(int(activations + pass_q.local - counted_twice * call.act), pass_q.gathered,
                         state_views=buffer)
        attn = self.attention_call(call)
        op = attention_saved_bytes(attn, buffer, row * rows)
        views = op.own - attention_saved_bytes(attn, 0, row * rows).own
        return Saves(int(activations + op.own), shared=op.shared, state_views=views)

    def transient_bytes(self, call: LayerCall) -> int:
        """The fused backward's buffers where the call takes the fused kernels (``ops.attention.fused``, pass-Q's
        ``sharded_fused_backward_transient_bytes`` under CP); under CP off them, the blocked pass-Q's backward
        (``sharded_blocked_transient_bytes``). None without ``need_output``: the layer does not attend."""
        if not call.need_output:
            return 0
        if self.takes_blocked_pass_q(call):
            return self.blocked_pass_q(call).backward
        if call.cp_size > 1:
            return sharded_fused_backward_transient_bytes(call.device_type, call.dtype, call.batch, self.q_heads,
                                                          self.kv_heads, self.qk_dim, call.sizes, call.rank,
                                                          call.prefix, call.consecutive)
        attn = self.attention_call(call)
        if attention_path(attn) != "fused":
            return 0
        return fused_backward_transient_bytes(call.device_type, call.dtype, call.batch, self.q_heads, self.kv_heads,
                                              self.qk_dim, call.tokens, call.prefix, call.tokens,
                                              shared_prefix=attn.shared_prefix)

    def forward_transient_bytes(self, call: LayerCall) -> int:
        """Under CP off the fused kernels, the blocked pass-Q's no-grad forward (``sharded_blocked_transient_bytes``);
        else ``score_block_bytes``."""
        if call.need_output and self.takes_blocked_pass_q(call):
            return self.blocked_pass_q(call).forward
        return self.score_block_bytes(call)

    def takes_blocked_pass_q(self, call: LayerCall) -> bool:
        """Whether ``call`` runs pass-Q on the blocked op (``pass_q_path``, under CP)."""
        return call.cp_size > 1 and self.pass_q_path(call) == "blocked"

    def blocked_pass_q(self, call: LayerCall) -> BlockedPassQTransients:
        """``sharded_blocked_transient_bytes`` of ``call`` (under CP)."""
        return sharded_blocked_transient_bytes(call.device_type, call.dtype, call.batch, self.q_heads, self.kv_heads,
                                               self.qk_dim, self.v_dim, call.sizes, call.rank, call.prefix)

    def score_block_bytes(self, call: LayerCall) -> int:
        """Under CP on the blocked pass-Q (the fused kernels do not take the inputs): the scores and probabilities
        of one key block (``ops.attention.prefix.key_block_size``) of this rank's keys for the gathered queries, in the
        compute dtype; else 0 (and without ``need_output``: the layer does not attend)."""
        if not call.need_output or not self.takes_blocked_pass_q(call):
            return 0
        itemsize = call.compute.itemsize
        block = min(attention_ops.key_block_size(self.q_heads * call.queries, itemsize), call.prefix + call.tokens)
        return 2 * self.q_heads * call.queries * block * itemsize

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """Pass-Q's (``ops.attention.cp``) where the layer attends, R ranks of n_r tokens, N = sum n_r,
        L = max n_r, Hq heads, b / f bytes of the model / arithmetic dtype. Forward: all-gather of the queries
        R L Hq D b and of the logsumexps R N Hq f, reduce-scatter of the weighted partial outputs R L Hq Dv f.
        Backward on the fused kernels: all-gather of d(output) and output R L Hq 2 Dv b, reduce-scatter of
        d(queries) R L Hq D f; on the blocked op: all-gather of d(output) R L Hq Dv f, reduce-scatters of
        d(logsumexp) R N Hq f and of d(queries) R L Hq D f (query gradients summed in float32)."""
        if call.cp_size == 1 or not call.need_output:
            return {}
        r, n, longest, heads = call.cp_size, call.queries, max(call.sizes), self.q_heads
        b, f = call.act, call.compute.itemsize
        gather = r * longest * heads * self.qk_dim * b + r * n * heads * f
        scatter = r * longest * heads * self.v_dim * f
        if backward and self.pass_q_path(call) == "fused":
            gather += r * longest * heads * 2 * self.v_dim * b
            scatter += r * longest * heads * self.qk_dim * f
        elif backward:
            gather += r * longest * heads * self.v_dim * f
            scatter += r * n * heads * f + r * longest * heads * self.qk_dim * f
        return {"all_gather": gather, "reduce_scatter": scatter}

    def flops(self, tokens: int, prefix: int) -> float:
        """QK^T over ``qk_dim`` and AV over ``v_dim``, 2 FLOPs a product, per query head and key seen (full
        attention with head dim d: 4 x heads x d x S x (p + (S + 1) / 2))."""
        return 2 * self.q_heads * (self.qk_dim + self.v_dim) * keys_seen(tokens, prefix, self.window)


def keys_seen(tokens: int, prefix: int, window: int | None) -> float:
    """Keys the queries at positions [prefix, prefix + tokens) attend to, causally, each within its last ``window``
    keys (its own included; None: every earlier key): sum over i < tokens of min(window, prefix + i + 1)."""
    whole = tokens if window is None else min(max(window - prefix, 0), tokens)  # queries that see every earlier key
    return whole * prefix + whole * (whole + 1) / 2 + (tokens - whole) * (window or 0)


class Attention(RowAttention):
    """GQA softmax attention of a transformers attention module (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    ``head_dim``, ``scaling``; optional per-head ``q_norm`` / ``k_norm`` (qwen3) and a sigmoid output gate packed
    into ``q_proj``, which then projects to twice ``o_proj``'s input (qwen3_next / qwen3_5 full layers)) over
    every earlier key. A family whose module names the output projection or the norms otherwise subclasses it
    with ``out_proj``, ``q_norm``, ``k_norm`` set to its names."""

    kind = "attention"
    flop_class = "attention"
    out_proj, q_norm, k_norm = "o_proj", "q_norm", "k_norm"  # the module's names of these submodules

    def __init__(self, module: nn.Module):
        self.module = module
        self.head_dim = module.head_dim
        self.q_heads = getattr(module, self.out_proj).in_features // self.head_dim
        self.kv_heads = module.k_proj.out_features // self.head_dim
        self.qk_dim = self.v_dim = self.head_dim
        self.gated_output = module.q_proj.out_features == 2 * getattr(module, self.out_proj).in_features

    @property
    def kinds(self) -> tuple[Rows, Rows]:
        row = Rows(shape=(1, self.kv_heads, 1, self.head_dim))
        return row, row

    def token_bytes(self, act: int) -> float:
        gate = 2 if self.gated_output else 1
        return act * ATTENTION_SAVES * (self.q_heads * self.qk_dim * gate + 2 * self.kv_heads * self.qk_dim)

    def upcast_bytes(self, dtype: torch.dtype, need_output: bool) -> float:
        """The key norm's on each key head and, with ``need_output``, the query norm's on each query head."""
        heads = {self.k_norm: self.kv_heads, self.q_norm: self.q_heads if need_output else 0}
        return sum(count * upcast_row_bytes(getattr(self.module, name), self.head_dim, dtype)
                   for name, count in heads.items() if count and hasattr(self.module, name))

    def new_state(self, past: LayerState, k: torch.Tensor, v: torch.Tensor) -> LayerState:
        """The segment's state: its own K/V rows."""
        return k, v

    def attend(self, ctx: SegmentContext, q, past: LayerState, k, v) -> torch.Tensor:
        return attend(ctx, q, past[0], past[1], k, v, self.module.scaling)

    def forward(self, x, ctx, past, need_output):
        """Attention of segment ``x`` [B, S, hidden] over past K/V [1, ...] plus itself."""
        attn, shape = self.module, (*x.shape[:-1], -1, self.head_dim)
        k = attn.k_proj(x).view(shape)
        if hasattr(attn, self.k_norm):
            k = getattr(attn, self.k_norm)(k)
        k = apply_rope(k.transpose(1, 2), ctx.cos, ctx.sin)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        state = self.new_state(past, k, v)
        if not need_output:  # only the state is needed (last layer of a capture): no queries
            return None, state
        q = attn.q_proj(x)
        if self.gated_output:
            q, gate = torch.chunk(q.view(*x.shape[:-1], -1, 2 * self.head_dim), 2, dim=-1)
            gate = gate.reshape(*x.shape[:-1], -1)
        q = q.reshape(shape)
        if hasattr(attn, self.q_norm):
            q = getattr(attn, self.q_norm)(q)
        q = apply_rope(q.transpose(1, 2), ctx.cos, ctx.sin)
        out = self.attend(ctx, q, past, k, v).transpose(1, 2).reshape(*x.shape[:-1], -1)
        if self.gated_output:
            out = out * torch.sigmoid(gate)
        return getattr(attn, self.out_proj)(out), state


class WindowAttention(Attention):
    """``Attention`` within a sliding ``window`` of keys (None: every earlier key) and with the module's learned
    ``sinks`` where it has them (gpt_oss), through ``ops.attention.window``. State: for a window the last W - 1
    rows (``Window.extend``), else every row. No CP form: a window layer's state is W - 1 rows, not the prompt's."""

    kind = "window_attention"
    context_parallel = False

    def __init__(self, module: nn.Module, window: int | None):
        super().__init__(module)
        self.window = window
        self.sinks = getattr(module, "sinks", None) is not None

    @property
    def kinds(self) -> tuple[Rows, Rows] | tuple[Window, Window]:
        if self.window is None:
            return super().kinds
        row = Window(shape=(1, self.kv_heads, 1, self.head_dim), rows_kept=self.window - 1)
        return row, row

    def new_state(self, past, k, v):
        if self.window is None:
            return k, v
        kind = self.kinds[0]
        return kind.extend(past[0], k), kind.extend(past[1], v)

    def attend(self, ctx, q, past, k, v):
        if ctx.split is not None:
            raise UnsupportedModelError("sliding-window and sink attention have no context-parallel form")
        return window_attention(q, past[0], past[1], k, v, self.module.scaling, self.window,
                                getattr(self.module, "sinks", None))

    def token_bytes(self, act: int) -> float:
        return act * WINDOW_SAVES * (self.q_heads * self.qk_dim + 2 * self.kv_heads * self.qk_dim)

    def saves(self, call: LayerCall) -> Saves:
        """The projections' per-token saves and the window op's (``window_attention_saved_bytes`` over the rows a
        query can still see); none of it a view of the state (a window's past is a copy)."""
        row, rows = self.row_nbytes(call.dtype), call.batch * call.tokens
        upcasts = rows * self.upcast_bytes(call.dtype, call.need_output)
        if not call.need_output:
            return Saves(int(self.state_only_saves * row * rows + upcasts))
        past = call.prefix if self.window is None else min(call.prefix, self.window - 1)
        op = window_attention_saved_bytes(call.batch, self.q_heads, self.kv_heads, self.qk_dim, self.v_dim,
                                          call.tokens, past, self.window, self.sinks, call.dtype,
                                          past_shared=call.batch > 1, device_type=call.device_type)
        return Saves(int(rows * self.token_bytes(call.act) + upcasts + op))

    def transient_bytes(self, call: LayerCall) -> int:
        """The fused backward's buffers where ``window_attention`` takes the fused kernels (layers over every earlier
        key, ``window_attention_fused_dtype``); none without ``need_output`` (the layer does not attend)."""
        if not call.need_output:
            return 0
        fused = window_attention_fused_dtype(call.device_type, call.dtype, self.q_heads, self.kv_heads, self.qk_dim,
                                             self.v_dim, self.window)
        if fused is None:
            return 0
        return fused_backward_transient_bytes(call.device_type, call.dtype, call.batch, self.q_heads, self.kv_heads,
                                              self.qk_dim, call.tokens, call.prefix, call.tokens,
                                              shared_prefix=call.batch > 1 and call.prefix > 0)
