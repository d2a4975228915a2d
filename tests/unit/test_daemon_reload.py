"""operations/daemon_reload.py and gpufleet/controller/reload_guard.py: what the reload guard's answer means
(its script is run on real hosts with GPU containers in tests/e2e/test_daemon_reload_gpu.py and
tests/e2e/test_docker_gpu.py)."""
from __future__ import annotations

import pytest

from gpufleet.operations.daemon_reload import UDEV_RULE_TEXT
from gpufleet.controller.reload_guard import GUARD_SCRIPT, guard_command, parse_guard, repaired


@pytest.mark.parametrize("lines,said", [
    (["RELOADED"], (True, [])),
    (["PENDING docker-b.scope docker-a.scope"], (False, ["docker-a.scope", "docker-b.scope"])),
    (["noise", "PENDING cri-containerd-1.scope\x1b[2J"], (False, ["cri-containerd-1.scope\\x1b[2J"])),  # shown escaped
    (["REPAIRED docker-a.scope 195:0", "SAFE"], (True, [])),
    (["UNSAFE docker-a.scope"], (False, ["docker-a.scope"])),
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


def test_the_scopes_it_fixed_are_read_with_their_devices():
    lines = ["REPAIRED docker-a.scope 195:0 195:255", "REPAIRED cri-containerd-b.scope 195:1", "REPAIRED", "RELOADED"]
    assert repaired(lines) == {"docker-a.scope": ["195:0", "195:255"], "cri-containerd-b.scope": ["195:1"]}


def test_the_guard_names_devices_only_through_links_to_them_all_at_once():
    # the DeviceAllow it adds is read-write on the exact /dev/char/MAJ:MIN, only after checking
    # that the link resolves to a node of that number, and never for the host's own units
    assert 'linked "$mm" || ok=0; set -- "$@" "DeviceAllow=/dev/char/$mm rw"' in GUARD_SCRIPT
    assert 'if [ "$ok" = 1 ] && systemctl set-property --runtime -- "$unit" "$@"' in GUARD_SCRIPT   # all or none
    assert "/user.slice/*|'') continue" in GUARD_SCRIPT
    assert guard_command("hold").get_raw_value().split()[-2:] == ["hold", "/run/gpufleet/daemon-reload-pending"]
    with pytest.raises(AssertionError):
        guard_command("now")
