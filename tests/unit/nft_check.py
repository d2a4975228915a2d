"""nftables' own parser on a rendered ruleset (`nft -c`: checked, never loaded), where this machine
has nft and lets it check; the test is skipped, saying why, where it cannot."""
from __future__ import annotations

import subprocess

import pytest


def assert_nft_accepts(text: str) -> None:
    try:
        run = subprocess.run(["nft", "-c", "-f", "-"], input=text, capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        pytest.skip("nft is not installed here")
    if "Operation not permitted" in run.stderr:
        pytest.skip("nft -c needs CAP_NET_ADMIN here")
    assert run.returncode == 0, run.stderr
