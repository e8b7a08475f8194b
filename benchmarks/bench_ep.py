"""Expert parallelism against FSDP2-gathered experts in the `longstraw` engine (CPU, gloo, issue 30 item 6).

Two engines on R spawned gloo ranks (``run_ranks``), both `longstraw` with ``context_parallel_size`` R (one CP group,
every rank gets the whole batch), fp32, SDPA, veRL's gradient checkpointing on, SGD (lr 1e-6), one micro-batch:
- `fsdp2_only`: ``expert_parallel`` false: FSDP2 shards every parameter over the CP group, so each MoE layer's
  routed experts are all-gathered whenever FSDP2 unshards the layer (per decoder layer, forward and backward);
- `expert_parallel`: ``expert_parallel`` true: each rank holds E / R of every MoE layer's experts outside FSDP2 and
  the (token, expert) pairs travel to their owners and back by all-to-all.
The same global batch for both: one GRPO group, a prompt of P tokens and G responses of T tokens. Model: a qwen3_moe
of ``MODEL`` (every layer MoE, 8 experts, top 2; `verl_longstraw.tiny`), saved with ``save_pretrained`` for veRL.

Per engine, op (`compute_log_prob` with entropy, `update_actor` = forward_backward_batch + optimizer_step) and rank,
measured in the same call:
- seconds and peak RSS delta in MiB (``bench_engine.measure``: peak RSS during the call minus RSS before it, glibc
  mmap threshold 64 KiB, a barrier of the ranks before the clock starts);
- MoE-layer calls: a forward pre-hook on every routed-experts module counts its calls (gradient checkpointing's
  recomputes included; the same walk in both engines);
- EP all-to-all bytes: the token tensors this rank passes to the experts' all-to-alls, forward and backward
  (``experts.trace_all_to_all`` around the whole call; the engine's own ``longstraw/ep_collective_bytes`` is kept
  beside it as a check);
- FSDP2 all-gather bytes: FSDP2's ``foreach_all_gather`` wrapped; per call, its output bytes for every parameter
  from the all-gather's own input numels and dtypes (``AllGatherResult``) times R: the whole call's and the
  routed experts' share; a rank receives (R - 1) / R of them. Likewise FSDP2's gradient reduce-scatters
  (``foreach_reduce``: the unsharded gradients' bytes, the reduce-scatter's per-rank input).
Bytes of a collective are its per-rank buffer, as in ``bench_cp.py``: an all-gather's output, a reduce-scatter's or an
all-to-all's input (each includes this rank's own part). Per MoE-layer call: a step's bytes over its calls; per
unshard: the experts' all-gather bytes over the all-gathers that carried them (one layer's experts, E x the expert
weights).

R ranks of ``torch threads / R`` threads each (at least one) share the machine's cores; timings on a shared machine are
noisy. The report is rewritten after every R.

    python benchmarks/bench_ep.py                           # R 2 4, P 1024, G 4, T 64 -> results/ep.json, ep.md
    python benchmarks/bench_ep.py --smoke --out /tmp/ep     # seconds-long check (R 2, tiny batch)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from bench_engine import (
    ROOT,
    WARMUP,
    _code_lines,
    _per_rank,
    _scalar,
    code_version,
    log_prob,
    measure,
    restart_in_measurement_env,
    update_actor,
)
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from verl_longstraw.machine import describe, machine
from verl_longstraw.parallel import experts
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.testing import verl_harness as testing

if __name__ == "__main__":
    restart_in_measurement_env()  # bench_engine's measurement environment

FAMILY = "qwen3_moe"
MODEL = dict(  # every layer MoE (decoder_sparse_step 1): 4 x 8 experts of 3 x 256 x 256 fp32 = 6 MiB a layer
    num_hidden_layers=4,
    decoder_sparse_step=1,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    max_position_embeddings=16384,
)
ENGINES = {"fsdp2_only": False, "expert_parallel": True}  # name: longstraw.expert_parallel
OPS = ("compute_log_prob", "update_actor")
# per-rank counters of one call (``collective_counters``) and what is derived from them; merged as the largest rank's
# and every rank's (``<key>_per_rank``)
COUNTERS = ("moe_calls", "ep_all_to_all_bytes", "all_gathers", "all_gather_bytes", "expert_all_gathers",
            "expert_all_gather_bytes", "reduce_scatter_bytes", "expert_reduce_scatter_bytes")
DERIVED = ("ep_bytes_per_call", "expert_all_gather_bytes_per_call", "expert_all_gather_bytes_per_unshard")
ENGINE_METRICS = ("ep_collective_bytes", "cp_collective_bytes", "tokens_forwarded")
PER_RANK = ("seconds", "peak_rss_delta_mib", *COUNTERS, *DERIVED, *ENGINE_METRICS)
SMOKE = dict(ranks=[2], prompt=32, group=2, response=4, chunk_size=16)
MIB = 2**20


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routed-experts modules of ``model`` that its expert-parallel plan names (one per MoE layer)."""
    return [module for _, module in experts.dispatched_experts(model)]


def layer_expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of one MoE layer's routed-expert weights, all E experts, in their dtype (from the parameter sizes;
    DTensor shards counted whole)."""
    module = experts_modules(model)[0]
    return sum(p.numel() * p.element_size() for p in module.parameters())


def break_even_tokens(expert_bytes: int) -> int:
    """Tokens per rank per forward call at which EP's all-to-all buffers (each token's top-k pairs sent and returned,
    fp32 hidden states) equal one unshard's expert all-gather output of ``expert_bytes`` (computed from ``MODEL``)."""
    return round(expert_bytes / (2 * MODEL["num_experts_per_tok"] * MODEL["hidden_size"] * 4))


@contextmanager
def collective_counters(model: torch.nn.Module) -> Iterator[dict[str, int]]:
    """``COUNTERS`` of this rank inside the block (module docstring): MoE-layer calls, the experts' all-to-all bytes,
    FSDP2's all-gather output bytes and reduce-scatter input bytes, whole and the routed experts' share, and how
    many all-gathers there were (those carrying expert weights apart)."""
    modules = experts_modules(model)
    owned = set(map(id, modules))
    counts = dict.fromkeys(COUNTERS, 0)

    def is_expert(fsdp_param) -> bool:
        return id(fsdp_param._module_info.module) in owned

    def count_call(module, args) -> None:
        counts["moe_calls"] += 1

    all_gather, reduce = _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce

    def traced_all_gather(fsdp_params, group, *args, **kwargs):
        result = all_gather(fsdp_params, group, *args, **kwargs)
        if result is None:
            return result
        per_param = [sum(n * d.itemsize for n, d in zip(numels, dtypes, strict=True)) * group.size()
                     for numels, dtypes in zip(result.param_all_gather_input_numels,
                                               result.param_all_gather_input_dtypes, strict=True)]
        expert = sum(b for b, p in zip(per_param, fsdp_params, strict=True) if is_expert(p))
        counts["all_gathers"] += 1
        counts["all_gather_bytes"] += sum(per_param)
        counts["expert_all_gathers"] += expert > 0
        counts["expert_all_gather_bytes"] += expert
        return result

    def traced_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
        grad_bytes = [g.numel() * g.element_size() for g in unsharded_grads]
        counts["reduce_scatter_bytes"] += sum(grad_bytes)
        counts["expert_reduce_scatter_bytes"] += sum(b for b, p in zip(grad_bytes, fsdp_params, strict=True)
                                                     if is_expert(p))
        return reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    hooks = [module.register_forward_pre_hook(count_call) for module in modules]
    _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce = traced_all_gather, traced_reduce
    try:
        with experts.trace_all_to_all() as sent:
            yield counts
            counts["ep_all_to_all_bytes"] = sum(sent)
    finally:
        _fsdp_param_group.foreach_all_gather, _fsdp_param_group.foreach_reduce = all_gather, reduce
        for hook in hooks:
            hook.remove()


def per_call(counts: dict[str, int]) -> dict[str, float]:
    """``DERIVED`` from one call's ``COUNTERS``: all-to-all and expert all-gather bytes per MoE-layer call, and
    expert all-gather bytes per all-gather that carried expert weights (one layer's unshard)."""
    calls = max(counts["moe_calls"], 1)
    return dict(ep_bytes_per_call=counts["ep_all_to_all_bytes"] / calls,
                expert_all_gather_bytes_per_call=counts["expert_all_gather_bytes"] / calls,
                expert_all_gather_bytes_per_unshard=counts["expert_all_gather_bytes"]
                / max(counts["expert_all_gathers"], 1))


def ep_rank(rank: int, world: int, path: str, prompt: int, group: int, response: int, chunk_size: int | None,
            threads: int) -> list[dict]:
    """One spawned rank: both engines (``ENGINES``), warmed up on bench_engine's tiny batch, then every op on the
    global batch, measured (module docstring)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    rows = []
    for name, expert_parallel in ENGINES.items():
        config = testing.actor_config("longstraw", "token-mean", False, 0.0, group, context_parallel_size=world,
                                      chunk_size=chunk_size, expert_parallel=expert_parallel)
        engine = testing.make_engine("longstraw", path, config, group, lr=1e-6)
        for shape, measured in ((WARMUP, False), (dict(prompt=prompt, group=group, response=response), True)):
            td = testing.make_batch(1, shape["group"], seed=shape["prompt"] + shape["group"],
                                    prompt_len=(shape["prompt"], shape["prompt"] + 1),
                                    response_len=(shape["response"], shape["response"] + 1))
            for op, fn in (("compute_log_prob", log_prob), ("update_actor", update_actor)):
                args = (engine, td.clone()) + ((config,) if op == "update_actor" else ()) + (shape["group"],)
                with collective_counters(engine.module) as counts:
                    metrics, seconds, rss = measure(partial(fn, *args), dist.barrier)
                if not measured:
                    continue
                row = dict(engine=name, op=op, P=prompt, G=group, T=response, seconds=seconds,
                           peak_rss_delta_mib=rss, layer_expert_bytes=layer_expert_bytes(engine.module), **counts,
                           **per_call(counts))
                row.update({key: _scalar(metrics[f"longstraw/{key}"]) for key in ENGINE_METRICS})
                rows.append(row)
        del engine
    return rows


def merge(per_rank: list[list[dict]], world: int) -> list[dict]:
    """One row per (engine, op): every ``PER_RANK`` key as the largest rank's and as every rank's list."""
    merged = []
    for rows in zip(*per_rank, strict=True):
        assert len({(r["engine"], r["op"]) for r in rows}) == 1, rows
        row = dict(rows[0], R=world)
        for key in PER_RANK:
            row[key] = max(r[key] for r in rows)
            row[f"{key}_per_rank"] = [r[key] for r in rows]
        merged.append(row)
    return merged


def ratios(rows: list[dict]) -> list[dict]:
    """Per (R, op): expert_parallel against fsdp2_only. Bytes per MoE-layer call: EP's all-to-all against the
    experts' FSDP2 all-gather, per unshard (its output, and the (R - 1) / R a rank receives) and per call (a step's
    all-gathers over its calls); seconds and peak RSS delta (largest rank) as EP / FSDP2."""
    by_key = {(r["R"], r["op"], r["engine"]): r for r in rows}
    out = []
    for (world, op, engine), ep in by_key.items():
        fs = by_key.get((world, op, "fsdp2_only"))
        if engine != "expert_parallel" or fs is None:
            continue
        unshard = fs["expert_all_gather_bytes_per_unshard"]
        received = unshard * (world - 1) / world
        out.append(dict(
            R=world, op=op, P=ep["P"], G=ep["G"], T=ep["T"], moe_calls=ep["moe_calls"],
            ep_bytes_per_call=ep["ep_bytes_per_call"], all_gather_bytes_per_unshard=unshard,
            all_gather_received_bytes_per_unshard=received,
            all_gather_bytes_per_call=fs["expert_all_gather_bytes_per_call"],
            bytes_ratio_per_unshard=ep["ep_bytes_per_call"] / max(unshard, 1e-9),
            bytes_ratio_received=ep["ep_bytes_per_call"] / max(received, 1e-9),
            bytes_ratio_per_call=ep["ep_bytes_per_call"] / max(fs["expert_all_gather_bytes_per_call"], 1e-9),
            fsdp2_s=fs["seconds"], ep_s=ep["seconds"], time_ratio=ep["seconds"] / fs["seconds"],
            fsdp2_mib=fs["peak_rss_delta_mib"], ep_mib=ep["peak_rss_delta_mib"],
            mem_ratio=ep["peak_rss_delta_mib"] / max(fs["peak_rss_delta_mib"], 1e-9)))
    return out


def markdown(result: dict) -> str:
    rows = {(r["R"], r["op"], r["engine"]): r for r in result["rows"]}
    model = ", ".join(f"{k} {v}" for k, v in MODEL.items())
    lines = [
        "# Expert parallelism vs FSDP2-gathered experts, longstraw engine (veRL 0.9.1, CPU gloo, fp32)",
        "",
        f"Command: `{result['command']}`  ",
        f"Machine at the start: {describe(result['machine'])}; torch threads {result['torch_threads']}  ",
        f"Load average at the end: {result.get('load_average_end', '-')}  ",
        *_code_lines(result),
        f"Runtime: {result['runtime_s']:.0f} s for R in {sorted({r['R'] for r in result['rows']})} of {result['R']}. "
        f"Model: {FAMILY}, {model} (one layer's routed experts: {result['layer_expert_bytes'] / MIB:.2f} MiB). "
        f"Batch: one group, P={result['P']}, G={result['G']}, T={result['T']}, one micro-batch; both engines "
        f"`longstraw` with context_parallel_size R, chunk_size {result['chunk_size']}, gradient checkpointing on.",
        "",
        "`fsdp2_only`: expert_parallel false (FSDP2 all-gathers a layer's experts whenever it unshards the layer); "
        "`expert_parallel`: expert_parallel true (E / R experts per rank, tokens by all-to-all). Bytes are per-rank "
        "buffers (an all-gather's output, an all-to-all's input, both including this rank's own part), measured on "
        "the collectives' calls (benchmarks/bench_ep.py docstring); largest rank, every rank's in brackets. Times and "
        "memory: one run per case, R ranks of "
        f"{result['rank_threads']} thread(s) each sharing the same cores, on a machine loaded by other work: the "
        "seconds are noisy. Memory = peak RSS during the call minus RSS before it, per rank.",
        "",
        "## Bytes per MoE-layer call",
        "",
        "EP's all-to-all grows with the tokens a rank routes per call (forward: 2 x top-k x hidden x 4 B per token, "
        "the pairs sent and their outputs returned; the backward as much again), FSDP2's expert all-gather is fixed "
        "by the weights (E experts, fp32): per unshard the two are equal at about "
        f"{break_even_tokens(result['layer_expert_bytes'])} tokens per rank per forward call (computed from the "
        "sizes).",
        "",
        "| R | op | MoE-layer calls | EP all-to-all KiB/call | FSDP2 expert all-gather KiB/unshard (received) "
        "| FSDP2 expert all-gather KiB/call | EP / all-gather per unshard | EP / received | EP / all-gather per call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for q in result["ratios"]:
        ep = rows[q["R"], q["op"], "expert_parallel"]
        lines.append(
            f"| {q['R']} | {q['op']} | {q['moe_calls']} | {_per_rank(ep, 'ep_bytes_per_call', 1024, '{:.0f}')} | "
            f"{q['all_gather_bytes_per_unshard'] / 1024:.0f} ({q['all_gather_received_bytes_per_unshard'] / 1024:.0f})"
            f" | {q['all_gather_bytes_per_call'] / 1024:.0f} | {q['bytes_ratio_per_unshard']:.3f} | "
            f"{q['bytes_ratio_received']:.3f} | {q['bytes_ratio_per_call']:.3f} |")
    lines += [
        "",
        "## Time and memory per rank",
        "",
        "| R | op | fsdp2_only s | expert_parallel s | EP / FSDP2 s | fsdp2_only MiB | expert_parallel MiB "
        "| EP / FSDP2 MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for q in result["ratios"]:
        fs, ep = rows[q["R"], q["op"], "fsdp2_only"], rows[q["R"], q["op"], "expert_parallel"]
        lines.append(
            f"| {q['R']} | {q['op']} | {_per_rank(fs, 'seconds', fmt='{:.2f}')} | "
            f"{_per_rank(ep, 'seconds', fmt='{:.2f}')} | {q['time_ratio']:.2f} | "
            f"{_per_rank(fs, 'peak_rss_delta_mib')} | {_per_rank(ep, 'peak_rss_delta_mib')} | {q['mem_ratio']:.2f} |")
    lines += [
        "",
        "## Every collective of the call, per rank (MiB, largest rank)",
        "",
        "FSDP2 all-gathers and reduce-scatters of all parameters and of the routed experts alone; the experts' "
        "all-to-all as traced around the call and as the engine reports it (`longstraw/ep_collective_bytes`); the "
        "context-parallel collectives (`longstraw/cp_collective_bytes`).",
        "",
        "| R | op | engine | all-gathers (with experts) | all-gather | expert all-gather | reduce-scatter "
        "| expert reduce-scatter | EP all-to-all (engine metric) | CP collectives |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['R']} | {r['op']} | {r['engine']} | {r['all_gathers']} ({r['expert_all_gathers']}) | "
            + " | ".join(f"{r[k] / MIB:.2f}" for k in ("all_gather_bytes", "expert_all_gather_bytes",
                                                      "reduce_scatter_bytes", "expert_reduce_scatter_bytes"))
            + f" | {r['ep_all_to_all_bytes'] / MIB:.2f} ({r['ep_collective_bytes'] / MIB:.2f}) | "
            f"{r['cp_collective_bytes'] / MIB:.2f} |")
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    (out / f"{tag}.md").write_text(markdown(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4], help="R values (each divides the 8 experts)")
    parser.add_argument("--prompt", type=int, default=1024, help="P, prompt tokens")
    parser.add_argument("--group", type=int, default=4, help="G, responses to the prompt")
    parser.add_argument("--response", type=int, default=64, help="T, tokens per response")
    parser.add_argument("--chunk-size", type=int, default=256, help="longstraw.chunk_size (tokens)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="hard limit for one R")
    parser.add_argument("--smoke", action="store_true", help=f"seconds-long check: {SMOKE}")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--tag", default="ep", help="files are written as <tag>.json/md")
    args = parser.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.tag = "ep_smoke"
    command = " ".join(["python", "benchmarks/bench_ep.py", *map(shlex.quote, sys.argv[1:])])
    threads = torch.get_num_threads()
    result = dict(command=command, machine=machine(), torch_threads=threads, model=dict(family=FAMILY, **MODEL),
                  P=args.prompt, G=args.group, T=args.response, R=args.ranks, chunk_size=args.chunk_size,
                  rank_threads=max(1, threads // max(args.ranks)), code_start=code_version(), rows=[])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = testing.save_tiny_model(FAMILY, f"{tmp}/{FAMILY}", **MODEL)
        for world in args.ranks:
            load = [round(x, 1) for x in os.getloadavg()]
            per_rank = run_ranks(ep_rank, world, path, args.prompt, args.group, args.response, args.chunk_size,
                                 max(1, threads // world), timeout_s=args.timeout_s)
            rows = [dict(r, load_average=load) for r in merge(per_rank, world)]
            for r in rows:
                print(json.dumps({k: v for k, v in r.items() if not k.endswith("_per_rank")}), flush=True)
            result["rows"] += rows
            result.update(runtime_s=time.perf_counter() - t0, ratios=ratios(result["rows"]),
                          layer_expert_bytes=rows[0]["layer_expert_bytes"],
                          load_average_end=[round(x, 1) for x in os.getloadavg()], code_end=code_version())
            write(result, Path(args.out), args.tag)
    print(markdown(result))


if __name__ == "__main__":
    main()
