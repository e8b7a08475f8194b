"""Context-parallel benchmark: one GRPO group on R gloo ranks on CPU, against R = 1 (one process).

For each family x prompt length P x R (one set of spawned ranks, measuring every G in turn), a
training step in chunked exact mode (``capture_prompt``, ``group_log_probs``, ``group_backward``):
- per-rank peak bytes saved for backward over the whole step (``verl_longstraw.memory``,
  parameters excluded) and per-rank prompt-state bytes (``PromptState.nbytes``);
- seconds per phase (``GroupStats``): capture, log-prob replay, training replay, prompt backward;
- bytes per collective kind per phase (``comm.trace_collectives``), next to the formulas below;
- ratios to R = 1, and whether every rank issued the same collectives (lockstep).
R = 1 runs the single-process path (``cp_group=None``) in this process, R > 1 in spawned ranks.

Bytes of a collective are its per-rank buffer, the convention of the design study's traffic
table: an all-gather's output, a reduce-scatter's input (on a ring, a rank sends and receives
(R-1)/R of it). Variable sizes are padded to the largest rank's.

Formulas: ``FORMULAS`` below (also written into cp.md), owned by each layer's op (``MixerOp.collective_bytes``);
``formula_bytes`` sums them over the plan's steps.

    python benchmarks/bench_cp.py                   # qwen3, qwen3_5, deepseek_v3; R 1 2 4; P 4096 8192 16384; G 8
    python benchmarks/bench_cp.py --quick --out /tmp/cp   # smoke test: tiny P, R 1 2, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import verl_longstraw.execute as execute
from verl_longstraw import GroupStats, Knobs, capture_prompt, group_backward, group_log_probs
from verl_longstraw.adapters import adapter_on_meta
from verl_longstraw.machine import describe, machine
from verl_longstraw.memory import parameter_meter
from verl_longstraw.mixers import layer_calls
from verl_longstraw.parallel import comm
from verl_longstraw.parallel.launch import run_ranks
from verl_longstraw.plan import Capture, Recompute, Replay, star_plan
from verl_longstraw.testing.compare import make_group
from verl_longstraw.tiny import VOCAB, tiny_config, tiny_model

FAMILIES = ("qwen3", "qwen3_5", "deepseek_v3")
PHASES = ("capture", "replay_log_probs", "replay_train", "prompt_backward")
MB = 2**20
FORMULAS = """\
Bytes of the collectives of one group (R ranks; in a segment rank r has n_r tokens, N = sum n_r,
L = max n_r; Hq query heads, D query and Dv value dim per head of the attention op (MLA: absorbed,
D = kv_lora_rank + rope dim, Dv = kv_lora_rank); b bytes per element of the model dtype, f of the
arithmetic dtype (4 for float32 and bfloat16 models)):
- pass-Q attention, per attention layer per segment (a capture or recompute chunk, a replay round):
  forward: all-gather of the queries R*L*Hq*D*b, of the logsumexps R*N*Hq*f, reduce-scatter of the
  weighted partial outputs R*L*Hq*Dv*f (the design study's, §3.3). Backward on the fused kernels (Dv = D):
  all-gather of d(output) and output R*L*Hq*2*Dv*b, reduce-scatter of d(queries) R*L*Hq*D*f; on the
  blocked op (MLA: Dv != D): all-gather of d(output) R*L*Hq*Dv*f, reduce-scatters of d(logsumexp)
  R*N*Hq*f and of d(queries) R*L*Hq*D*f (query gradients are summed in float32). The design study's
  backward all-gathers Q again and d(output) in b and (L, delta) in float32 and reduce-scatters dQ in
  float32: per query Hq*(2*Dv + 6*D + 8) bytes
  for a bfloat16 model, where the fused one keeps the gathered queries from the forward and moves
  Hq*(4*Dv + 4*D) (Qwen3.5-27B, Hq 24, D = Dv = 256, R = 8: 49 KB against 49 KB; 37 KB with d(queries) in
  bfloat16, which rounds every rank's share).
- Gated DeltaNet (KDA, Mamba2 alike: ``mixers.base.affine_merge_bytes``, ``CausalConv.collective_bytes``), per layer per
  capture or recompute chunk (replay rounds need none): all-gather of the (E, M) maps R*H*Dk*(Dv+Dk)*f and of
  the conv tails R*min(K-1, L)*C*b
  (H value heads, C conv channels, K kernel size); backward: reduce-scatters of the same sizes, the
  tails' in float32 (R*min(K-1, L)*C*f).
- results: per replay round, all-gather of the log-probs R*L*4 (both replays: ``group_backward`` returns them
  too) and of (loss, validity) R*2*4 (training replay).
The last layer of a capture or recompute chunk only produces state (no attention output, no
pass-Q). Not modelled: GLM-MoE-DSA's distributed top-k (needed only for P > index_topk).
"""
QUICK = dict(families=["qwen3_5"], ranks=[1, 2], prompt_lens=[128], group_sizes=[3], chunk_size=32,
             response_len=8)


def grpo_loss(i: int, log_probs: torch.Tensor) -> torch.Tensor:
    """Advantage-weighted token-mean policy-gradient loss (advantages alternate in sign)."""
    return -(1.0 if i % 2 == 0 else -1.0) * log_probs.mean()


@contextmanager
def prompt_backward_trace() -> Iterator[list[tuple]]:
    """The collectives of ``group_backward``'s last phase (the prompt backward: its walk's recompute steps, which
    follow every replay), recorded apart from its replay."""
    original, records = execute._Walk._recompute, []

    def traced(self, step):
        with comm.trace_collectives() as inner:
            original(self, step)
        records.extend(inner)

    execute._Walk._recompute = traced
    try:
        yield records
    finally:
        execute._Walk._recompute = original


def measure_group(model, prompt_len: int, group_size: int, response_len: int, chunk_size: int, group) -> dict:
    """One training step of one group on this rank: saved and state bytes, seconds and collectives per phase."""
    prompt, responses = make_group(VOCAB, prompt_len, [response_len] * group_size)
    model.zero_grad(set_to_none=True)
    stats = {phase: GroupStats() for phase in ("capture", "replay_log_probs", "train")}
    with parameter_meter(model) as meter:
        with comm.trace_collectives() as capture_records:
            state = capture_prompt(model, prompt, stats=stats["capture"], cp_group=group,
                                   knobs=Knobs(chunk_size=chunk_size))
        with comm.trace_collectives() as log_prob_records:
            group_log_probs(model, prompt, responses, stats=stats["replay_log_probs"], state=state, cp_group=group,
                            knobs=Knobs(chunk_size=chunk_size))
        with comm.trace_collectives() as train_records, prompt_backward_trace() as backward_records:
            group_backward(model, prompt, responses, grpo_loss, stats=stats["train"], state=state, cp_group=group,
                           knobs=Knobs(chunk_size=chunk_size))
    replay_records = train_records[: len(train_records) - len(backward_records)]
    assert replay_records + backward_records == train_records, "the prompt backward is group_backward's last phase"
    return dict(
        G=group_size,
        saved_peak_bytes=meter.peak,
        state_bytes=state.nbytes(),
        seconds=dict(capture=stats["capture"].capture_s, replay_log_probs=stats["replay_log_probs"].replay_s,
                     replay_train=stats["train"].replay_s, prompt_backward=stats["train"].prompt_backward_s),
        records=dict(capture=capture_records, replay_log_probs=log_prob_records, replay_train=replay_records,
                     prompt_backward=backward_records),
    )


def measure_rank(rank: int, world: int, family: str, prompt_len: int, group_sizes: list[int], response_len: int,
                 chunk_size: int) -> list[dict]:
    """``measure_group`` for every G on this rank of ``world`` (R = 1: the single-process path)."""
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world))) if world > 1 else None
    model = tiny_model(family, max_position_embeddings=prompt_len + response_len)
    return [measure_group(model, prompt_len, g, response_len, chunk_size, group) for g in group_sizes]


def bytes_by_op(records: list[tuple[str, int, int, str]]) -> dict[str, dict[str, int]]:
    """{op: {"bytes": buffer bytes, "calls": n}} of trace records ``(op, group_size, numel, dtype)``."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "calls": 0})
    for op, _, numel, dtype in records:
        out[op]["bytes"] += numel * getattr(torch, dtype).itemsize
        out[op]["calls"] += 1
    return dict(out)


def formula_bytes(family: str, prompt_len: int, chunk_size: int, response_lens: list[int], world: int,
                  dtype: torch.dtype = torch.float32) -> dict[str, dict[str, int]]:
    """{phase: {op: bytes}} the formulas of the module docstring give for one group on ``world`` ranks: rank 0's
    steps priced, each layer's by its op (``MixerOp.collective_bytes`` of the step's ``mixers.layer_calls``) and the
    walk's own (``Step.collectives``): the exact walk's captures (``capture_prompt``: a star's prompt chain, all
    before its first replay), the log-prob walk's replays (``group_log_probs``), the exact walk's replays and
    recomputes (``group_backward``)."""
    ops = adapter_on_meta(tiny_config(family)).ops  # each layer's op and its collectives (``collective_bytes``)
    out = {phase: Counter() for phase in PHASES}
    if world == 1:
        return {phase: {} for phase in PHASES}
    plan = star_plan(prompt_len, response_lens, Knobs(chunk_size=chunk_size), world=world, rank=0)
    # each walk's steps this benchmark's phases count, by step type; whether the walk backpropagates (has a loss)
    walks = {"log_probs": ({Replay: "replay_log_probs"}, False),
             "exact": ({Capture: "capture", Replay: "replay_train", Recompute: "prompt_backward"}, True)}
    for mode, (phases, loss) in walks.items():
        for step in plan.steps(mode):
            if type(step) not in phases:
                continue
            counter = out[phases[type(step)]]
            backward = loss and step.differentiable
            for op, call in zip(ops, layer_calls(step.call, len(ops), dtype, "cpu"), strict=True):
                counter.update(op.collective_bytes(call, backward))
            counter.update(step.collectives(loss, entropy=False))
    return {phase: dict(counts) for phase, counts in out.items()}


def run_case(family: str, world: int, prompt_len: int, group_sizes: list[int], response_len: int, chunk_size: int,
             timeout_s: float) -> list[dict]:
    """One row per G: the largest per-rank figures, every rank's memory, collectives against the formulas."""
    args = (family, prompt_len, group_sizes, response_len, chunk_size)
    ranks = run_ranks(measure_rank, world, *args, timeout_s=timeout_s) if world > 1 else [measure_rank(0, 1, *args)]
    rows = []
    for per_rank in zip(*ranks, strict=True):
        mine = per_rank[0]
        rows.append(dict(
            family=family, P=prompt_len, R=world, G=mine["G"], T=response_len, chunk_size=chunk_size,
            saved_peak_bytes=max(r["saved_peak_bytes"] for r in per_rank),
            state_bytes=max(r["state_bytes"] for r in per_rank),
            saved_peak_bytes_per_rank=[r["saved_peak_bytes"] for r in per_rank],
            state_bytes_per_rank=[r["state_bytes"] for r in per_rank],
            seconds={phase: max(r["seconds"][phase] for r in per_rank) for phase in PHASES},
            lockstep=all(r["records"] == mine["records"] for r in per_rank),
            collectives={phase: bytes_by_op(mine["records"][phase]) for phase in PHASES},
            formula_bytes=formula_bytes(family, prompt_len, chunk_size, [response_len] * mine["G"], world),
        ))
    return rows


def ratio(value: float, reference: float | None) -> str:
    """``value / reference`` for a table, "-" without a reference."""
    return f"{value / reference:.3f}" if reference else "-"


def write_reports(rows: list[dict], out_dir: str, command: str, info: dict, name: str = "cp") -> None:
    """``<name>.json``, ``.md`` and ``.png`` under ``out_dir``; ``info`` is ``machine()`` from the start of the run."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(dict(command=command, machine=info, rows=rows), f, indent=1)
    lines = [
        "# Context-parallel benchmark (CPU, gloo)", "", f"Command: `{command}`", "",
        f"Machine at the start: {describe(info)}. The machine was shared with other jobs, and R ranks of one "
        f"thread each share its {info['cpus']} CPUs: seconds are contended and only roughly comparable: R > 1 adds "
        "no compute; bytes are exact.", "",
        f"Chunked exact, chunk {rows[0]['chunk_size']} prompt tokens (global, split over the R ranks), responses of "
        f"T = {rows[0]['T']} tokens, float32, one thread per rank. Per-rank figures are the largest over the ranks; "
        "ratios are to R = 1 (one process, `cp_group=None`). Peak saved: bytes saved for backward over capture + "
        "log-probs + backward, parameters excluded. Lockstep: every rank issued the same collectives.", "",
        *summary_table(rows), "", *collective_table(rows), "", *group_size_table(rows), "", "```", FORMULAS, "```",
    ]
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(rows, os.path.join(out_dir, f"{name}.png"))


def summary_table(rows: list[dict]) -> list[str]:
    """Memory and seconds per phase, with ratios to R = 1."""
    single = {(r["family"], r["P"], r["G"]): r for r in rows if r["R"] == 1}
    lines = [
        "| family | P | R | G | peak saved MB/rank | vs R=1 | state MB/rank | vs R=1 | capture s | log-prob replay s "
        "| train replay s | prompt backward s | total s | vs R=1 | lockstep |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = single.get((r["family"], r["P"], r["G"]), {})
        seconds = [r["seconds"][phase] for phase in PHASES]
        ref_seconds = sum(ref["seconds"].values()) if ref else None
        lines.append(
            f"| {r['family']} | {r['P']} | {r['R']} | {r['G']} | {r['saved_peak_bytes'] / MB:.2f} | "
            f"{ratio(r['saved_peak_bytes'], ref.get('saved_peak_bytes'))} | {r['state_bytes'] / MB:.2f} | "
            f"{ratio(r['state_bytes'], ref.get('state_bytes'))} | " + " | ".join(f"{x:.2f}" for x in seconds) +
            f" | {sum(seconds):.2f} | {ratio(sum(seconds), ref_seconds)} | {'yes' if r['lockstep'] else 'NO'} |"
        )
    return lines


def collective_table(rows: list[dict]) -> list[str]:
    """Bytes per collective kind per phase, measured and from ``FORMULAS`` (R > 1)."""
    lines = [
        "Collective bytes per group (per-rank buffers: all-gather output, reduce-scatter input), measured and from "
        "the formulas at the end:", "",
        "| family | P | R | G | phase | op | calls | measured MB | formula MB | measured / formula |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for phase in PHASES:
            for op in sorted(set(r["collectives"][phase]) | set(r["formula_bytes"][phase])):
                measured = r["collectives"][phase].get(op, {"bytes": 0, "calls": 0})
                formula = r["formula_bytes"][phase].get(op, 0)
                lines.append(
                    f"| {r['family']} | {r['P']} | {r['R']} | {r['G']} | {phase} | {op} | {measured['calls']} | "
                    f"{measured['bytes'] / MB:.3f} | {formula / MB:.3f} | {ratio(measured['bytes'], formula)} |"
                )
    return lines


def group_size_table(rows: list[dict]) -> list[str]:
    """Peak saved bytes at the largest G over the smallest, per family, P and R (empty for one G)."""
    group_sizes = sorted({r["G"] for r in rows})
    if len(group_sizes) < 2:
        return []
    low, high = group_sizes[0], group_sizes[-1]
    index = {(r["family"], r["P"], r["R"], r["G"]): r for r in rows}
    lines = [f"Peak saved bytes per rank, G={high} / G={low}:", "", "| family | P | R | ratio |", "|---|---|---|---|"]
    for (family, p, world, g), r in index.items():
        if g == high and (family, p, world, low) in index:
            small = index[(family, p, world, low)]["saved_peak_bytes"]
            lines.append(f"| {family} | {p} | {world} | {ratio(r['saved_peak_bytes'], small)} |")
    return lines


def plot(rows: list[dict], path: str) -> None:
    """Per family, against R at the largest G: peak saved MB and state MB per rank (each P), collective MB per
    phase (the largest P)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in rows})
    group_size = max(r["G"] for r in rows)
    fig, axes = plt.subplots(3, len(families), figsize=(4.2 * len(families), 9), squeeze=False)
    for j, family in enumerate(families):
        mine = [r for r in rows if r["family"] == family and r["G"] == group_size]
        for p in sorted({r["P"] for r in mine}):
            points = sorted(((r["R"], r) for r in mine if r["P"] == p), key=lambda point: point[0])
            worlds = [w for w, _ in points]
            for i, key in enumerate(("saved_peak_bytes", "state_bytes")):
                axes[i][j].plot(worlds, [r[key] / MB for _, r in points], marker="o", label=f"P={p}")
                first_world, first = points[0]
                axes[i][j].plot(worlds, [first[key] * first_world / MB / w for w in worlds], ls=":", color="gray")
        longest = max(r["P"] for r in mine)
        points = sorted((r for r in mine if r["P"] == longest), key=lambda r: r["R"])
        for phase in PHASES:
            total = [sum(v["bytes"] for v in r["collectives"][phase].values()) / MB for r in points]
            axes[2][j].plot([r["R"] for r in points], total, marker="o", label=phase)
        titles = ("peak saved MB per rank", "prompt state MB per rank", f"collective MB per group, P={longest}")
        for i, title in enumerate(titles):
            axes[i][j].set_title(f"{family}, G={group_size}: {title}", fontsize=9)
            axes[i][j].set_xlabel("R (ranks)")
            axes[i][j].set_xticks(sorted({r["R"] for r in rows}))
            axes[i][j].legend(fontsize=6)
    fig.suptitle("context parallel on CPU (dotted: the smallest R's figure scaled by 1/R)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4], help="R values (processes)")
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[4096, 8192, 16384],
                        help="P values (8192: the size of the issue's memory acceptance)")
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[8])
    parser.add_argument("--chunk-size", type=int, default=2048, help="prompt tokens per capture/recompute chunk")
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=3600, help="hard limit for one set of ranks")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK}")
    parser.add_argument("--tag", default="", help="name the files cp_<tag>.json/.md/.png instead of cp.*")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    command = " ".join(["python benchmarks/bench_cp.py", *(argv if argv is not None else sys.argv[1:])])
    info = machine()
    rows = []
    for family in args.families:
        for p in args.prompt_lens:
            for world in args.ranks:
                rows += run_case(family, world, p, args.group_sizes, args.response_len, args.chunk_size, args.timeout_s)
                for r in rows[-len(args.group_sizes):]:
                    print(f"{family:12s} P={p:6d} R={world} G={r['G']} saved {r['saved_peak_bytes'] / MB:8.2f} MB  "
                          f"state {r['state_bytes'] / MB:7.2f} MB  seconds {r['seconds']}", flush=True)
    name = f"cp_{args.tag}" if args.tag else "cp"
    write_reports(rows, args.out, command, info, name)
    print(f"wrote {args.out}/{name}.json, .md, .png")
    return rows


if __name__ == "__main__":
    main()
