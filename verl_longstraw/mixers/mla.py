"""Multi-head latent attention (deepseek_v3, glm_moe_dsa with DSA's sparse indexer, kimi_linear's full layers).

State: the normalised KV latent and the rotated rope key, one tensor [1, S, kv_lora_rank + rope_dim] (never the
decompressed per-head K/V); for DSA layers that run their own indexer also the indexer keys [1, S, index_head_dim]
(selection only: no gradient flows through them, as in the model).

Attention runs in absorbed form: query heads are projected into latent space through the key half of ``kv_b_proj``,
attend to the latent (one shared key/value head), and the result leaves latent space through the value half: the
call shape and costs of ``mixers.attention.RowAttention``. The plain form, K/V decompressed per head, is the reference
beside the op (``ops.mla.reference``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from ..lora import linear_weights
from ..ops.dsa.cp import (
    QUERY_BLOCK,
    keeps_every_key,
    most_keys_seen,
    selection_collective_bytes,
    sharded_dsa_topk_mask,
)
from ..ops.dsa.topk import KEY_BLOCK
from ..state import LayerState, Rows
from .attention import RowAttention, attend
from .base import LayerCall, Saves, SegmentContext, apply_rope

LATENT_SAVES = 2.0  # queries, absorbed queries, latent projections and outputs, per token in units of their widths
STATE_ONLY_SAVES = 2.5  # without the output: the latent norm's input, output and statistics and the rotary tables, per
# token in units of the latent row


def rope_is_interleaved(config, module: nn.Module) -> bool:
    """Whether ``module`` rotates interleaved pairs: ``config.rope_interleave`` where the model reads it
    (deepseek_v3), else what the installed transformers release's forward calls (glm_moe_dsa changed
    from split-half to interleaved between releases)."""
    flag = getattr(config, "rope_interleave", None)
    if isinstance(flag, bool):
        return flag
    return "apply_rotary_pos_emb_interleave" in inspect.unwrap(type(module).forward).__code__.co_names


def _indexer_keys(indexer: nn.Module, x: torch.Tensor, ctx: SegmentContext, interleaved: bool) -> torch.Tensor:
    """DSA indexer keys [B, S, index_head_dim] (rope part first) of ``x`` [B, S, hidden]."""
    k = indexer.k_norm(indexer.wk(x))
    k_rope, k_pass = torch.split(k, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
    return torch.cat([apply_rope(k_rope, ctx.cos, ctx.sin, interleaved), k_pass], dim=-1)


def _sparse_selection(
    indexer: nn.Module, x, q_resid, past_keys, keys, ctx: SegmentContext, interleaved: bool
) -> torch.Tensor | None:
    """Bool key mask of each query's top-k keys by indexer score (DSA), causal, or None where top-k keeps every
    key: [S, P + S] in one process, [sum(query_sizes), P_r + S] on a CP rank (``ops.dsa.cp``), [B, S, P + S]
    for B > 1 sequences of ``x`` after one prefix (each selected alone, as one sequence would be); ``past_keys``
    [1, P(_r), index_head_dim] and ``keys`` [B, S, index_head_dim] the indexer keys of the prefix and segment.
    Whether top-k keeps every key is asked first, before the query projection and the float32 copy of the prefix
    keys (at P = 1M about 0.5 GB per layer call)."""
    if keeps_every_key(past_keys.shape[1], x.shape[1], indexer.index_topk, ctx.split):
        return None
    q = indexer.wq_b(q_resid).unflatten(-1, (indexer.n_heads, indexer.head_dim))  # [B, S, H, D]
    q_rope, q_pass = torch.split(q, [indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim], dim=-1)
    q_rope = apply_rope(q_rope.transpose(1, 2), ctx.cos, ctx.sin, interleaved).transpose(1, 2)
    q = torch.cat([q_rope, q_pass], dim=-1).float()
    weights = indexer.weights_proj(x).float() * indexer.n_heads**-0.5  # [B, S, H]
    prefix = past_keys[0].float()
    masks = [
        sharded_dsa_topk_mask(q[b], weights[b], prefix, keys[b].float(), indexer.softmax_scale, indexer.index_topk,
                              ctx.split, ctx.group)
        for b in range(len(x))
    ]
    return masks[0] if len(masks) == 1 or masks[0] is None else torch.stack(masks)


@dataclass
class _SelectionInputs:
    """What an indexer layer's key selection is computed from in one segment (``_sparse_selection``'s arguments)
    besides the prefix's indexer keys, which are read from the path state again (``SegmentContext.past``)."""

    indexer: nn.Module
    x: torch.Tensor
    q_resid: torch.Tensor
    keys: torch.Tensor
    interleaved: bool


class DsaSelections:
    """The DSA key selections of one segment (``ctx.scratch["dsa"]``), by the index of the indexer layer that makes
    them: each indexer layer's inputs to its selection (its normed input and query residual, [B, S, hidden] and
    [B, S, q_lora_rank], and the segment's indexer keys), and the one selection last made (a key mask can be as large
    as [queries of all ranks, prompt rows of this rank], so only one is kept). The prefix's indexer keys are not
    kept: with ``state_on_host`` they are a device copy of host rows (``state.stream``), which would keep every
    indexer layer's copy on the device for the whole segment.

    A shared layer asks for its indexer layer's selection (``mask``): the one kept if it is that layer's, else
    selected again from that layer's inputs and its prefix keys read from the path again (``ctx.past[source]``; a
    ``StreamedPath`` copies that layer's rows to the device again). So it gets its own indexer layer's selection in
    whatever order the layers run: under activation checkpointing the backward recomputes the layers last to first,
    and a shared layer's recompute comes after a later indexer layer's (the model itself passes
    ``prev_topk_indices`` as a layer argument for this). Every rank asks in the same order (the layers'), so a
    selection made again issues the same collectives on every rank."""

    def __init__(self) -> None:
        self.inputs: dict[int, _SelectionInputs] = {}
        self.kept: tuple[int, torch.Tensor | None] | None = None

    def select(self, source: int, inputs: _SelectionInputs, past_keys: torch.Tensor,
               ctx: SegmentContext) -> torch.Tensor | None:
        """Layer ``source``'s selection (``_sparse_selection``) from ``inputs`` after the prefix's indexer keys
        ``past_keys`` [1, P(_r), index_head_dim], remembered with the inputs."""
        self.inputs[source] = inputs
        mask = _sparse_selection(inputs.indexer, inputs.x, inputs.q_resid, past_keys, inputs.keys, ctx,
                                 inputs.interleaved)
        self.kept = (source, mask)
        return mask

    def mask(self, source: int, ctx: SegmentContext) -> torch.Tensor | None:
        """The selection of indexer layer ``source``, which must have run in this segment with its output needed."""
        if self.kept is not None and self.kept[0] == source:
            return self.kept[1]
        if source not in self.inputs:
            raise RuntimeError(f"DSA: a shared layer reads the selection of indexer layer {source}, which made none in "
                               f"this segment (layers run out of order, or that layer's output was not needed)")
        if ctx.past is None:
            raise RuntimeError(f"DSA: selecting the keys of indexer layer {source} again reads its prefix keys from "
                               "SegmentContext.past, which is None (execute.run_segment sets it)")
        with torch.no_grad():
            return self.select(source, self.inputs[source], ctx.past[source][1], ctx)


class LatentAttention(RowAttention):
    """MLA of a transformers DeepSeek-V3-style attention module (``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` /
    ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``), in ``config``'s rope
    layout. ``sparse``: the model selects keys with DSA's indexer (``config.index_topk``); ``runs_indexer``: this
    layer runs its own indexer; ``selection_source``: the index of the layer whose selection this layer uses (its
    own where it runs the indexer, else the last layer before it that does; ``DsaSelections``).
    Call shape: every head's latent-space query over one key head of the latent plus rope dims, values the latent."""

    kind = "mla"
    flop_class = "attention"
    state_only_saves = STATE_ONLY_SAVES

    def __init__(self, module: nn.Module, config, sparse: bool, runs_indexer: bool, selection_source: int):
        self.module, self.sparse, self.runs_indexer = module, sparse, runs_indexer
        self.selection_source = selection_source
        self.index_topk = config.index_topk if sparse else None  # the keys DSA's selection keeps per query
        self.interleaved = rope_is_interleaved(config, module)
        self.indexer_interleaved = rope_is_interleaved(config, module.indexer) if runs_indexer else False
        rank, rope = module.kv_lora_rank, module.qk_rope_head_dim
        self.q_heads, self.kv_heads, self.qk_dim, self.v_dim = module.num_heads, 1, rank + rope, rank

    @property
    def kinds(self) -> tuple[Rows, ...]:
        latent = Rows(shape=(1, 1, self.qk_dim))
        if not self.runs_indexer:
            return (latent,)
        return latent, Rows(shape=(1, 1, self.module.indexer.head_dim), differentiable=False)

    def token_bytes(self, act: int) -> float:
        m = self.module
        per_head = self.q_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        return act * LATENT_SAVES * (self.q_heads * self.qk_dim + per_head + (m.q_lora_rank or 0) + m.kv_lora_rank)

    def masks_keys(self, call: LayerCall) -> bool:
        """Whether the call's attention reads a DSA key mask: a sparse layer whose top-k does not keep every key a
        query sees (``ops.dsa.cp.most_keys_seen``)."""
        return self.sparse and most_keys_seen(call.group_prefix, call.sizes, call.consecutive) > self.index_topk

    def selects(self, call: LayerCall) -> bool:
        """Whether this layer makes a DSA selection in ``call``: it runs its own indexer, its output is needed and
        its attention reads a key mask (``masks_keys``)."""
        return self.runs_indexer and call.need_output and self.masks_keys(call)

    def selection_bytes(self, call: LayerCall) -> int:
        """Where the layer ``selects``: its key mask (bool [batch, queries of all ranks, this rank's prefix rows +
        tokens]), which its attention saves and ``DsaSelections`` keeps, and the inputs ``DsaSelections`` keeps to
        select again (the normed input and the query residual, [batch, tokens, hidden + q_lora_rank] in the model
        dtype); else 0."""
        if not self.selects(call):
            return 0
        module = self.module
        mask = call.batch * call.queries * (call.prefix + call.tokens)
        inputs = call.batch * call.tokens * (module.q_a_proj.in_features + module.q_lora_rank) * call.act
        return mask + inputs

    def selection_transient_bytes(self, call: LayerCall) -> int:
        """Where the layer ``selects``, what making the selection holds besides the mask: the indexer queries and
        weights of every rank's tokens (float32 [batch x queries, heads, head dim + 1]) and one query block's
        running top-k and scores (``ops.dsa.cp.QUERY_BLOCK`` rows of int64 sort keys, 3 x (top-k + key block),
        and two bool rows over this rank's keys); else 0."""
        if not self.selects(call):
            return 0
        indexer = self.module.indexer
        gathered = call.batch * call.queries * indexer.n_heads * (indexer.head_dim + 1) * 4
        block = QUERY_BLOCK * (3 * (indexer.index_topk + KEY_BLOCK) * 8 + 2 * (call.prefix + call.tokens))
        return gathered + block

    def saves(self, call: LayerCall) -> Saves:
        """``RowAttention``'s, and an indexer layer's selection (``selection_bytes``); a shared layer's attention
        saves a view of its indexer layer's mask, counted there."""
        saves = super().saves(call)
        return saves._replace(own=saves.own + self.selection_bytes(call))

    def forward_transient_bytes(self, call: LayerCall) -> int:
        """``RowAttention``'s or the selection's (``selection_transient_bytes``), whichever is larger, beside the
        mask where the layer selects (a capture saves nothing, so the mask is a transient there)."""
        return self.selection_bytes(call) + max(super().forward_transient_bytes(call),
                                                self.selection_transient_bytes(call))

    def collective_bytes(self, call: LayerCall, backward: bool) -> dict[str, int]:
        """``RowAttention``'s, and where a layer running its own DSA indexer selects keys under CP (its output is
        needed and top-k does not keep every key: ``ops.dsa.cp.keeps_every_key``) the selection's, forward only
        (no autograd): all-gathers of the indexer queries R L Hi Di and weights R L Hi (float32; L = max n_r) and
        the threshold search's all-reduces (``ops.dsa.cp.selection_collective_bytes``)."""
        out = super().collective_bytes(call, backward)
        if call.cp_size == 1 or not self.selects(call):
            return out
        indexer, r, longest = self.module.indexer, call.cp_size, max(call.sizes)
        out["all_gather"] = out.get("all_gather", 0) + r * longest * indexer.n_heads * (indexer.head_dim + 1) * 4
        out["all_reduce"] = out.get("all_reduce", 0) + selection_collective_bytes(call.queries)
        return out

    def _dsa_mask(self, x, q_resid, ctx: SegmentContext, past: LayerState, need_output: bool):
        """(extra indexer-key state, bool key mask or None) of a DSA layer (``_sparse_selection``). Without
        ``need_output`` (a state-only call: nothing attends) the indexer keys only, no selection."""
        if not self.sparse:
            return (), None
        selections = ctx.scratch.setdefault("dsa", DsaSelections())
        if not self.runs_indexer:  # shared layer: its indexer layer's selection
            return (), selections.mask(self.selection_source, ctx)
        indexer = self.module.indexer
        with torch.no_grad():  # selection only: the model's indexer gets no gradient either
            keys = _indexer_keys(indexer, x, ctx, self.indexer_interleaved)
            if not need_output:  # a state-only call: nothing attends, no selection
                return (keys,), None
            inputs = _SelectionInputs(indexer, x.detach(), q_resid.detach(), keys, self.indexer_interleaved)
            return (keys,), selections.select(self.selection_source, inputs, past[1], ctx)

    def forward(self, x, ctx, past, need_output):
        """Without ``need_output`` only the latent rows (and a DSA layer's indexer keys) are computed: no queries
        (the indexer's query input without autograd)."""
        attn = self.module
        heads, nope, rope_dim, rank = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
        latent, k_rope = torch.split(attn.kv_a_proj_with_mqa(x), [rank, rope_dim], dim=-1)
        k_rope = apply_rope(k_rope, ctx.cos, ctx.sin, self.interleaved)
        segment = torch.cat([attn.kv_a_layernorm(latent), k_rope], dim=-1)  # [B, S, rank + rope]
        q_resid = None
        if attn.q_lora_rank is not None and need_output:
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
        extra_state, mask = self._dsa_mask(x, q_resid, ctx, past, need_output)
        if not need_output:
            return None, (segment, *extra_state)
        q = attn.q_proj(x) if q_resid is None else attn.q_b_proj(q_resid)
        q = q.unflatten(-1, (heads, attn.qk_head_dim)).transpose(1, 2)  # [B, H, S, nope + rope]
        q_nope, q_rope = torch.split(q, [nope, rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, ctx.cos, ctx.sin, self.interleaved)

        w_kv = linear_weights(attn.kv_b_proj)[0].view(heads, nope + attn.v_head_dim, rank)  # LoRA's delta too
        out = self.attend_latent(ctx, q_nope, q_rope, past[0], segment, w_kv[:, :nope], w_kv[:, nope:], mask)
        out = out.transpose(1, 2).reshape(*x.shape[:-1], -1)
        return attn.o_proj(out), (segment, *extra_state)

    def attend_latent(self, ctx: SegmentContext, q_nope, q_rope, prefix, segment, w_k, w_v,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """Attention in absorbed form (shapes as ``ops.mla.reference.decompressed_latent_attention``, which it
        equals): the queries' nope part projected into latent space through ``w_k``, attending (``attend``) to the
        latent rows as one shared key head whose values are the latent, the result leaving latent space through
        ``w_v``: [B, H, S, v_dim]."""
        rank = self.module.kv_lora_rank
        query = torch.cat([torch.einsum("bhsn,hnr->bhsr", q_nope, w_k), q_rope], dim=-1)
        prefix, own = prefix[:, None], segment[:, None]  # one shared key head: [1, 1, P, .], [B, 1, S, .]
        out = attend(ctx, query, prefix, prefix[..., :rank], own, own[..., :rank], self.module.scaling, key_mask=mask)
        return torch.einsum("bhsr,hvr->bhsv", out, w_v)
