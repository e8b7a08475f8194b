"""Summary of a tool_lookup run: kv_retrieval's report (machine, step time and its phases, reward at the start and
the end, checkpoint), then per step the reward, the turns per trajectory and the tokens LongStraw
ran through the model against its star path (one plan per GRPO group) and against no sharing at all (every row's
prompt and response alone), and their ratios; a two-panel curve (reward; tokens forwarded) in WORKDIR/reward_curve.png.

    python summarize.py --workdir DIR [--window N] [--png FILE]

The live per-step lines and checkpoint state come from kv_retrieval's summarize.py (run.sh calls it directly).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

_spec = importlib.util.spec_from_file_location(
    "kv_retrieval_summarize", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kv_retrieval",
                                           "summarize.py"))
kv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv)

# tokens of a step's update_actor: the tree walk's (TOKENS), the star path's (STAR_TOKENS) and the rows' own, nothing
# shared (UNSHARED: each row's prompt + response run alone)
TOKENS, STAR_TOKENS = kv.TOKENS, kv.STAR_TOKENS
UNSHARED_TOKENS = "actor/longstraw/unshared_tokens_forwarded"
TURNS = "num_turns/mean"  # veRL's agent loop: user (tool) + assistant turns + 1; 6 = two lookups and an answer


def _get(data: dict, key: str):
    """``data[key]``, or the value of a key ending with the same ``longstraw/...`` name (another prefix)."""
    if key in data:
        return data[key]
    name = key.split("/", 1)[1] if key.startswith("actor/") else key
    return next((v for k, v in data.items() if k.endswith(name)), None)


def token_rows(steps: dict[int, dict]) -> list[dict]:
    """Per step: ``tokens``, ``star``, ``unshared`` (None when not logged) and the ratios tokens/star,
    tokens/unshared, star/unshared where both are there."""
    rows = []
    for step, data in steps.items():
        row = {"step": step, "tokens": _get(data, TOKENS), "star": _get(data, STAR_TOKENS),
               "unshared": _get(data, UNSHARED_TOKENS)}
        for a, b in (("tokens", "star"), ("tokens", "unshared"), ("star", "unshared")):
            if row[a] is not None and row[b]:
                row[f"{a}/{b}"] = row[a] / row[b]
        rows.append(row)
    return rows


def _fmt(x, width: int, decimals: int) -> str:
    return f"{x:{width}.{decimals}f}" if x is not None else "-".rjust(width)


def report(workdir: str, window: int | None, png: str | None) -> dict:
    out = kv.report(workdir, window, None)
    if not out:
        return out
    steps = kv.load_metrics(workdir)
    tokens = token_rows(steps)
    print("[summary] per step: reward, turns per trajectory (6: two lookups and the answer), tokens forwarded by "
          "update_actor (tree / star: one plan per GRPO group / unshared: every row alone)", flush=True)
    print(f"[summary] {'step':>4} {'reward':>7} {'turns':>6} {'tree':>8} {'star':>8} {'unshared':>9} "
          f"{'tree/star':>9} {'tree/unsh':>9} {'star/unsh':>9}", flush=True)
    for row in tokens:
        data = steps[row["step"]]
        print(f"[summary] {row['step']:>4} {_fmt(data.get(kv.REWARD), 7, 3)} {_fmt(data.get(TURNS), 6, 2)} "
              f"{_fmt(row['tokens'], 8, 0)} {_fmt(row['star'], 8, 0)} {_fmt(row['unshared'], 9, 0)} "
              f"{_fmt(row.get('tokens/star'), 9, 2)} {_fmt(row.get('tokens/unshared'), 9, 2)} "
              f"{_fmt(row.get('star/unshared'), 9, 2)}", flush=True)
    turns = [steps[s].get(TURNS) for s in steps]
    w = out["window"]
    if all(t is not None for t in turns[:w] + turns[-w:]):
        out.update(turns_start=kv._mean(turns[:w]), turns_end=kv._mean(turns[-w:]))
        print(f"[summary] turns       first {w} steps {out['turns_start']:.2f}  ->  last {w} steps "
              f"{out['turns_end']:.2f} per trajectory (6: two lookups and the answer)", flush=True)
    means = {}
    for key in ("tokens", "star", "unshared"):
        values = [r[key] for r in tokens if r[key] is not None]
        if values:
            means[key] = sum(values) / len(values)
    if means:
        ratios = {f"{a}/{b}": means[a] / means[b] for a, b in (("tokens", "star"), ("tokens", "unshared"),
                                                               ("star", "unshared")) if a in means and b in means}
        out["tokens_per_step"] = {**means, **ratios}
        text = ", ".join(f"{k} {v:.0f}" for k, v in means.items())
        text += "".join(f", {k} {v:.2f}x" for k, v in ratios.items())
        print(f"[summary] tokens per step (mean): {text}", flush=True)
        if "unshared" not in means:
            print(f"[summary] ({UNSHARED_TOKENS} not logged by this engine version)", flush=True)
    if png:
        try:
            out["plot"] = plot(steps, tokens, png)
            print(f"[summary] reward curve {png}", flush=True)
        except Exception as e:  # plotting is a nicety; never fail the run on it
            print(f"[summary] could not plot: {e!r}", flush=True)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def plot(steps: dict[int, dict], tokens: list[dict], png: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(steps)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(xs, [steps[s].get(kv.REWARD, float("nan")) for s in xs], "o-", label="mean reward (batch x 8)")
    if len(xs) >= 3:
        rew = [steps[s].get(kv.REWARD) for s in xs]
        ax.plot(xs, [kv._mean(rew[max(0, i - 2): i + 1]) for i in range(len(xs))], "-", lw=3, alpha=0.5,
                label="reward, 3-step moving mean")
    ax.set(xlabel="GRPO step", ylabel="reward", ylim=(-0.02, 0.62), title="tool_lookup GRPO (ToolAgentLoop, vLLM-CPU)")
    ax.grid(alpha=0.3)
    turns = [steps[s].get(TURNS, float("nan")) for s in xs]
    tx = ax.twinx()
    tx.plot(xs, turns, "s--", color="tab:green", alpha=0.7, label="turns per trajectory (right axis)")
    tx.set(ylabel="turns per trajectory (6: two lookups, answer)", ylim=(1.8, 6.4))
    handles = ax.get_legend_handles_labels()
    ax.legend(handles[0] + tx.get_legend_handles_labels()[0], handles[1] + tx.get_legend_handles_labels()[1],
              loc="lower right")
    for key, label in (("tokens", "longstraw (tree)"), ("star", "star: one plan per group"),
                       ("unshared", "no sharing")):
        ys = [r[key] if r[key] is not None else float("nan") for r in tokens]
        if any(y == y for y in ys):
            bx.plot(xs, ys, "o-", label=label)
    bx.set(xlabel="GRPO step", ylabel="tokens forwarded by update_actor", title="tokens run through the model")
    bx.set_ylim(bottom=0)
    bx.grid(alpha=0.3)
    bx.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--window", type=int, default=5, help="steps averaged at each end")
    ap.add_argument("--png", default=None, help="default: WORKDIR/reward_curve.png")
    a = ap.parse_args(argv)
    report(a.workdir, a.window, a.png or os.path.join(a.workdir, "reward_curve.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
