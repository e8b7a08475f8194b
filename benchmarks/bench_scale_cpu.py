"""Peak bytes saved for backward on CPU: standard vs chunked exact, every tiny family, long prompts.

    python benchmarks/bench_scale_cpu.py --prompt-len 16384 --group-size 8

Standard holds the G full-sequence graphs of one micro-batch (losses summed, one backward);
chunked exact replays responses one at a time and recomputes the prompt chunk by chunk.
Writes benchmarks/results/scale_cpu.{json,md} with the ratio standard / chunked exact per family.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from models import FAMILIES, VOCAB, tiny_model  # noqa: E402
from reference import full_log_probs, make_group, weighted_loss  # noqa: E402

from verl_longstraw import group_backward  # noqa: E402
from verl_longstraw.memory import parameter_meter  # noqa: E402


def standard_peak(model, prompt, responses) -> int:
    with parameter_meter(model) as meter:
        total = sum(weighted_loss(i, full_log_probs(model, prompt, r)[0]) for i, r in enumerate(responses))
        total.backward()
    return meter.peak


def exact_peak(model, prompt, responses, chunk_size: int) -> int:
    with parameter_meter(model) as meter:
        group_backward(model, prompt, responses, weighted_loss, chunk_size=chunk_size)
    return meter.peak


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=16384)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    rows = []
    for family in FAMILIES:
        model = tiny_model(family, max_position_embeddings=args.prompt_len + args.response_len)
        prompt, responses = make_group(VOCAB, args.prompt_len, (args.response_len,) * args.group_size)
        start = time.perf_counter()
        exact = exact_peak(model, prompt, responses, args.chunk_size)
        exact_s = time.perf_counter() - start
        start = time.perf_counter()
        standard = standard_peak(model, prompt, responses)
        standard_s = time.perf_counter() - start
        rows.append({"family": family, "P": args.prompt_len, "G": args.group_size, "chunk_size": args.chunk_size,
                     "standard_bytes": standard, "exact_bytes": exact, "ratio": standard / exact,
                     "standard_s": standard_s, "exact_s": exact_s})
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale_cpu.json").write_text(json.dumps(rows, indent=1))
    lines = ["| family | P | G | chunk | standard MB | chunked exact MB | ratio |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['P']} | {r['G']} | {r['chunk_size']} | {r['standard_bytes'] / 1e6:.0f} | "
              f"{r['exact_bytes'] / 1e6:.0f} | {r['ratio']:.1f} |" for r in rows]
    (args.out / "scale_cpu.md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main()
