"""The feed-forward op each adapter declares per layer (``feed_forward``), pinned per family: which layers are dense,
MoE or mixer-only, their widths and top-k (the values ``Adapter.mlp_width`` and the config's ``num_experts_per_tok``
gave before the op owned them), for the tiny families and the named models; and ``parallel/`` importing nothing above
it now that the expert plan is the feed-forward module's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verl_longstraw.adapters import adapter_on_meta
from verl_longstraw.feed_forward import Mlp, Moe, NoFeedForward
from verl_longstraw.models import CONFIGS
from verl_longstraw.tiny import TINY_CONFIGS, tiny_config, unavailable

KINDS = {Mlp: "d", Moe: "m", NoFeedForward: "-"}  # a layer's op, one letter: dense MLP, MoE, none
# family: (each layer's kind, {kind: (width, top_k)})
EXPECTED = {
    "qwen3": ("dd", {"d": (96, 0)}), "llama": ("dd", {"d": (96, 0)}), "qwen2": ("dd", {"d": (96, 0)}),
    "mistral": ("dd", {"d": (96, 0)}), "qwen3_5": ("dddd", {"d": (96, 0)}), "bamba": ("ddd", {"d": (96, 0)}),
    "lfm2": ("ddd", {"d": (96, 0)}),
    "qwen3_next": ("dmdm", {"d": (96, 0), "m": (100, 2)}), "qwen3_moe": ("dm", {"d": (96, 0), "m": (68, 2)}),
    "qwen3_5_moe": ("mmmm", {"m": (100, 2)}), "glm4_moe": ("dm", {"d": (96, 0), "m": (100, 2)}),
    "deepseek_v3": ("dmm", {"d": (96, 0), "m": (100, 2)}), "deepseek_v32": ("dmm", {"d": (96, 0), "m": (100, 2)}),
    "glm_moe_dsa": ("dmm", {"d": (96, 0), "m": (100, 2)}), "kimi_linear": ("dmm", {"d": (96, 0), "m": (100, 2)}),
    "nemotron_h": ("-m--d", {"-": (0, 0), "m": (100, 2), "d": (96, 0)}),
    "granitemoehybrid": ("mmm", {"m": (228, 2)}), "gpt_oss": ("mmmm", {"m": (388, 2)}),
    "jamba": ("dmdm", {"d": (96, 0), "m": (196, 2)}),  # the adapter's mlp_width override before the op
    "Qwen3.5-27B": ("d" * 64, {"d": (17408, 0)}),
    "GLM-5": ("ddd" + "m" * 75, {"d": (12288, 0), "m": (18688, 8)}),
    "GLM-5.2": ("ddd" + "m" * 75, {"d": (12288, 0), "m": (18688, 8)}),
    "Qwen3.5-397B-A17B": ("m" * 60, {"m": (11776, 10)}), "Qwen3.5-122B-A10B": ("m" * 48, {"m": (9472, 8)}),
}


def test_every_named_model_is_pinned():
    """The pins are the figures of ``Adapter.mlp_width`` before the op replaced it: every named model and every family
    of that time (a family added since is measured against the meter by tests/test_estimate.py, with no row here)."""
    assert set(CONFIGS) <= set(EXPECTED) <= set(TINY_CONFIGS) | set(CONFIGS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_feed_forward_per_layer(name):
    if name in TINY_CONFIGS and unavailable(name):
        pytest.skip(unavailable(name))
    config = tiny_config(name) if name in TINY_CONFIGS else CONFIGS[name]()
    ops = adapter_on_meta(config).feed_forwards
    kinds, figures = EXPECTED[name]
    assert "".join(KINDS[type(op)] for op in ops) == kinds
    assert all((op.width, op.top_k) == figures[kind] for op, kind in zip(ops, kinds, strict=True))
    assert all(op.hidden == config.get_text_config().hidden_size for op in ops)


def test_parallel_imports_nothing_above_it():
    """``parallel/`` reads only the modules below it (ops, plan, errors, lora, feed_forward, dtypes) and itself; the
    feed-forward module reads only ``errors``."""
    package = Path(__file__).resolve().parents[1] / "verl_longstraw"
    below = {"ops", "plan", "errors", "lora", "feed_forward", "dtypes"}
    for path in [*(package / "parallel").glob("*.py"), package / "feed_forward.py"]:
        level = 2 if path.parent.name == "parallel" else 1
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == level:
                allowed = {"errors"} if path.name == "feed_forward.py" else below
                assert (node.module or "").split(".")[0] in allowed, (path.name, node.module)
