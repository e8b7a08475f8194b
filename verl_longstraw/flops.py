"""The floating-point operations a walk runs (``execute.GroupStats.model_flops``) and the share of a GPU's peak they
make (``mfu``): veRL's ``perf/mfu`` counts the tokens of the standard path, not what a walk captured, replayed and
recomputed.

One model call (``execute.run_segment``) of one sequence of S tokens at positions [p, p + S) of its row (p: the
positions before it, the prefix it attends to) runs, forward (``ModelCost.forward``)::

    2 x N_layers x S  +  sum over layers of mixer(S, p)  +  2 x hidden x vocab x scored

- N_layers: the decoder layers' matmul weights (``active_params``): Linear and depthwise-conv weights whole, a
  routed-experts tensor [E, ., .] at k / E (k = ``num_experts_per_tok`` experts run per token; shared experts are
  Linear, whole). Embeddings, norms, biases and elementwise ops are not counted.
- The LM head (hidden x vocab) over the ``scored`` rows the call scores. A call that scores nothing stops its last
  layer at the layer's state (``Adapter.layer`` without ``need_output``): that layer is left out (what it still
  runs, K/V or latent projections or a recurrent mixer, a share of one layer, is not counted).
- mixer: ``MIXER_FLOPS[Mixer.kind]`` (``attention_flops``, ``recurrence_flops``).

Backward runs ``BACKWARD`` x forward (input and weight gradients). A capture (no autograd) counts its forward, a
replay or recompute its forward and, once its backward has run, its backward: so a segment captured and recomputed
counts 1 + 1 + 2 forwards. A batched replay counts each row's real tokens, not its padding.

Not counted: DSA's indexer scores (its projections are counted as weights; its top-k masks dense scores, so MLA
counts every key), attention sinks, chunked recurrent kernels' intra-chunk products and chunk padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .adapters import Adapter
from .adapters.base import Mixer
from .state import StateKind

BACKWARD = 2.0  # backward FLOPs per forward FLOP: the gradients of a matmul's input and of its weight


def keys_seen(tokens: int, prefix: int, window: int | None) -> float:
    """Keys the queries at positions [prefix, prefix + tokens) attend to, causally, each within its last ``window``
    keys (its own included; None: every earlier key): sum over i < tokens of min(window, prefix + i + 1)."""
    whole = tokens if window is None else min(max(window - prefix, 0), tokens)  # queries that see every earlier key
    return whole * prefix + whole * (whole + 1) / 2 + (tokens - whole) * (window or 0)


def attention_flops(m: Mixer, kinds: tuple[StateKind, ...], tokens: int, prefix: int) -> float:
    """Kinds "attention", "window_attention", "mla" (absorbed: latent-space queries against one latent key head):
    QK^T over ``qk_dim`` and AV over ``v_dim``, 2 FLOPs a product, per query head and key seen (``keys_seen``).
    Full attention with head_dim d: 4 x heads x d x S x (p + (S + 1) / 2)."""
    return 2 * m.q_heads * (m.qk_dim + m.v_dim) * keys_seen(tokens, prefix, m.window)


def recurrence_flops(per_element: int) -> Callable[[Mixer, tuple[StateKind, ...], int, int], float]:
    """Kinds of a fixed-size recurrent state (the layer's last state kind, [1, heads, d1, d2]): ``per_element``
    FLOPs per state element per token, counted from the recurrence its op computes (``ops``' docstrings).

    - "gated_delta", "kda" (``ops.gated_delta_rule``, ``ops.kda``), state [heads, dk, dv]: 7 = the decay of S (1),
      k S (2), the rank-1 update S + k^T (beta (v - k S)) (2), q S (2);
    - "mamba2" (``ops.ssd_scan``), state [heads, head_dim, state_size]: 5 = the decay of h (1), the update
      h + dt x B^T (2), h C (2)."""

    def flops(m: Mixer, kinds: tuple[StateKind, ...], tokens: int, prefix: int) -> float:
        return per_element * math.prod(kinds[-1].shape) * tokens

    return flops


MIXER_FLOPS: dict[str, Callable[[Mixer, tuple[StateKind, ...], int, int], float]] = {
    "attention": attention_flops,
    "window_attention": attention_flops,
    "mla": attention_flops,
    "gated_delta": recurrence_flops(7),
    "kda": recurrence_flops(7),
    "mamba2": recurrence_flops(5),
    "none": lambda m, kinds, tokens, prefix: 0.0,
}  # forward FLOPs of one sequence's ``tokens`` after ``prefix`` positions through a mixer, by ``Mixer.kind``


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
    """What one model's calls cost (``model_cost``): each decoder layer's ``active_params``, mixer and state kinds,
    and the LM head's weight elements (hidden x vocab)."""

    layer_params: tuple[float, ...]
    mixers: tuple[Mixer, ...]
    kinds: tuple[tuple[StateKind, ...], ...]
    head_params: int

    def forward(self, tokens: int, prefix: int, scored: int | None) -> float:
        """Forward FLOPs of one sequence of ``tokens`` at positions [prefix, prefix + tokens) in one call, the LM
        head over ``scored`` rows (None: the call scores nothing and its last layer stops at its state)."""
        layers = len(self.mixers) if scored is not None else len(self.mixers) - 1
        body = sum(2 * self.layer_params[i] * tokens
                   + MIXER_FLOPS[self.mixers[i].kind](self.mixers[i], self.kinds[i], tokens, prefix)
                   for i in range(layers))
        return body + 2 * self.head_params * (scored or 0)


def model_cost(adapter: Adapter) -> ModelCost:
    """``adapter``'s model as ``ModelCost``: its layers' weights, ``Adapter.mixers`` and ``Adapter.specs``."""
    top_k = getattr(adapter.config, "num_experts_per_tok", 0) or 0
    return ModelCost(tuple(active_params(layer, top_k) for layer in adapter.layers), tuple(adapter.mixers()),
                     tuple(adapter.specs()), adapter.lm_head.weight.numel())


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
