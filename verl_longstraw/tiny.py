"""Tiny random-init models of every supported family, built from transformers configs (no hub).

Used by the tests, the benchmarks, the CPU examples and ``python -m verl_longstraw.profile --model tiny:<family>``;
each family's config is one row of ``TINY_CONFIGS``.
"""

from __future__ import annotations

import copy
import functools

import torch
import transformers

from .adapters import adapter_on_meta

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=4096, tie_word_embeddings=False
)
GQA = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# Gated DeltaNet : attention = 1 : 1 (Qwen3-Next, Qwen3.5)
GATED_DELTA_HYBRID = dict(
    num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)
# MLA attention, a dense first layer, then MoE (DeepSeek-V3 and its DSA successors)
MLA_MOE = dict(
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, first_k_dense_replace=1, n_group=1,
    topk_group=1, **MOE,
)
DSA_INDEXER = dict(index_topk=4096, index_n_heads=2, index_head_dim=16)

# family -> (transformers config class name, its fields). Names, not classes: a release without the class (kimi_linear
# and deepseek_v32 in 5.10) still imports this module, and ``unavailable`` reports the family.
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3Config", dict(**COMMON, **GQA, head_dim=16)),
    "llama": ("LlamaConfig", dict(**COMMON, **GQA)),
    "qwen2": ("Qwen2Config", dict(**COMMON, **GQA)),
    "mistral": ("MistralConfig", dict(**COMMON, **GQA, sliding_window=None)),  # Mistral-Nemo/Small-3 (full layers)
    "qwen3_next": ("Qwen3NextConfig", dict(
        **COMMON, **MOE, **GATED_DELTA_HYBRID, num_experts=4, shared_expert_intermediate_size=32, decoder_sparse_step=2,
    )),
    "qwen3_5": ("Qwen3_5TextConfig", dict(**COMMON, **GATED_DELTA_HYBRID)),
    # every other layer sparse (decoder_sparse_step 2): a dense and a MoE layer
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        **COMMON, **MOE, **GQA, head_dim=16, num_experts=4, decoder_sparse_step=2, norm_topk_prob=True,
    )),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(
        **{k: v for k, v in COMMON.items() if k != "intermediate_size"}, **MOE, **GATED_DELTA_HYBRID, num_experts=4,
        shared_expert_intermediate_size=32,
    )),
    # a dense first layer, then MoE with a shared expert; partial rotary, q/k norm, biases
    "glm4_moe": ("Glm4MoeConfig", dict(
        **COMMON, **MOE, **GQA, head_dim=16, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
        use_qk_norm=True, attention_bias=True,
    )),
    "deepseek_v3": ("DeepseekV3Config", dict(**COMMON, **MLA_MOE)),
    # DeepSeek-V3.2: a DSA indexer on every layer (split-half rope in it)
    "deepseek_v32": ("DeepseekV32Config", dict(**COMMON, **MLA_MOE, **DSA_INDEXER)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(**COMMON, **MLA_MOE, **DSA_INDEXER)),
    # KDA : MLA (NoPE) = 2 : 1, a dense first MLP then MoE with a shared expert
    "kimi_linear": ("KimiLinearConfig", dict(
        **COMMON, **MOE, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, linear_num_heads=2,
        linear_head_dim=16, linear_conv_kernel_dim=4, num_local_experts=4, n_shared_experts=1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )),
    # Mamba2, attention, MoE and MLP blocks; scan chunks of 16 so prompts span several
    "nemotron_h": ("NemotronHConfig", dict(
        **COMMON, **MOE, layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, n_routed_experts=4,
        moe_shared_expert_intermediate_size=32,
    )),
    # Granite 4.0: Mamba2 and RoPE attention layers, MoE + shared MLP, multipliers
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(
        **COMMON, num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_expand=1, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, position_embedding_type="rope",
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0,
    )),
    # Mamba2 : attention = 2 : 1, partial RoPE (Bamba)
    "bamba": ("BambaConfig", dict(
        **COMMON, num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16,
        mamba_expand=1,
    )),
    # LFM2: short-conv and attention (q/k norms) layers, conv biases; the MLP at intermediate_size (no 2/3 and
    # multiple-of-256 adjustment)
    "lfm2": ("Lfm2Config", dict(
        **COMMON, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3, conv_bias=True, block_auto_adjust_ff_dim=False,
    )),
    # Jamba's pattern, scaled: Mamba1 layers and an attention layer (no positional embedding) at 2 of every 4, MoE
    # (4 experts, top 2) on the odd layers and a gated MLP on the rest (so Mamba layers have both; the last is Mamba)
    "jamba": ("JambaConfig", dict(
        **COMMON, num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False,
    )),
    # sliding (window 8, so prompts span several windows) and full layers, sinks, MoE
    "gpt_oss": ("GptOssConfig", dict(
        **COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        num_local_experts=4, num_experts_per_tok=2,
    )),
}


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """Config of a 2-4 layer model of ``family`` (hidden 64, vocab 128; ``TINY_CONFIGS``); ``overrides`` set config
    fields."""
    config = _base_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return use_reference_kernels(config)


def use_reference_kernels(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """Set the attention and MoE kernels the standard path is compared with; returns ``config``."""
    # transformers 5.10 GLM-MoE-DSA drops the causal mask under sdpa (attends to future tokens): eager there.
    # gpt-oss's sinks: eager (SDPA takes no sink logits)
    config._attn_implementation = "eager" if config.model_type in ("glm_moe_dsa", "gpt_oss") else "sdpa"
    config._experts_implementation = "eager"  # CPU grouped-mm rejects float64
    return config


def _base_config(family: str) -> transformers.PretrainedConfig:
    """``TINY_CONFIGS[family]`` built (AttributeError where the installed transformers lacks its class)."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; known: {', '.join(TINY_CONFIGS)}")
    class_name, fields = TINY_CONFIGS[family]
    return getattr(transformers, class_name)(**copy.deepcopy(fields))  # a copy: configs keep the layer_types lists


FAMILIES = ("qwen3", "qwen3_next", "qwen3_5", "deepseek_v3", "glm_moe_dsa")  # one per adapter path
DENSE_VARIANTS = ("llama", "qwen2", "mistral")  # the other dense GQA model types
# the other model types of the adapter paths: the dense and hybrid adapters over MoE blocks, DeepSeek-V3.2's MLA + DSA,
# Nemotron-H's, Granite 4.0's and Bamba's Mamba2 hybrids, Kimi Linear's KDA + MLA hybrid, gpt-oss's sliding and full
# attention with sinks, LFM2's short-conv + attention hybrid, Jamba's Mamba1 + attention + MoE hybrid
VARIANTS = ("qwen3_moe", "qwen3_5_moe", "glm4_moe", "deepseek_v32", "nemotron_h", "granitemoehybrid", "kimi_linear",
            "gpt_oss", "bamba", "lfm2", "jamba")


@functools.cache
def unavailable(family: str) -> str | None:
    """Why the installed transformers cannot build ``family``'s tiny model or its adapter serve it, None where it
    can: its config class is absent (kimi_linear, deepseek_v32 in 5.10), refuses the fields of the releases the
    adapter serves (nemotron_h's layer types in 5.10) or builds a model the adapter refuses (granitemoehybrid in
    5.10: other layer type names, no mamba2_chunk_scan). The tests skip such a family with this reason; from
    ``EVERY_FAMILY_SINCE`` on every family builds (``tests/test_core_contract.py``)."""
    try:
        adapter_on_meta(_base_config(family))
    except Exception as error:  # AttributeError: no such class; huggingface_hub's validation error (not a ValueError);
        # UnsupportedModelError: the adapter's refusal
        reason = " ".join(str(error).split())  # one line (validation errors span several)
        return f"transformers {transformers.__version__} cannot build {family} ({type(error).__name__}: {reason})"[:300]
    return None


EVERY_FAMILY_SINCE = "5.17.0"  # the oldest release tested with every tiny family (the GPU image's)


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A random-init causal LM of ``family`` in train mode, eager attention, eager experts, its weights in ``dtype``
    as transformers builds them (from 5.2x the routers of the DeepSeek-style MoE families stay float32: their
    ``_keep_in_fp32_modules_strict``), except that every parameter of a float64 model is float64: the float64
    comparisons (``testing.compare.float64_throughout``) widen what the parameters meet, and autograd refuses a
    float64 gradient for a float32 leaf. (Buffers stay as built: the mode widens their reads.)"""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if dtype == torch.float64:
        for param in model.parameters():
            param.data = param.data.to(torch.float64)
    return model.train()

