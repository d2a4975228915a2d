"""operations/daemon_reload.py: what the reload gate's answer means (its script is run on real
hosts with GPU containers in tests/e2e/test_daemon_reload_gpu.py)."""
from __future__ import annotations

import pytest

from gpufleet.operations.daemon_reload import UDEV_RULE_TEXT, parse_guard


@pytest.mark.parametrize("lines,said", [
    (["RELOADED"], (True, [])),
    (["PENDING docker-b.scope docker-a.scope"], (False, ["docker-a.scope", "docker-b.scope"])),
    (["noise", "PENDING cri-containerd-1.scope\x1b[2J"], (False, ["cri-containerd-1.scope\\x1b[2J"])),  # shown escaped
])
def test_the_gate_says_reloaded_or_the_units_it_deferred_for(lines, said):
    assert parse_guard(lines) == said


def test_an_answer_that_says_neither_is_a_failure():
    with pytest.raises(ValueError):
        parse_guard(["Failed to reload daemon: Access denied"])
    with pytest.raises(ValueError):
        parse_guard([])


def test_the_udev_rule_is_nvidias():
    # NVIDIA/nvidia-docker#1671: the rule NVIDIA gives, run when the driver binds
    assert ('ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
            'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"') in UDEV_RULE_TEXT
