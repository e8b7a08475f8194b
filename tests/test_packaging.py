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


def test_light_modules_import_without_the_model_code():
    """The package's public names load on first use: the recipes' command-line helpers (``verl_longstraw.machine``
    under summarize.py, ``python -m verl_longstraw.configs``) start without transformers or the walks, and every
    public name still resolves from the package."""
    code = ("import sys, verl_longstraw.machine, verl_longstraw.configs\n"
            "print(sorted(m for m in ('transformers', 'verl_longstraw.api') if m in sys.modules))\n"
            "import verl_longstraw\n"
            "print(all(getattr(verl_longstraw, name) is not None for name in verl_longstraw.__all__))\n")
    out = subprocess.run([sys.executable, "-c", code], text=True, capture_output=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr
    import verl_longstraw
    with pytest.raises(AttributeError, match="no attribute 'group_walk'"):
        verl_longstraw.group_walk  # noqa: B018
    assert {"Knobs", "tree_backward", "UnsupportedModelError"} <= set(dir(verl_longstraw))
