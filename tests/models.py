"""Tiny models for the tests (see verl_longstraw.tiny) and a float64-exact standard path."""

from verl_longstraw.tiny import FAMILIES, VOCAB, tiny_config, tiny_model  # noqa: F401


def exact_linear_attention(model, monkeypatch) -> None:
    """Make the model's own (standard-path) Gated DeltaNet compute in the input dtype.

    transformers runs its torch Gated DeltaNet in float32 even for float64 models, which
    caps a float64 comparison at ~1e-7. The token-by-token reference recurrence (an
    algorithm independent of the chunked one replay uses) keeps float64 throughout.
    """
    import sys

    from verl_longstraw.ops.gated_delta_rule import gated_delta_rule_reference

    def recurrence(query, key, value, g, beta, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **_):
        out, state = gated_delta_rule_reference(query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel)
        return out, (state if output_final_state else None)

    for module in model.modules():
        if hasattr(module, "chunk_gated_delta_rule"):
            monkeypatch.setattr(module, "chunk_gated_delta_rule", recurrence)
            monkeypatch.setattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule", recurrence)
