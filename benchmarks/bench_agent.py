"""One prefix tree per mini-batch against trees per micro-batch and the star path, on a batch shaped like agent
trajectories (CPU, one process, issue 32).

The batch: G_n tasks x G trials (default 8 x 4), one row per trajectory (veRL's multi-turn layout). Every prompt is
one system prompt with the tool schemas (3712 tokens) ++ its task's user turn (256); the trials diverge at their
first assistant turn. A response is ``turns`` (default 3) rounds of an assistant turn (96 tokens) and a tool output
(160, response mask 0: no loss term), then an answer (64). The rows are shuffled (``verl_harness.samples_batch``) and
veRL cuts them into micro-batches of G rows.

Engines (the longstraw engine, fp32, SDPA, gradient checkpointing, SGD lr 1e-6, as ``bench_tree.py``):
- `minibatch`: as configured by default: every row of the call as one prefix tree;
- `micro_batch_trees`: each micro-batch's rows as their own trees (the engine before issue 32);
- `star`: each micro-batch's GRPO groups captured on their own (``bench_tree.StarEngine``).
Per engine and op (`compute_log_prob` with entropy, `update_actor`: one replay per response, exact) it reports
seconds, CPU seconds, peak RSS delta (``bench_tree.measure_trimmed``) and tokens forwarded (the engine's
``longstraw/tokens_forwarded``), against the batch's distinct tokens (the positions of the rows' token trie:
what a walk that shares every repeated prefix runs once) and the rows' tokens (no sharing).

    python benchmarks/bench_agent.py --scale 0.5 --repeats 2     # -> benchmarks/results/agent.json / .md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from bench_engine import (
    MODELS,
    ROOT,
    _scalar,
    code_version,
    log_prob,
    restart_in_measurement_env,
    update_actor,
)
from bench_tree import build, measure_trimmed, run_lines, uptime

from verl_longstraw.integration.engine import LongStrawEngine
from verl_longstraw.machine import machine
from verl_longstraw.testing import verl_harness as testing
from verl_longstraw.tiny import VOCAB

if __name__ == "__main__":
    restart_in_measurement_env()  # bench_engine's measurement environment

ENGINES = ("minibatch", "micro_batch_trees", "star")
OPS = ("compute_log_prob", "update_actor")


@dataclass(frozen=True)
class Shape:
    """The batch's sizes in tokens at scale 1 (``scaled`` multiplies them); counts are not scaled."""

    system: int = 3712
    task: int = 256
    assistant: int = 96
    tool: int = 160
    answer: int = 64
    turns: int = 3
    tasks: int = 8
    trials: int = 4

    def scaled(self, scale: float) -> Shape:
        counts = ("turns", "tasks", "trials")
        return Shape(**{k: v if k in counts else max(1, round(v * scale)) for k, v in asdict(self).items()})


def trajectories(n: Shape, gen: torch.Generator):
    """(prompts [P_i], responses [T_i], response masks [T_i], uids) of the batch (module docstring)."""

    def tokens(count: int) -> torch.Tensor:
        return torch.randint(1, VOCAB, (count,), generator=gen)

    system = tokens(n.system)
    prompts, responses, masks, uids = [], [], [], []
    for task in range(n.tasks):
        prompt = torch.cat([system, tokens(n.task)])
        for _ in range(n.trials):
            parts, mask = [], []
            for _ in range(n.turns):
                parts += [tokens(n.assistant), tokens(n.tool)]
                mask += [torch.ones(n.assistant, dtype=torch.long), torch.zeros(n.tool, dtype=torch.long)]
            parts.append(tokens(n.answer))
            mask.append(torch.ones(n.answer, dtype=torch.long))
            prompts.append(prompt)
            responses.append(torch.cat(parts))
            masks.append(torch.cat(mask))
            uids.append(f"task-{task}")
    return prompts, responses, masks, uids


def distinct_tokens(rows: list[torch.Tensor]) -> int:
    """Positions of the rows' token trie: the rows' tokens less, in sorted order, each row's longest common prefix
    with the one before it."""
    ordered = sorted(tuple(row.tolist()) for row in rows)
    total = sum(len(row) for row in ordered)
    for before, row in zip(ordered, ordered[1:], strict=False):
        shorter = min(len(before), len(row))
        total -= next((i for i in range(shorter) if before[i] != row[i]), shorter)
    return total


class MicroBatchTreesEngine(LongStrawEngine):
    """The longstraw engine walking each micro-batch's rows as their own trees (the engine before issue 32)."""

    def _walk_units(self, walk):
        return super()._walk_units(walk)[1:]


def build_engines(path: str, micro_batch: int) -> dict:
    """name -> (engine, actor config), the longstraw engine with its default knobs and the units of ``ENGINES``."""
    engines = {name: build(name if name == "star" else "tree", path, {}, micro_batch) for name in ENGINES}
    engines["micro_batch_trees"][0].__class__ = MicroBatchTreesEngine
    return engines


def measure_rows(engines: dict, n: Shape, seed: int, repeats: int) -> list[dict]:
    """Every engine's measurements of the same batch, both ops; each call ``repeats`` times, the fastest's seconds
    and metrics."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, masks, uids = trajectories(n, gen)
    td = testing.samples_batch(prompts, responses, uids, gen, response_masks=masks)
    rows = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
    distinct, unshared = distinct_tokens(rows), sum(len(row) for row in rows)
    out = []
    for name, (engine, config) in engines.items():
        for op in OPS:
            runs = []
            for _ in range(repeats):
                call = (partial(log_prob, engine, td.clone(), n.trials) if op == "compute_log_prob" else
                        partial(update_actor, engine, td.clone(), config, n.trials))
                runs.append(measure_trimmed(call))
            metrics, seconds, _, _ = min(runs, key=lambda run: run[1])
            tokens = _scalar(metrics["longstraw/tokens_forwarded"])
            out.append(dict(engine=name, op=op, seconds=seconds, seconds_runs=[run[1] for run in runs],
                            cpu_seconds=min(run[2] for run in runs), peak_rss_delta_mib=max(run[3] for run in runs),
                            tokens_forwarded=tokens, distinct_tokens=distinct, unshared_tokens=unshared,
                            tokens_per_distinct=tokens / distinct, tokens_per_unshared=tokens / unshared,
                            star_tokens_forwarded=_scalar(metrics["longstraw/star_tokens_forwarded"]),
                            fragments=_scalar(metrics["longstraw/fragments"])))
    return out


def markdown(result: dict) -> str:
    n = Shape(**result["shape"])
    lines = [
        "# One tree per mini-batch vs trees per micro-batch vs the star path (veRL 0.9.1 engine, CPU, fp32)",
        "",
        *run_lines(result),
        f"Runtime: {result.get('runtime_s', 0):.0f} s. Scale {result['scale']}.",
        "",
        f"Batch: {n.tasks} tasks x {n.trials} trials, one row per trajectory: system prompt {n.system} + task "
        f"{n.task} tokens; response {n.turns} x (assistant {n.assistant} + tool output {n.tool}, masked) + answer "
        f"{n.answer}. Rows shuffled, micro-batches of {n.trials} rows. Model: tiny qwen3 "
        "(`bench_engine.MODELS`). update_actor: ppo_loss token-mean, one replay per response, exact prompt "
        "gradient (a shared segment is captured, then recomputed with autograd: forwarded twice).",
        "",
        "Distinct tokens: the positions of the rows' token trie; unshared: the rows' tokens (what veRL's stock "
        "engine forwards per pass). Seconds: the fastest of the runs (all in the JSON).",
        "",
        "| op | engine | walks (trees) | s | CPU s | MiB | tokens forwarded | / distinct | / unshared |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {r['engine']} | {r['fragments']:.0f} | {r['seconds']:.2f} | "
                     f"{r['cpu_seconds']:.2f} | {r['peak_rss_delta_mib']:.0f} | {r['tokens_forwarded']:.0f} | "
                     f"{r['tokens_per_distinct']:.3f} | {r['tokens_per_unshared']:.3f} |")
    lines += ["", "`minibatch` against the others (their seconds / minibatch's; their tokens / minibatch's):", "",
              "| op | against | speed-up | CPU speed-up | tokens |", "|---|---|---|---|---|"]
    by_key = {(r["op"], r["engine"]): r for r in result["rows"]}
    for (op, engine), r in by_key.items():
        ours = by_key[(op, "minibatch")]
        if engine != "minibatch":
            lines.append(f"| {op} | {engine} | {r['seconds'] / ours['seconds']:.2f} | "
                         f"{r['cpu_seconds'] / ours['cpu_seconds']:.2f} | "
                         f"{r['tokens_forwarded'] / ours['tokens_forwarded']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of every length")
    for name in ("tasks", "trials", "turns"):
        parser.add_argument(f"--{name}", type=int, default=getattr(Shape, name))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not 0 < args.scale <= 1:
        parser.error(f"--scale {args.scale} must be in (0, 1]")
    n = Shape(tasks=args.tasks, trials=args.trials, turns=args.turns).scaled(args.scale)
    command = " ".join(["python", "benchmarks/bench_agent.py", *map(shlex.quote, sys.argv[1:])])
    result = dict(command=command, machine=machine(), torch_threads=torch.get_num_threads(), uptime_start=uptime(),
                  scale=args.scale, repeats=args.repeats, shape=asdict(n), code_start=code_version())
    testing.init_dist()
    t0 = time.perf_counter()
    longest = n.system + n.task + n.turns * (n.assistant + n.tool) + n.answer
    with tempfile.TemporaryDirectory() as tmp:
        config = dict(MODELS["qwen3"], max_position_embeddings=longest)
        path = testing.save_tiny_model("qwen3", f"{tmp}/qwen3", **config)
        result["rows"] = measure_rows(build_engines(path, n.trials), n, args.seed, args.repeats)
    result.update(runtime_s=time.perf_counter() - t0, uptime_end=uptime(), code_end=code_version())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agent.json").write_text(json.dumps(result, indent=1))
    (out / "agent.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
