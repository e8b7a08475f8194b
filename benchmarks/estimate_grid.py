"""Every figure of the memory estimate, the FLOP count and the per-GPU table over a grid of configurations, as
JSON: a refactor of the core runs it before and after and diffs the two files (``--compare``), field by field.

The grid: every tiny family the installed transformers builds (``tiny.py``) and the named models
(``models.CONFIGS``) x CP ranks 1-3 x exact/detached x CUDA/CPU kernels x bf16/fp32 x plain/checkpointed, the
state-gradient sums on the host or not, EP where the model has routed experts and R > 1; each family's forward
FLOPs by class of a prompt and a replay; and each cluster recipe's ``gpu_table``.

    python benchmarks/estimate_grid.py --out /tmp/after.json.gz
    python benchmarks/estimate_grid.py --compare benchmarks/results/renovation3/estimate_grid_ef1a2a7.json.gz
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import itertools
import json
import sys
from pathlib import Path

import torch

from verl_longstraw.adapters import adapter_on_meta
from verl_longstraw.estimate import estimate_memory
from verl_longstraw.flops import model_cost
from verl_longstraw.models import CONFIGS
from verl_longstraw.tiny import DENSE_VARIANTS, FAMILIES, VARIANTS, tiny_config, unavailable

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _models() -> dict[str, object]:
    """The tiny families this transformers builds, then the named models, by name."""
    models = {f: tiny_config(f) for f in (*FAMILIES, *DENSE_VARIANTS, *VARIANTS) if unavailable(f) is None}
    models.update({name: make() for name, make in CONFIGS.items()})
    return models


def _has_experts(config) -> bool:
    return any(getattr(config, key, 0) for key in ("n_routed_experts", "num_experts", "num_local_experts"))


def grid() -> dict[str, object]:
    """``{key: figures}`` for every point of the grid (a key names the point; figures are JSON values)."""
    out: dict[str, object] = {}
    for name, config in _models().items():
        adapter = adapter_on_meta(config)
        tiny = name in (*FAMILIES, *DENSE_VARIANTS, *VARIANTS)
        prompt, response, chunk = (96, 24, 32) if tiny else (1 << 18, 4096, 1 << 16)
        for r, mode, device, dtype, ckpt, host in itertools.product(
                (1, 2, 3), ("exact", "detached"), ("cuda", "cpu"), DTYPES, (False, True), (False, True)):
            if host and (mode == "detached" or device == "cpu" or ckpt):
                continue  # the host sums matter in exact mode; one point of them per (R, dtype) is enough
            for ep in (False, True) if r > 1 and _has_experts(config) else (False,):
                key = f"{name}|R{r}|{mode}|{device}|{dtype}|ckpt{int(ckpt)}|host{int(host)}|ep{int(ep)}"
                try:
                    est = estimate_memory(config, prompt, 4, response, chunk_size=chunk, prompt_grad=mode,
                                          dtype=DTYPES[dtype], adapter=adapter, cp_size=r, state_grad_on_host=host,
                                          checkpointed=ckpt, device_type=device, expert_parallel=ep)
                    out[key] = {**dataclasses.asdict(est), "total_bytes": est.total_bytes,
                                "host_bytes": est.host_bytes}
                except Exception as error:  # a refusal is a figure too: it must stay the same refusal
                    out[key] = f"{type(error).__name__}: {error}"
        cost = model_cost(adapter)
        out[f"{name}|flops"] = {"prompt": cost.forward_by_class(prompt, 0, None),
                                "replay": cost.forward_by_class(response, prompt, response)}
    out.update(_recipe_tables())
    return out


def _recipe_tables() -> dict[str, object]:
    """Each cluster recipe's ``gpu_table`` (the figures its README table prints)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "clusters"))
    try:
        import memory_table  # noqa: PLC0415 (a script folder, not a package)
    except ImportError as error:  # hydra/omegaconf absent (the image's environment)
        return {"recipes": f"not computed: {error}"}
    from verl_longstraw.configs import compose_recipe  # noqa: PLC0415 (hydra, as above)
    return {f"recipe|{name}": dataclasses.asdict(memory_table.memory(name, compose_recipe(name), model))
            for name, model in memory_table.MODELS.items()}


def compare(before: dict, after: dict) -> list[str]:
    """The keys and fields whose figures differ, one line each."""
    lines = []
    for key in sorted(before.keys() | after.keys()):
        a, b = before.get(key, "<absent>"), after.get(key, "<absent>")
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for field in sorted(a.keys() | b.keys()):
                if a.get(field) != b.get(field):
                    lines.append(f"{key}.{field}: {a.get(field)} -> {b.get(field)}")
        else:
            lines.append(f"{key}: {a} -> {b}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the grid's figures here (gzipped JSON)")
    parser.add_argument("--compare", type=Path, help="a file --out wrote: print each difference, exit 1 on any")
    args = parser.parse_args()
    figures = json.loads(json.dumps(grid(), sort_keys=True))  # tuples as lists, as a file reads back
    if args.out:
        args.out.write_bytes(gzip.compress(json.dumps(figures, indent=0, sort_keys=True).encode(), mtime=0))
    if args.compare:
        diff = compare(json.loads(gzip.decompress(args.compare.read_bytes())), figures)
        print("\n".join(diff) or f"equal: {len(figures)} points")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
