"""veRL's stock `fsdp2` engine against the `longstraw` engine on identical GRPO batches (CPU), on R = 1 or
R = 2 ranks (context parallelism, gloo).

One group per batch (one prompt of P tokens, G responses of T tokens), fp32, SDPA, veRL's default
gradient checkpointing on, SGD (lr 1e-6). Per case and engine it times `compute_log_prob`
(`infer_batch`, entropy on) and `update_actor` (`forward_backward_batch` + `optimizer_step`), and
measures memory as the process's peak RSS during the call minus its RSS just before (VmHWM reset
through /proc/self/clear_refs). glibc is told to mmap every allocation >= 64 KiB
(MALLOC_MMAP_THRESHOLD_), so freed tensors leave RSS and each delta is that call's own transient memory.
Idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE unless set; recorded with the machine).

R = 1: both engines in this process (torch's threads), one micro-batch of G rows.
R = 2: two spawned gloo ranks (``run_ranks``), each with ``torch threads / R`` threads (the same cores
in all), measured per rank (its own RSS delta and seconds, a barrier before each call); both engines
in each rank, FSDP2 sharding the parameters over the 2 ranks in both. The same global batch (one
group of G rows) goes to both engines:
- `longstraw` with `context_parallel_size` 2: both ranks get all G rows (one CP group, data-parallel
  size 1), each holds about half of the prompt state;
- `fsdp2`: data parallel, the batch split, G/R rows per rank (how the stock engine uses R ranks; the
  parity test tests/integration/test_cp_engine.py compares the two engines in this layout).
So ratios at R = 2 compare the two engines on the same global batch and the same R ranks; the
R table compares each engine's per-rank figures with its own R = 1 run on the same batch.

    python benchmarks/bench_engine.py            # R = 1, G 2 4 8, P 2048 8192 -> engine_results.*
    python benchmarks/bench_engine.py --ranks 1 2 --groups 8 --tag cp   # context parallel sweep -> engine_cp.*
    python benchmarks/bench_engine.py --smoke --out /tmp/bench          # seconds-long check of both R
    python benchmarks/bench_engine.py --models qwen3 --prompt 8192 --groups 8 --response 1024 --baseline \
        --tag throughput_t1024    # also longstraw's earlier two-pass, one-response-at-a-time path (speed-up table)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# idle OpenMP threads sleep instead of spinning (spinning ones slow every other process on a shared machine,
# and the other rank at R > 1); set it to override
THREAD_ENV = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def restart_in_measurement_env() -> None:
    """Run this script again with ``MMAP_ENV`` and ``THREAD_ENV`` set unless they are: glibc and OpenMP read them
    at start-up only (spawned ranks inherit them)."""
    if any(os.environ.get(k) != v for k, v in {**MMAP_ENV, **THREAD_ENV}.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MMAP_ENV, **THREAD_ENV})


if __name__ == "__main__":
    restart_in_measurement_env()

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from verl_longstraw.machine import describe, machine  # noqa: E402
from verl_longstraw.parallel.launch import run_ranks  # noqa: E402
from verl_longstraw.testing import verl_harness as testing  # noqa: E402

ENGINES = ("fsdp2", "longstraw")
# --baseline: the longstraw engine on the path before issue 12's throughput work, in the same run: training
# evaluates the loss on a no-grad replay, then replays again with autograd; every response replays alone
BASELINE = "longstraw_two_pass"
BASELINE_KNOBS = dict(single_forward=False, replay_tokens=1)
OPS = ("compute_log_prob", "update_actor")
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
# the engine's per-step metrics (this rank's; seconds and bytes moved sum over micro-batches, sizes held take the max)
LS_METRICS = ("capture_seconds", "replay_seconds", "prompt_backward_seconds", "prompt_state_bytes",
              "state_grad_device_bytes", "state_grad_host_bytes", "cp_collective_bytes", "peak_memory_gb")
SMOKE = dict(models=["qwen3"], prompt=[64], groups=[2], response=8, ranks=[1, 2], tag="smoke", baseline=True)
WARMUP = dict(prompt=64, group=2, response=8)


def code_version() -> dict:
    """The checkout's commit and its uncommitted changes under verl_longstraw/ (spawned ranks import the
    package when their case starts, so a tree edited during a run is measured as edited)."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "modified": git("status", "--porcelain", "--", "verl_longstraw").splitlines()}


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def measure(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> tuple[Any, float, float]:
    """(fn(), seconds, peak RSS during the call minus RSS before it, in MiB); ``sync`` (a barrier of the
    ranks) runs after the collection and before the clock starts."""
    gc.collect()
    if sync is not None:
        sync()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    # the kernel raises VmHWM lazily: pages freed since the start reading can leave it below that reading, a call
    # that added nothing above the start (0, not a negative peak)
    return result, seconds, max(_kib("VmHWM") - before, 0) / 1024


def _scalar(value: Any) -> float:
    """A veRL metric (Metric, number, or a per-micro-batch list of them) as one float."""
    if isinstance(value, list):
        return sum(_scalar(v) for v in value)
    return float(value.aggregate() if hasattr(value, "aggregate") else value)


def log_prob(engine, td, micro_batch: int) -> dict:
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False, micro_batch_size_per_gpu=micro_batch)
    with engine.eval_mode():
        return engine.infer_batch(td, loss_function=None)["metrics"]


def update_actor(engine, td, config, micro_batch: int) -> dict:
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=True, micro_batch_size_per_gpu=micro_batch)
    with engine.train_mode():
        engine.optimizer_zero_grad()
        metrics = engine.forward_backward_batch(td, partial(ppo_loss, config=config), forward_only=False)["metrics"]
        engine.optimizer_step()
    return metrics


def rank_rows(engines: dict, configs: dict, prompt: int, group: int, response: int, rank: int = 0,
              world: int = 1) -> list[dict]:
    """This rank's measurements of one (P, G) case: both engines, both ops. `longstraw` (one CP group of
    ``world`` ranks) gets the whole group on every rank; `fsdp2` its data-parallel share, G / world rows."""
    assert group % world == 0, f"G={group} must be a multiple of R={world} (fsdp2 splits the group over the ranks)"
    sync = dist.barrier if world > 1 else None
    rows = []
    for name in engines:
        dp_rank, dp_size = (rank, world) if name == "fsdp2" else (0, 1)
        td = testing.make_batch(1, group, seed=prompt + group, rank=dp_rank, world_size=dp_size,
                                prompt_len=(prompt, prompt + 1), response_len=(response, response + 1))
        micro_batch = group // dp_size
        for op, fn in (("compute_log_prob", log_prob), ("update_actor", update_actor)):
            args = (engines[name], td.clone()) + ((configs[name],) if op == "update_actor" else ()) + (micro_batch,)
            metrics, seconds, rss = measure(partial(fn, *args), sync)
            row = dict(engine=name, op=op, P=prompt, G=group, T=response, rows_per_rank=micro_batch, seconds=seconds,
                       peak_rss_delta_mib=rss)
            for key in LS_METRICS:
                if f"longstraw/{key}" in metrics:
                    row[key] = _scalar(metrics[f"longstraw/{key}"])
            rows.append(row)
    return rows


def merge_ranks(per_rank: list[list[dict]], world: int) -> list[dict]:
    """One row per (engine, op) from every rank's: seconds, RSS delta and the engine's metrics as the largest
    over the ranks (the old single-rank keys) and as per-rank lists (``<key>_per_rank``)."""
    merged = []
    for rows in zip(*per_rank, strict=True):
        first = rows[0]
        assert all((r["engine"], r["op"]) == (first["engine"], first["op"]) for r in rows)
        row = dict(first, R=world)
        for key in ("seconds", "peak_rss_delta_mib", *LS_METRICS):
            if key in first:
                row[key] = max(r[key] for r in rows)
                row[f"{key}_per_rank"] = [r[key] for r in rows]
        merged.append(row)
    return merged


def engine_configs(world: int, group: int, chunk_size: int | None, baseline: bool = False) -> dict:
    """Actor configs by engine for ``world`` ranks: FSDP2 shards over all of them; longstraw is one CP group
    (with ``baseline`` also the longstraw engine with ``BASELINE_KNOBS``)."""
    configs = {"fsdp2": testing.actor_config("fsdp2", "token-mean", False, 0.0, group // world)}
    for name, knobs in (("longstraw", {}), (BASELINE, BASELINE_KNOBS))[: 2 if baseline else 1]:
        configs[name] = testing.actor_config("longstraw", "token-mean", False, 0.0, group,
                                             context_parallel_size=world, chunk_size=chunk_size, **knobs)
    return configs


def build(path: str, world: int, group: int, chunk_size: int | None, rank: int = 0,
          baseline: bool = False) -> tuple[dict, dict]:
    """(engines, actor configs) by engine name for the saved model at ``path``, warmed up on a tiny batch."""
    configs = engine_configs(world, group, chunk_size, baseline)
    engines = {name: testing.make_engine(config.strategy, path, config, config.ppo_micro_batch_size_per_gpu,
                                         lr=1e-6) for name, config in configs.items()}
    rank_rows(engines, configs, WARMUP["prompt"], WARMUP["group"], WARMUP["response"], rank, world)
    return engines, configs


def cp_rank(rank: int, world: int, path: str, prompt: int, group: int, response: int, chunk_size: int | None,
            threads: int, baseline: bool = False) -> list[dict]:
    """One spawned rank of an R = ``world`` case (``run_ranks``): build the engines, warm up, measure."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    engines, configs = build(path, world, group, chunk_size, rank, baseline)
    return rank_rows(engines, configs, prompt, group, response, rank, world)


def ratios(rows: list[dict]) -> list[dict]:
    """longstraw / fsdp2 per (model, op, P, G, R) for seconds and peak RSS delta (per rank: the largest), and
    with a baseline run its seconds and RSS delta and the speed-up baseline s / longstraw s."""
    by_key = {(r["model"], r["op"], r["P"], r["G"], r.get("R", 1), r["engine"]): r for r in rows}
    out = []
    for (model, op, prompt, group, world, engine), ls in by_key.items():
        st = by_key.get((model, op, prompt, group, world, "fsdp2"))
        if engine != "longstraw" or st is None:
            continue
        out.append(dict(model=model, op=op, P=prompt, G=group, R=world, fsdp2_s=st["seconds"],
                        longstraw_s=ls["seconds"], time_ratio=ls["seconds"] / st["seconds"],
                        fsdp2_mib=st["peak_rss_delta_mib"], longstraw_mib=ls["peak_rss_delta_mib"],
                        mem_ratio=ls["peak_rss_delta_mib"] / max(st["peak_rss_delta_mib"], 1e-9)))
        base = by_key.get((model, op, prompt, group, world, BASELINE))
        if base is not None:
            out[-1].update(baseline_s=base["seconds"], speedup=base["seconds"] / ls["seconds"],
                           baseline_mib=base["peak_rss_delta_mib"])
    return out


def rank_ratios(rows: list[dict]) -> list[dict]:
    """R > 1 against R = 1 per (model, engine, op, P, G): seconds and per-rank peak RSS delta (the largest)."""
    single = {(r["model"], r["engine"], r["op"], r["P"], r["G"]): r for r in rows if r.get("R", 1) == 1}
    out = []
    for r in rows:
        ref = single.get((r["model"], r["engine"], r["op"], r["P"], r["G"]))
        if r.get("R", 1) == 1 or ref is None:
            continue
        out.append(dict(model=r["model"], engine=r["engine"], op=r["op"], P=r["P"], G=r["G"], R=r["R"],
                        r1_s=ref["seconds"], s=r["seconds"], time_ratio=r["seconds"] / ref["seconds"],
                        r1_mib=ref["peak_rss_delta_mib"], mib=r["peak_rss_delta_mib"],
                        mem_ratio=r["peak_rss_delta_mib"] / max(ref["peak_rss_delta_mib"], 1e-9)))
    return out


def _per_rank(row: dict, key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    """The largest value over the ranks, with every rank's in brackets when there are several."""
    values = row.get(f"{key}_per_rank", [row[key]])
    text = fmt.format(row[key] / scale)
    return text if len(values) == 1 else f"{text} ({', '.join(fmt.format(v / scale) for v in values)})"


def _code_lines(result: dict) -> list[str]:
    """The code measured: commit and uncommitted verl_longstraw/ changes at the start, and at the end if they differ."""
    start, end = result.get("code_start"), result.get("code_end")
    if start is None:
        return []

    def text(code: dict) -> str:
        return code["commit"] + (f" with uncommitted {', '.join(code['modified'])}" if code["modified"] else "")

    if end is None or end == start:
        return [f"Code: {text(start)}  "]
    return [f"Code at the start: {text(start)}; at the end: {text(end)} (the tree changed during the run)  "]


def markdown(result: dict) -> str:
    worlds = result.get("R", [1])
    cases = len(result["models"]) * len(result["P"]) * len(result["G"]) * len(worlds)
    done = len({(r["model"], r["P"], r["G"], r.get("R", 1)) for r in result["rows"]})
    lines = [
        "# longstraw vs fsdp2 engine (veRL 0.9.1, CPU, fp32)",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine at the start: {describe(result['machine'])}; torch threads {result['torch_threads']}  ",
        f"Load average at the end: {result.get('load_average_end', '-')}  ",
        *_code_lines(result),
        f"Runtime: {result['runtime_s']:.0f} s for {done} of {cases} (model, P, G, R) cases. "
        f"Models: {', '.join(result['models'])}; T={result['T']}, one group per batch, one micro-batch per rank, "
        f"gradient checkpointing on; longstraw chunk_size {result.get('chunk_size')}.",
        "",
        "Memory = peak RSS during the call minus RSS before it (per process, i.e. per rank, MiB; glibc mmap "
        "threshold 64 KiB). Single run per case on a shared machine: timings are noisy (other jobs compete for the "
        "cores).",
    ]
    if max(worlds) > 1:
        lines += [
            "",
            "R = 2: two spawned gloo ranks of "
            f"{result.get('rank_threads')} torch thread(s) each on the same CPUs (no speed-up to expect from R). "
            "Both engines get the same global batch, one group of G rows: longstraw (context_parallel_size 2) "
            "gives both ranks all G rows and splits the prompt; fsdp2 splits the rows, G/2 per rank (data "
            "parallel). Both shard the parameters over the 2 ranks. Per-rank figures: the largest over the ranks, "
            "every rank's in brackets; seconds per rank include waiting for the other rank in collectives.",
        ]
    lines += [
        "",
        "| model | op | P | G | R | fsdp2 rows/rank | fsdp2 s | longstraw s | time ratio | fsdp2 MiB/rank "
        "| longstraw MiB/rank | mem ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["model"], r["op"], r["P"], r["G"], r.get("R", 1), r["engine"]): r for r in result["rows"]}
    for q in result["ratios"]:
        world = q.get("R", 1)
        st, ls = (by_key[(q["model"], q["op"], q["P"], q["G"], world, e)] for e in ENGINES)
        lines.append(
            f"| {q['model']} | {q['op']} | {q['P']} | {q['G']} | {world} | {st.get('rows_per_rank', q['G'])} | "
            f"{_per_rank(st, 'seconds', fmt='{:.2f}')} | {_per_rank(ls, 'seconds', fmt='{:.2f}')} | "
            f"{q['time_ratio']:.2f} | {_per_rank(st, 'peak_rss_delta_mib')} | "
            f"{_per_rank(ls, 'peak_rss_delta_mib')} | {q['mem_ratio']:.2f} |"
        )
    if any("speedup" in q for q in result["ratios"]):
        lines += [
            "",
            f"longstraw against `{BASELINE}`, the same engine with {BASELINE_KNOBS} (the path before issue 12: "
            "training replays every response twice, a no-grad pass for veRL's loss then one with autograd; "
            "one response per forward) in the same run; speed-up = its seconds / longstraw's:",
            "",
            "| model | op | P | G | R | two-pass s | longstraw s | speed-up | two-pass MiB/rank | longstraw MiB/rank |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for q in result["ratios"]:
            if "speedup" in q:
                lines.append(
                    f"| {q['model']} | {q['op']} | {q['P']} | {q['G']} | {q.get('R', 1)} | {q['baseline_s']:.2f} | "
                    f"{q['longstraw_s']:.2f} | {q['speedup']:.2f} | {q['baseline_mib']:.0f} | "
                    f"{q['longstraw_mib']:.0f} |"
                )
    if result.get("rank_ratios"):
        lines += [
            "",
            "Each engine at R ranks against itself at R = 1 on the same batch (per-rank figures, the largest rank):",
            "",
            "| model | engine | op | P | G | R | R=1 s | R s | time ratio | R=1 MiB | R MiB/rank | mem ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for q in result["rank_ratios"]:
            lines.append(
                f"| {q['model']} | {q['engine']} | {q['op']} | {q['P']} | {q['G']} | {q['R']} | {q['r1_s']:.2f} | "
                f"{q['s']:.2f} | {q['time_ratio']:.2f} | {q['r1_mib']:.0f} | {q['mib']:.0f} | {q['mem_ratio']:.2f} |"
            )
    state_r1 = {(r["model"], r["op"], r["P"], r["G"]): r.get("prompt_state_bytes") for r in result["rows"]
                if r["engine"] == "longstraw" and r.get("R", 1) == 1}
    lines += [
        "",
        "longstraw's step metrics per rank (update_actor: replay = one replay with autograd per response, the "
        "single-forward path; prompt backward = recompute with grad + backward). State = prompt state held by the "
        "rank; CP collective = bytes of the tensors the rank passed to the context-parallel collectives; peak RSS "
        "= the engine's `longstraw/peak_memory_gb` (the process's whole peak RSS during the call, not a delta):",
        "",
        "| model | op | P | G | R | capture s | replay s | prompt backward s | prompt state MiB/rank | state vs R=1 "
        "| state grad MiB (device / host) | CP collective MiB/rank | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["engine"] != "longstraw" or "prompt_state_bytes" not in r:
            continue
        world = r.get("R", 1)
        ref = state_r1.get((r["model"], r["op"], r["P"], r["G"]))
        vs = f"{r['prompt_state_bytes'] / ref:.3f}" if ref and world > 1 else "-"
        grad = (f"{_per_rank(r, 'state_grad_device_bytes', 2**20, '{:.1f}')} / "
                f"{_per_rank(r, 'state_grad_host_bytes', 2**20, '{:.1f}')}" if "state_grad_device_bytes" in r else "-")
        moved = _per_rank(r, "cp_collective_bytes", 2**20, "{:.1f}") if "cp_collective_bytes" in r else "-"
        peak = _per_rank(r, "peak_memory_gb", 1.0, "{:.2f}") if "peak_memory_gb" in r else "-"
        seconds = " | ".join(_per_rank(r, key, fmt="{:.2f}") for key in LS_METRICS[:3])
        lines.append(
            f"| {r['model']} | {r['op']} | {r['P']} | {r['G']} | {world} | {seconds} | "
            f"{_per_rank(r, 'prompt_state_bytes', 2**20, '{:.2f}')} | {vs} | {grad} | {moved} | {peak} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """longstraw / fsdp2 ratios (seconds, peak RSS delta per rank) against G (one R) or against R (several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = result.get("R", [1])
    x_key, x_values, x_label = (("R", worlds, "R (ranks)") if len(worlds) > 1 else
                                ("G", result["G"], "G (responses per prompt)"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "time_ratio", "seconds"), (axes[1], "mem_ratio", "peak RSS delta per rank")):
        for model in result["models"]:
            for op, marker in (("compute_log_prob", "o"), ("update_actor", "s")):
                for i, prompt in enumerate(result["P"]):
                    for group in result["G"] if x_key == "R" else [None]:
                        style = ("--", "-", ":", "-.")[i % 4]
                        pts = sorted((r for r in result["ratios"] if (r["model"], r["op"], r["P"], group or r["G"])
                                      == (model, op, prompt, r["G"])), key=lambda r: r.get(x_key, 1))
                        if not pts:
                            continue
                        label = f"{model} {op} P={prompt}" + (f" G={group}" if group is not None else "")
                        ax.plot([r.get(x_key, 1) for r in pts], [r[key] for r in pts], style, marker=marker,
                                label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel=x_label, ylabel="longstraw / fsdp2 (same R)",
               title=f"{title}, T={result['T']}")
        ax.set_xticks(x_values, [str(x) for x in x_values])
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
    parser.add_argument("--ranks", nargs="+", type=int, default=[1], help="R values: 1 in this process, "
                        "R > 1 as R spawned gloo ranks with longstraw.context_parallel_size R")
    parser.add_argument("--chunk-size", type=int, default=None, help="longstraw.chunk_size (default: whole prompt)")
    parser.add_argument("--baseline", action="store_true",
                        help=f"also run `{BASELINE}` (longstraw with {BASELINE_KNOBS}) for the speed-up table")
    parser.add_argument("--timeout-s", type=float, default=3600, help="hard limit for one R > 1 case")
    parser.add_argument("--smoke", action="store_true", help=f"seconds-long check: {SMOKE}")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="results", help="files are written as engine_<tag>.json/md/png")
    args = parser.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    command = " ".join(["python", "benchmarks/bench_engine.py", *map(shlex.quote, sys.argv[1:])])
    threads = torch.get_num_threads()
    result = dict(command=command, machine=machine(), torch_threads=threads, models=args.models, P=args.prompt,
                  G=args.groups, T=args.response, R=args.ranks, chunk_size=args.chunk_size, baseline=args.baseline,
                  rank_threads=max(1, threads // max(args.ranks)), code_start=code_version(), rows=[])
    testing.init_dist()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {family: testing.save_tiny_model(family, f"{tmp}/{family}", **MODELS[family]) for family in args.models}
        single = {family: build(path, 1, max(args.groups), args.chunk_size, baseline=args.baseline)
                  for family, path in paths.items()
                  if 1 in args.ranks}
        for prompt in args.prompt:  # cheap cases first; results are rewritten after every case
            for family, path in paths.items():
                for group in args.groups:
                    for world in args.ranks:
                        load = [round(x, 1) for x in os.getloadavg()]
                        if world == 1:
                            per_rank = [rank_rows(*single[family], prompt, group, args.response)]
                        else:
                            per_rank = run_ranks(cp_rank, world, path, prompt, group, args.response, args.chunk_size,
                                                 max(1, threads // world), args.baseline, timeout_s=args.timeout_s)
                        rows = [dict(model=family, **r, load_average=load) for r in merge_ranks(per_rank, world)]
                        for r in rows:
                            print(json.dumps(r), flush=True)
                        result["rows"] += rows
                        result.update(runtime_s=time.perf_counter() - t0, ratios=ratios(result["rows"]),
                                      rank_ratios=rank_ratios(result["rows"]),
                                      load_average_end=[round(x, 1) for x in os.getloadavg()],
                                      code_end=code_version())
                        write(result, Path(args.out), args.tag)
    print(markdown(result))


def write(result: dict, out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"engine_{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"engine_{tag}.md").write_text(markdown(result))
    plot(result, out / f"engine_{tag}.png")


if __name__ == "__main__":
    main()
