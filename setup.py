"""Package layout (everything else is in pyproject.toml): the code under verl_longstraw/, and the
top-level configs/ folder installed as the package verl_longstraw.configs. pyproject.toml cannot
combine package discovery with one package mapped from another folder, hence this file."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["verl_longstraw*"]), "verl_longstraw.configs"],
    package_dir={"verl_longstraw.configs": "configs"},
)
