"""The one interface every architecture adapter implements.

An adapter runs a segment of tokens through the model, layer by layer, reading the state
of the tokens before it and returning the state the segment adds. It reuses the model's
own submodules (projections, norms, MLP/MoE) and owns only the token mixer (attention,
linear attention) and the state format, so it does not depend on one transformers
release's cache classes.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..ops.attention import prefix_causal_attention
from ..ops.gated_delta_rule import gated_delta_rule
from ..ops.kda import DeltaRule, kda_rule
from ..ops.ssd_scan import ChunkScan, ssd_scan
from ..ops.window_attention import window_attention
from ..parallel import comm
from ..parallel.attention import sharded_prefix_attention
from ..parallel.gated_delta import sharded_conv_input, sharded_gated_delta_rule
from ..parallel.kda import sharded_kda_rule
from ..parallel.ssd import sharded_ssd_scan
from ..plan import Split
from ..state import LayerState, StateKind
from .lora import base_model, check_lora


@dataclass
class SegmentContext:
    """What every layer of one segment shares: rotary tables of its positions, how the segment is split
    over a context-parallel group (``split``, the plan's, and ``group``; None: one process), scratch for the
    adapter.

    Token mixers run their sequence-mixing ops through ``attention``, ``delta_rule``, ``kda_rule``, ``ssd_scan``
    and ``conv_input`` so one code path serves one process and a CP group.
    """

    cos: torch.Tensor  # [S, rotary_dim]: the segment's S tokens
    sin: torch.Tensor
    split: Split | None = None
    group: comm.Group = None
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def splits_sequence(self) -> bool:
        """Whether this rank's tokens continue another rank's (a capture or recompute chunk under CP)."""
        return self.split is not None and self.split.consecutive

    def attention(self, q, k_prefix, v_prefix, k_self, v_self, scale: float, key_mask=None) -> torch.Tensor:
        """``prefix_causal_attention`` (shapes there, a batch-1 prefix shared by B sequences included) over the
        prompt state of every rank of the group."""
        if self.split is None:
            return prefix_causal_attention(
                q, k_prefix, v_prefix, k_self, v_self, scale, key_mask=key_mask, cache=self.scratch
            )
        s = self.split
        return sharded_prefix_attention(
            q, k_prefix, v_prefix, k_self, v_self, scale,
            self.group, s.query_sizes, s.prefix_sizes, s.consecutive, key_mask,
        )

    def window_attention(self, q, k_past, v_past, k_self, v_self, scale: float, window: int | None,
                         sinks: torch.Tensor | None) -> torch.Tensor:
        """``ops.window_attention.window_attention`` (shapes there) over the rows before the segment; one process
        only (``Adapter.check_context_parallel`` refuses a CP group for models with such layers)."""
        if self.split is not None:
            raise UnsupportedModelError("sliding-window and sink attention have no context-parallel form")
        return window_attention(q, k_past, v_past, k_self, v_self, scale, window, sinks)

    def delta_rule(self, q, k, v, g, beta, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``gated_delta_rule`` (shapes there, q/k L2-normalised) continuing ``initial_state``; under CP with a split
        sequence the state flows through the ranks and the returned final state is every rank's."""
        if not self.splits_sequence:
            return gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, use_qk_l2norm=True)
        return sharded_gated_delta_rule(
            q, k, v, g, beta, initial_state, self.group, self.split.query_sizes, use_qk_l2norm=True
        )

    def kda_rule(self, rule: DeltaRule, q, k, v, g, beta, initial_state: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Kimi Delta Attention's ``ops.kda.kda_rule`` (shapes there) continuing ``initial_state``; under CP with a
        split sequence the state flows through the ranks and the returned final state is every rank's."""
        if not self.splits_sequence:
            return kda_rule(rule, q, k, v, g, beta, initial_state)
        return sharded_kda_rule(rule, q, k, v, g, beta, initial_state, self.group, self.split.query_sizes)

    def ssd_scan(self, scan: ChunkScan, x, dt, A, B, C, D, initial_state: torch.Tensor,
                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mamba2's ``ops.ssd_scan.ssd_scan`` (shapes there) continuing ``initial_state``; under CP with a split
        sequence the state flows through the ranks and the returned final state is every rank's."""
        if not self.splits_sequence:
            return ssd_scan(scan, x, dt, A, B, C, D, initial_state, chunk_size)
        return sharded_ssd_scan(scan, x, dt, A, B, C, D, initial_state, chunk_size, self.group,
                                self.split.query_sizes)

    def conv_input(self, x: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Input of a causal depthwise conv: the K-1 inputs before the segment, then ``x`` [B, C, S]; and the
        last K-1 inputs after it (the next conv state, owning its storage). ``conv_state`` [B, C, K-1]."""
        if self.splits_sequence:
            return sharded_conv_input(x, conv_state, self.group, self.split.query_sizes)
        conv_in = torch.cat([conv_state, x], dim=-1)
        return conv_in, conv_in[..., -conv_state.shape[-1] :].clone()


def per_sequence(state: torch.Tensor, batch: int) -> torch.Tensor:
    """A fixed-size state [1, ...] for ``batch`` sequences: itself for one, else a contiguous copy [batch, ...]
    (small: e.g. a Gated DeltaNet recurrent state; kernels such as flash-linear-attention's read it densely)."""
    return state if state.shape[0] == batch else state.expand(batch, *state.shape[1:]).contiguous()


@contextmanager
def forward_replaced(module: nn.Module, fn: Callable) -> Iterator[None]:
    """Make ``module(...)`` run ``fn`` while keeping the module's hooks.

    Calling the module (rather than ``fn`` directly) fires its forward hooks, so FSDP2
    unshards and reshards parameters and registers its backward hooks, and HF gradient
    checkpointing wraps the call, exactly as in a normal forward.
    """
    previous = module.__dict__.get("forward")
    module.forward = fn
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


def call_as(module: nn.Module, fn: Callable, *args: Any) -> Any:
    """``module(*args)`` with ``fn`` as the forward (see ``forward_replaced``).

    HF gradient checkpointing (``module.gradient_checkpointing``) is applied here, around
    the swap, so its recompute during backward runs ``fn`` again rather than the
    module's own forward.
    """
    if getattr(module, "gradient_checkpointing", False) and module.training and torch.is_grad_enabled():
        return module._gradient_checkpointing_func(_call_replaced, module, fn, *args)
    return _call_replaced(module, fn, *args)


def _call_replaced(module: nn.Module, fn: Callable, *args: Any) -> Any:
    with forward_replaced(module, fn):
        return nn.Module.__call__(module, *args)  # module hooks fire; HF's checkpointing __call__ is bypassed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding on the first ``cos.shape[-1]`` channels of ``x`` [..., S, D] (partial rotary passes the rest).

    ``cos``/``sin`` [S, rotary_dim] come from the model's rotary module (split-half layout).
    ``interleaved`` first de-interleaves pairs (DeepSeek-V3 ``rope_interleave``).
    """
    rot_dim = cos.shape[-1]
    if not rot_dim:  # no positional embedding (nemotron_h attention)
        return x
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if interleaved:
        rot = rot.unflatten(-1, (rot_dim // 2, 2)).transpose(-1, -2).flatten(-2)
    rot = rot * cos + rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


MIXER_KINDS = ("attention", "window_attention", "mla", "gated_delta", "kda", "mamba2", "none")
ATTENTION_KINDS = ("attention", "mla")  # the kinds that attend over K/V rows (``ops.attention``)


@dataclass(frozen=True)
class Mixer:
    """A layer's token mixer as the memory estimate and the benchmarks read it (``Adapter.mixer``).

    ``kind`` (``MIXER_KINDS``): "attention" (``ops.attention`` over K/V rows), "window_attention" (``ops.
    window_attention``: within a sliding ``window`` of keys, None for every earlier key, with learned ``sinks`` or
    not, over K/V rows or a window of them), "mla" (the same op in MLA's latent
    space: absorbed queries, one key head, the values a view of the latent keys), "gated_delta" (the chunked
    gated delta rule over fixed-size state), "kda" (Kimi Delta Attention, ``ops.kda``, over fixed-size state),
    "mamba2" (Mamba2's chunked scan, ``ops.ssd_scan``, over fixed-size
    state) or "none" (no token mixer: a block of an MLP or MoE alone, nemotron_h). Attention kinds: the op's call
    shape, ``q_heads``, ``kv_heads``, ``qk_dim`` and ``v_dim`` per head; ``gated_output``: a sigmoid output gate
    packed into ``q_proj`` (which then projects to twice the query width). "mamba2": the scan's shape, ``q_heads``
    SSM heads of ``v_dim`` channels, ``kv_heads`` B/C groups of ``state_size``, chunks of ``scan_chunk`` tokens;
    "kda": the rule's ``q_heads`` heads of ``qk_dim`` keys and ``v_dim`` values."""

    kind: str
    q_heads: int = 0
    kv_heads: int = 0
    qk_dim: int = 0
    v_dim: int = 0
    gated_output: bool = False
    window: int | None = None
    sinks: bool = False
    state_size: int = 0
    scan_chunk: int = 0

    @property
    def attends(self) -> bool:
        """Whether the mixer attends over K/V rows (``ATTENTION_KINDS``)."""
        return self.kind in ATTENTION_KINDS


class Adapter(ABC):
    """Runs decoder layers over a segment given the prompt state of earlier tokens.

    Decoder layers are pre-norm: ``h + mixer(input_layernorm(h))``, then
    ``h + mlp(post_attention_layernorm(h))``. Subclasses implement the mixer and its state.
    """

    model_types: tuple[str, ...] = ()
    weights_read: tuple[str, ...] = ("lm_head",)  # modules whose weight is read, not called (``score``): no LoRA
    layer_types: tuple[str, ...] | None = None  # the config.layer_types values ``mix`` runs (None: not read)
    # the expert-parallel plan of a MoE family whose config has no base_model_ep_plan (``parallel.experts``): module
    # and parameter names under the base model (``*`` for a layer number) to transformers' styles, the experts
    # module's ``ep_dispatch_experts`` and its 3-D weights' ``grouped_gemm`` (experts on dim 0); None: none needed
    expert_plan: dict[str, str] | None = None

    def __init__(self, model: nn.Module):
        self.model = model  # the module called (FSDP2's root hooks; a peft model's wrapper)
        base = base_model(model)
        self.config = base.config.get_text_config()
        self.backbone = getattr(base.model, "language_model", base.model)
        self.layers = self.backbone.layers
        self.lm_head = base.lm_head
        self.check_supported()

    # -- to implement per architecture -------------------------------------------------
    @abstractmethod
    def state_kinds(self, idx: int) -> tuple[StateKind, ...]:
        """Kind of each of layer ``idx``'s state tensors (``state.kinds``: layout, gradient, bytes, empty value)."""

    @abstractmethod
    def mixer(self, idx: int) -> Mixer:
        """What layer ``idx``'s token mixer runs (its kind and the attention op's call shape)."""

    @abstractmethod
    def mix(
        self, idx: int, x: torch.Tensor, ctx: SegmentContext, past: LayerState, need_output: bool
    ) -> tuple[torch.Tensor | None, LayerState]:
        """Token mixer of layer ``idx``: normalised input ``x`` [B, S, hidden] -> (output [B, S, hidden], state).

        B is 1, or B > 1 right-padded responses replayed together after one batch-1 ``past`` (whose ``Rows``
        tensors must be broadcast, never copied per response; ``SegmentContext.attention`` does so).

        Without ``need_output`` only the state is needed (the output may be None), e.g. the
        last layer while capturing a prompt: attention then skips attending.
        """

    def check_supported(self) -> None:
        """Raise ``UnsupportedModelError`` for configurations this adapter would compute wrongly."""
        if self.model.training and getattr(self.config, "attention_dropout", 0.0):
            raise UnsupportedModelError(
                f"{self.config.model_type}: attention_dropout={self.config.attention_dropout} in train mode; "
                "replay computes attention without dropout. Set config.attention_dropout=0."
            )
        if getattr(self.config, "final_logit_softcapping", None):
            raise UnsupportedModelError(f"{self.config.model_type}: final_logit_softcapping is not supported.")
        unknown = sorted(set(getattr(self.config, "layer_types", None) or []) - set(self.layer_types or ()))
        if self.layer_types is not None and unknown:
            raise UnsupportedModelError(
                f"{self.config.model_type}: layer type(s) {unknown} of config.layer_types are not supported (this "
                f"adapter runs {' and '.join(self.layer_types)} layers)"
            )
        check_lora(self.model, self.weights_read)

    def check_length(self, total: int) -> None:
        """Raise for a sequence length this architecture cannot replay exactly."""

    def check_context_parallel(self, cp_size: int) -> None:
        """Raise ``UnsupportedModelError`` naming ``context_parallel_size`` where a layer's token mixer has no
        sharded form and ``cp_size`` > 1 (sliding-window and sink attention, ``Mixer.kind`` "window_attention")."""
        if cp_size <= 1:
            return
        unsharded = [idx for idx, m in enumerate(self.mixers()) if m.kind == "window_attention"]
        if unsharded:
            raise UnsupportedModelError(
                f"{self.config.model_type}: context_parallel_size={cp_size} is not supported for its sliding-window "
                f"or sink attention layers ({len(unsharded)} of {self.num_layers}, e.g. layer {unsharded[0]}); set "
                "longstraw.context_parallel_size=1 (a window layer's state is W - 1 rows, not the prompt's)"
            )

    def mlp_width(self, idx: int) -> int:
        """Intermediate width one token passes through in layer ``idx``'s MLP or MoE block (routed experts x top-k,
        the shared experts, the router's logits), what the memory estimate counts its activations by."""
        config = self.config
        experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None)
        dense_first = getattr(config, "first_k_dense_replace", 0)
        sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
        dense_only = getattr(config, "mlp_only_layers", None) or ()
        if not experts or idx < dense_first or (idx + 1) % sparse_step or idx in dense_only:
            return config.intermediate_size
        shared = (getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
        shared += getattr(config, "shared_expert_intermediate_size", 0) or 0
        return config.num_experts_per_tok * config.moe_intermediate_size + shared + experts

    # -- shared ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def specs(self) -> list[tuple[StateKind, ...]]:
        """Every layer's ``state_kinds``."""
        return [self.state_kinds(i) for i in range(self.num_layers)]

    def mixers(self) -> list[Mixer]:
        """Every layer's ``mixer``."""
        return [self.mixer(i) for i in range(self.num_layers)]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S] -> hidden [1, S, hidden]; ids [B, S] (right-padded sequences) -> [B, S, hidden]."""
        return self.backbone.embed_tokens(ids if ids.dim() == 2 else ids[None])

    def context(self, h: torch.Tensor, start: int, split: Split | None = None,
                group: comm.Group = None) -> SegmentContext:
        """The segment's positions and rotary tables, and its ``split`` over ``group`` (None: one process);
        zero-width tables (``apply_rope`` then passes every channel) for a backbone without a rotary module (no
        positional embedding: nemotron_h, kimi_linear)."""
        length = h.shape[1]
        rotary = getattr(self.backbone, "rotary_emb", None)
        if rotary is None:
            empty = h.new_zeros(length, 0)
            return SegmentContext(cos=empty, sin=empty, split=split, group=group)
        positions = torch.arange(start, start + length, device=h.device)[None]  # [1, length]
        if hasattr(rotary, "mrope_section"):  # multimodal rope (qwen3_5): text tokens at t = h = w = position;
            positions = positions.expand(3, 1, length)  # [3, 1, length] (transformers < 5.19 takes no [1, length])
        cos, sin = rotary(h, positions)
        return SegmentContext(cos=cos[0], sin=sin[0], split=split, group=group)

    def layer(
        self, idx: int, h: torch.Tensor, ctx: SegmentContext, past: LayerState, need_output: bool
    ) -> tuple[torch.Tensor | None, ...]:
        """One decoder layer: (hidden [B, S, hidden], *segment_state); hidden is None without ``need_output``.
        A flat tuple of tensors, so module hooks (FSDP2's) see every output."""
        layer = self.layers[idx]
        mixed, state = self.mix(idx, layer.input_layernorm(h), ctx, past, need_output)
        if not need_output:
            return (None, *state)
        h = h + mixed
        out = layer.mlp(layer.post_attention_layernorm(h))
        if isinstance(out, tuple):  # MoE blocks of some releases also return router logits
            out = out[0]
        return (h + out, *state)

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [B, S, hidden] -> the final norm's output [B * S, hidden] (the sequences' rows in turn), what the
        LM head (``model.lm_head``, a Linear) reads."""
        return self.backbone.norm(h).flatten(0, 1)


_REGISTRY: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    for model_type in cls.model_types:
        _REGISTRY[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def model_on_meta(config) -> nn.Module:
    """``config``'s causal LM built on the meta device (no weights, no memory), in eval mode, with eager attention
    (nothing runs on it; a model's default, e.g. gpt-oss's hub kernel, may need a package that is not installed)."""
    import transformers  # the model classes, only where a config is all there is

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager").eval()


def adapter_on_meta(config) -> Adapter:
    """The adapter of ``model_on_meta(config)``: what the memory estimate reads of a model it has only the config
    of (state kinds, token mixers)."""
    return adapter_for(model_on_meta(config))


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter registered for ``model.config.model_type``."""
    model_type = model.config.model_type
    cls = _REGISTRY.get(model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no LongStraw adapter; supported: {', '.join(supported_model_types())}. "
            "Add one module under verl_longstraw/adapters/ to support it."
        )
    return cls(model)
