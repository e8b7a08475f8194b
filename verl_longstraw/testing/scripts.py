"""Running the repository's scripts from tests and tools: a benchmark or recipe file loaded as a module, a benchmark
run in a subprocess for its JSON report. Standard library only."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


def load_script(path: str | Path) -> ModuleType:
    """The Python file ``path`` (a benchmark or recipe script) as a module named ``<folder>_<stem>``."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_benchmark(script: Path, args: Sequence[str], report: Path, timeout_s: float) -> dict:
    """Run ``python script *args`` (a benchmark under benchmarks/) and return its JSON ``report``; fails with
    the end of its stderr when it exits with an error."""
    run = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout_s)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(report.read_text())
