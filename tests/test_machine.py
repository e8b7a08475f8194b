"""verl_longstraw.machine: the CPU, device and versions a measurement ran on."""

from importlib.metadata import version

import torch

from verl_longstraw.machine import ISA_OVERRIDES, describe, machine

CPUINFO = "processor\t: {n}\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n\n"


def test_machine_reads_model_and_isa_from_cpuinfo(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(CPUINFO.format(n=0) + CPUINFO.format(n=1))
    for key in ISA_OVERRIDES:  # e.g. the AVX2 emulation's, when the suite runs under it
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    info = machine(str(cpuinfo))
    assert info["cpu"] == "AMD EPYC 7B13" and info["isa"] == ["avx2"]
    assert info["overrides"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert info["torch_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert info["versions"]["torch"] == version("torch") and info["versions"]["transformers"] == version("transformers")
    line = describe(info)
    assert line.startswith(f"AMD EPYC 7B13, {info['cpus']} CPUs (avx2; torch kernels ")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in line and f"torch {version('torch')}" in line
