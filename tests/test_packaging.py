"""A regular wheel of the repository holds every module of the package and the top-level configs/ folder
(installed as `verl_longstraw.configs`), and `python -m verl_longstraw.configs` run from that wheel points
into it. (The editable install is what the rest of the suite runs on.)"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_wheel_holds_package_and_configs(tmp_path):
    pytest.importorskip("setuptools", minversion="68", reason="pyproject.toml's build-system needs setuptools>=68")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for folder in ("verl_longstraw", "configs"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("verl_longstraw-*.whl")
    members = set(zipfile.ZipFile(wheel).namelist())

    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "verl_longstraw").rglob("*.py")}
    expected |= {f"verl_longstraw/configs/{p.relative_to(REPO / 'configs').as_posix()}"
                 for p in (REPO / "configs").rglob("*") if p.suffix in (".py", ".yaml")}
    assert {"verl_longstraw/configs/longstraw_grpo.yaml", "verl_longstraw/configs/__main__.py"} <= expected
    assert expected <= members, f"missing from the wheel: {sorted(expected - members)}"

    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    env = dict(os.environ, PYTHONPATH=str(unpacked))  # ahead of the editable install's import hook
    printed = subprocess.run([sys.executable, "-m", "verl_longstraw.configs"], env=env, capture_output=True,
                             text=True, check=True, cwd=tmp_path).stdout.strip()
    assert Path(printed) == unpacked / "verl_longstraw" / "configs"
    assert (Path(printed) / "recipe" / "kv_retrieval.yaml").is_file()
