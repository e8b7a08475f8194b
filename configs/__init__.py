"""The Hydra configs shipped with verl-longstraw (installed as the package ``verl_longstraw.configs``).

``longstraw_grpo.yaml`` is the primary config: GRPO with ``strategy=longstraw`` on veRL's ``ppo_trainer``.
``recipe/<name>.yaml`` are ``@package _global_`` overlays on it, applied with ``+recipe=<name>``: the
cluster recipes and the CPU main job of ``recipes/kv_retrieval``. Locate the folder with
``python -m verl_longstraw.configs`` (shell) or :func:`config_dir` (Python)::

    python -m verl.trainer.main_ppo --config-path "$(python -m verl_longstraw.configs)" \\
        --config-name longstraw_grpo +recipe=qwen35_27b_1m ...
"""

from pathlib import Path

__all__ = ["config_dir"]


def config_dir() -> Path:
    """The absolute path of the folder holding ``longstraw_grpo.yaml`` and ``recipe/``."""
    return Path(__file__).resolve().parent
