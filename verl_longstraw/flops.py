"""The floating-point operations a walk runs (``execute.GroupStats.model_flops``) and the share of a GPU's peak they
make (``mfu``): veRL's ``perf/mfu`` counts the tokens of the standard path, not what a walk captured, replayed and
recomputed.

One model call (``execute.run_segment``) of one sequence of S tokens at positions [p, p + S) of its row (p: the
positions before it, the prefix it attends to) runs, forward (``ModelCost.forward``)::

    2 x N_layers x S  +  sum over layers of mixer(S, p)  +  2 x hidden x vocab x scored

- N_layers: the decoder layers' matmul weights (``active_params``): Linear and depthwise-conv weights whole, a
  routed-experts tensor [E, ., .] at k / E (k: the experts a token runs, the layer's ``FeedForward.top_k``; shared
  experts are Linear, whole). Embeddings, norms, biases and elementwise ops are not counted.
- The LM head (hidden x vocab) over the ``scored`` rows the call scores. A call that scores nothing stops its last
  layer at the layer's state (``Adapter.layer`` without ``need_output``): that layer is left out (what it still
  runs, K/V or latent projections or a recurrent mixer, a share of one layer, is not counted).
- mixer: the layer's op's ``MixerOp.flops`` (attention: 2 FLOPs a product of QK^T and AV per query head and key
  seen; recurrences: FLOPs per state element per token counted from the recurrence their op computes).

Backward runs ``BACKWARD`` x forward (input and weight gradients). A capture (no autograd) counts its forward, a
replay or recompute its forward and, once its backward has run, its backward: so a segment captured and recomputed
counts 1 + 1 + 2 forwards. A batched replay counts each row's real tokens, not its padding.

Not counted: DSA's indexer scores (its projections are counted as weights; its top-k masks dense scores, so MLA
counts every key), attention sinks, chunked recurrent kernels' intra-chunk products and chunk padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .adapters import Adapter
from .mixers import MixerOp, layer_needs_output
from .plan import ModelCall

BACKWARD = 2.0  # backward FLOPs per forward FLOP: the gradients of a matmul's input and of its weight
# The op classes the FLOPs of a call fall in: the weights' and LM head's matmuls, and the token mixers' sequence
# mixing by their op's ``MixerOp.flop_class`` (attention-like ops, recurrent scans)
FLOP_CLASSES = ("matmul", "attention", "scan")


def active_params(layer: nn.Module, top_k: int) -> float:
    """Matmul weights one token runs through in ``layer``: Linear weights (LoRA's included) and depthwise-conv
    weights whole (2 x elements FLOPs per token either way), a routed-experts tensor [E, ., .] at ``top_k`` / E.
    Full sizes of FSDP2's DTensors."""
    total = 0.0
    for module in layer.modules():
        for name, p in module.named_parameters(recurse=False):
            if name.endswith("bias"):
                continue
            if p.dim() == 2 or isinstance(module, nn.Conv1d):
                total += p.numel()
            elif p.dim() == 3:  # routed experts [E, out, in]
                total += p.numel() * top_k / p.shape[0]
    return total


@dataclass(frozen=True)
class ModelCost:
    """What one model's calls cost (``model_cost``): each decoder layer's ``active_params`` and mixer op, and the LM
    head's weight elements (hidden x vocab)."""

    layer_params: tuple[float, ...]
    ops: tuple[MixerOp, ...]
    head_params: int

    def forward(self, tokens: int, prefix: int, scored: int | None) -> float:
        """Forward FLOPs of one sequence of ``tokens`` at positions [prefix, prefix + tokens) in one call, the LM
        head over ``scored`` rows (None: the call scores nothing and its last layer stops at its state)."""
        return sum(self.forward_by_class(tokens, prefix, scored).values())

    def forward_by_class(self, tokens: int, prefix: int, scored: int | None) -> dict[str, float]:
        """``forward``'s FLOPs by ``FLOP_CLASSES``: the weights and the LM head as "matmul", each token mixer's as
        its op's ``flop_class``."""
        out = dict.fromkeys(FLOP_CLASSES, 0.0)
        layers = len(self.ops)
        for i in range(layers):
            if layer_needs_output(i, layers, scored is not None):
                out["matmul"] += 2 * self.layer_params[i] * tokens
                out[self.ops[i].flop_class] += self.ops[i].flops(tokens, prefix)
        out["matmul"] += 2 * self.head_params * (scored or 0)
        return out

    def call_forward(self, call: ModelCall) -> dict[str, float]:
        """Forward FLOPs by class of a step's model call (``plan.ModelCall``: ``Step.call``) on its rank, as the walk
        (``execute``) runs it: each sequence's real tokens (a CP dummy's: none) from the call's start, scoring its
        scored positions (none: the last layer stops)."""
        out = dict.fromkeys(FLOP_CLASSES, 0.0)
        for k, tokens in enumerate(call.lengths):
            scored = None if call.scored is None else call.scored[k]
            for name, value in self.forward_by_class(tokens, call.start, scored).items():
                out[name] += value
        return out


def model_cost(adapter: Adapter) -> ModelCost:
    """``adapter``'s model as ``ModelCost``: its layers' weights (routed experts at each layer's feed-forward op's
    ``top_k``) and ``Adapter.ops``."""
    return ModelCost(tuple(active_params(layer, feed_forward.top_k)
                           for layer, feed_forward in zip(adapter.layers, adapter.feed_forwards, strict=True)),
                     adapter.ops, adapter.lm_head.weight.numel())


# Dense bf16 tensor-core peak per GPU, FLOP/s, without 2:4 sparsity (NVIDIA's datasheets quote twice these figures
# "with sparsity"); the values veRL's verl/utils/flops_counter.py uses for perf/mfu.
PEAK_BF16_FLOPS = {
    "H20": 148e12,  # NVIDIA H20: FP16/BF16 Tensor Core 148 TFLOPS (dense)
    "H100": 989e12,  # NVIDIA H100 datasheet, H100 SXM: BF16 Tensor Core 1,979 TFLOPS (with sparsity)
    "H200": 989e12,  # NVIDIA H200 datasheet, H200 SXM: BF16 Tensor Core 1,979 TFLOPS (with sparsity)
    "B200": 2.25e15,  # NVIDIA HGX B200 datasheet, per GPU: FP16/BF16 Tensor Core 4.5 PFLOPS (with sparsity)
}
OTHER_VARIANTS = ("PCIe", "NVL", "MIG")  # name words of lower-clocked boards and GPU slices: not in the table


def peak_flops(device_name: str) -> float | None:
    """``PEAK_BF16_FLOPS`` of a device named ``device_name`` (``torch.cuda.get_device_name()``, e.g. "NVIDIA H100
    80GB HBM3"), matched by whole word; None for a device not in the table: a CPU, another GPU, a PCIe, NVL or MIG
    variant."""
    words = device_name.split()
    if any(word in OTHER_VARIANTS for word in words):
        return None
    return next((PEAK_BF16_FLOPS[word] for word in words if word in PEAK_BF16_FLOPS), None)


def mfu(model_flops: float, seconds: float, device_name: str) -> float | None:
    """Model FLOPs utilisation: ``model_flops`` (one rank's ``GroupStats.model_flops``) run in ``seconds`` of wall
    time, as a fraction of the device's ``peak_flops``. None where there is no peak to compare with (MFU is not
    reported on CPU, nor on a GPU outside the table) or no time elapsed."""
    peak = peak_flops(device_name)
    if peak is None or seconds <= 0:
        return None
    return model_flops / seconds / peak
