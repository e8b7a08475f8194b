"""The documentation's generated parts are current: docs/knobs.md is what scripts/docs_knobs.py prints from
LongStrawConfig's field docs, and every knob has one."""

import dataclasses
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_knobs_page_is_generated_from_the_config():
    pytest.importorskip("verl", reason="the config module (verl_longstraw.integration.config) imports veRL")
    from verl_longstraw.integration.config import KNOBS, LongStrawConfig
    from verl_longstraw.testing.scripts import load_script

    documented = {f.name for f in dataclasses.fields(LongStrawConfig) if f.metadata.get("doc")}
    assert documented == set(KNOBS)
    page = load_script(REPO / "scripts" / "docs_knobs.py").render()
    assert (REPO / "docs" / "knobs.md").read_text() == page, (
        "docs/knobs.md is stale: run `python scripts/docs_knobs.py --write`")
