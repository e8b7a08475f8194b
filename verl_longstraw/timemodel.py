"""A time model of one training step on one rank: seconds per phase from the work the plan's steps run, priced at a
device's rates. It is a model, not a measurement: its GPU rates are a datasheet's peaks times efficiencies this module
assumes (``ASSUMED``), and its CPU rates are fitted to measured phases (``calibrate``;
``benchmarks/bench_time_model.py`` checks the method by predicting settings it was not fitted on).

Work (``phase_work``), per phase ("capture", "replay", "recompute": ``GroupStats``' ``capture_s``, ``replay_s`` and
``prompt_backward_s``), summed over the plan's steps on its rank (``Plan.steps``):

- FLOPs by op class (``flops.ModelCost.call_forward``, the count the walk reports): "matmul", "attention_forward",
  "scan" (the recurrences); a replay or recompute adds its backward, ``flops.BACKWARD`` x its forward, as "matmul",
  "attention_backward" and "scan" (with ``frozen_base``, LoRA's frozen weights, the matmuls' backward is their input
  gradient only: 1 x forward; the adapters' own products are not counted); ``checkpointed`` (per-layer activation
  checkpointing) runs each backward step's forward again inside its backward: its FLOPs and collectives twice;
- "collective": bytes per rank of the context-parallel collectives the step's layer calls issue (``MixerOp.
  collective_bytes`` of the step's layer calls, forward and backward), the walk's own (``Step.collectives``: a
  replay round's gathers of the log-probs and losses, a scored segment's; entropies, where asked, are gathered as
  many again: not counted) and, with ``fsdp_param_bytes``, FSDP2's:
  each model call all-gathers the parameters (their (R - 1) / R share; again for its backward) and a backward
  reduce-scatters their gradients in ``reduce_dtype``;
- "host_copy": with ``state_grad_on_host``, the state-gradient bytes a backward adds to the host sums (the gradient
  of the differentiable state it read: every row of its prefix, and a fixed-size state once; model dtype) and the
  float32 sums a recompute reads back (its own state's);
- "state_stream": with ``state_on_host``, the prompt state a step reads (its prefix's rows, and a fixed-size state
  once) copied from the host to the device a layer at a time (``state.stream``): once in its forward, and once
  more in a backward (what the forward saved of them is fetched back; checkpointed, the recompute reads them again);
  ``stream_overlap`` says how much of it hides behind the phase's other work (the next layer's copy runs on a side
  stream while the layers before it compute);
- "layer_calls": decoder-layer calls, each priced at a fixed cost (kernel launches on a GPU, Python dispatch on a
  CPU).

Not modelled: elementwise and memory-bound work outside these classes (norms, activations, the scoring's softmax:
inside each class's efficiency), overlap of collectives or copies with compute (the model adds them; the printed
table takes off the streamed state's hidden seconds, ``stream_overlap``), the optimizer step, MoE token exchanges,
load imbalance between ranks.

    python -m verl_longstraw.timemodel --model Qwen3.5-27B --prompt-len 2097152 --cp-size 8 --gpu H20 \\
        --prompt-grad detached exact --reference-seconds 6785
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .adapters import Adapter, adapter_on_meta
from .estimate import _Layers
from .flops import BACKWARD, model_cost
from .knobs import Knobs
from .plan import Plan, star_plan

PHASES = ("capture", "replay", "recompute")
FLOP_WORK = ("matmul", "attention_forward", "attention_backward", "scan")
WORK = (*FLOP_WORK, "collective", "host_copy", "state_stream", "layer_calls")  # FLOPs..., bytes x 3, calls
_FORWARD = {"matmul": "matmul", "attention": "attention_forward", "scan": "scan"}  # ``flops.FLOP_CLASSES`` ->
_BACKWARD = {"matmul": "matmul", "attention": "attention_backward", "scan": "scan"}  # work classes


def phase_work(config, plan: Plan, mode: str, dtype: torch.dtype = torch.bfloat16, adapter: Adapter | None = None,
               state_grad_on_host: bool = False, fsdp_param_bytes: int = 0,
               reduce_dtype: torch.dtype = torch.float32, frozen_base: bool = False,
               checkpointed: bool = False, state_on_host: bool = False) -> dict[str, dict[str, float]]:
    """Per phase (``PHASES``), the work (``WORK``: FLOPs, bytes, calls) of a walk of ``plan`` computing ``mode`` on
    its rank, in a model of ``config`` (or ``adapter``'s) in ``dtype`` (module docstring). ``fsdp_param_bytes``: the
    whole model's parameters in their compute dtype, gathered by FSDP2 over ``plan.world`` ranks (0: no FSDP2); with
    ``frozen_base`` (LoRA) no gradient of them is reduce-scattered; ``state_on_host``: the knob (the streamed rows'
    copies, "state_stream")."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    adapter = adapter if adapter is not None else adapter_on_meta(config)
    cost, layers = model_cost(adapter), _Layers(config, dtype, adapter, "cuda")
    world = plan.world
    gathered = fsdp_param_bytes * (world - 1) / world
    grads_scattered = 0 if frozen_base else gathered * reduce_dtype.itemsize / dtype.itemsize
    differentiable = [s for layer in adapter.specs() for s in layer if s.differentiable]
    kinds = [s for layer in adapter.specs() for s in layer]
    work = {phase: dict.fromkeys(WORK, 0.0) for phase in PHASES}
    for step in plan.steps(mode):
        if step.call is None:
            continue
        out = work[step.phase]
        backward = step.differentiable and mode != "log_probs"  # a log-prob walk runs no backward
        forwards = 2 if backward and checkpointed else 1
        for name, value in cost.call_forward(step.call).items():
            out[_FORWARD[name]] += forwards * value
            if backward:
                out[_BACKWARD[name]] += (1.0 if frozen_base and name == "matmul" else BACKWARD) * value
        calls = layers.calls(step.call)
        out["layer_calls"] += len(calls)
        out["collective"] += sum(sum(op.collective_bytes(call, backward).values())
                                 + (forwards - 1) * sum(op.collective_bytes(call, False).values())
                                 for op, call in zip(adapter.ops, calls, strict=True))
        out["collective"] += gathered * (2 if backward else 1) + (grads_scattered if backward else 0)
        # the walk's own: under CP the gathers of the scored log-probs and the losses, the sums of value gradients
        out["collective"] += sum(step.collectives(loss=mode != "log_probs", entropy=False).values())
        if state_on_host and calls[0].prefix:  # the prefix rows come to the device: forward, and again in backward
            out["state_stream"] += (2 if backward else 1) * sum(s.nbytes(calls[0].prefix, dtype) for s in kinds)
        if state_grad_on_host and backward and mode == "exact":
            read = calls[0].prefix  # the gradient of the state it read goes to the host sums (model dtype)
            out["host_copy"] += sum(s.nbytes(read, dtype) for s in differentiable) if read else 0
            if step.keeps_own_state:  # a recompute: its own state's float32 sums come back to the device
                out["host_copy"] += sum(s.nbytes(calls[0].tokens, torch.float32) for s in differentiable)
    return work


@dataclass(frozen=True)
class Device:
    """A GPU's datasheet peaks: dense bf16 tensor-core FLOP/s; bytes/s per GPU of NVLink (one direction, intra-node
    collectives), of the inter-node network, and of PCIe (host copies)."""

    name: str
    bf16_flops: float
    nvlink_bytes_per_s: float
    internode_bytes_per_s: float
    pcie_bytes_per_s: float


# NVIDIA datasheets (dense bf16: half the "with sparsity" figures; NVLink: half the bidirectional per-GPU figure);
# inter-node: one 400 Gb/s NIC per GPU; PCIe Gen5 x16.
DEVICES = {
    "H20": Device("H20", 148e12, 450e9, 50e9, 64e9),
    "H100": Device("H100", 989e12, 450e9, 50e9, 64e9),
    "H200": Device("H200", 989e12, 450e9, 50e9, 64e9),
    "B200": Device("B200", 2.25e15, 900e9, 50e9, 64e9),
}


@dataclass(frozen=True)
class Efficiencies:
    """Fractions of a device's peak each class reaches (FLOP classes of ``bf16_flops``, "collective" of the link,
    "host_copy" and "state_stream" of PCIe), and the fixed seconds of one decoder-layer call."""

    matmul: float
    attention_forward: float
    attention_backward: float
    scan: float
    collective: float
    host_copy: float
    layer_call_s: float

    def rates(self, device: Device, internode: bool = False) -> dict[str, float]:
        """Work per second of each ``WORK`` class on ``device`` (``internode``: collectives cross nodes); calls: per
        second of one call's fixed cost."""
        link = device.internode_bytes_per_s if internode else device.nvlink_bytes_per_s
        out = {name: getattr(self, name) * device.bf16_flops for name in FLOP_WORK}
        out |= {"collective": self.collective * link, "host_copy": self.host_copy * device.pcie_bytes_per_s,
                "state_stream": self.host_copy * device.pcie_bytes_per_s,
                "layer_calls": 1 / self.layer_call_s if self.layer_call_s else float("inf")}
        return out


# Assumed, not measured on any GPU: a large bf16 GEMM's share of peak, flash attention's forward and backward
# (FlashAttention-3 reports 0.6-0.75 forward on H100), flash-linear-attention's chunked scans counted at the
# recurrence's FLOPs (``flops.py``: their intra-chunk products are not counted, so a low share), NCCL's bus
# efficiency, pinned copies, and about 20 kernels of 5 us per layer call.
ASSUMED = Efficiencies(matmul=0.6, attention_forward=0.5, attention_backward=0.35, scan=0.1, collective=0.7,
                       host_copy=0.8, layer_call_s=1e-4)


def seconds(work: Mapping[str, float], rates: Mapping[str, float]) -> float:
    """Seconds of one phase's ``work`` at ``rates`` (work per second per class): the classes' times added."""
    return sum(amount / rates[name] for name, amount in work.items() if amount)


def stream_overlap(work: Mapping[str, float], rates: Mapping[str, float]) -> tuple[float, float]:
    """(seconds, of which hidden) of one phase's streamed-state copies (``work["state_stream"]``) at ``rates``. The
    copy of a layer's rows runs on a side stream while the layers before it compute, so it is hidden where it takes
    no longer than they do: with the copies and the compute spread evenly over the phase's layer calls, hidden are
    the copy seconds up to the phase's other seconds (``seconds`` of the rest of ``work``)."""
    copy = work["state_stream"] / rates["state_stream"] if work["state_stream"] else 0.0
    other = seconds({name: amount for name, amount in work.items() if name != "state_stream"}, rates)
    return copy, min(copy, other)


def calibrate(works: Sequence[Mapping[str, float]], measured: Sequence[float]) -> dict[str, float]:
    """Rates (work per second per ``WORK`` class) that fit ``measured`` seconds of phases of ``works`` best in least
    squares of the relative error, each class's seconds per unit non-negative (Lawson-Hanson); a class no phase
    runs, or the fit sets to zero, gets an infinite rate (it costs nothing)."""
    names = [name for name in WORK if any(w[name] for w in works)]
    scale = np.array(measured, dtype=float)
    a = np.array([[w[name] for name in names] for w in works], dtype=float) / scale[:, None]
    b = np.ones(len(works))
    per_unit = _nnls(a, b)
    rates = dict.fromkeys(WORK, float("inf"))
    rates |= {name: 1 / x for name, x in zip(names, per_unit, strict=True) if x > 0}
    return rates


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (Lawson and Hanson's active-set method), columns scaled to unit norm."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1
    a = a / norms
    x = np.zeros(a.shape[1])
    free = np.zeros(a.shape[1], dtype=bool)
    for _ in range(10 * a.shape[1]):
        gradient = a.T @ (b - a @ x)
        if free.all() or gradient[~free].max(initial=0) <= 1e-12:
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while True:
            z = np.zeros_like(x)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            blocked = free & (z <= 0)
            alpha = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + alpha * (z - x)
            free &= x > 1e-15
    return x / norms


def _table(work: dict[str, dict[str, float]], rates: dict[str, float], peak: float) -> tuple[list[str], float]:
    """Markdown rows of each phase's seconds and MFU (its FLOPs over its seconds at ``peak``), and the step's
    seconds; a phase's streamed-state copies count less their hidden part (``stream_overlap``)."""
    rows, total = [], 0.0
    for phase in PHASES:
        copy, hidden = stream_overlap(work[phase], rates)
        t = seconds(work[phase], rates) - hidden
        total += t
        flops = sum(work[phase][name] for name in FLOP_WORK)
        parts = ", ".join(f"{name} {work[phase][name] / rates[name]:.0f} s" for name in WORK if work[phase][name])
        parts += f" ({hidden:.0f} of its {copy:.0f} s hidden behind compute)" if copy else ""
        rows.append(f"| {phase} | {flops / 1e15:.1f} | {t:.0f} | {flops / t / peak if t else 0:.1%} | {parts} |")
    return rows, total


def main(argv: Sequence[str] | None = None) -> str:
    """Print the predicted step per ``--prompt-grad`` mode on ``--gpu`` beside ``--reference-seconds``."""
    from .models import CONFIGS

    parser = argparse.ArgumentParser(prog="python -m verl_longstraw.timemodel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), required=True)
    parser.add_argument("--prompt-len", type=int, required=True)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=8192)
    parser.add_argument("--chunk-size", type=int, default=65536)
    parser.add_argument("--cp-size", type=int, default=8)
    parser.add_argument("--prompt-grad", nargs="+", choices=("exact", "detached"), default=["detached", "exact"])
    parser.add_argument("--state-grad-on-host", action="store_true")
    parser.add_argument("--checkpointed", action="store_true", help="per-layer activation checkpointing")
    parser.add_argument("--state-on-host", action="store_true", help="the prompt state's rows streamed from the host")
    parser.add_argument("--gpu", choices=sorted(DEVICES), default="H20")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="a larger --cp-size crosses nodes")
    parser.add_argument("--lora", action="store_true", help="a frozen base (LoRA): no weight gradients")
    parser.add_argument("--reference-seconds", type=float, help="a measured step to set beside the prediction")
    parser.add_argument("--reference-phase", nargs="*", default=[], metavar="PHASE=SECONDS",
                        help="measured seconds of phases (capture, replay, recompute): the MFU each needs")
    args = parser.parse_args(argv)
    config = CONFIGS[args.model]()
    adapter = adapter_on_meta(config.get_text_config())
    device = DEVICES[args.gpu]
    internode = args.cp_size > args.gpus_per_node  # a CP group past one node: its collectives cross the network
    rates = ASSUMED.rates(device, internode)
    params = sum(p.numel() for p in adapter.model.parameters()) * torch.bfloat16.itemsize
    plan = star_plan(args.prompt_len, [args.response_len] * args.group_size, Knobs(chunk_size=args.chunk_size),
                     args.cp_size, 0)
    lines = [f"# Time model (a model, not a measurement): {args.model}{' LoRA' if args.lora else ''}, P = "
             f"{args.prompt_len:,}, G = {args.group_size} x {args.response_len:,}, chunk {args.chunk_size:,}, CP "
             f"{args.cp_size} ({'inter-node' if internode else 'NVLink'} collectives), rank 0, "
             f"{args.gpu} (bf16 {device.bf16_flops / 1e12:.0f} TFLOP/s), efficiencies assumed: {ASSUMED}", ""]
    for mode in args.prompt_grad:
        work = phase_work(config, plan, mode, adapter=adapter, state_grad_on_host=args.state_grad_on_host,
                          fsdp_param_bytes=params, frozen_base=args.lora, checkpointed=args.checkpointed,
                          state_on_host=args.state_on_host)
        rows, total = _table(work, rates, device.bf16_flops)
        lines += [f"## {mode}: predicted step {total:,.0f} s", "", "| phase | PFLOPs | s | MFU | by class |",
                  "|---|---:|---:|---:|---|", *rows, ""]
        if args.reference_seconds:
            flops = sum(work[p][name] for p in PHASES for name in FLOP_WORK)
            lines += [f"Beside the reference {args.reference_seconds:,.0f} s: {total / args.reference_seconds:.2f}x; "
                      f"the step's FLOPs in that time are {flops / args.reference_seconds / device.bf16_flops:.1%} "
                      f"of peak, each phase at its predicted MFU x {total / args.reference_seconds:.2f}.", ""]
        for phase, measured in (item.split("=") for item in args.reference_phase):
            flops, modelled = sum(work[phase][name] for name in FLOP_WORK), seconds(work[phase], rates)
            lines.append(f"- {phase} in the reference's {float(measured):,.0f} s: MFU "
                         f"{flops / float(measured) / device.bf16_flops:.1%} (the model: {modelled:,.0f} s)")
        lines += [""] if args.reference_phase else []
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
