"""The driver's fixed scripts (operations/driver.py, operations/driver_upgrade.py) run for real (sh, with apt/dpkg/gpg stand-ins on PATH
that record their argv): every value reaches the tools as one argument, whatever it holds, and
the messages echo values without running them."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpufleet.operations.driver import _REPO_KEY_SCRIPT
from gpufleet.operations.driver_upgrade import PACKAGE_CHANGE_SCRIPT, change_arguments

pytestmark = pytest.mark.unit

EVIL = "x'$(touch {mark})`touch {mark}`;touch {mark}"

STUBS = {
    # apt-cache madison PKG: one offered version per package, "1:580.95.05-1" style
    "apt-cache": 'printf "%s\\n" "apt-cache $*" >> "$LOG"; [ "$1" = madison ] && echo " $2 | 1:580.95.05-1 | file:/ x"; exit 0',
    "apt-get": 'printf "%s\\n" "apt-get $*" >> "$LOG"; for a; do printf "arg:%s\\n" "$a" >> "$LOG"; done',
    "apt-mark": 'printf "%s\\n" "apt-mark $*" >> "$LOG"',
    "dpkg-query": 'case "$2" in *Version*) printf 1:580.95.05-1;; *) printf "install ok installed";; esac',
}


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log)}
    return env, log


def run(script: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script, "gpufleet-test", *args], env=env, capture_output=True,
                          text=True, timeout=30)


def _change_script(tmp_path: Path) -> str:
    return PACKAGE_CHANGE_SCRIPT.replace("/var/log/gpufleet", str(tmp_path / "logs"))


def _dpkg_stub(env: dict) -> None:
    dpkg = Path(env["PATH"].split(":")[0]) / "dpkg"
    dpkg.write_text('#!/bin/sh\nprintf "%s\\n" "dpkg $*" >> "$LOG"\n')
    dpkg.chmod(0o755)


def test_change_script_puts_the_version_lock_in_first_then_exact_versions_and_holds_again(stubs, tmp_path):
    """The change all.py's first install makes (decided on the controller: operations/package_steps.py):
    NVIDIA's version lock in an apt run of its own, then everything at its exact version without
    Recommends, then the holds."""
    env, log = stubs
    _dpkg_stub(env)
    args = change_arguments({"nvidia-open": "580.95.05-1", "nvidia-driver-pinning-580.95.05": None, "cuda-toolkit": None},
                            [], ["nvidia-open"], ["cuda-toolkit", "nvidia-open"], False,
                            first=["nvidia-driver-pinning-580.95.05"], recommends=False)
    proc = run(_change_script(tmp_path), args, env)
    assert proc.returncode == 0, (tmp_path / "logs/package-change.log").read_text()
    lines = log.read_text().splitlines()
    assert lines[:2] == ["dpkg --configure -a", "apt-mark unhold nvidia-open"]
    installs = [line for line in lines if line.startswith("apt-get")]
    assert installs[0].endswith("--no-install-recommends nvidia-driver-pinning-580.95.05")
    assert installs[1].endswith("--no-install-recommends cuda-toolkit nvidia-driver-pinning-580.95.05 nvidia-open=580.95.05-1")
    assert lines[-1] == "apt-mark hold cuda-toolkit nvidia-open"


def test_change_script_holds_again_when_apt_fails(stubs, tmp_path):
    env, log = stubs
    _dpkg_stub(env)
    failing = Path(env["PATH"].split(":")[0]) / "apt-get"
    failing.write_text('#!/bin/sh\nprintf "%s\\n" "apt-get $*" >> "$LOG"; exit 100\n')
    proc = run(_change_script(tmp_path), change_arguments({"nvidia-open": "575.1-1"}, [], ["nvidia-open"],
                                                          ["nvidia-open"], False), env)
    assert proc.returncode == 100
    assert log.read_text().splitlines()[-1] == "apt-mark hold nvidia-open"


def test_repo_key_script_takes_the_url_as_one_word(tmp_path):
    mark = tmp_path / "pwned"
    evil = "file:///nonexistent/" + EVIL.format(mark=mark)
    proc = run(_REPO_KEY_SCRIPT, [evil, "/usr/share/keyrings/x.gpg", "A" * 40, str(tmp_path / "k.gpg")],
               {"PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and not mark.exists() and not (tmp_path / "k.gpg").exists()
    if Path("/usr/lib/apt/apt-helper").exists():
        assert f"cannot download the repository key from {evil}" in proc.stderr


def test_repo_key_script_refuses_a_key_with_another_fingerprint(tmp_path):
    if not Path("/usr/lib/apt/apt-helper").exists():
        pytest.skip("no apt-helper on this machine")
    home = tmp_path / "gnupg"
    home.mkdir(mode=0o700)
    try:
        _fingerprint_check(tmp_path, home)
    finally:  # key generation starts a gpg-agent for that home: stop it, leave nothing running
        subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], capture_output=True)


def _fingerprint_check(tmp_path, home):
    gpg = ["gpg", "--batch", "--homedir", str(home), "--passphrase", "", "--pinentry-mode", "loopback"]
    subprocess.run([*gpg, "--quick-gen-key", "gpufleet test <t@example.invalid>", "ed25519", "sign", "1d"],
                   check=True, capture_output=True)
    key = tmp_path / "key.asc"
    key.write_bytes(subprocess.run([*gpg, "--armor", "--export"], check=True, capture_output=True).stdout)
    proc = run(_REPO_KEY_SCRIPT, [f"file://{key}", "", "B" * 40, str(tmp_path / "k.gpg")], {"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and f"not the pinned {'B' * 40}" in proc.stderr
    assert not (tmp_path / "k.gpg").exists()
    fpr = [line.split(":")[9] for line in subprocess.run([*gpg, "--with-colons", "--list-keys"], check=True,
           capture_output=True, text=True).stdout.splitlines() if line.startswith("fpr:")][0]
    proc = run(_REPO_KEY_SCRIPT, [f"file://{key}", "", fpr, str(tmp_path / "k.gpg")], {"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "k.gpg").read_bytes()[:1] != b"-"  # dearmored


def test_unit_script_repairs_dpkg_first_and_logs_to_the_units_log(stubs, tmp_path):
    """The file the package change unit runs: dpkg --configure -a before anything else, all of
    its output in the log the runner reads back on failure."""
    env, log = stubs
    _dpkg_stub(env)
    proc = run(_change_script(tmp_path), change_arguments({"nvidia-open": "580.95.05-1"}, [], ["nvidia-open"], [], False), env)
    assert proc.returncode == 0 and proc.stdout == proc.stderr == ""
    lines = log.read_text().splitlines()
    assert lines[0] == "dpkg --configure -a" and lines[1] == "apt-mark unhold nvidia-open"
    assert "=== " in (tmp_path / "logs/package-change.log").read_text()
