"""End-to-end: gpufleet/pyinfra_private.py's patches give pyinfra's own answers on a real
test host (real sshd, systemd, apt, over pyinfra's ssh connector).

The same facts are asked in fresh processes: with the patches off (a pyinfra release gpufleet
was not verified with: pyinfra's plain path, one command per fact), with them on (the memo),
and on again with last run's plan (the prefetch: one remote script, files and units batched).
Every answer must be equal; only the number of commands may differ.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testing import testhosts

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys
from pathlib import Path
import pyinfra_cli  # noqa: F401  (gevent, as the CLI)
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.facts import get_fact
from pyinfra.api.host import Host
from pyinfra.facts import deb, files, server, systemd

from gpufleet.controller import factcache
from gpufleet import pyinfra_private
from gpufleet.facts.gpu import GpuState
from gpufleet.facts.packages import HeldPackages, PackageVersions, StackPackages
from gpufleet.facts.ssh import SshdVersion
from gpufleet.facts.system import OsRelease

mode, name, data, plans = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
if mode == "off":
    pyinfra_private.pyinfra_version = lambda: "3.99.0"
factcache.PLAN_DIR = Path(plans)
factcache.install()
QUESTIONS = [
    (files.File, {"path": "/etc/hostname"}), (files.File, {"path": "/etc/debian_version"}),
    (files.File, {"path": "/nonexistent/file"}), (files.Directory, {"path": "/etc/ssh"}),
    (files.Directory, {"path": "/etc/hostname"}), (files.Directory, {"path": "/nonexistent"}),
    (files.Sha1File, {"path": "/etc/os-release"}), (files.Sha256File, {"path": "/etc/os-release"}),
    (files.Sha1File, {"path": "/etc/ssh"}), (files.Sha256File, {"path": "/nonexistent"}),
    (files.FileContents, {"path": "/etc/debian_version"}),
    (systemd.SystemdStatus, {"services": "ssh.service"}), (systemd.SystemdEnabled, {"services": "ssh.service"}),
    (systemd.SystemdStatus, {"services": ["systemd-journald.service", "no-such-unit.service"]}),
    (systemd.SystemdEnabled, {"services": ["systemd-journald.service", "no-such-unit.service"]}),
    (deb.DebPackages, {}), (deb.DebPackage, {"package": "openssh-server"}), (server.Arch, {}), (server.Os, {}),
    (OsRelease, {}), (SshdVersion, {}), (GpuState, {}),
    # gpufleet's facts that read dpkg's database: with DebPackages, one dpkg-query in the prefetch
    (HeldPackages, {}), (PackageVersions, {"packages": ["openssh-server", "nosuch-gpufleet-pkg", "libc[0-9]*"]}),
    (PackageVersions, {"packages": "sudo"}), (StackPackages, {"packages": ["openssh-server", "lib*"]}),
]
inventory = Inventory(([(name, data)], {}))
state = State(inventory, Config())
connect_all(state)
host = inventory.get_host(name)
commands = []
counted = Host.run_shell_command
def counting(self, *args, **kwargs):
    commands.append(1)
    return counted(self, *args, **kwargs)
Host.run_shell_command = counting
factcache.prefetch_all(state)
answers = [[get_fact(state, host, cls, kwargs=dict(kwargs)) for cls, kwargs in QUESTIONS] for _ in range(2)]
disconnect_all(state)  # writes the host's fact plan (gpufleet/controller/run_end.py)
print(json.dumps({"answers": answers, "commands": len(commands), "patched": list(pyinfra_private.patched())},
                 default=lambda o: o.to_json() if hasattr(o, "to_json") else repr(o) if not isinstance(o, set) else sorted(o)))
'''


def _ask(mode: str, host, plans: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, host.name, json.dumps(host.pyinfra_data()), str(plans)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def answers(hostpool, tmp_path_factory):
    # reached as root: on the release pretended unknown ("off") a sudo password is refused,
    # never sent (gpufleet/controller/askpass.py), and the deploy user's sudo asks for one
    host = hostpool.get("pyinfra-private", 1, ssh_user="root")[0]
    # a package on hold, for HeldPackages and DebPackages' "hi" to have one
    testhosts.ssh(host, "apt-mark hold openssh-server >/dev/null")
    plans = tmp_path_factory.mktemp("plans")
    _ask("off", host, tmp_path_factory.mktemp("unused"))  # every file read once: atimes settle
    got = {"off": _ask("off", host, tmp_path_factory.mktemp("unused")),
           "memo": _ask("on", host, plans),  # no plan yet: the memo alone; writes the plan
           "prefetch": _ask("on", host, plans)}
    print("remote commands for the same facts asked twice:",
          ", ".join(f"{mode} {answers['commands']}" for mode, answers in got.items()))
    return got


def test_the_patches_are_off_on_an_unknown_release_and_on_here(answers):
    # only the guard that refuses to send a sudo password (gpufleet/controller/askpass.py): no speed-up
    assert all(name.endswith(("make_unix_command_for_host", "Host.disconnect")) for name in answers["off"]["patched"])
    assert "pyinfra.api.facts._get_fact" not in answers["off"]["patched"]
    assert "pyinfra.api.facts._get_fact" in answers["memo"]["patched"]


def test_patched_answers_equal_pyinfras_own(answers):
    off = answers["off"]["answers"]
    assert off[0] == off[1]  # pyinfra asked twice: the host did not change in between
    assert off[0][0] is not None and off[0][2] is None  # real answers, and a missing file's default
    for mode in ("memo", "prefetch"):
        for got in answers[mode]["answers"]:
            assert got == off[0], mode


def test_the_patches_save_commands(answers):
    n = len(answers["off"]["answers"][0])
    assert answers["off"]["commands"] == 2 * n  # pyinfra's plain path: one command per fact, every time
    assert answers["memo"]["commands"] == n  # each question once
    assert answers["prefetch"]["commands"] < n // 2  # one script for last run's facts, the rest alone
