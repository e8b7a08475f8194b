"""The longstraw engine's prefix trees against today's star path and veRL's stock `fsdp2` (CPU, one process,
issue 19).

Three batch shapes, every engine on the identical batch in the same run (one micro-batch holding every row):
- `a` shared system prompt: G_n groups x G responses (default 8 x 8); every row's prompt is one system prompt
  (4096 tokens) ++ its group's prompt (512), responses of T = 128;
- `b` multi-turn: the per-turn samples of N 4-turn trajectories (default N = 4, one task: their first prompt is
  shared); the history grows by 2048 tokens per turn (the turn's response, T = 128, then 2048 - T new tokens), so
  turn k's sample is the first 2048 k tokens of its trajectory, scored on the last T;
- `c` one long response: one row, a 512-token prompt and a 32768-token response.
Engines (fp32, SDPA, veRL's gradient checkpointing on, SGD lr 1e-6, as `bench_engine.py`):
- `tree`: the longstraw engine as configured by default (one process: the micro-batch's rows as prefix trees,
  `tree_log_probs` / `tree_backward`), with `min_shared_tokens` 64 x scale; in shape c with `response_chunk_size`
  2048 x scale (``--response-chunk-size``, in tokens at scale 1);
- `star`: the same engine with its units forced to the GRPO groups (``StarEngine``: `grpo_groups`, by uid and prompt)
  through `group_log_probs` / `group_backward`: the path before prefix trees, what the engine runs under context
  parallelism; every distinct prompt is captured on its own;
- `tree_unsegmented` (shape c only): `tree` with `response_chunk_size` None (the response replayed whole);
- `fsdp2`: veRL's stock engine.
Per engine and op it reports `compute_log_prob` (entropy on) and `update_actor` (forward_backward_batch +
optimizer_step) seconds and peak RSS delta (`bench_engine.measure`: peak RSS during the call minus RSS before it,
glibc mmap threshold 64 KiB; ``measure_trimmed`` returns free heap pages first), and tokens forwarded: longstraw's
`longstraw/tokens_forwarded` metric (captures, replays, recomputes); fsdp2's rows' tokens (the sum of the rows'
lengths, one forward each; its gradient checkpointing re-runs the layers in the backward, not counted).
``--repeats k`` runs each longstraw call k times and reports the fastest (fsdp2, 10-25x slower, runs once).

``--scale s`` multiplies every length (prompts, responses, history growth, `min_shared_tokens`,
`response_chunk_size`) by s, for a run that fits a small CPU; the targets (``TARGETS``) are checked at that scale.

    python benchmarks/bench_tree.py --scale 0.25 --repeats 3         # both models, shapes a b c -> tree.json/md
    python benchmarks/bench_tree.py --models qwen3 --shapes c --scale 0.5 --out /tmp/tree
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from bench_engine import (
    MODELS,
    ROOT,
    _code_lines,
    _scalar,
    code_version,
    log_prob,
    measure,
    restart_in_measurement_env,
    update_actor,
)

from verl_longstraw import capture_prompt, group_backward, group_log_probs
from verl_longstraw.integration.engine import LongStrawEngine
from verl_longstraw.integration.losses import TwoPass
from verl_longstraw.integration.regroup import WalkRows, grpo_groups, prompt_lengths, sample_temperatures
from verl_longstraw.machine import describe, machine
from verl_longstraw.parallel import comm
from verl_longstraw.plan import Plan, star_plan
from verl_longstraw.testing import verl_harness as testing
from verl_longstraw.tiny import VOCAB

if __name__ == "__main__":
    restart_in_measurement_env()  # bench_engine's measurement environment

FAMILIES = {
    "qwen3": MODELS["qwen3"],
    "qwen3_5": dict(  # 4 layers: Gated DeltaNet, attention, Gated DeltaNet, attention; dense MLPs
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    ),
}
SHAPES = ("a", "b", "c")
OPS = ("compute_log_prob", "update_actor")
STAR, TREE, UNSEGMENTED, FSDP2 = "star", "tree", "tree_unsegmented", "fsdp2"
PHASES = ("capture_seconds", "replay_seconds", "prompt_backward_seconds")  # longstraw's per-step seconds
STATE = ("prompt_state_bytes", "state_grad_device_bytes")  # longstraw's largest path state and its gradient sums
# issue 19's targets: (shape, op, what, engine compared with, bound); what: "tokens" (the other's tokens / tree's),
# "speedup" (the other's seconds / tree's), "memory" (tree's peak RSS delta / the other's)
TARGETS = (
    ("a", "update_actor", "tokens", STAR, 2.5),
    ("a", "compute_log_prob", "tokens", STAR, 2.5),
    ("a", "update_actor", "speedup", STAR, 2.0),
    ("b", "update_actor", "speedup", STAR, 3.0),
    ("c", "update_actor", "memory", UNSEGMENTED, 0.25),
)
WARMUP = dict(prompt=64, group=2, response=8)
LIBC = ctypes.CDLL(None)  # this process's C library (glibc: malloc_trim)


@dataclass(frozen=True)
class Lengths:
    """Issue 19's sizes in tokens at scale 1 (``scaled`` multiplies them); counts are not scaled."""

    system: int = 4096  # a: system prompt shared by every group
    group_prompt: int = 512  # a: each group's own prompt after it
    groups: int = 8  # a
    group_size: int = 8  # a: responses per group
    response: int = 128  # a, b: T
    growth: int = 2048  # b: history growth per turn (the turn's response and what follows it)
    turns: int = 4  # b
    trajectories: int = 4  # b
    long_prompt: int = 512  # c
    long_response: int = 32768  # c
    min_shared_tokens: int = 64  # the tree engine's knob (its default)
    response_chunk_size: int = 2048  # c: the tree engine's knob

    def scaled(self, scale: float) -> Lengths:
        counts = ("groups", "group_size", "turns", "trajectories")
        return Lengths(**{k: v if k in counts else max(1, round(v * scale)) for k, v in asdict(self).items()})


def samples(shape: str, n: Lengths, gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """(prompts [P_i], responses [T_i], uids) of one batch of ``shape`` (module docstring), token ids drawn
    from ``gen``."""

    def tokens(count: int) -> torch.Tensor:
        return torch.randint(1, VOCAB, (count,), generator=gen)

    prompts, responses, uids = [], [], []
    if shape == "a":
        system = tokens(n.system)
        for k in range(n.groups):
            prompt = torch.cat([system, tokens(n.group_prompt)])
            for _ in range(n.group_size):
                prompts.append(prompt)
                responses.append(tokens(n.response))
                uids.append(f"group-{k}")
    elif shape == "b":
        if n.growth <= n.response:
            raise ValueError(f"shape b: history growth {n.growth} must exceed the response length {n.response}")
        first = tokens(n.growth - n.response)
        for _ in range(n.trajectories):
            history = first
            for turn in range(n.turns):
                response = tokens(n.response)
                prompts.append(history)
                responses.append(response)
                uids.append("task")
                if turn + 1 < n.turns:
                    history = torch.cat([history, response, tokens(n.growth - n.response)])
    elif shape == "c":
        prompts, responses, uids = [tokens(n.long_prompt)], [tokens(n.long_response)], ["long"]
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {SHAPES}")
    return prompts, responses, uids


def engine_knobs(n: Lengths) -> dict[str, dict | None]:
    """The engines built per model: name -> longstraw knobs (None: fsdp2). ``star`` keeps the default knobs and
    becomes a ``StarEngine``; ``tree_chunked`` is shape c's ``tree``."""
    tree = dict(min_shared_tokens=n.min_shared_tokens)
    return {FSDP2: None, STAR: {}, TREE: tree, "tree_chunked": dict(tree, response_chunk_size=n.response_chunk_size)}


def shape_engines(shape: str, fsdp2: bool = True) -> dict[str, str]:
    """The engines measured on ``shape``: reported name -> built engine (``engine_knobs``); without ``fsdp2``
    the longstraw engines only."""
    engines = {FSDP2: FSDP2} if fsdp2 else {}
    if shape == "c":
        return {**engines, STAR: STAR, TREE: "tree_chunked", UNSEGMENTED: TREE}
    return {**engines, STAR: STAR, TREE: TREE}


@dataclass
class Fragment:
    """Samples of one micro-batch that share a prompt: one GRPO group (``grpo_groups``), the star path's unit.

    prompt_ids: [P] prompt tokens (no padding); rows: walk rows of the samples (``WalkRows``);
    responses: [T_i] response tokens per row; temperature: the rows' common sampling temperature.
    """

    prompt_ids: torch.Tensor
    rows: list[int]
    responses: list[torch.Tensor]
    temperature: float


def fragments(walk: WalkRows) -> list[Fragment]:
    """The GRPO groups of each micro-batch of ``walk`` (``grpo_groups``) as fragments, in micro-batch order."""
    out = []
    for m, data in enumerate(walk.micro_batches):
        values, offsets = data["input_ids"].values(), data["input_ids"].offsets().tolist()
        prompts, temperatures = prompt_lengths(data).tolist(), sample_temperatures(data, len(data))
        for rows in grpo_groups(data):
            start, p = offsets[rows[0]], int(prompts[rows[0]])
            out.append(Fragment(values[start : start + p], [walk.first[m] + row for row in rows],
                                [values[offsets[row] + p : offsets[row + 1]] for row in rows], temperatures[rows[0]]))
    return out


class StarEngine(LongStrawEngine):
    """The longstraw engine on the star path, the path before prefix trees: every micro-batch's GRPO groups (by
    uid and prompt, ``fragments``), each run by ``group_log_probs`` / ``group_backward``. A two-pass step captures
    each group's prompt once: its log-prob pass keeps the state (``capture_prompt``) and the backward reuses it,
    so the states of the call's groups are alive together between the two passes. Its ``tokens_forwarded`` is the
    engine's ``star_tokens_forwarded`` (tests/test_bench_agent.py)."""

    def _walk(self, walk, units, loss_function, strategy, stats, walk_metrics):
        self._keep_states = isinstance(strategy, TwoPass)
        self._states: dict[int, Any] = {}
        try:
            return super()._walk(walk, units, loss_function, strategy, stats, walk_metrics)
        finally:
            self._states = {}

    def _walk_units(self, walk) -> list[Callable[[], list[Fragment]]]:
        return [lambda: fragments(walk)]

    def _unit_plan(self, unit: Fragment) -> Plan:
        """This rank's plan of one GRPO group run as a star (``plan.star_plan``) with the engine's knobs."""
        return star_plan(len(unit.prompt_ids), [len(r) for r in unit.responses], self.longstraw.knobs,
                         self.cp_size, comm.group_rank(self.get_context_parallel_group()))

    def _unit_log_probs(self, unit: Fragment, with_entropy: bool, stats):
        knobs, group = self.longstraw.knobs, self.get_context_parallel_group()
        state = None
        if self._keep_states:
            state = capture_prompt(self.module, unit.prompt_ids, for_backward=knobs.prompt_grad == "exact",
                                   stats=stats, cp_group=group, knobs=knobs)
            self._states[id(unit)] = state
        return group_log_probs(self.module, unit.prompt_ids, unit.responses, temperature=unit.temperature,
                               return_entropy=with_entropy, stats=stats, state=state, cp_group=group, knobs=knobs)

    def _unit_backward(self, unit: Fragment, loss_fn, with_entropy: bool, stats):
        with self._autocast():
            return group_backward(
                self.module, unit.prompt_ids, unit.responses, loss_fn, temperature=unit.temperature,
                with_entropy=with_entropy, stats=stats, state=self._states.pop(id(unit), None),
                cp_group=self.get_context_parallel_group(), knobs=self.longstraw.knobs,
            )


def build(name: str, path: str, knobs: dict | None, rows: int):
    """(engine, actor config) ``name`` of ``engine_knobs`` for the saved model at ``path``, micro-batches of up to
    ``rows`` rows, warmed up on a tiny batch."""
    if knobs is None:
        config = testing.actor_config("fsdp2", "token-mean", False, 0.0, rows)
    else:
        config = testing.actor_config("longstraw", "token-mean", False, 0.0, rows, **knobs)
    engine = testing.make_engine(config.strategy, path, config, rows, lr=1e-6)
    if name == STAR:
        engine.__class__ = StarEngine  # the same built engine (model, optimizer), walking stars
    td = testing.make_batch(1, WARMUP["group"], prompt_len=(WARMUP["prompt"], WARMUP["prompt"] + 1),
                            response_len=(WARMUP["response"], WARMUP["response"] + 1))
    log_prob(engine, td.clone(), WARMUP["group"])
    update_actor(engine, td.clone(), config, WARMUP["group"])
    return engine, config


def measure_trimmed(fn: Callable[[], Any]) -> tuple[Any, float, float, float]:
    """(fn(), seconds, CPU seconds of this process's threads, peak RSS delta in MiB): ``bench_engine.measure`` after
    handing every free heap page back to the kernel (glibc ``malloc_trim``): the free chunks an earlier, larger
    call leaves in malloc's arenas are resident, and allocations they serve (even above the mmap threshold: bins
    are searched before mmap) would not show in the next call's RSS delta. CPU seconds (``time.process_time``,
    idle OpenMP threads sleep) count the work done, less disturbed than wall seconds by other processes on the
    cores; they include ``measure``'s garbage collection before the clock starts."""
    gc.collect()
    LIBC.malloc_trim(0)
    cpu = time.process_time()
    result, seconds, rss = measure(fn)
    return result, seconds, time.process_time() - cpu, rss


def case_rows(engines: dict, shape: str, n: Lengths, seed: int, repeats: int, fsdp2: bool = True) -> list[dict]:
    """Every engine's measurements (``engines``: built name -> (engine, config)) of one batch of ``shape``, both
    ops, the batch identical for all. A longstraw engine's call runs ``repeats`` times: its fastest run's seconds
    and metrics, the fewest CPU seconds, the largest peak RSS delta, every run's (``seconds_runs``,
    ``cpu_seconds_runs``); fsdp2's once."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, uids = samples(shape, n, gen)
    td = testing.samples_batch(prompts, responses, uids, gen)
    rows_tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    out = []
    for name, built in shape_engines(shape, fsdp2).items():
        engine, config = engines[built]
        for op in OPS:
            load = [round(x, 1) for x in os.getloadavg()]
            runs = []
            for _ in range(1 if name == FSDP2 else repeats):
                call = (partial(log_prob, engine, td.clone(), len(prompts)) if op == "compute_log_prob" else
                        partial(update_actor, engine, td.clone(), config, len(prompts)))
                runs.append(measure_trimmed(call))
            metrics, seconds, _, _ = min(runs, key=lambda run: run[1])
            row = dict(shape=shape, engine=name, op=op, rows=len(prompts), seconds=seconds,
                       seconds_runs=[run[1] for run in runs], cpu_seconds=min(run[2] for run in runs),
                       cpu_seconds_runs=[run[2] for run in runs], peak_rss_delta_mib=max(run[3] for run in runs),
                       load_average=load)
            if name == FSDP2:
                row["tokens_forwarded"] = rows_tokens
            else:
                row["tokens_forwarded"] = _scalar(metrics["longstraw/tokens_forwarded"])
                row["tree_segments"] = _scalar(metrics["longstraw/tree_segments"])
                row.update({key: _scalar(metrics[f"longstraw/{key}"]) for key in PHASES + STATE})
            out.append(row)
    return out


def ratios(rows: list[dict]) -> list[dict]:
    """Per (model, shape, op) the tree engine against each other engine: tokens (theirs / tree's), speed-up
    (their seconds / tree's; ``cpu_speedup`` of CPU seconds), memory (tree's peak RSS delta / theirs)."""
    by_key = {(r["model"], r["shape"], r["op"], r["engine"]): r for r in rows}
    out = []
    for (model, shape, op, engine), other in by_key.items():
        tree = by_key.get((model, shape, op, TREE))
        if engine == TREE or tree is None:
            continue
        out.append(dict(model=model, shape=shape, op=op, against=engine,
                        tokens=other["tokens_forwarded"] / tree["tokens_forwarded"],
                        speedup=other["seconds"] / tree["seconds"],
                        cpu_speedup=other["cpu_seconds"] / tree["cpu_seconds"],
                        memory=tree["peak_rss_delta_mib"] / max(other["peak_rss_delta_mib"], 1e-9)))
    return out


def targets(ratio_rows: list[dict]) -> list[dict]:
    """``TARGETS`` checked per model on the measured ratios (only those measured)."""
    by_key = {(q["model"], q["shape"], q["op"], q["against"]): q for q in ratio_rows}
    out = []
    for model in dict.fromkeys(q["model"] for q in ratio_rows):
        for shape, op, what, against, bound in TARGETS:
            q = by_key.get((model, shape, op, against))
            if q is None:
                continue
            value = q[what]
            met = value <= bound if what == "memory" else value >= bound
            out.append(dict(model=model, shape=shape, op=op, what=what, against=against, bound=bound, value=value,
                            met=met, cpu_value=q["cpu_speedup"] if what == "speedup" else None))
    return out


def uptime() -> str:
    """`uptime`'s line (load averages), '' when it cannot run."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_lines(result: dict) -> list[str]:
    """A report's lines on the run: its command, machine, load at its start and end, and the code measured."""
    return [
        f"Command: `{result['command']}`  ",
        f"Machine at the start: {describe(result['machine'])}; torch threads {result['torch_threads']}  ",
        f"`uptime` at the start: {result['uptime_start']}  ",
        f"`uptime` at the end: {result.get('uptime_end', '-')}  ",
        *_code_lines(result),
    ]


def markdown(result: dict) -> str:
    n = Lengths(**result["lengths"])
    lines = [
        "# Prefix trees vs the star path vs fsdp2 (veRL 0.9.1 engines, CPU, fp32, one process)",
        "",
        *run_lines(result),
        f"Runtime: {result.get('runtime_s', 0):.0f} s. Scale {result['scale']} (every length x {result['scale']}; "
        "issue 19's sizes at scale 1).",
        "",
        f"Shapes at this scale: a) {n.groups} groups x {n.group_size} responses, system prompt {n.system} + group "
        f"prompt {n.group_prompt} tokens, T={n.response}; b) {n.trajectories} trajectories x {n.turns} turns, "
        f"history +{n.growth} tokens per turn, T={n.response}, first prompt shared; c) one row, prompt "
        f"{n.long_prompt}, response {n.long_response}. Engines: `tree` (min_shared_tokens {n.min_shared_tokens}; "
        f"shape c also response_chunk_size {n.response_chunk_size}), `star` (the same engine, units = GRPO groups by "
        "uid), `tree_unsegmented` (c: response_chunk_size None), `fsdp2` (stock). One micro-batch of every row, "
        "gradient checkpointing on, ppo_loss token-mean (longstraw: one replay per response).",
        "",
        "Memory = peak RSS during the call minus RSS before it (MiB, glibc mmap threshold 64 KiB, free heap pages "
        "returned by malloc_trim before each call). Tokens forwarded: longstraw's `longstraw/tokens_forwarded` "
        "(captures + replays + recomputes); fsdp2: the rows' tokens. State / state grad: longstraw's "
        "`prompt_state_bytes` (the largest path state held) and `state_grad_device_bytes` (its float32 gradient "
        "sums, exact mode). "
        f"Seconds: the fastest of {result['repeats']} run(s) of each longstraw call (all in the JSON, "
        "`seconds_runs`), fsdp2 run once; MiB: the largest. A shared 2-core machine: timings are noisy (the load "
        "average before each call is in its row).",
        "",
        "| model | shape | op | engine | rows | s | CPU s | MiB | tokens forwarded | segments | capture s | replay s "
        "| prompt backward s | state MiB | state grad MiB | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        phases = " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in PHASES)
        state = " | ".join(f"{r[k] / 2**20:.1f}" if k in r else "-" for k in STATE)
        segments = f"{r['tree_segments']:.0f}" if "tree_segments" in r else "-"
        lines.append(
            f"| {r['model']} | {r['shape']} | {r['op']} | {r['engine']} | {r['rows']} | {r['seconds']:.2f} | "
            f"{r['cpu_seconds']:.2f} | {r['peak_rss_delta_mib']:.0f} | {r['tokens_forwarded']:.0f} | {segments} | "
            f"{phases} | {state} | {r['load_average'][0]} |"
        )
    lines += [
        "",
        "`tree` against each other engine: tokens = theirs / tree's, speed-up = their seconds / tree's (CPU: of CPU "
        "seconds), memory = tree's MiB / theirs:",
        "",
        "| model | shape | op | against | tokens | speed-up | CPU speed-up | memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for q in result["ratios"]:
        lines.append(f"| {q['model']} | {q['shape']} | {q['op']} | {q['against']} | {q['tokens']:.2f} | "
                     f"{q['speedup']:.2f} | {q['cpu_speedup']:.2f} | {q['memory']:.3f} |")
    lines += ["", "Targets (issue 19), at this scale (speed-ups on wall seconds; the CPU-seconds ratio beside them):",
              "", "| model | shape | op | target | measured | met | CPU speed-up |", "|---|---|---|---|---|---|---|"]
    for t in result["targets"]:
        relation = "<=" if t["what"] == "memory" else ">="
        lines.append(f"| {t['model']} | {t['shape']} | {t['op']} | {t['what']} vs {t['against']} {relation} "
                     f"{t['bound']} | {t['value']:.3f} | {'yes' if t['met'] else 'NO'} | "
                     f"{'-' if t['cpu_value'] is None else format(t['cpu_value'], '.3f')} |")
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree.json").write_text(json.dumps(result, indent=1))
    (out / "tree.md").write_text(markdown(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of every length (module docstring)")
    for name in ("groups", "group_size", "trajectories", "response_chunk_size"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(Lengths, name))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each longstraw call (the fastest is "
                        "reported); fsdp2, 10-25x slower, runs once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fsdp2", action="store_true", help="leave veRL's stock engine out (the targets compare "
                        "with the star path; at scale 1 fsdp2 alone takes an hour or more on 2 cores)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if not 0 < args.scale <= 1:
        parser.error(f"--scale {args.scale} must be in (0, 1]")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be at least 1")
    n = Lengths(groups=args.groups, group_size=args.group_size, trajectories=args.trajectories,
                response_chunk_size=args.response_chunk_size).scaled(args.scale)
    command = " ".join(["python", "benchmarks/bench_tree.py", *map(shlex.quote, sys.argv[1:])])
    longest = max(n.system + n.group_prompt + n.response, n.growth * n.turns, n.long_prompt + n.long_response)
    result = dict(command=command, machine=machine(), torch_threads=torch.get_num_threads(), uptime_start=uptime(),
                  scale=args.scale, repeats=args.repeats, lengths=asdict(n), models=args.models, shapes=args.shapes,
                  code_start=code_version(), rows=[], ratios=[], targets=[])
    testing.init_dist()
    t0 = time.perf_counter()
    rows = max(len(samples(shape, n, torch.Generator())[0]) for shape in args.shapes)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.models:
            config = dict(FAMILIES[family], max_position_embeddings=longest)
            path = testing.save_tiny_model(family, f"{tmp}/{family}", **config)
            needed = {built for shape in args.shapes for built in shape_engines(shape, not args.no_fsdp2).values()}
            engines = {name: build(name, path, knobs, rows) for name, knobs in engine_knobs(n).items()
                       if name in needed}
            for shape in args.shapes:
                case = [dict(model=family, **r)
                        for r in case_rows(engines, shape, n, args.seed, args.repeats, not args.no_fsdp2)]
                for r in case:
                    print(json.dumps(r), flush=True)
                result["rows"] += case
                result["ratios"] = ratios(result["rows"])
                result.update(targets=targets(result["ratios"]), runtime_s=time.perf_counter() - t0,
                              uptime_end=uptime(), code_end=code_version())
                write(result, Path(args.out))
            del engines
    print(markdown(result))


if __name__ == "__main__":
    main()
