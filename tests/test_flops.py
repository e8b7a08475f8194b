"""Model FLOPs (``flops``, ``GroupStats.model_flops``): a walk's count equals one made by hand from the config, call by
call, and the peak table gives MFU on the GPUs it names only."""

import pytest
import torch

from verl_longstraw import Knobs, group_backward, group_log_probs, tree_backward, tree_log_probs
from verl_longstraw.adapters.base import adapter_on_meta
from verl_longstraw.flops import mfu, model_cost, peak_flops
from verl_longstraw.mixers.attention import keys_seen
from verl_longstraw.tiny import VOCAB, tiny_config, tiny_model


def attention(heads: int, head_dim: int, tokens: int, prefix: int) -> float:
    """QK^T and AV of ``tokens`` queries against ``prefix`` keys and, causally, their own."""
    return 4 * heads * head_dim * tokens * (prefix + (tokens + 1) / 2)


def loss(row, log_probs):
    return log_probs.sum()


@pytest.mark.parametrize("mode", ["log_probs", "exact"])
@pytest.mark.parametrize("shape", ["star", "tree"])
def test_dense_walk_flops_match_the_hand_count(shape, mode):
    """qwen3, 2 layers. Star: a 9-token prompt (positions [0, 4), [4, 8) captured, chunk_size 4) and responses of 3
    and 5 tokens replayed at position 8. Tree: two rows sharing 6 tokens (positions [0, 5) captured), leaves of 4 and
    3 positions replayed at position 5. A capture scores nothing, so its last layer stops at its K/V (not counted);
    exact mode recomputes each captured segment (forward + 2 x forward) and backpropagates each replay."""
    model = tiny_model("qwen3")
    c = model.config
    h, heads, kv, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * c.intermediate_size  # q, k, v, o; gate, up, down
    assert layer == 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96

    def call(tokens: int, prefix: int, layers: int, scored: int) -> float:
        return layers * (2 * layer * tokens + attention(heads, d, tokens, prefix)) + 2 * h * VOCAB * scored

    g = torch.Generator().manual_seed(0)
    if shape == "star":
        prompt = torch.randint(0, VOCAB, (9,), generator=g)
        responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in (3, 5)]
        captures = call(4, 0, 1, 0) + call(4, 4, 1, 0)
        replays = call(3, 8, 2, 3) + call(5, 8, 2, 5)
        if mode == "log_probs":
            stats = group_log_probs(model, prompt, responses, knobs=Knobs(chunk_size=4)).stats
        else:
            stats = group_backward(model, prompt, responses, loss, knobs=Knobs(chunk_size=4)).stats
    else:
        shared = torch.randint(3, VOCAB, (6,), generator=g)
        rows = [torch.cat([shared, torch.tensor([1, 2, 3, 4])]), torch.cat([shared, torch.tensor([2, 1, 1])])]
        captures = call(5, 0, 1, 0)
        replays = call(4, 5, 2, 4) + call(3, 5, 2, 3)
        if mode == "log_probs":
            stats = tree_log_probs(model, rows, [6, 6]).stats
        else:
            stats = tree_backward(model, rows, [6, 6], loss).stats
    expected = captures + replays if mode == "log_probs" else captures + 3 * replays + 3 * captures
    assert stats.model_flops == expected


def test_gated_deltanet_walk_flops_match_the_hand_count():
    """qwen3_5 (4 layers: Gated DeltaNet, gated full attention, twice): a 9-token prompt captured whole (layers 0-2;
    the last, attention, stops at its K/V) and responses of 2 and 4 tokens replayed at position 8. A Gated DeltaNet
    layer's mixer costs 7 FLOPs per recurrent-state element per token (state [value heads, dk, dv])."""
    model = tiny_model("qwen3_5")
    c = model.config
    h, heads, kv, d, i = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    conv = 2 * nk * dk + nv * dv  # the conv's channels: q, k, v
    linear = conv * h + nv * dv * h + 2 * nv * h + h * nv * dv + conv * c.linear_conv_kernel_dim  # qkv, z, b, a, out
    full = 2 * heads * d * h + 2 * kv * d * h + heads * d * h  # q with its output gate, k, v, o
    mlp = 3 * h * i
    assert (linear, full, mlp) == (128 * 64 + 64 * 64 + 8 * 64 + 64 * 64 + 128 * 4, 128 * 64 + 64 * 64 + 64 * 64, 18432)

    def delta(tokens: int) -> float:
        return 2 * (linear + mlp) * tokens + 7 * nv * dk * dv * tokens

    def attn(tokens: int, prefix: int) -> float:
        return 2 * (full + mlp) * tokens + attention(heads, d, tokens, prefix)

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (9,), generator=g)
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in (2, 4)]
    stats = group_log_probs(model, prompt, responses).stats
    capture = 2 * delta(8) + attn(8, 0)
    replays = sum(2 * delta(n) + 2 * attn(n, 8) + 2 * h * VOCAB * n for n in (2, 4))
    assert stats.model_flops == capture + replays


def test_short_conv_walk_flops_match_the_hand_count():
    """lfm2 (3 layers: short conv, attention, short conv): a 9-token prompt captured whole (layers 0-1; the last, a
    short conv, stops at its state) and responses of 2 and 4 tokens replayed at position 8. A short-conv layer costs
    its weights alone: its depthwise conv's 2 x channels x kernel FLOPs per token are its weight's."""
    model = tiny_model("lfm2")
    c = model.config
    h, heads, kv, i = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    d = h // heads
    conv = 3 * h * h + h * h + h * c.conv_L_cache  # in_proj (B, C, x), out_proj, the depthwise conv
    full = 2 * heads * d * h + 2 * kv * d * h  # q, out; k, v
    mlp = 3 * h * i  # w1, w3, w2
    assert (conv, full, mlp) == (4 * 64 * 64 + 64 * 3, 2 * 64 * 64 + 2 * 32 * 64, 18432)

    def short_conv(tokens: int) -> float:
        return 2 * (conv + mlp) * tokens

    def attn(tokens: int, prefix: int) -> float:
        return 2 * (full + mlp) * tokens + attention(heads, d, tokens, prefix)

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (9,), generator=g)
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in (2, 4)]
    stats = group_log_probs(model, prompt, responses).stats
    capture = short_conv(8) + attn(8, 0)
    replays = sum(2 * short_conv(n) + attn(n, 8) + 2 * h * VOCAB * n for n in (2, 4))
    assert stats.model_flops == capture + replays


def test_moe_layers_count_the_routed_experts_run():
    """qwen3_moe's sparse layer 1: attention projections, the router, and top-k of the E experts (gate, up, down)."""
    c = tiny_config("qwen3_moe")
    h, d, k, e, i = c.hidden_size, c.head_dim, c.num_experts_per_tok, c.num_experts, c.moe_intermediate_size
    attention_weights = 2 * h * c.num_attention_heads * d + 2 * h * c.num_key_value_heads * d
    assert model_cost(adapter_on_meta(c)).layer_params[1] == attention_weights + e * h + k * 3 * i * h


def test_window_keys():
    """A sliding window bounds the keys each query sees."""
    assert keys_seen(4, 2, None) == 3 + 4 + 5 + 6
    assert keys_seen(4, 2, 4) == 3 + 4 + 4 + 4
    assert keys_seen(3, 5, 4) == 4 + 4 + 4


def test_peak_table_and_mfu():
    """Dense bf16 peaks of the SXM boards named; None (no MFU) on CPU, other GPUs and variants, or without time."""
    assert peak_flops("NVIDIA H100 80GB HBM3") == peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H20") == 148e12
    assert peak_flops("NVIDIA B200") == 2.25e15
    for other in ("cpu", "NVIDIA GB200", "NVIDIA H100 PCIe", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-80GB"):
        assert peak_flops(other) is None
    assert mfu(989e12, 2.0, "NVIDIA H200") == 0.5
    assert mfu(1e12, 1.0, "cpu") is None
    assert mfu(1e12, 0.0, "NVIDIA H20") is None
