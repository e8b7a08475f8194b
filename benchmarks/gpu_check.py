"""One-command GPU check of the scale path: equivalence, then memory and time at growing prompt length.

    python benchmarks/gpu_check.py            # one GPU, finishes inside ~8 minutes on an H200
    python benchmarks/gpu_check.py --tiny     # CPU smoke run at tiny sizes (tests/test_gpu_check.py)

Stages (each under its own time limit, seconds):
1. equivalence: tiny random models of every family in float32 and bfloat16; replay log-probs and
   chunked exact gradients against the standard full-sequence path (float32 reference); float32
   passes within TOLERANCE, bfloat16 when no worse than the bfloat16 standard path's own error
   (``verl_longstraw.testing.no_worse_than_standard``);
2. scale: random-init layer stacks at real widths (Qwen3.5-27B: hidden 5120, 3 Gated DeltaNet + 1
   full-attention layer; GLM-5: MLA, hidden 6144, 3 layers), bfloat16; for standard / exact
   (chunked) / detached and G in {2, 8}, P doubles until the path runs out of memory or time (each
   (model, G, path) series gets an equal share of the stage's time); peak
   memory is ``torch.cuda.max_memory_allocated`` (on CPU: bytes saved for backward, SavedTensorMeter);
3. report: JSON and a markdown table under ``benchmarks/results/`` (longest P that fits per path).
Needs torch and transformers only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from verl_longstraw import group_backward
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.machine import describe, machine
from verl_longstraw.memory import parameter_meter
from verl_longstraw.ops.attention import ATTENTION_PATHS
from verl_longstraw.testing import make_group, no_worse_than_standard, replay_errors, standard_grads, weighted_loss
from verl_longstraw.tiny import FAMILIES, VOCAB, tiny_model, use_reference_kernels

ROOT = Path(__file__).resolve().parents[1]
TINY_FAMILY = {"qwen3_like": "qwen3", "glm5_like": "glm_moe_dsa"}  # metered CPU standard GDN is slow
TOLERANCE = 1e-4  # float32: max |log p| error and gradient relative L2


def equivalence(device: torch.device, families: tuple[str, ...], prompt_len: int, deadline: float) -> list[dict]:
    """Replay vs the float32 standard path, per family and dtype (with the same-dtype standard
    path's own errors)."""
    rows = []
    for family in families:
        with device:
            reference = tiny_model(family)
        prompt, responses = make_group(VOCAB, prompt_len, (prompt_len // 10 + 1, 1, prompt_len // 5), device=device)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype)[6:]
            if time.monotonic() > deadline:
                rows.append({"family": family, "dtype": name, "skipped": "time limit"})
                continue
            errors = replay_errors(reference, dtype, prompt, responses, weighted_loss, prompt_len // 3)
            if dtype == torch.float32:
                passed = errors["log_prob"] < TOLERANCE and errors["grad"] < TOLERANCE
            else:
                passed = no_worse_than_standard(errors, dtype)
            rows.append({
                "family": family, "dtype": name, "log_prob_error": errors["log_prob"], "grad_rel_l2": errors["grad"],
                "standard_log_prob_error": errors["standard_log_prob"], "standard_grad_rel_l2": errors["standard_grad"],
                "passed": passed,
            })
    return rows


def scale_configs(tiny: bool) -> dict[str, transformers.PretrainedConfig]:
    """Real-width (or, with ``tiny``, small) random-init stacks with few layers and a small vocabulary."""
    if tiny:
        return {name: tiny_model(family).config for name, family in TINY_FAMILY.items()}
    qwen = transformers.Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=5120, intermediate_size=17408, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=24, num_key_value_heads=4,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=1 << 22, tie_word_embeddings=False,
    )
    glm = transformers.GlmMoeDsaConfig(
        vocab_size=4096, hidden_size=6144, intermediate_size=12288, num_hidden_layers=3, num_attention_heads=64,
        num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, n_routed_experts=16, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, index_topk=1 << 22, index_n_heads=32, index_head_dim=128,
        max_position_embeddings=1 << 22, tie_word_embeddings=False,
    )
    return {"qwen3_5_27b_dims": qwen, "glm5_dims": glm}


def build(config, device: torch.device, dtype: torch.dtype):
    use_reference_kernels(config)
    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for module in model.modules():  # keep random-init activations in range at real widths
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    return model.train()


def run_path(model, path: str, prompt, responses, chunk_size: int) -> None:
    if path == "standard":
        standard_grads(model, prompt, responses, weighted_loss)
    else:
        model.zero_grad(set_to_none=True)
        group_backward(model, prompt, responses, weighted_loss, prompt_grad=path, chunk_size=chunk_size)


def measure(model, path: str, prompt, responses, chunk_size: int, device: torch.device) -> tuple[int, float]:
    """(peak bytes, seconds) of one group on ``path``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        run_path(model, path, prompt, responses, chunk_size)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), time.perf_counter() - start
    start = time.perf_counter()
    with parameter_meter(model) as meter:
        run_path(model, path, prompt, responses, chunk_size)
    return meter.peak, time.perf_counter() - start


def scale(device: torch.device, tiny: bool, deadline: float) -> list[dict]:
    """Peak memory and seconds per (model, G, path, P); P doubles until OOM or the time limit."""
    rows = []
    configs = scale_configs(tiny)
    start_len, max_len = (128, 1024) if tiny else (4096, 1 << 21)
    response_len, chunk_size = (16, 64) if tiny else (256, 8192)
    dtype = torch.float32 if tiny else torch.bfloat16  # CPU bf16 Gated DeltaNet is too slow for a smoke test
    per_model = (deadline - time.monotonic()) / len(configs)
    for name, config in configs.items():
        model_deadline = min(deadline, time.monotonic() + per_model)
        if tiny:
            with device:
                model = tiny_model(TINY_FAMILY[name])
        else:
            model = build(config, device, dtype)
        for group_size in (2, 8):
            for index, path in enumerate(("standard", "exact", "detached")):
                series_left = 6 - 3 * (group_size == 8) - index  # this and the later series of this model
                series_deadline = time.monotonic() + (model_deadline - time.monotonic()) / series_left
                prompt_len, last_seconds = start_len, 0.0
                while prompt_len <= max_len and time.monotonic() + 2.5 * last_seconds < series_deadline:
                    prompt, responses = make_group(config.vocab_size, prompt_len, [response_len] * group_size,
                                                   seed=prompt_len, device=device)
                    row = {"model": name, "G": group_size, "path": path, "P": prompt_len, "T": response_len}
                    try:
                        peak, seconds = measure(model, path, prompt, responses, chunk_size, device)
                    except torch.OutOfMemoryError:
                        rows.append({**row, "fits": False})
                        break
                    estimate = estimate_memory(config, prompt_len, group_size, response_len, chunk_size,
                                               "exact" if path == "standard" else path, dtype)
                    rows.append({**row, "fits": True, "peak_bytes": peak, "seconds": seconds,
                                 "estimated_total_bytes": estimate.total_bytes if path != "standard" else None})
                    last_seconds = seconds
                    prompt_len *= 2
                model.zero_grad(set_to_none=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown(result: dict) -> str:
    lines = ["# GPU check", "", f"device: {result['device']}, total {result['seconds']:.0f} s", "",
             f"Machine: {describe(result['machine'])}", "", f"Attention paths (calls): {result['attention_paths']}", "",
             "## Equivalence vs the float32 standard path", "",
             "| family | dtype | max abs log-prob error (standard path's) | gradient rel L2 (standard's) | passed |",
             "|---|---|---|---|---|"]
    for r in result["equivalence"]:
        if "skipped" in r:
            lines.append(f"| {r['family']} | {r['dtype']} | skipped | | |")
        else:
            lp = f"{r['log_prob_error']:.2e} ({r['standard_log_prob_error']:.2e})"
            grad = f"{r['grad_rel_l2']:.2e} ({r['standard_grad_rel_l2']:.2e})"
            lines.append(f"| {r['family']} | {r['dtype']} | {lp} | {grad} | {r['passed']} |")
    lines += ["", f"## Peak memory ({result['memory_metric']}) and seconds", "",
              "| model | G | path | P | peak GiB | seconds | fits |", "|---|---|---|---|---|---|---|"]
    for r in result["scale"]:
        peak = f"{r['peak_bytes'] / 2**30:.3f}" if r["fits"] else "OOM"
        secs = f"{r['seconds']:.2f}" if r["fits"] else ""
        lines.append(f"| {r['model']} | {r['G']} | {r['path']} | {r['P']} | {peak} | {secs} | {r['fits']} |")
    lines += ["", "## Longest P that fits", "", "| model | G | path | longest P |", "|---|---|---|---|"]
    for (model, group_size, path), longest in result["longest_fitting_P"].items():
        lines.append(f"| {model} | {group_size} | {path} | {longest} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, CPU allowed (smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--equivalence-seconds", type=float, default=90.0)
    parser.add_argument("--scale-seconds", type=float, default=330.0)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    info = machine()
    started = time.monotonic()
    families = ("qwen3", "qwen3_5", "deepseek_v3") if args.tiny else FAMILIES
    ATTENTION_PATHS.clear()
    equiv = equivalence(device, families, 64 if args.tiny else 301, started + args.equivalence_seconds)
    paths = {"equivalence": dict(ATTENTION_PATHS)}
    ATTENTION_PATHS.clear()
    rows = scale(device, args.tiny, time.monotonic() + args.scale_seconds)
    paths["scale"] = dict(ATTENTION_PATHS)
    longest: dict = {}
    for r in rows:
        key = (r["model"], r["G"], r["path"])
        longest.setdefault(key, 0)
        if r["fits"]:
            longest[key] = max(longest[key], r["P"])
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "machine": info,
        "memory_metric": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "bytes saved for backward",
        "equivalence": equiv, "scale": rows, "longest_fitting_P": longest, "seconds": time.monotonic() - started,
        "attention_paths": paths,  # prefix_causal_attention calls per path (fused kernel, SDPA, blocked) per stage
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_check_tiny" if args.tiny else "gpu_check"
    serialisable = {**result, "longest_fitting_P": [
        {"model": m, "G": g, "path": p, "P": n} for (m, g, p), n in longest.items()]}
    (args.out / f"{stem}.json").write_text(json.dumps(serialisable, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
