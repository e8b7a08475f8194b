"""The one interface every architecture adapter implements.

An adapter runs a segment of tokens through the model, layer by layer, reading the state of the tokens before it
and returning the state the segment adds. It reuses the model's own submodules (projections, norms, MLP/MoE) and
declares each layer once: its norms (``layer_norms``), its token mixer (``op``: a ``mixers.MixerOp`` that owns the
layer's state, forward, CP form and costs) and its feed-forward half (``feed_forward``: a
``feed_forward.FeedForward`` that owns its width, top-k and costs), so it does not depend on one transformers
release's cache classes.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..feed_forward import FeedForward, Mlp, Moe
from ..lora import base_model, check_lora
from ..mixers import MixerOp, SegmentContext
from ..parallel import comm
from ..plan import Split
from ..state import LayerState, StateKind


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


# Fields every tiny model shares (``TinyModel``): hidden 64, vocab 128; and a small MoE's routing.
TINY_COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, max_position_embeddings=4096, tie_word_embeddings=False
)
TINY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)


@dataclass(frozen=True)
class TinyModel:
    """A 2-5 layer random-init model of one family for the tests, benchmarks and CPU examples (``tiny.tiny_model``):
    a transformers config class, by name (a release without the class still imports the package; ``tiny.unavailable``
    reports the family), and the fields it is built with; ``note`` says what the model exercises."""

    config_class: str
    fields: dict[str, Any]
    note: str = ""


@dataclass(frozen=True)
class ModelDoc:
    """An adapter's row of the supported-architectures table (docs/models.md; README.md's short table groups the rows
    of one ``summary``; ``scripts/docs_models.py`` writes both from the registry): what the family is, the prompt
    state a layer keeps and its size, and what is refused (naming the field). ``notes``: model type -> a remark
    printed beside it."""

    summary: str
    family: str
    state: str
    bytes_per_token: str
    refused: str = "-"
    notes: dict[str, str] = field(default_factory=dict)


class Adapter(ABC):
    """Runs decoder layers over a segment given the prompt state of earlier tokens.

    Decoder layers are pre-norm: ``h + mixer(input_norm(h))``, then ``h + mlp(post_norm(h))``, the submodules named
    by the class attributes. Subclasses declare each layer's mixer (``op``), their names where they differ and,
    where the layer's structure differs, ``layer``, ``embed``, ``final_hidden`` and ``feed_forward``.
    """

    model_types: tuple[str, ...] = ()
    # declared by every registered adapter class itself (``register`` checks): family -> its tiny model, the first
    # the adapter's representative (the per-adapter tests run it), and the table row
    tiny: ClassVar[dict[str, TinyModel]] = {}
    doc: ClassVar[ModelDoc]
    weights_read: tuple[str, ...] = ("lm_head",)  # modules whose weight is read, not called (``score``): no LoRA;
    # with the mixers' own (``MixerOp.weights_read``: a causal conv's), what ``lora.check_lora`` refuses
    layer_types: tuple[str, ...] | None = None  # the config.layer_types values ``op`` serves (None: not read)
    # the names of a decoder layer's submodules that ``layer`` calls, and of the backbone's final norm
    input_norm, post_norm, mlp, final_norm = "input_layernorm", "post_attention_layernorm", "mlp", "norm"

    def __init__(self, model: nn.Module):
        self.model = model  # the module called (FSDP2's root hooks; a peft model's wrapper)
        base = base_model(model)
        self.config = base.config.get_text_config()
        self.backbone = getattr(base.model, "language_model", base.model)
        self.layers = self.backbone.layers
        self.lm_head = base.lm_head
        self.check_supported()
        self.ops: tuple[MixerOp, ...] = tuple(self.op(idx) for idx in range(len(self.layers)))
        self.feed_forwards: tuple[FeedForward, ...] = tuple(self.feed_forward(idx) for idx in range(len(self.layers)))
        check_lora(self.model, self.weights_read + tuple(name for op in self.ops for name in op.weights_read))

    # -- to implement per architecture -------------------------------------------------
    @abstractmethod
    def op(self, idx: int) -> MixerOp:
        """Layer ``idx``'s token mixer, bound to its module (built once, ``ops``)."""

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

    def check_length(self, total: int) -> None:
        """Raise for a sequence length this architecture cannot replay exactly."""

    def check_context_parallel(self, cp_size: int) -> None:
        """Raise ``UnsupportedModelError`` naming ``context_parallel_size`` where a layer's token mixer has no
        sharded form (``MixerOp.context_parallel``) and ``cp_size`` > 1."""
        if cp_size <= 1:
            return
        unsharded = [idx for idx, op in enumerate(self.ops) if not op.context_parallel]
        if unsharded:
            kinds = sorted({self.ops[idx].kind for idx in unsharded})
            raise UnsupportedModelError(
                f"{self.config.model_type}: context_parallel_size={cp_size} is not supported for its {kinds} layers "
                f"({len(unsharded)} of {self.num_layers}, e.g. layer {unsharded[0]}), which have no context-parallel "
                "form; set longstraw.context_parallel_size=1"
            )

    def layer_norms(self, idx: int, need_output: bool) -> tuple[nn.Module, ...]:
        """The hidden-wide norms layer ``idx`` runs on each token (``layer``): its input norm, and with
        ``need_output`` its post norm; what the memory estimate measures their half-precision copies from."""
        layer = self.layers[idx]
        return (getattr(layer, self.input_norm), getattr(layer, self.post_norm)) if need_output else (
            getattr(layer, self.input_norm),)

    def feed_forward(self, idx: int) -> FeedForward:
        """Layer ``idx``'s feed-forward half (built once, ``feed_forwards``), read off the transformers config
        fields the MoE families share: routed experts (``n_routed_experts`` or ``num_experts``) on the layers not
        made dense by ``first_k_dense_replace``, ``decoder_sparse_step`` or ``mlp_only_layers``, with shared
        experts of ``n_shared_experts`` x ``moe_intermediate_size`` or ``shared_expert_intermediate_size``; else
        a gated MLP of ``intermediate_size``."""
        config = self.config
        experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None)
        dense_first = getattr(config, "first_k_dense_replace", 0)
        sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
        dense_only = getattr(config, "mlp_only_layers", None) or ()
        if not experts or idx < dense_first or (idx + 1) % sparse_step or idx in dense_only:
            return Mlp(config.hidden_size, config.intermediate_size)
        shared = (getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
        shared += getattr(config, "shared_expert_intermediate_size", 0) or 0
        return Moe(config.hidden_size, experts, config.num_experts_per_tok, config.moe_intermediate_size, shared)

    # -- shared ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def state_kinds(self, idx: int) -> tuple[StateKind, ...]:
        """Kind of each of layer ``idx``'s state tensors (its op's: layout, gradient, bytes, empty value)."""
        return self.ops[idx].kinds

    def specs(self) -> list[tuple[StateKind, ...]]:
        """Every layer's ``state_kinds``."""
        return [op.kinds for op in self.ops]

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
        A flat tuple of tensors, so module hooks (FSDP2's) see every output. The pre-norm layer of the class
        attributes ``input_norm``, ``post_norm`` and ``mlp``."""
        layer = self.layers[idx]
        mixed, state = self.ops[idx].forward(getattr(layer, self.input_norm)(h), ctx, past, need_output)
        if not need_output:
            return (None, *state)
        h = h + mixed
        out = getattr(layer, self.mlp)(getattr(layer, self.post_norm)(h))
        if isinstance(out, tuple):  # MoE blocks of some releases also return router logits
            out = out[0]
        return (h + out, *state)

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """hidden [B, S, hidden] -> the final norm's output [B * S, hidden] (the sequences' rows in turn), what the
        LM head (``model.lm_head``, a Linear) reads."""
        return getattr(self.backbone, self.final_norm)(h).flatten(0, 1)


_REGISTRY: dict[str, type[Adapter]] = {}


def register(cls: type[Adapter]) -> type[Adapter]:
    """Serve ``cls.model_types`` with ``cls``; the class itself (not a base) declares its ``tiny`` models and its
    ``doc`` row, so every family the registry holds is built by the tests and listed in the docs."""
    missing = [name for name in ("tiny", "doc") if name not in vars(cls) or not getattr(cls, name)]
    if missing:
        raise TypeError(f"adapter {cls.__name__} declares no {' and no '.join(missing)} of its own: a registered "
                        "adapter names its tiny models (adapters.base.TinyModel) and its table row (ModelDoc)")
    for model_type in cls.model_types:
        _REGISTRY[model_type] = cls
    return cls


def registered_adapters() -> tuple[type[Adapter], ...]:
    """Every registered adapter class, once each, in the order they registered (``adapters/__init__``'s imports)."""
    return tuple(dict.fromkeys(_REGISTRY.values()))


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
    of (its layers' mixer and feed-forward ops)."""
    return adapter_for(model_on_meta(config))


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter registered for ``model.config.model_type``."""
    model_type = model.config.model_type
    cls = _REGISTRY.get(model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no LongStraw adapter; supported: {', '.join(supported_model_types())}. "
            "Add one module under verl_longstraw/adapters/ declaring each layer's mixer op (verl_longstraw/mixers/) "
            "to support it."
        )
    return cls(model)
