"""Named model dimensions: the models the cluster recipes are sized for, as transformers configs built from the
dims their public configs state (or ASSUMED here where none was at hand, said per model). Read by
recipes/clusters/memory_table.py (the recipes' per-GPU tables) and ``verl_longstraw.dryrun`` (``--model``).
"""

from __future__ import annotations

from collections.abc import Callable

import transformers


def qwen35_27b() -> transformers.PretrainedConfig:
    """Qwen3.5-27B's text model as its public config.json states it (assumed here, not read from a checkpoint):
    64 layers, every 4th full attention (24 query heads, 4 KV heads of 256) and the rest Gated DeltaNet
    (16 key heads, 48 value heads of 128, conv kernel 4), hidden 5120, MLP 17408, vocabulary 248320, untied
    embeddings. The same dims as benchmarks/gpu_check.py's real-width stack."""
    return transformers.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=1 << 23, tie_word_embeddings=False,
    )


def glm5(**fields: object) -> transformers.PretrainedConfig:
    """GLM-5 as transformers' GlmMoeDsaConfig defaults describe it: 78 MLA layers (64 heads, latent 512 +
    rope 64, DSA indexer 32 heads of 128 on every layer), 3 dense then 75 MoE layers of 256 routed experts
    (top 8) + 1 shared, hidden 6144, vocabulary 154880, untied embeddings; ``fields`` set other config fields."""
    return transformers.GlmMoeDsaConfig(max_position_embeddings=1 << 23, **fields)


def glm5_2() -> transformers.PretrainedConfig:
    """GLM-5.2: GLM-5's dims (``glm5``) with the DSA indexer on 21 of the 78 layers, transformers' every-4th
    schedule (``index_topk_freq`` 4: layers 0, 1, 5, 9, ..., 77); the other 57 reuse the top-k selection of the
    indexer layer before them (``indexer_types`` "shared"), so they hold no indexer weights and no indexer keys
    in the prompt state (bf16: 93 KiB per token, against GLM-5's 107.25). Which 21 layers does not change the
    bytes; assumed, not read from a checkpoint."""
    return glm5(index_topk_freq=4)


def qwen35_moe(**fields: object) -> transformers.PretrainedConfig:
    """A Qwen3.5 MoE text model (transformers' Qwen3_5MoeTextConfig, whose defaults are Qwen3.5-35B-A3B's) with the
    dims ASSUMED here for the larger ones (no public config of them is in the installed transformers; not read from a
    checkpoint): every 4th layer full attention (32 query heads, 2 KV heads of 256), the rest Gated DeltaNet (16 key
    heads, 64 value heads of 128, conv kernel 4), routed experts and one shared expert of 1024, vocabulary 248320,
    untied embeddings; ``fields`` the size."""
    return transformers.Qwen3_5MoeTextConfig(
        vocab_size=248320, num_attention_heads=32, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024, max_position_embeddings=1 << 23,
        tie_word_embeddings=False, **fields,
    )


def qwen35_397b() -> transformers.PretrainedConfig:
    """Qwen3.5-397B-A17B, ASSUMED (``qwen35_moe``): 60 layers, hidden 4096, 512 routed experts, top 10 (396.35e9
    parameters on the meta device: the name's total)."""
    return qwen35_moe(hidden_size=4096, num_hidden_layers=60, num_experts=512, num_experts_per_tok=10)


def qwen35_122b() -> transformers.PretrainedConfig:
    """Qwen3.5-122B-A10B, ASSUMED (``qwen35_moe``): 48 layers, hidden 3072, 256 routed experts, top 8 (122.11e9
    parameters on the meta device: the name's total)."""
    return qwen35_moe(hidden_size=3072, num_hidden_layers=48, num_experts=256, num_experts_per_tok=8)


CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {  # a model's name: its dims
    "Qwen3.5-27B": qwen35_27b, "GLM-5": glm5, "GLM-5.2": glm5_2, "Qwen3.5-397B-A17B": qwen35_397b,
    "Qwen3.5-122B-A10B": qwen35_122b,
}
