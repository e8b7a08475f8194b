"""The Hydra configs shipped with verl-longstraw (installed as the package ``verl_longstraw.configs``).

``longstraw_grpo.yaml`` is the primary config: GRPO with ``strategy=longstraw`` on veRL's ``ppo_trainer``.
``recipe/<name>.yaml`` are ``@package _global_`` overlays on it, applied with ``+recipe=<name>``: the
cluster recipes and the CPU main job of ``recipes/kv_retrieval``. Locate the folder with
``python -m verl_longstraw.configs`` (shell) or :func:`config_dir` (Python)::

    python -m verl.trainer.main_ppo --config-path "$(python -m verl_longstraw.configs)" \\
        --config-name longstraw_grpo +recipe=qwen35_27b_1m ...
"""

from pathlib import Path

__all__ = ["compose_recipe", "config_dir", "recipe_names"]


def config_dir() -> Path:
    """The absolute path of the folder holding ``longstraw_grpo.yaml`` and ``recipe/``."""
    return Path(__file__).resolve().parent


def recipe_names() -> list[str]:
    """The overlays of ``recipe/``, by name."""
    return sorted(path.stem for path in (config_dir() / "recipe").glob("*.yaml"))


def compose_recipe(name: str):
    """``longstraw_grpo`` + ``+recipe=<name>`` as a recipe's launch.sh composes it (Hydra, which veRL brings), with
    a placeholder model path: an omegaconf ``DictConfig``."""
    if name not in recipe_names():
        raise ValueError(f"recipe {name!r} is not one of {recipe_names()} (configs/recipe/*.yaml)")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
        return compose(config_name="longstraw_grpo", overrides=[f"+recipe={name}", "actor_rollout_ref.model.path=x"])
