"""The settings reference is generated from tiers.yaml and must not drift from it."""
from pathlib import Path

import pytest

from gpufleet.config.schema import KEYS
from gpufleet.config.settings_doc import _comments, render

pytestmark = pytest.mark.unit
DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_docs_settings_md_is_current():
    assert DOC.read_text() == render(), "docs/settings.md is stale: run tools/settings-doc"


def test_every_setting_has_a_description():
    described = _comments()
    missing = [key for key in KEYS if key != "tier" and not described.get(key)]
    assert missing == [], f"settings without a comment in tiers.yaml defaults: {missing}"
