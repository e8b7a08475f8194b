"""Profile one GRPO training step per setting: seconds per phase and peak memory, beside the pre-flight estimate.

Each setting (group size G x prompt chunk size x replay budget ``replay_tokens`` x ``prompt_grad`` mode) runs one step
of the core API on the local device, on a random group (``testing.compare.make_group``: a prompt of P tokens, G
responses of T tokens) with ``testing.compare.weighted_loss``: ``capture_prompt`` once, then ``group_backward`` on its
state. Per setting it records the wall seconds of the step and of its phases (``GroupStats``: capture, replay, prompt
backward), the peak bytes the step allocates above what was live before it (model weights and their pre-allocated .grad
excluded; CUDA: ``torch.cuda.max_memory_allocated``, CPU: ``memory.AllocationMeter``, every storage the ops allocate)
and ``estimate.estimate_memory(...).total_bytes`` of the same knobs. Each setting runs a warm-up (on CPU the metered
run, as the meter slows ops), then ``--repeats`` timed runs of which the fastest is kept (wall seconds: on a shared
machine repeat, or pin threads with OMP_NUM_THREADS). ``--standard`` adds per G the standard path for reference: one
forward and backward of the G full sequences in one batch (``benchmarks/bench_core.py``'s, so a source checkout).

Writes ``{out}/{name}.csv`` (a row per setting; ``pareto`` marks the rows that no other row of the same work, the same G
and gradient (exact and standard: the same; detached: another), beats in both step seconds and peak bytes) and
``{out}/{name}.png`` (step seconds against peak memory, points labelled by their knobs, the Pareto fronts drawn).

    python -m verl_longstraw.profile --model tiny:qwen3 --override hidden_size=256 num_hidden_layers=4 \\
        'layer_types=["full_attention","full_attention","full_attention","full_attention"]' \\
        --prompt-len 2048 --response-len 128 --group-sizes 2 4 8 --chunk-sizes none 512 \\
        --replay-tokens 128 8192 --prompt-grad exact detached --standard --repeats 3 --out profile_out
    python -m verl_longstraw.profile --model /models/Qwen3-8B --prompt-len 32768 --response-len 1024 \\
        --group-sizes 8 --chunk-sizes 4096 8192 --prompt-grad exact --out profile_qwen3_8b   # on a GPU, bf16

``--override`` sets config fields as given (values as JSON): a tiny config keeps its ``layer_types``, so a new
``num_hidden_layers`` needs a matching ``layer_types``. Context parallel runs one process per rank; this command is
one process, so its only CP size is 1 (profile CP with ``benchmarks/bench_cp.py`` under torchrun).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from functools import partial
from itertools import cycle, product
from pathlib import Path

import torch
import transformers
from tqdm import tqdm  # a transformers dependency

from verl_longstraw import GroupStats, Knobs, capture_prompt, group_backward
from verl_longstraw.adapters.base import TINY_COMMON
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.knobs import REPLAY_TOKENS
from verl_longstraw.memory import AllocationMeter
from verl_longstraw.testing.compare import make_group, weighted_loss
from verl_longstraw.testing.scripts import load_script
from verl_longstraw.timing import Stopwatch
from verl_longstraw.tiny import tiny_model

TINY_PREFIX = "tiny:"
BENCH_CORE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_core.py"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIB = 2**20
PHASES = ("capture_s", "replay_s", "prompt_backward_s")  # GroupStats' seconds per phase


def load_model(name: str, overrides: dict, dtype: torch.dtype, device: torch.device, min_positions: int):
    """``tiny:<family>`` (``tiny.tiny_model``) or a Hugging Face model path, with config ``overrides``, in train mode
    on ``device``; tiny models get at least ``min_positions`` positions (tokens)."""
    if name.startswith(TINY_PREFIX):
        positions = max(TINY_COMMON["max_position_embeddings"], min_positions)
        model = tiny_model(name.removeprefix(TINY_PREFIX), dtype, **{"max_position_embeddings": positions, **overrides})
    else:
        config = transformers.AutoConfig.from_pretrained(name, **overrides)
        model = transformers.AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype).train()
    return model.to(device)


def measure(step: Callable[[], tuple[GroupStats | None, float]], device: torch.device, repeats: int = 1):
    """Run ``step`` once to warm up, then ``repeats`` timed runs: (the fastest run's stats and seconds, peak bytes
    allocated above what was live before a run). CUDA: the timed runs' ``max_memory_allocated``; CPU: the
    warm-up's ``AllocationMeter`` peak (the meter slows ops, so it stays off the timed runs)."""
    if device.type == "cuda":
        step()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        stats, seconds = min((step() for _ in range(repeats)), key=lambda run: run[1])
        return stats, seconds, torch.cuda.max_memory_allocated(device) - before
    with AllocationMeter() as meter:
        step()
    stats, seconds = min((step() for _ in range(repeats)), key=lambda run: run[1])
    return stats, seconds, meter.peak


def longstraw_step(model, prompt, responses, prompt_grad: str, chunk_size: int | None, replay_tokens: int):
    """One training step: capture the prompt, then ``group_backward`` on its state; (stats, wall seconds)."""
    model.zero_grad(set_to_none=False)
    stats = GroupStats()
    watch = Stopwatch(prompt.device)
    knobs = Knobs(prompt_grad=prompt_grad, chunk_size=chunk_size, replay_tokens=replay_tokens)
    state = capture_prompt(model, prompt, for_backward=prompt_grad == "exact", stats=stats, knobs=knobs)
    group_backward(model, prompt, responses, weighted_loss, stats=stats, state=state, knobs=knobs)
    return stats, watch.seconds()


def standard_step(model, prompt, responses, standard_backward: Callable):
    """One step of the standard path ``standard_backward(model, prompt, responses)``; (None, wall seconds)."""
    model.zero_grad(set_to_none=False)
    watch = Stopwatch(prompt.device)
    standard_backward(model, prompt, responses)
    return None, watch.seconds()


def same_work(row: dict) -> tuple[int, str]:
    """What a row computes: its G and its gradient ("exact" for the standard path: the same gradient)."""
    return row["G"], row["prompt_grad"] or "exact"


def pareto_front(rows: Sequence[dict]) -> list[bool]:
    """Per row, whether no other row of the same work (``same_work``: G and gradient) has both ``step_s`` and
    ``peak_bytes`` at most its own, one of them less."""
    def dominates(a: dict, b: dict) -> bool:
        return (same_work(a) == same_work(b) and a["step_s"] <= b["step_s"] and a["peak_bytes"] <= b["peak_bytes"]
                and (a["step_s"], a["peak_bytes"]) != (b["step_s"], b["peak_bytes"]))
    return [not any(dominates(other, row) for other in rows) for row in rows]


def label(row: dict) -> str:
    """A point's knobs, short: G, and chunk size, replay budget and prompt_grad mode (or "standard")."""
    if row["path"] == "standard":
        return f"G{row['G']} standard"
    return f"G{row['G']} c{row['chunk_size']} r{row['replay_tokens']} {row['prompt_grad']}"


def plot(rows: Sequence[dict], title: str, path: Path) -> None:
    """Step seconds against peak MiB: a labelled point per row (colour: G; marker: prompt_grad or standard) and the
    Pareto front of each G and gradient as a line (solid: exact, dashed: detached)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5))
    markers = {"exact": "o", "detached": "^", "": "s"}  # prompt_grad; "" is the standard path
    for colour, G in zip(cycle(plt.rcParams["axes.prop_cycle"].by_key()["color"]), sorted({r["G"] for r in rows}),
                         strict=False):
        for mode, marker in markers.items():
            points = [r for r in rows if r["G"] == G and r["prompt_grad"] == mode]
            ax.scatter([r["peak_bytes"] / MIB for r in points], [r["step_s"] for r in points], color=colour,
                       marker=marker, label=f"G={G} {mode or 'standard'}" if points else None)
        for gradient, style in (("exact", "-"), ("detached", "--")):
            front = sorted((r["peak_bytes"] / MIB, r["step_s"]) for r in rows
                           if same_work(r) == (G, gradient) and r["pareto"])
            ax.step([m for m, _ in front], [s for _, s in front], style, where="post", color=colour, alpha=0.6)
    for r in rows:
        ax.annotate(label(r), (r["peak_bytes"] / MIB, r["step_s"]), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak memory of the step (MiB)")
    ax.set_ylabel("step time (s); lines: Pareto front per G and gradient")
    ax.set_title(textwrap.fill(title, 110), fontsize=8)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_override(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` -> (key, value as JSON, else the string)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--override wants KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_chunk(text: str) -> int | None:
    return None if text == "none" else int(text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m verl_longstraw.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="tiny:<family> (verl_longstraw.tiny) or a model path")
    parser.add_argument("--override", nargs="*", type=parse_override, default=[], metavar="KEY=VALUE",
                        help="config fields, e.g. hidden_size=256 num_hidden_layers=4")
    parser.add_argument("--prompt-len", type=int, required=True, help="P, tokens")
    parser.add_argument("--response-len", type=int, required=True, help="T, tokens per response")
    parser.add_argument("--group-sizes", nargs="+", type=int, required=True, help="G values")
    parser.add_argument("--chunk-sizes", nargs="+", type=parse_chunk, default=[None],
                        help="prompt chunk sizes in tokens, 'none' for one chunk")
    parser.add_argument("--replay-tokens", nargs="+", type=int, default=[REPLAY_TOKENS],
                        help="replay budgets, tokens per replay forward")
    parser.add_argument("--prompt-grad", nargs="+", choices=("exact", "detached"), default=["exact"])
    parser.add_argument("--cp-sizes", nargs="+", type=int, choices=(1,), default=[1],
                        help="context-parallel sizes: this command is one process, so 1 only (CP: "
                             "benchmarks/bench_cp.py under torchrun)")
    parser.add_argument("--standard", action="store_true", help="also the standard path per G, for reference")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on CUDA, float32 otherwise")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per setting; the fastest is kept")
    parser.add_argument("--seed", type=int, default=0, help="of the random group")
    parser.add_argument("--out", type=Path, required=True, help="folder of the CSV and PNG")
    parser.add_argument("--name", default="profile", help="stem of the CSV and PNG")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run the sweep, write the CSV and PNG; returns the rows."""
    args = parse_args(argv)
    if args.standard and not BENCH_CORE.exists():
        sys.exit(f"--standard runs {BENCH_CORE}'s standard path: it needs a source checkout")
    standard_backward = load_script(BENCH_CORE).standard_backward if args.standard else None
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    P, T = args.prompt_len, args.response_len
    model = load_model(args.model, dict(args.override), dtype, device, P + T)
    for p in model.parameters():  # pre-allocated, so a step's peak leaves them out on every device
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    config = model.config.get_text_config()
    settings = [("longstraw", *knobs) for knobs in product(args.group_sizes, args.chunk_sizes, args.replay_tokens,
                                                           args.prompt_grad, args.cp_sizes)]
    settings += [("standard", g, None, None, None, 1) for g in args.group_sizes] if args.standard else []
    rows = []
    for path, G, chunk_size, replay_tokens, prompt_grad, cp_size in tqdm(settings, desc="settings", file=sys.stderr):
        prompt, responses = make_group(config.vocab_size, P, [T] * G, args.seed, device)
        row = dict(model=args.model, device=device.type, dtype=dtype_name, P=P, T=T, G=G,
                   path=path, chunk_size=chunk_size or "none", replay_tokens=replay_tokens or "",
                   prompt_grad=prompt_grad or "", cp_size=cp_size)
        if path == "standard":
            stats, seconds, peak = measure(partial(standard_step, model, prompt, responses, standard_backward),
                                           device, args.repeats)
            estimate = None
        else:
            step = partial(longstraw_step, model, prompt, responses, prompt_grad, chunk_size, replay_tokens)
            stats, seconds, peak = measure(step, device, args.repeats)
            estimate = estimate_memory(config, P, G, T, chunk_size, prompt_grad, dtype, cp_size=cp_size,
                                       replay_tokens=replay_tokens, device_type=device.type).total_bytes
        row |= dict(step_s=round(seconds, 6), **{p: round(getattr(stats, p), 6) if stats else "" for p in PHASES},
                    peak_bytes=peak, estimate_bytes=estimate if estimate is not None else "")
        rows.append(row)
        estimated = f"{estimate / MIB:9.1f} MiB" if estimate is not None else "        -    "
        tqdm.write(f"{label(row):32s} step {seconds:8.3f} s  peak {peak / MIB:9.1f} MiB  estimate {estimated}",
                   file=sys.stderr)
    for row, on_front in zip(rows, pareto_front(rows), strict=True):
        row["pareto"] = on_front
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / f"{args.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    overrides = " ".join(f"{key}={value}" for key, value in args.override)
    plot(rows, f"{args.model} {overrides} P={P} T={T} {device.type} {dtype_name}", args.out / f"{args.name}.png")
    print(f"wrote {args.out / args.name}.csv and .png")
    return rows


if __name__ == "__main__":
    main()
