"""Core benchmark: standard GRPO backward vs LongStraw detached / exact / chunked exact, on CPU.

For each family x prompt length P x group size G (responses of T tokens) it measures, each
configuration in a fresh process:
- peak bytes saved for backward (verl_longstraw.memory, parameters excluded),
- process peak RSS growth over the loaded model (MB; includes state, gradients and allocator slack),
- wall and CPU seconds of one group's forward + backward (one thread, so that CPU seconds
  count work rather than threads spinning on a shared machine);
and, at one size, the relative L2 gradient error of each path against standard. For a family with sliding-window
layers (gpt_oss) it also captures one prompt of each P and compares each layer's state bytes with the same model's
with every layer full attention: a sliding layer of window W keeps W - 1 rows, (W - 1) / P of a full layer's.
"standard" is one micro-batch holding the G sequences prompt ++ response (what veRL runs).
Where standard does not fit in memory (``--standard-max-len``: MLA at P=16K on CPU keeps
[G, heads, S, S] attention probabilities per layer, ~35 GB a layer at G=8), a
"standard_bound" row gives a lower bound instead: the bytes of those probabilities alone,
layers x G x heads x S^2 x 4 (computed, not run; sizes where both exist check the bound).

    python benchmarks/bench_core.py                      # full sweep, writes benchmarks/results/core.*
    python benchmarks/bench_core.py --prompt-lens 512 --group-sizes 2 8 --out /tmp/x   # quick
    python benchmarks/bench_core.py --families all --prompt-lens 16384 --group-sizes 8 \
        --paths standard chunked_exact --name scale_cpu   # every family (tiny.FAMILIES and VARIANTS) at P=16K
    python benchmarks/bench_core.py --families deepseek_v3 glm_moe_dsa --prompt-lens 2048 16384 \
        --group-sizes 2 8 --paths standard detached chunked_exact --standard-max-len 4096 \
        --error-prompt-len 2048 --name scale_cpu_mla   # MLA at P=16K against the standard bound
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from verl_longstraw import Knobs, capture_prompt, group_backward
from verl_longstraw.adapters import adapter_for
from verl_longstraw.machine import describe, machine
from verl_longstraw.memory import parameter_meter
from verl_longstraw.mixers import RowAttention
from verl_longstraw.testing.compare import make_group
from verl_longstraw.tiny import FAMILIES as ALL_FAMILIES
from verl_longstraw.tiny import VARIANTS, VOCAB, tiny_config, tiny_model

FAMILIES = ("qwen3", "qwen3_5", "deepseek_v3")
PATHS = ("standard", "detached", "exact", "chunked_exact")
CHUNKS = 8  # chunked exact splits the prompt into this many chunks
# standard keeps attention probabilities on CPU (MLA: v dim != qk dim)
BOUNDED_FAMILIES = ("deepseek_v3", "glm_moe_dsa")


def standard_attention_bound(family: str, prompt_len: int, group_size: int, response_len: int) -> dict:
    """Lower bound of standard's saved bytes for a model whose attention keeps its probabilities
    (eager, or SDPA's math fallback as for MLA on CPU): layers x G x heads x S^2 float32."""
    config = tiny_config(family)
    seq = prompt_len + response_len
    nbytes = config.num_hidden_layers * group_size * config.num_attention_heads * seq * seq * 4
    return dict(family=family, P=prompt_len, G=group_size, T=response_len, path="standard_bound",
                saved_peak_mb=nbytes / 2**20, rss_growth_mb=None, wall_s=None, cpu_s=None)


def grpo_loss(i: int, log_probs: torch.Tensor) -> torch.Tensor:
    """Advantage-weighted token-mean policy-gradient loss (advantages alternate in sign)."""
    return -(1.0 if i % 2 == 0 else -1.0) * log_probs.mean()


def standard_backward(model, prompt, responses) -> None:
    """All G sequences in one batch: one forward, one backward (G prompt graphs alive)."""
    ids = torch.stack([torch.cat([prompt, r]) for r in responses])
    logits = model(ids).logits.float()
    log_probs = torch.log_softmax(logits[:, len(prompt) - 1 : -1], dim=-1)
    token_lp = log_probs.gather(-1, torch.stack(responses)[..., None])[..., 0]
    sum(grpo_loss(i, token_lp[i]) for i in range(len(responses))).backward()


def run_path(model, path: str, prompt, responses) -> None:
    if path == "standard":
        standard_backward(model, prompt, responses)
    else:
        chunk = -(-(len(prompt) - 1) // CHUNKS) if path == "chunked_exact" else None
        mode = "detached" if path == "detached" else "exact"
        group_backward(model, prompt, responses, grpo_loss, knobs=Knobs(prompt_grad=mode, chunk_size=chunk))


def measure_one(family: str, prompt_len: int, group_size: int, response_len: int, path: str) -> dict:
    """One configuration (run in its own process so peak RSS is its own)."""
    torch.set_num_threads(1)
    model = tiny_model(family, max_position_embeddings=prompt_len + response_len)
    prompt, responses = make_group(VOCAB, prompt_len, [response_len] * group_size)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run_path(model, path, prompt, responses[:1])  # warm-up (allocator, kernels): a subset of the measured work
    model.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter(), time.process_time()
    with parameter_meter(model) as meter:
        run_path(model, path, prompt, responses)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    return dict(
        family=family, P=prompt_len, G=group_size, T=response_len, path=path,
        saved_peak_mb=meter.peak / 2**20, rss_growth_mb=rss_growth / 1024, wall_s=wall, cpu_s=cpu,
    )


def gradient_errors(family: str, prompt_len: int, group_size: int, response_len: int, paths) -> dict:
    """Relative L2 error of each LongStraw path's gradient against standard's, over all parameters."""
    model = tiny_model(family, max_position_embeddings=prompt_len + response_len)
    prompt, responses = make_group(VOCAB, prompt_len, [response_len] * group_size)
    grads = {}
    for path in ("standard", *[p for p in paths if p != "standard"]):  # errors are against standard
        model.zero_grad(set_to_none=True)
        run_path(model, path, prompt, responses)
        grads[path] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()
    ref = grads["standard"]
    return {path: float((grads[path] - ref).norm() / ref.norm()) for path in grads if path != "standard"}


def full_attention_overrides(config) -> dict:
    """Config fields that make every layer of ``config``'s model full attention, the weights unchanged."""
    if getattr(config, "layer_types", None) is not None:
        return dict(layer_types=["full_attention" if t == "sliding_attention" else t for t in config.layer_types])
    return dict(sliding_window=None)


def window_state(family: str, prompt_len: int) -> list[dict]:
    """Per layer of a family with sliding-window layers (none: []): the captured prompt's state bytes against the
    same model with every layer full attention, and the (W - 1) / P a sliding layer should keep of it."""
    model = tiny_model(family, max_position_embeddings=prompt_len)
    windows = [op.window if isinstance(op, RowAttention) else None for op in adapter_for(model).ops]
    if not any(windows):
        return []
    full = tiny_model(family, max_position_embeddings=prompt_len, **full_attention_overrides(model.config))
    prompt, _ = make_group(VOCAB, prompt_len, [1])
    with torch.no_grad():
        states = [capture_prompt(m, prompt).store for m in (model, full)]
    return [dict(family=family, P=prompt_len, layer=i, window=w, state_bytes=states[0].layer_nbytes(i),
                 full_attention_bytes=states[1].layer_nbytes(i),
                 expected_ratio=1.0 if w is None else min(w - 1, prompt_len - 1) / (prompt_len - 1))
            for i, w in enumerate(windows)]


def write_reports(rows: list[dict], errors: dict, windows: list[dict], out_dir: str, name: str, command: str,
                  info: dict) -> None:
    """``{name}.json``, ``.md`` and ``.png`` under ``out_dir``; ``info`` is ``machine()`` from the start of the run."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(dict(command=command, machine=info, rows=rows, gradient_errors=errors, window_state=windows), f,
                  indent=1)
    index = {(r["family"], r["P"], r["G"], r["path"]): r for r in rows}
    lines = [
        "# Core benchmark (CPU)", "", f"Command: `{command}`", "", f"Machine: {describe(info)}", "",
        "Peak saved-for-backward MB (ratio to standard), CPU seconds (ratio), peak RSS growth MB. T = "
        f"{rows[0]['T']}; chunked exact uses {CHUNKS} chunks. standard_bound rows are computed lower "
        "bounds of standard (attention probabilities only), used where standard does not fit in memory; "
        "ratios against them are upper bounds (<=).", "",
        "| family | P | G | path | saved MB | vs std | CPU s | vs std | RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        case = (r["family"], r["P"], r["G"])
        std = index.get((*case, "standard")) or index.get((*case, "standard_bound"))
        saved_ratio = f"{r['saved_peak_mb'] / std['saved_peak_mb']:.3g}" if std else "-"
        if std and std["path"] == "standard_bound":
            saved_ratio = f"<= {saved_ratio}"
        measured = r["cpu_s"] is not None
        cpu_ratio = f"{r['cpu_s'] / std['cpu_s']:.3f}" if measured and std and std["path"] == "standard" else "-"
        cpu, rss = (f"{r['cpu_s']:.2f}", f"{r['rss_growth_mb']:.0f}") if measured else ("-", "-")
        lines.append(
            f"| {r['family']} | {r['P']} | {r['G']} | {r['path']} | {r['saved_peak_mb']:.1f} | {saved_ratio} | "
            f"{cpu} | {cpu_ratio} | {rss} |"
        )
    lines += ["", "Growth of peak saved bytes from G=2 to G=8:", "", "| family | P | path | G=8 / G=2 |",
              "|---|---|---|---|"]
    for (family, p, g, path), r in index.items():
        if g == 8 and (family, p, 2, path) in index:
            growth = r["saved_peak_mb"] / index[(family, p, 2, path)]["saved_peak_mb"]
            lines.append(f"| {family} | {p} | {path} | {growth:.3f} |")
    lines += ["", "Gradient relative L2 error against standard:", "", "| family | setting | path | error |",
              "|---|---|---|---|"]
    for key, errs in errors.items():
        family, setting = key.split(" ", 1)
        lines += [f"| {family} | {setting} | {path} | {err:.2e} |" for path, err in errs.items()]
    if windows:
        lines += ["", "Captured prompt state per layer (P - 1 tokens captured), sliding-window layers against the same "
                  "model with every layer full attention:", "",
                  "| family | P | layer | window | state KiB | full-attention KiB | ratio | (W - 1) / (P - 1) |",
                  "|---|---|---|---|---|---|---|---|"]
        for w in windows:
            lines.append(f"| {w['family']} | {w['P']} | {w['layer']} | {w['window'] or 'full'} | "
                         f"{w['state_bytes'] / 1024:.1f} | {w['full_attention_bytes'] / 1024:.1f} | "
                         f"{w['state_bytes'] / w['full_attention_bytes']:.4g} | {w['expected_ratio']:.4g} |")
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(rows, os.path.join(out_dir, f"{name}.png"))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({r["family"] for r in rows})
    prompt_lens = sorted({r["P"] for r in rows})
    fig, axes = plt.subplots(len(prompt_lens), len(families), figsize=(4 * len(families), 3.2 * len(prompt_lens)),
                             squeeze=False)
    for i, p in enumerate(prompt_lens):
        for j, family in enumerate(families):
            ax = axes[i][j]
            for name in ("standard_bound", *PATHS):
                pts = sorted((r["G"], r["saved_peak_mb"]) for r in rows
                             if (r["family"], r["P"], r["path"]) == (family, p, name))
                if pts:
                    ax.plot([g for g, _ in pts], [mb for _, mb in pts], marker="o", label=name)
            ax.set_yscale("log")
            ax.set_title(f"{family}, P={p}")
            ax.set_xlabel("group size G")
            ax.set_ylabel("peak saved MB")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), help="family names, or 'all'")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--prompt-lens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--error-prompt-len", type=int, default=4096)
    parser.add_argument("--standard-max-len", type=int, default=None,
                        help="run standard only up to this P; beyond it (and at it, as a check) write "
                             "standard_bound rows")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--name", default="core", help="stem of the result files")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: JSON args of one configuration
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(**json.loads(args.one))))
        return
    command = "python benchmarks/bench_core.py " + " ".join(sys.argv[1:])
    info = machine()
    families = [*ALL_FAMILIES, *VARIANTS] if args.families == ["all"] else args.families
    paths = args.paths
    rows, errors, windows = [], {}, []
    for family in families:
        for p in args.prompt_lens:
            windows += window_state(family, p)
        for p in args.prompt_lens:
            for g in args.group_sizes:
                if args.standard_max_len is not None and family in BOUNDED_FAMILIES:
                    rows.append(standard_attention_bound(family, p, g, args.response_len))
                    bound_mb = rows[-1]["saved_peak_mb"]
                    print(f"{family:12s} P={p:6d} G={g} standard_bound saved >= {bound_mb:9.1f} MB", flush=True)
                for path in paths:
                    if path == "standard" and args.standard_max_len is not None and p > args.standard_max_len:
                        continue
                    spec = dict(family=family, prompt_len=p, group_size=g, response_len=args.response_len, path=path)
                    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True,
                                         text=True)
                    if out.returncode != 0:
                        raise RuntimeError(f"{spec} failed:\n{out.stderr[-2000:]}")
                    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                    r = rows[-1]
                    print(f"{family:12s} P={p:6d} G={g} {path:14s} saved {r['saved_peak_mb']:9.1f} MB  "
                          f"cpu {r['cpu_s']:7.2f} s  rss +{r['rss_growth_mb']:.0f} MB", flush=True)
        setting = f"P={args.error_prompt_len} G={max(args.group_sizes)} T={args.response_len}"
        errors[f"{family} {setting}"] = gradient_errors(
            family, args.error_prompt_len, max(args.group_sizes), args.response_len, paths
        )
        print(f"{family:12s} gradient errors vs standard ({setting}): {errors[f'{family} {setting}']}", flush=True)
    write_reports(rows, errors, windows, args.out, args.name, command, info)
    print(f"wrote {args.out}/{args.name}.json, .md, .png")


if __name__ == "__main__":
    main()
