"""A CPU platform for veRL, so the engine and the whole trainer run without an accelerator.

veRL 0.9.1 ships CUDA/NPU/ROCm platforms only and falls back to "nvidia" when none is
detected. `register_cpu_platform` adds this one to `PlatformRegistry` only when torch sees no
accelerator and no registered platform finds one, so GPU/NPU machines are unaffected (veRL's
CUDA probe fails without `nvidia-smi`, e.g. in containers, while torch still sees the GPUs).
Ray placement still asks for the resource "GPU": start Ray with a logical
`ray_kwargs.ray_init.num_gpus` equal to the number of CPU workers.
"""

import logging
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Optional

import psutil
import torch

logger = logging.getLogger(__name__)


def _peak_rss_bytes(device: Any = None) -> int:
    """Peak resident set size of this process since the last `_reset_peak_rss` (Linux VmHWM, in bytes)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError("/proc/self/status has no VmHWM line; the CPU platform's memory metrics need Linux")


def _reset_peak_rss(device: Any = None) -> None:
    """Reset the peak resident set size to the current one (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _rss_bytes(device: Any = None) -> int:
    return psutil.Process().memory_info().rss


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    vm = psutil.virtual_memory()
    return vm.available, vm.total


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


# `torch.cpu` lacks the memory/RNG helpers veRL calls on `get_torch_device()`; add them.
cpu_device_module = SimpleNamespace(
    **{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")},
    empty_cache=_noop,
    ipc_collect=_noop,
    set_per_process_memory_fraction=_noop,
    reset_peak_memory_stats=_reset_peak_rss,
    memory_allocated=_rss_bytes,
    memory_reserved=_rss_bytes,
    max_memory_allocated=_peak_rss_bytes,
    max_memory_reserved=_peak_rss_bytes,
    mem_get_info=_mem_get_info,
    get_rng_state=lambda device=None: torch.get_rng_state(),
    set_rng_state=lambda state, device=None: torch.set_rng_state(state),
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_device_name=lambda device=None: "cpu",
)


def register_cpu_platform() -> bool:
    """Register platform "cpu" when torch sees no accelerator and no registered platform detects one.

    Returns whether it is registered, and logs the outcome. Must run before veRL's first `get_platform()`.
    """
    from verl.plugin.platform import PlatformBase, PlatformRegistry, platform_manager

    if "cpu" in PlatformRegistry.registered_names():
        return True
    if torch.accelerator.is_available():
        logger.info(
            "verl_longstraw: torch sees accelerator %r; the CPU platform is not registered (veRL picks the platform).",
            torch.accelerator.current_accelerator().type,
        )
        return False
    for name in PlatformRegistry.registered_names():
        platform_cls = PlatformRegistry.get(name)
        try:
            if platform_cls().is_platform_available(use_smi_check=True):
                logger.info("verl_longstraw: veRL platform %r is available; the CPU platform is not registered.", name)
                return False
        except Exception:  # a vendor probe that cannot run here means: not this vendor
            continue
    current = platform_manager._current_platform
    if current is not None and current.device_name != "cpu":
        logger.warning(
            "verl_longstraw: veRL resolved platform %r before the CPU platform was registered; "
            "import verl (which loads the plugin) before anything calls get_platform().",
            current.device_name,
        )

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        """Plain CPU: gloo collectives, device "cpu", Ray resource "GPU" counted logically."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> Any:
            return cpu_device_module

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "GPU"

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    logger.warning(
        "verl_longstraw: no accelerator visible to torch or veRL; registered the CPU platform "
        "(device cpu, gloo collectives)."
    )
    return True
