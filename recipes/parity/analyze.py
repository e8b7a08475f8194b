"""Parity study report: reward curves on one plot and a per-arm table.

    python recipes/parity/analyze.py --runs runs/parity --seeds 1 2 3 --arms fsdp2 exact detached

Reads each run's veRL file-logger metrics (``<runs>/<arm>-seed<seed>/metrics/*.jsonl``) and
writes ``parity.json``, ``parity.md`` and ``parity.png`` under ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys

_summarize = runpy.run_path(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kv_retrieval", "summarize.py")
)
REWARD, load_metrics = _summarize["REWARD"], _summarize["load_metrics"]

GRAD_NORM = "actor/grad_norm"
STEP_TIME = "timing_s/step"
UPDATE_TIME = "timing_s/update_actor"
WINDOW = 5  # steps averaged for "start" and "final" reward


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _spread(xs: list[float]) -> str:
    """'mean ± std' over seeds (std omitted for one seed)."""
    if len(xs) < 2:
        return f"{_mean(xs):.3f}"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def run_summary(steps: dict[int, dict]) -> dict:
    """Per-run numbers: reward start/final (mean of the first/last WINDOW steps), grad norm, times (s)."""
    xs = list(steps)
    col = lambda key: [steps[s][key] for s in xs if key in steps[s]]  # noqa: E731
    rew = col(REWARD)
    return {
        "steps": len(xs),
        "reward": rew,
        "grad_norm": col(GRAD_NORM),
        "reward_start": _mean(rew[:WINDOW]),
        "reward_final": _mean(rew[-WINDOW:]),
        "grad_norm_mean": _mean(col(GRAD_NORM)),
        # the first step includes one-off start-up work (compilation, allocator warm-up)
        "step_s": _mean(col(STEP_TIME)[1:]),
        "update_actor_s": _mean(col(UPDATE_TIME)[1:]),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, help="folder holding <arm>-seed<seed>/ run folders")
    ap.add_argument("--seeds", nargs="+", type=int, required=True)
    ap.add_argument("--arms", nargs="+", default=["fsdp2", "exact", "detached"])
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--command", default="bash recipes/parity/run.sh")
    args = ap.parse_args(argv)

    runs = {}
    for arm in args.arms:
        for seed in args.seeds:
            steps = load_metrics(os.path.join(args.runs, f"{arm}-seed{seed}"))
            if steps:
                runs[(arm, seed)] = run_summary(steps)
            else:
                print(f"[parity] no metrics for {arm} seed {seed}", file=sys.stderr)
    if not runs:
        print(f"[parity] nothing to report under {args.runs}", file=sys.stderr)
        return 1

    rows = []
    for arm in args.arms:
        per = [runs[(arm, s)] for s in args.seeds if (arm, s) in runs]
        if per:
            rows.append({"arm": arm, "seeds": len(per), **{k: [r[k] for r in per] for k in (
                "reward_start", "reward_final", "grad_norm_mean", "step_s", "update_actor_s")}})

    os.makedirs(args.results, exist_ok=True)
    md = ["# Parity study: fsdp2 vs longstraw exact vs longstraw detached", "",
          f"Command: `{args.command}`", "",
          f"Reward = `{REWARD}` (digits of the value right, minus 0.1 per missing or extra token). "
          f"Start/final = mean of the first/last {WINDOW} steps; mean ± std over seeds. Times exclude step 1.", "",
          "| arm | seeds | reward start | reward final | grad norm (mean) | step s | update_actor s |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['arm']} | {r['seeds']} | {_spread(r['reward_start'])} | {_spread(r['reward_final'])} | "
                  f"{_spread(r['grad_norm_mean'])} | {_spread(r['step_s'])} | {_spread(r['update_actor_s'])} |")
    with open(os.path.join(args.results, "parity.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(args.results, "parity.json"), "w") as f:
        json.dump({"command": args.command, "window": WINDOW, "table": rows,
                   "runs": {f"{a}-seed{s}": v for (a, s), v in runs.items()}}, f, indent=1)
    print("\n".join(md))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fsdp2": "tab:gray", "exact": "tab:blue", "detached": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "reward", "mean reward"), (axes[1], "grad_norm", "actor grad norm")):
        for arm in args.arms:
            curves = [runs[(arm, s)][key] for s in args.seeds if (arm, s) in runs]
            for c in curves:
                ax.plot(range(1, len(c) + 1), c, color=colors.get(arm), alpha=0.3, lw=0.8)
            n = min(map(len, curves), default=0)
            if n:
                mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
                ax.plot(range(1, n + 1), mean, color=colors.get(arm), lw=2, label=f"{arm} (mean of {len(curves)})")
        ax.set_xlabel("GRPO step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("kv_retrieval, tiny Qwen3-Next hybrid, G=8: thin = one seed, thick = mean over seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(args.results, "parity.png"), dpi=110)
    print(f"[parity] wrote {args.results}/parity.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
