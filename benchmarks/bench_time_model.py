"""The time model (``verl_longstraw.timemodel``) checked on this CPU: its rates fitted to two ``profile`` settings,
then each phase of other settings predicted and measured.

A float32 Gated DeltaNet + attention hybrid (tiny qwen3_5 at hidden 256, 4 layers: both the attention and the scan
classes run), one process on one thread (``--threads``: a thread per core spins against whatever else the box runs,
which makes phases several times slower at random). A star setting runs ``profile.longstraw_step`` (capture the
prompt, then ``group_backward``), a tree setting ``tree_backward`` on two groups of responses after a shared system
prompt; each its warm-up and ``--repeats`` timed runs, the fastest kept. Per setting the phases' seconds
(``GroupStats``) beside the model's (``timemodel.phase_work`` of the same plan at the fitted rates), and the error
of the step (the phases' sum). Errors are the model's against this run, on this CPU only.

    python benchmarks/bench_time_model.py --out benchmarks/results/time_model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from verl_longstraw import GroupStats, Knobs, tree_backward
from verl_longstraw.plan import star_plan, tree_plan
from verl_longstraw.profile import longstraw_step, measure
from verl_longstraw.testing.compare import make_group, weighted_loss
from verl_longstraw.timemodel import PHASES, WORK, calibrate, phase_work, seconds
from verl_longstraw.tiny import tiny_model

MODEL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
             max_position_embeddings=16384)
ISA_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")  # an emulated older CPU
STATS_SECONDS = {"capture": "capture_s", "replay": "replay_s", "recompute": "prompt_backward_s"}


@dataclass(frozen=True)
class Setting:
    """One step: a prompt of P tokens (a tree: a shared system prompt of P, then two groups' questions of ``question``
    tokens each), G responses of T (a tree: G per group), the prompt ``chunk`` (None: whole), ``mode``."""

    name: str
    P: int
    G: int
    T: int
    chunk: int | None
    mode: str
    tree: bool = False
    question: int = 512


CALIBRATION = (Setting("calibration A", 2048, 4, 128, 512, "exact"),
               Setting("calibration B", 8192, 2, 256, 2048, "exact"))
PREDICTED = (Setting("P 4096, chunk 1024", 4096, 4, 128, 1024, "exact"),
             Setting("G 8, chunk 512", 4096, 8, 128, 512, "exact"),
             Setting("P 8192, chunk 4096, detached", 8192, 4, 128, 4096, "detached"),
             Setting("G 8, T 256, chunk 512, detached", 2048, 8, 256, 512, "detached"),
             Setting("P 6144, G 2", 6144, 2, 128, 2048, "exact"),
             Setting("P 12288, chunk 4096", 12288, 2, 128, 4096, "exact"),
             Setting("tree exact", 2048, 3, 128, 1024, "exact", tree=True),
             Setting("tree detached", 4096, 3, 128, 1024, "detached", tree=True))


def _tree_rows(setting: Setting, vocab: int) -> tuple[list[torch.Tensor], list[int]]:
    """Two groups of ``G`` responses after one system prompt of ``P`` and a question of their own."""
    system, rest = make_group(vocab, setting.P, [setting.question] * 2 + [setting.T] * 2 * setting.G, seed=1)
    questions, responses = rest[:2], rest[2:]
    rows = [torch.cat([system, questions[i // setting.G], r]) for i, r in enumerate(responses)]
    return rows, [setting.P + setting.question] * len(rows)


def run(setting: Setting, model, repeats: int) -> dict:
    """The setting's fastest step: its phases' measured seconds and its plan's work."""
    config = model.config
    knobs = Knobs(chunk_size=setting.chunk, prompt_grad=setting.mode)
    if setting.tree:
        rows, starts = _tree_rows(setting, config.vocab_size)
        plan = tree_plan(rows, starts, knobs)

        def step():
            model.zero_grad(set_to_none=False)
            stats = GroupStats()
            tree_backward(model, rows, starts, weighted_loss, stats=stats, knobs=knobs, plan=plan)
            return stats, stats.capture_s + stats.replay_s + stats.prompt_backward_s
    else:
        prompt, responses = make_group(config.vocab_size, setting.P, [setting.T] * setting.G)
        plan = star_plan(setting.P, [setting.T] * setting.G, knobs)

        def step():
            return longstraw_step(model, prompt, responses, setting.mode, setting.chunk, knobs.replay_tokens)
    stats, _, _ = measure(step, torch.device("cpu"), repeats)
    captured = sum(plan.segments[i].length for i in plan.captured)
    assert stats.tokens_captured == captured, (setting, stats.tokens_captured, captured)  # the walk ran the plan
    work = phase_work(config, plan, setting.mode, torch.float32, state_grad_on_host=False)
    return {"setting": asdict(setting), "measured": {p: getattr(stats, STATS_SECONDS[p]) for p in PHASES},
            "work": work}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", default="cpu_validation", help="stem of the .md and .json written to --out")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model = tiny_model("qwen3_5", torch.float32, **MODEL)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    runs = {s.name: run(s, model, args.repeats) for s in (*CALIBRATION, *PREDICTED)}
    fitted = [(r["work"][p], r["measured"][p]) for s in CALIBRATION for r in [runs[s.name]] for p in PHASES
              if r["measured"][p] > 0]
    rates = calibrate([w for w, _ in fitted], [t for _, t in fitted])
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")),
                      platform.processor())
    emulated = " ".join(f"{k}={os.environ[k]}" for k in ISA_VARIABLES if k in os.environ)
    lines = [f"# The time model on a CPU: {model_name}, torch {torch.__version__}", "",
             f"`{emulated + ' ' if emulated else ''}python benchmarks/bench_time_model.py --repeats {args.repeats} "
             f"--out {args.out} --name {args.name}`; tiny qwen3_5 "
             f"{MODEL}, float32, {args.threads} thread(s). Rates fitted on {', '.join(s.name for s in CALIBRATION)}:",
             "", "| class | fitted rate |", "|---|---:|"]
    units = {"collective": "B/s", "host_copy": "B/s", "state_stream": "B/s", "layer_calls": "calls/s"}
    lines += [f"| {name} | {rates[name]:.4g} {units.get(name, 'FLOP/s')} |" for name in WORK
              if rates[name] != float("inf")]
    lines += ["", "| setting | " + " | ".join(f"{p} s measured / model" for p in PHASES) +
              " | step s measured | model | error |", "|---|" + "---:|" * (len(PHASES) + 3)]
    errors = {}
    for name, r in runs.items():
        predicted = {p: seconds(r["work"][p], rates) for p in PHASES}
        measured, model_s = sum(r["measured"].values()), sum(predicted.values())
        errors[name] = model_s / measured - 1
        lines.append(f"| {name} | " + " | ".join(f"{r['measured'][p]:.3f} / {predicted[p]:.3f}" for p in PHASES)
                     + f" | {measured:.3f} | {model_s:.3f} | {errors[name]:+.1%} |")
    held_out = [abs(errors[s.name]) for s in PREDICTED]
    lines += ["", f"Held-out settings: {len(held_out)}, largest error {max(held_out):.1%}, "
              f"{sum(e <= 0.25 for e in held_out)} within 25%."]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text + "\n")
    (args.out / f"{args.name}.json").write_text(json.dumps({"cpu": model_name, "rates": rates, "runs": runs},
                                                             indent=1, default=str))
    sys.exit(0 if max(held_out) <= 0.25 else 1)


if __name__ == "__main__":
    main()
