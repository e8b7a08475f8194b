"""Nemotron-H: Mamba2, attention, MLP and MoE blocks (``nemotron_h``), each block ``h + sublayer(norm(h))`` with one
token mixer or one MLP/MoE.

State per layer:
- Mamba2: conv state [1, conv_dim, kernel - 1] (the last inputs of the causal depthwise conv, model dtype) and SSM
  state [1, heads, head_dim, state_size] (float32), both ``Fixed``;
- attention (no positional embedding): K, V [1, kv_heads, S, head_dim] (``Rows``);
- MLP and MoE blocks: none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.ssd_scan import model_chunk_scan, step_sizes
from ..state import Fixed, LayerState, StateKind
from .base import Adapter, Mixer, SegmentContext, per_sequence, register
from .dense import attention_mix, attention_mixer, kv_kinds

_MLP_BLOCKS = ("mlp", "moe")


def mamba2_kinds(mixer: nn.Module) -> tuple[Fixed, Fixed]:
    """Conv state [1, conv_dim, kernel - 1] (model dtype), SSM state [1, heads, head_dim, state_size] (at least
    float32); both start at zero."""
    conv = Fixed(shape=(1, mixer.conv_dim, mixer.conv_kernel_size - 1))
    ssm = Fixed(shape=(1, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size), min_dtype=torch.float32)
    return conv, ssm


def mamba2_mixer(mixer: nn.Module) -> Mixer:
    """The chunked scan's shape (``Mixer`` "mamba2") as the module runs it."""
    return Mixer("mamba2", q_heads=mixer.num_heads, kv_heads=mixer.n_groups, v_dim=mixer.head_dim,
                 state_size=mixer.ssm_state_size, scan_chunk=mixer.chunk_size)


def mamba2_mix(mixer: nn.Module, x: torch.Tensor, ctx: SegmentContext, past: LayerState) -> tuple[torch.Tensor,
                                                                                                  LayerState]:
    """Mamba2 over segment ``x`` [B, S, hidden] continuing (conv_state, ssm_state) [1, ...] (copied per sequence for
    B > 1), the ops of transformers' ``NemotronHMamba2Mixer`` torch path: in_proj -> (gate, xBC, dt), the causal
    conv and its activation over xBC, the chunked scan (``ops.ssd_scan``: the model's own, mamba_ssm's kernel where
    installed) with the skip term D, the gated RMSNorm, out_proj. The new conv state owns its storage; the SSM state
    stays float32 (float64 in a float64 model)."""
    conv_state, ssm_state = past
    batch, seq_len = x.shape[:2]
    gate, xbc, dt = mixer.in_proj(x).split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
    conv_in, new_conv_state = ctx.conv_input(xbc.transpose(1, 2), per_sequence(conv_state.to(xbc.dtype), batch))
    weight = mixer.conv1d.weight
    xbc = mixer.act(F.conv1d(conv_in, weight, mixer.conv1d.bias, groups=weight.shape[0])).transpose(1, 2)
    group_width = mixer.n_groups * mixer.ssm_state_size
    hidden, B, C = torch.split(xbc, [mixer.intermediate_size, group_width, group_width], dim=-1)
    out, new_ssm_state = ctx.ssd_scan(
        model_chunk_scan(mixer),
        hidden.view(batch, seq_len, mixer.num_heads, mixer.head_dim),
        step_sizes(dt, mixer.dt_bias, mixer.time_step_limit),
        -torch.exp(mixer.A_log.float()),
        B.view(batch, seq_len, mixer.n_groups, mixer.ssm_state_size),
        C.view(batch, seq_len, mixer.n_groups, mixer.ssm_state_size),
        mixer.D,
        per_sequence(ssm_state, batch),
        mixer.chunk_size,
    )
    out = mixer.norm(out.reshape(batch, seq_len, -1), gate)
    new_ssm_state = new_ssm_state.to(torch.promote_types(x.dtype, torch.float32))
    return mixer.out_proj(out.to(x.dtype)), (new_conv_state, new_ssm_state)


@register
class NemotronHAdapter(Adapter):
    model_types = ("nemotron_h",)
    expert_plan = {"layers.*.mixer.experts.up_proj": "grouped_gemm", "layers.*.mixer.experts.down_proj": "grouped_gemm",
                   "layers.*.mixer.experts": "ep_dispatch_experts"}  # transformers 5.19 has none
    weights_read = (*Adapter.weights_read, "conv1d")  # the causal conv runs on its weight (mamba2_mix)
    layer_types = ("linear_attention", "full_attention", *_MLP_BLOCKS)

    def _block(self, idx: int) -> str:
        return self.config.layer_types[idx]

    def mixer(self, idx: int) -> Mixer:
        block = self._block(idx)
        if block == "linear_attention":
            return mamba2_mixer(self.layers[idx].mixer)
        return Mixer("none") if block in _MLP_BLOCKS else attention_mixer(self.layers[idx].mixer)

    def state_kinds(self, idx: int) -> tuple[StateKind, ...]:
        block = self._block(idx)
        if block == "linear_attention":
            return mamba2_kinds(self.layers[idx].mixer)
        return () if block in _MLP_BLOCKS else kv_kinds(self.layers[idx].mixer)

    def mlp_width(self, idx: int) -> int:
        """0 for a token mixer's block; an MLP's intermediate width; a MoE's routed experts x top-k, its shared
        expert and its router's logits."""
        c, block = self.config, self._block(idx)
        if block == "mlp":
            return c.intermediate_size
        if block == "moe":
            routed = c.num_experts_per_tok * c.moe_intermediate_size
            return routed + c.moe_shared_expert_intermediate_size + c.n_routed_experts
        return 0

    def mix(self, idx, x, ctx, past, need_output):
        mixer = self.layers[idx].mixer
        if self._block(idx) == "linear_attention":
            return mamba2_mix(mixer, x, ctx, past)
        return attention_mix(mixer, x, ctx, past, need_output)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embeddings(ids if ids.dim() == 2 else ids[None])

    def layer(self, idx, h, ctx, past, need_output):
        """One block: ``h + sublayer(norm(h))``; an MLP or MoE block keeps no state."""
        block = self.layers[idx]
        x = block.norm(h.to(block.norm.weight.dtype))
        if self._block(idx) in _MLP_BLOCKS:
            return (h + block.mixer(x),) if need_output else (None,)
        mixed, state = self.mix(idx, x, ctx, past, need_output)
        return (h + mixed if need_output else None, *state)

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm_f(h).flatten(0, 1)
