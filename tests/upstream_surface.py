"""Every transformers and peft name ``verl_longstraw`` touches, and the tests that pin each: the one list of the
project's upstream surface. The newest-releases check (``scripts/test_newest.sh``, run by .ci/run) runs exactly the
tests named here against the newest transformers and peft the registry serves; tests/test_upstream_surface.py keeps
the list honest (every test named exists; every ``transformers``/``peft`` import in the package is a row).

    python tests/upstream_surface.py      # the test node ids, one a line (what scripts/test_newest.sh runs)

A row: (upstream name, kind, where the package uses it, the tests that pin it). Public model-layout names (the
submodules an adapter binds, ``q_proj``, ``in_proj``, ...) are covered by the equivalence tests of every family.
"""

from __future__ import annotations

EQUIVALENCE = "tests/test_core_equivalence.py::test_exact_gradient_float64"  # every family, float64
CONTRACT = "tests/test_core_contract.py"
LORA = "tests/test_lora.py"
# Parity tests run at R = 2 only: the upstream calls do not depend on the world size (R = 3 is the suite's)
EP_FILE = "tests/parallel/test_experts.py"
EP_PARITY = f"{EP_FILE}::test_expert_parallel_matches_one_process[2]"  # every MoE family, star
# and tree (spawned ranks)
SEAM = "tests/parallel/test_transformers_ep.py"

TRANSFORMERS = (
    ("transformers.AutoModelForCausalLM.from_config", "class method", "tiny.py, adapters/base.py (model_on_meta)",
     (f"{CONTRACT}::test_every_family_builds_on_recent_transformers", EQUIVALENCE)),
    ("transformers.AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained", "class methods",
     "profile.py (a checkpoint path)", ("tests/test_profile.py::test_a_checkpoint_path_loads_with_its_overrides",)),
    ("transformers.PretrainedConfig, transformers.<Family>Config (18 config classes)", "classes",
     "tiny.py (tiny_config)",
     (f"{CONTRACT}::test_every_family_builds_on_recent_transformers",)),
    ("transformers.Qwen3_5TextConfig, Qwen3_5MoeTextConfig, GlmMoeDsaConfig (the named models' dims)", "classes",
     "models.py (read by dryrun.py and the recipes' tables)", ("tests/test_dryrun.py",)),
    ("transformers.__version__, importlib.metadata.version('transformers')", "version", "ops/mamba2/ssd.py, "
     "parallel/transformers_ep.py, machine.py", (f"{SEAM}::test_the_installed_release_is_its_rows_generation",
                                                "tests/test_machine.py")),
    ("PretrainedConfig._attn_implementation / ._experts_implementation", "private config attributes", "tiny.py",
     (EQUIVALENCE,)),
    ("PreTrainedModel._keep_in_fp32_modules_strict (routers kept float32, 5.2x)", "private class attribute",
     "tiny.py (a float64 model is cast whole)", (EQUIVALENCE, EP_PARITY)),
    ("PretrainedConfig.get_text_config", "method", "adapters/base.py, estimate.py, model_terms.py, profile.py",
     (f"{CONTRACT}::test_qwen3_5_vision_language_checkpoint_on_text",)),
    ("PreTrainedModel.get_input_embeddings / get_output_embeddings / get_decoder", "methods", "model_terms.py",
     (f"{LORA}::test_estimate_counts_frozen_base_without_gradients",)),
    ("<model>.rotary_emb(h, position_ids), .mrope_section, .inv_freq", "submodule call, attributes",
     "adapters/base.py, adapters/gpt_oss.py, estimate.py",
     (f"{CONTRACT}::test_single_token_prompt", EQUIVALENCE,
      "tests/test_estimate.py::test_state_grad_on_host_moves_bytes_to_host")),
    ("GradientCheckpointingLayer .gradient_checkpointing / ._gradient_checkpointing_func", "private attributes",
     "adapters/base.py (call_as)", (f"{CONTRACT}::test_gradient_checkpointing_keeps_prompt_state",)),
    ("modeling_{nemotron_h,granitemoehybrid,bamba}.mamba2_chunk_scan", "private module function",
     "ops/mamba2/ssd.py, mixers/mamba2.py", ("tests/ops/test_ssd_scan.py", EQUIVALENCE)),
    ("modeling_kimi_linear.chunk_kimi_delta_attention / recurrent_kimi_delta_attention (and __wrapped__)",
     "private module functions", "ops/kda/rule.py, mixers/kda.py, testing/compare.py", ("tests/ops/test_kda.py",
                                                                                  EQUIVALENCE)),
    ("modeling_{qwen3_next,qwen3_5,qwen3_5_moe}.torch_chunk_gated_delta_rule", "private module function",
     "testing/compare.py (reference_linear_attention)", ("tests/ops/test_gated_delta_rule.py::test_matches_"
                                                         "transformers", "tests/ops/test_gated_delta_rule.py::"
                                                         "test_chunked_float32_as_accurate_as_transformers",
                                                         EQUIVALENCE)),
    ("apply_rotary_pos_emb_interleave (a name in the MLA forward's code)", "private function name",
     "mixers/mla.py", (f"{CONTRACT}::test_mla_state_is_latent_only", f"{CONTRACT}::test_sparse_dsa_selection_"
                       "matches_full_forward")),
    ("transformers.integrations.hub_kernels (kernel wrappers keep __wrapped__; with the kernels package, which 5.25 "
     "requires, a kernels Func module closing over them as func)", "decorator", "ops/kda/rule.py (plain_torch_form), "
     "mixers/mla.py", ("tests/ops/test_kda.py",)),
    ("transformers.activations.ACT2FN", "registry", "mixers/kda.py", (EQUIVALENCE,)),
    ("mixer modules' attributes (Mamba2 / GatedDeltaNet / KDA / MLA / DSA indexer / attention sinks)",
     "module attributes and methods", "mixers/*.py", (EQUIVALENCE, f"{CONTRACT}::test_sparse_dsa_selection_matches_"
                                                      "full_forward", "tests/test_tree.py::test_tree_gradient_"
                                                      "float64", "tests/parallel/test_cp_core.py::test_cp_float64_"
                                                      "matches_single_process[2]")),
    ("PreTrainedModel.ep_plan (config.base_model_ep_plan), .base_model_prefix", "attributes",
     "parallel/experts.py", (f"{EP_FILE}::test_families_without_a_transformers_plan_have_the_adapters",)),
    ("transformers.distributed.{tensor_parallel,expert_parallel}.apply_expert_parallelism", "function",
     "parallel/transformers_ep.py", (SEAM, EP_PARITY)),
    ("transformers.distributed.*.all_to_all_single[_autograd] (the dispatcher's token exchange)", "module global",
     "parallel/transformers_ep.py, parallel/experts.py (trace_all_to_all)",
     (SEAM, f"{EP_FILE}::test_uneven_routing_and_a_rank_whose_experts_get_no_token",
      "tests/parallel/test_ep_estimate.py")),
    ("experts module .num_experts / .hidden_dim", "attributes", "parallel/experts.py, model_terms.py",
     (EP_PARITY, "tests/parallel/test_ep_estimate.py")),
)

PEFT = (
    ("peft.LoraConfig, peft.get_peft_model", "class, function", "model_terms.py (Lora.wrap)",
     (f"{LORA}::test_estimate_counts_frozen_base_without_gradients",)),
    ("PeftModel.peft_config / get_base_model", "attribute, method", "lora.py (base_model)", (LORA,)),
    ("LoraLayer.lora_A / .base_layer / get_base_layer / disable_adapters / merged / active_adapters",
     "attributes, methods", "lora.py (linear_weights)", (f"{LORA}::test_linear_weights_is_what_the_layer_applies",
                                                         f"{LORA}::test_reference_log_probs_with_the_adapters_"
                                                         "disabled")),
    ("lora.Linear.get_delta_weight", "method", "lora.py (MLA's kv_b_proj)", (LORA,)),
    ("LoraLayer.lora_dropout / .use_dora, ParamWrapper.parameter_name", "attributes", "lora.py (refusals)",
     (f"{LORA}::test_lora_the_replay_cannot_reproduce_is_refused", f"{LORA}::test_lora_on_the_short_conv_is_refused")),
    ("peft all-linear LoRA on every family", "behaviour", "lora.py, execute.py", (LORA,)),
)

ROWS = TRANSFORMERS + PEFT


def node_ids() -> list[str]:
    """The tests every row names, each once, in the order first named."""
    return list(dict.fromkeys(test for *_, tests in ROWS for test in tests))


if __name__ == "__main__":
    print("\n".join(node_ids()))
