"""The documentation's generated parts are current: docs/knobs.md is what scripts/docs_knobs.py prints from
LongStrawConfig's field docs, and every knob has one; the supported-architectures tables are what
scripts/docs_models.py writes from the adapter registry."""

import dataclasses
import re
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


def test_model_tables_are_generated_from_the_registry():
    """docs/models.md's table and README.md's short one are what scripts/docs_models.py writes from the adapters'
    declarations, so every registered model type is listed (a row per adapter class) and none that is not."""
    from verl_longstraw.adapters import supported_model_types
    from verl_longstraw.testing.scripts import load_script

    script = load_script(REPO / "scripts" / "docs_models.py")
    for page, table in script.tables().items():
        path = script.PAGES[page]
        assert path.read_text() == script.rewritten(path.read_text(), table), (
            f"{path.relative_to(REPO)}'s table is stale: run `python scripts/docs_models.py --write`")
        listed = {name for row in table.splitlines()[3:] for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[2])}
        assert listed == set(supported_model_types()), page
