"""Pre-flight memory estimate for one GRPO group, from a transformers config alone.

``estimate_memory`` predicts, in bytes:
- ``state_bytes``: the prompt state for P - 1 captured tokens, what ``PromptState.nbytes``
  measures (exact: it sums the adapter's own ``state_specs``, read from a model built on the
  meta device, so estimate and state share one layout): growing tensors, fixed-size tensors
  and, in exact mode, their copies kept at every chunk boundary;
- ``state_grad_bytes``: the float32 sums of the differentiable state tensors' gradients held
  in exact mode;
- ``saved_peak_bytes``: the peak of tensors saved for backward (what ``SavedTensorMeter``
  counts), the larger of the replay phase (one response of T tokens after the prompt) and,
  in exact mode, the prompt backward (the last chunk, whose prefix is longest).

Terms that grow with the prompt are counted exactly: K/V (or MLA latent) rows that attention
concatenates and saves, the state buffers the blocked op saves, the shared additive mask and
(MLA, whose SDPA falls back to the math backend) the float32 attention probabilities. Per-token
activations of a layer are ``dtype bytes x (NORM x hidden + MIXER x mixer width + MLP x MLP width)``
with the coefficients below, calibrated against ``SavedTensorMeter`` on CPU (the least certain
term; it does not grow with P). ``check_budget`` turns the estimate into an early, actionable error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import transformers

from .adapters import adapter_for
from .ops import attention as attention_ops
from .state import StateSpec

NORM = 8.0  # per-token saves of the two RMSNorms and residuals, in units of hidden
ATTN_MIXER = 3.0  # q, rotated q/k, output and o_proj input, in units of the projection widths
GDN_MIXER = 8.0  # float32 q/k/v/decay intermediates of the chunked gated delta rule, in units of its widths
GDN_CHUNK = 5.0  # its float32 per-chunk [64 x 64] matrices, in units of value heads x 64
GDN_CHUNK_LEN = 64
MLA_MIXER = 2.0
MLP = 4.0  # gate, up, activation, product, in units of the intermediate width
LOGITS = 3.0  # lm_head output, float32 copy and log-softmax, in units of vocab (float32)
GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes for one group; ``total_bytes`` adds state, state gradients and saved peak."""

    state_bytes: int
    state_grad_bytes: int
    replay_saved_bytes: int
    prompt_backward_saved_bytes: int

    @property
    def saved_peak_bytes(self) -> int:
        return max(self.replay_saved_bytes, self.prompt_backward_saved_bytes)

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.state_grad_bytes + self.saved_peak_bytes


def state_specs(config) -> list[tuple[StateSpec, ...]]:
    """Per-layer prompt-state layout of ``config``'s model: its adapter's ``state_specs``, read from
    the model built on the meta device (no weights, no memory)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return adapter_for(model.eval()).specs()


def _spec_bytes(spec: StateSpec, length: int, dtype: torch.dtype) -> int:
    """Bytes of one state tensor for ``length`` prompt tokens in a model of ``dtype``."""
    return spec.numel(length) * spec.dtype(dtype).itemsize


def _layer_kinds(config) -> list[str]:
    """'attention', 'linear' (Gated DeltaNet) or 'mla' per layer."""
    if getattr(config, "kv_lora_rank", None):
        return ["mla"] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return ["linear" if t == "linear_attention" else "attention" for t in types]


def _mlp_width(config, idx: int) -> int:
    """Intermediate width one token passes through in layer ``idx`` (routed experts x top-k + shared)."""
    experts = getattr(config, "n_routed_experts", None) or getattr(config, "num_experts", None)
    dense_first = getattr(config, "first_k_dense_replace", 0)
    sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
    if not experts or idx < dense_first or (idx + 1) % sparse_step:
        return config.intermediate_size
    shared = (getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
    shared += getattr(config, "shared_expert_intermediate_size", 0) or 0
    return config.num_experts_per_tok * config.moe_intermediate_size + shared + experts


class _Shapes:
    """Per-layer state and per-token widths of a config."""

    def __init__(self, config, dtype: torch.dtype, specs: list[tuple[StateSpec, ...]]):
        self.config = config
        self.kinds = _layer_kinds(config)
        self.act = torch.tensor([], dtype=dtype).element_size()
        c = config
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        # bytes per prompt token of the state attention reads (and saves): growing, differentiable
        self.attended_row_bytes = [
            sum(_spec_bytes(s, 1, dtype) for s in layer if s.growing and s.differentiable) for layer in specs
        ]

    def token_bytes(self, idx: int, kind: str) -> float:
        """Activation bytes one token saves in layer ``idx`` (not growing with the prefix)."""
        c = self.config
        if kind == "attention":
            gate = 2 if getattr(c, "model_type", "").startswith(("qwen3_next", "qwen3_5")) else 1
            mixer = ATTN_MIXER * (c.num_attention_heads * self.head_dim * gate + 2 * self.kv_heads * self.head_dim)
        elif kind == "linear":
            key_dim = c.linear_num_key_heads * c.linear_key_head_dim
            value_dim = c.linear_num_value_heads * c.linear_value_head_dim
            mixer = 2 * (key_dim + value_dim) + self.gdn_float32_bytes() / self.act
        else:
            heads = c.num_attention_heads
            absorbed_query = heads * (c.kv_lora_rank + c.qk_rope_head_dim)
            per_head = heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
            mixer = MLA_MIXER * (absorbed_query + per_head + (c.q_lora_rank or 0) + c.kv_lora_rank)
        return self.act * (NORM * c.hidden_size + mixer + MLP * _mlp_width(c, idx))

    def gdn_float32_bytes(self) -> float:
        """Float32 bytes per (padded) token that the chunked gated delta rule saves."""
        c = self.config
        key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        value_dim = c.linear_num_value_heads * c.linear_value_head_dim
        return 4 * (GDN_MIXER * 2 * (key_dim + value_dim) + GDN_CHUNK * c.linear_num_value_heads * GDN_CHUNK_LEN)

    def attention_rows(self, kind: str) -> int:
        """Mask rows per token: the query heads of a key head where the reference folds them into
        rows (MLA's one latent head, or a single key head), else 1."""
        heads = self.config.num_attention_heads
        if kind == "mla":
            return heads
        folded = attention_ops.folds_query_heads(heads, self.kv_heads, self.head_dim, self.head_dim)
        return heads // self.kv_heads if folded else 1

    def segment_saved(self, tokens: int, prefix: int, state_len: int, last_layer_stops: bool) -> int:
        """Saved bytes of one segment of ``tokens`` after ``prefix`` state rows (buffers of ``state_len`` rows)."""
        total = 0.0
        masks: set[int] = set()
        for idx, kind in enumerate(self.kinds):
            row_bytes = self.attended_row_bytes[idx]
            if last_layer_stops and idx == len(self.kinds) - 1:  # only its norm and state projections run
                total += tokens * (NORM / 2 * self.config.hidden_size * self.act + 2 * row_bytes)
                break
            total += tokens * self.token_bytes(idx, kind)
            if kind == "linear":  # the chunked rule pads the segment to whole chunks
                total += (-tokens % GDN_CHUNK_LEN) * self.gdn_float32_bytes()
                continue
            rows = self.attention_rows(kind) * tokens
            keys = prefix + tokens
            blocked = prefix > 0 and rows * keys * self.act > attention_ops.MASK_BYTES_LIMIT
            if blocked:  # the op saves the prefix views, i.e. the whole state buffer, plus its own rows
                total += row_bytes * (state_len + tokens)
                continue
            if kind == "mla":  # key dim != value dim: the math backend saves probabilities, not the mask
                rank = self.config.kv_lora_rank
                total += (2 * rank + self.config.qk_rope_head_dim) * keys * self.act
                total += rows * keys * max(self.act, 4)  # probabilities are float32 for half inputs (CPU)
            else:
                total += 2 * self.kv_heads * self.head_dim * keys * self.act
                if prefix > 0 or rows > tokens:
                    masks.add(rows * keys * self.act)
        return int(total + sum(masks))


def estimate_memory(
    config,
    prompt_len: int,
    group_size: int,
    response_len: int,
    chunk_size: int | None = None,
    prompt_grad: str = "exact",
    dtype: torch.dtype = torch.bfloat16,
    specs: list[tuple[StateSpec, ...]] | None = None,
) -> MemoryEstimate:
    """Predicted memory of ``group_backward`` for a prompt of ``prompt_len`` tokens and ``group_size``
    responses of at most ``response_len`` tokens (responses replay one at a time, so G only scales time).

    ``specs``: the model's per-layer state layout (``adapter.specs()``) when a model is at hand;
    None builds it from ``config`` (``state_specs``).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    specs = specs if specs is not None else state_specs(config)
    shapes = _Shapes(config, dtype, specs)
    state_len = prompt_len - 1
    exact = prompt_grad == "exact"
    segments = -(-state_len // (chunk_size or max(state_len, 1)))
    fixed_copies = segments if exact else min(segments, 1)  # exact mode keeps every segment's start state
    layout = [s for layer in specs for s in layer]
    state = sum(_spec_bytes(s, state_len, dtype) * (1 if s.growing else fixed_copies) for s in layout)
    state_grad = 0
    if exact and state_len:
        grad_dtype = torch.promote_types(dtype, torch.float32)
        state_grad = sum(_spec_bytes(s, state_len, grad_dtype) for s in layout if s.differentiable)
    replay = shapes.segment_saved(response_len, state_len, state_len, last_layer_stops=False)
    replay += int(response_len * (config.hidden_size * shapes.act + LOGITS * config.vocab_size * 4))
    backward = 0
    if exact and state_len:
        chunk = min(chunk_size or state_len, state_len)
        backward = shapes.segment_saved(chunk, state_len - chunk, state_len, last_layer_stops=True)
    return MemoryEstimate(state, state_grad, replay, backward)


def check_budget(estimate: MemoryEstimate, budget_bytes: int, chunk_size: int | None) -> None:
    """Raise MemoryError when ``estimate.total_bytes`` exceeds ``budget_bytes``, naming what to change."""
    if estimate.total_bytes <= budget_bytes:
        return
    advice = []
    if estimate.prompt_backward_saved_bytes >= estimate.replay_saved_bytes:
        smaller = max(1, (chunk_size or 4096) // 4)
        advice.append(f"set chunk_size={smaller} (now {chunk_size})")
    if estimate.state_grad_bytes:
        advice.append('use prompt_grad="detached" (drops the state gradients, biased)')
    advice.append("shard or offload the prompt state, or shorten the prompt")
    raise MemoryError(
        f"estimated {estimate.total_bytes / GIB:.2f} GiB > budget {budget_bytes / GIB:.2f} GiB "
        f"(prompt state {estimate.state_bytes / GIB:.2f}, state gradients {estimate.state_grad_bytes / GIB:.2f}, "
        f"saved for backward {estimate.saved_peak_bytes / GIB:.2f}); " + ", or ".join(advice)
    )
