"""veRL's stock `fsdp2` engine against the `longstraw` engine on identical GRPO batches (CPU).

One group per batch (one prompt of P tokens, G responses of T tokens), one micro-batch of G
rows, fp32, SDPA, veRL's default gradient checkpointing on, SGD (lr 1e-6). Per case and engine
it times `compute_log_prob` (`infer_batch`, entropy on) and `update_actor`
(`forward_backward_batch` + `optimizer_step`), and measures memory as the process's peak RSS
during the call minus its RSS just before (VmHWM reset through /proc/self/clear_refs). glibc is
told to mmap every allocation >= 64 KiB (MALLOC_MMAP_THRESHOLD_), so freed tensors leave RSS
and each delta is that call's own transient memory.

    python benchmarks/bench_engine.py            # full sweep, writes benchmarks/results/engine_results.*
    python benchmarks/bench_engine.py --prompt 256 --groups 2 --out /tmp/bench   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
if __name__ == "__main__" and any(os.environ.get(k) != v for k, v in MMAP_ENV.items()):  # read at start-up only
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MMAP_ENV})

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from verl_longstraw.integration import testing  # noqa: E402
from verl_longstraw.machine import describe, machine  # noqa: E402

ENGINES = ("fsdp2", "longstraw")
MODELS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        num_hidden_layers=4,
        layer_types=["full_attention"] * 4,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=16384,
    ),
    "qwen3_next": dict(  # 4 layers: Gated DeltaNet, attention, Gated DeltaNet, attention; MoE MLPs
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=16384,
    ),
}
LS_METRICS = ("capture_seconds", "replay_seconds", "prompt_backward_seconds", "prompt_state_bytes")


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def measure(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(fn(), seconds, peak RSS during the call minus RSS before it, in MiB)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    return result, seconds, (_kib("VmHWM") - before) / 1024


def _scalar(value: Any) -> float:
    """A veRL metric (Metric, number, or a per-micro-batch list of them) as one float."""
    if isinstance(value, list):
        return sum(_scalar(v) for v in value)
    return float(value.aggregate() if hasattr(value, "aggregate") else value)


def log_prob(engine, td, group_size: int) -> dict:
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, micro_batch_size_per_gpu=group_size)
    with engine.eval_mode():
        return engine.infer_batch(td, loss_function=None)["metrics"]


def update_actor(engine, td, config, group_size: int) -> dict:
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=True, micro_batch_size_per_gpu=group_size)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        metrics = engine.forward_backward_batch(td, partial(ppo_loss, config=config), forward_only=False)["metrics"]
        engine.optimizer_step()
    return metrics


def run_case(engines: dict, configs: dict, prompt: int, group: int, response: int) -> list[dict]:
    td = testing.make_batch(1, group, seed=prompt + group, prompt_len=(prompt, prompt + 1),
                            response_len=(response, response + 1))
    rows = []
    for name in ENGINES:
        for op, fn in (("compute_log_prob", log_prob), ("update_actor", update_actor)):
            args = (engines[name], td.clone()) + ((configs[name],) if op == "update_actor" else ()) + (group,)
            metrics, seconds, rss = measure(partial(fn, *args))
            row = dict(engine=name, op=op, P=prompt, G=group, T=response, seconds=seconds, peak_rss_delta_mib=rss)
            for key in LS_METRICS:
                if f"longstraw/{key}" in metrics:
                    row[key] = _scalar(metrics[f"longstraw/{key}"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def build(family: str, groups: list[int], tmp: str) -> tuple[dict, dict]:
    """(engines, actor configs) by engine name for one model, warmed up."""
    path = testing.save_tiny_model(family, f"{tmp}/{family}", **MODELS[family])
    configs = {name: testing.actor_config(name, "token-mean", False, 0.0, max(groups)) for name in ENGINES}
    engines = {name: testing.make_engine(name, path, configs[name], max(groups), lr=1e-6) for name in ENGINES}
    run_case(engines, configs, 64, 2, 8)
    return engines, configs


def ratios(rows: list[dict]) -> list[dict]:
    """longstraw / fsdp2 per (model, op, P, G) for seconds and peak RSS delta."""
    by_key = {(r["model"], r["op"], r["P"], r["G"], r["engine"]): r for r in rows}
    out = []
    for (model, op, prompt, group, engine), ls in by_key.items():
        if engine != "longstraw":
            continue
        st = by_key[(model, op, prompt, group, "fsdp2")]
        out.append(dict(model=model, op=op, P=prompt, G=group, fsdp2_s=st["seconds"], longstraw_s=ls["seconds"],
                        time_ratio=ls["seconds"] / st["seconds"], fsdp2_mib=st["peak_rss_delta_mib"],
                        longstraw_mib=ls["peak_rss_delta_mib"],
                        mem_ratio=ls["peak_rss_delta_mib"] / max(st["peak_rss_delta_mib"], 1e-9)))
    return out


def markdown(result: dict) -> str:
    cases = len(result["models"]) * len(result["P"]) * len(result["G"])
    lines = [
        "# longstraw vs fsdp2 engine (veRL 0.9.1, CPU, fp32)",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine: {describe(result['machine'])}; torch threads {result['torch_threads']}  ",
        f"Runtime: {result['runtime_s']:.0f} s for {len(result['ratios']) // 2} of {cases} (model, P, G) cases. "
        f"Models: {', '.join(result['models'])}; T={result['T']}, one group per batch, one micro-batch of G rows, "
        "gradient checkpointing on.",
        "",
        "Memory = peak RSS during the call minus RSS before it (whole process, MiB; glibc mmap threshold 64 KiB). "
        "Single run per case on a shared machine: timings are noisy (other jobs compete for the cores).",
        "",
        "| model | op | P | G | fsdp2 s | longstraw s | time ratio | fsdp2 MiB | longstraw MiB | mem ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["ratios"]:
        lines.append(
            f"| {r['model']} | {r['op']} | {r['P']} | {r['G']} | {r['fsdp2_s']:.2f} | {r['longstraw_s']:.2f} | "
            f"{r['time_ratio']:.2f} | {r['fsdp2_mib']:.0f} | {r['longstraw_mib']:.0f} | {r['mem_ratio']:.2f} |"
        )
    lines += [
        "",
        "longstraw cost split in update_actor (capture and replay include the log-prob pass the backward needs; "
        "prompt backward = recompute with grad + backward):",
        "",
        "| model | P | G | capture s | replay s | prompt backward s | prompt state MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["engine"] == "longstraw" and r["op"] == "update_actor":
            lines.append(
                f"| {r['model']} | {r['P']} | {r['G']} | {r['capture_seconds']:.2f} | {r['replay_seconds']:.2f} | "
                f"{r['prompt_backward_seconds']:.2f} | {r['prompt_state_bytes'] / 2**20:.1f} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "time_ratio", "seconds"), (axes[1], "mem_ratio", "peak RSS delta")):
        for model in result["models"]:
            for op, marker in (("compute_log_prob", "o"), ("update_actor", "s")):
                for i, prompt in enumerate(result["P"]):
                    style = ("--", "-", ":", "-.")[i % 4]
                    pts = [r for r in result["ratios"] if (r["model"], r["op"], r["P"]) == (model, op, prompt)]
                    if not pts:
                        continue
                    ax.plot([r["G"] for r in pts], [r[key] for r in pts], style, marker=marker,
                            label=f"{model} {op} P={prompt}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="G (responses per prompt)", ylabel="longstraw / fsdp2",
               title=f"{title}, T={result['T']}")
        ax.set_xticks(result["G"], [str(g) for g in result["G"]])
        ax.minorticks_off()
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompt", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--groups", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="results", help="files are written as engine_<tag>.json/md/png")
    args = parser.parse_args()
    command = " ".join(["python", "benchmarks/bench_engine.py", *map(shlex.quote, sys.argv[1:])])
    result = dict(command=command, machine=machine(), torch_threads=torch.get_num_threads(), models=args.models,
                  P=args.prompt, G=args.groups, T=args.response, rows=[])
    testing.init_dist()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        built = {family: build(family, args.groups, tmp) for family in args.models}
        for prompt in args.prompt:  # cheap cases first; results are rewritten after every case
            for family, (engines, configs) in built.items():
                for group in args.groups:
                    rows = run_case(engines, configs, prompt, group, args.response)
                    result["rows"] += [dict(model=family, **r) for r in rows]
                    result.update(runtime_s=time.perf_counter() - t0, ratios=ratios(result["rows"]))
                    write(result, Path(args.out), args.tag)
    print(markdown(result))


def write(result: dict, out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"engine_{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"engine_{tag}.md").write_text(markdown(result))
    plot(result, out / f"engine_{tag}.png")


if __name__ == "__main__":
    main()
