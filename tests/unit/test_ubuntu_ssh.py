"""Unit: SSH hardening on Ubuntu 22.04 and 24.04, proven on output from public sources
(tests/fixtures/ubuntu/ssh/SOURCES.md) since no Ubuntu host can be built here:

- the facts read Ubuntu's os-release and OpenSSH version lines (recorded), `sshd -T` recorded on
  Ubuntu 24.04 with ssh.socket listening, and `systemctl show ssh.socket ssh.service`
  (constructed for Ubuntu: socket-activated 24.04, idle socket on another port, 22.04's plain
  daemon; recorded on a Debian 13 test host switched to ssh.socket);
- the first release of every algorithm gpufleet writes agrees with the `ssh -Q` lists of
  OpenSSH 8.9p1, 9.2p1, 9.6p1, 9.9p1 and 10.0p2 (derived from openssh-portable at those tags);
- every keyword and algorithm of the rendered drop-in is accepted by 8.9p1 (Ubuntu 22.04) and
  9.6p1 (24.04), every key the deploy checks in `sshd -T` is one those sshd print, and an
  algorithm 8.9 lacks (mlkem768x25519-sha256) is refused at planning time;
- the hardening deploy, planned by pyinfra on Ubuntu 24.04 facts (the recorded `sshd -T`) with ssh.socket active,
  takes the socket-aware path (restart of a running ssh.service, never SIGHUP, ssh.socket and
  its ports left alone, the firewall opening the socket's port) and quiets needrestart.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.deploy import add_deploy
from pyinfra.api.host import Host
from pyinfra.context import ctx_host, ctx_state

import gpufleet.facts.nftables as nf
import gpufleet.facts.ssh as fs
import gpufleet.facts.sshd_files as sf
from gpufleet.operations import needrestart
from gpufleet.deploys import hardening as h
from gpufleet.facts.system import parse_os_release
from gpufleet.catalog import sshd_support
from gpufleet.catalog.sshd_policy import expected_sshd
from gpufleet.catalog.tiers import tier_defaults
from gpufleet.operations import ssh as ssh_ops

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
UBUNTU = FIXTURES / "ubuntu" / "ssh"
CLASSIC = list(tier_defaults("dev")["hardening_extra_kex"])
VERSIONS = {"8.9p1": (8, 9), "9.2p1": (9, 2), "9.6p1": (9, 6), "9.9p1": (9, 9), "10.0p2": (10, 0)}
# Keywords Debian's and Ubuntu's openssh packaging adds (debian-banner.patch); documented in
# Ubuntu's sshd_config(5) for jammy and noble (SOURCES.md), accepted by the Debian test hosts.
DISTRIBUTION_KEYWORDS = {"debianbanner"}


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def ssh_q(version: str, family: str) -> set[str]:
    return set(lines(UBUNTU / f"openssh-{version}-ssh-Q-{family}.txt"))


def keywords(version: str) -> dict[str, str]:
    return dict(line.split() for line in lines(UBUNTU / f"openssh-{version}-sshd-keywords.txt"))


# --- facts on Ubuntu's output ---------------------------------------------------------------


@pytest.mark.parametrize("release, codename, version_file, version", [
    ("22.04", "jammy", "ssh-V-22.04.txt", (8, 9)),     # jammy-updates, openssh 1:8.9p1-3ubuntu0.10
    ("22.04", "jammy", "ssh-V-22.04-ga.txt", (8, 9)),  # jammy's release pocket, 1:8.9p1-3
    ("24.04", "noble", "ssh-V-24.04.txt", (9, 6)),     # noble-updates, 1:9.6p1-3ubuntu13.4
])
def test_ubuntu_os_release_and_sshd_version(release, codename, version_file, version):
    # recorded lines (SOURCES.md); SshdVersion falls back to `ssh -V` when sshd prints no OpenSSH_ line
    os_release = parse_os_release(lines(UBUNTU / f"os-release-{release}.txt"))
    assert (os_release.id, os_release.version_id, os_release.version_codename) == ("ubuntu", release, codename)
    recorded = lines(UBUNTU / version_file)
    sshd = fs.parse_openssh_version(recorded)
    assert sshd.version == version and sshd.portable == 1 and sshd.raw == recorded[0]
    assert fs.SshdVersion().process(recorded) == sshd
    assert sshd.at_least(8, 5) and not sshd.at_least(9, 9)  # sntrup761 yes, ML-KEM no
    assert h.kex_algorithms(sshd, CLASSIC) == ["sntrup761x25519-sha512@openssh.com", "curve25519-sha256@libssh.org"]


def test_ubuntu_2404_socket_activation():
    active = fs.parse_sshd_activation(lines(UBUNTU / "systemctl-show-ssh-24.04-socket.txt"))
    assert active.socket_activated and active.accept is False
    assert active.ports == [22] and active.service_active == "active" and active.service_file_state == "disabled"
    idle = fs.parse_sshd_activation(lines(UBUNTU / "systemctl-show-ssh-24.04-socket-idle-port-2222.txt"))
    assert idle.socket_activated and idle.ports == [2222] and idle.service_active == "inactive"


def test_ubuntu_2204_runs_a_plain_daemon():
    jammy = fs.parse_sshd_activation(lines(UBUNTU / "systemctl-show-ssh-22.04.txt"))
    assert not jammy.socket_activated and jammy.ports == [] and jammy.accept is True
    assert jammy.service_active == "active"


def test_activation_recorded_on_debian_13():
    # tests/fixtures/ssh/COMMANDS.txt: the same command on a trixie test host, before and after
    # `systemctl disable --now ssh.service; systemctl enable --now ssh.socket` (ListenStream on
    # the host's 127.0.X.Y:22), with ssh.service running and idle
    default = fs.parse_sshd_activation(lines(FIXTURES / "ssh" / "systemctl-show-ssh-trixie-default.txt"))
    assert not default.socket_activated and default.ports == []
    running = fs.parse_sshd_activation(lines(FIXTURES / "ssh" / "systemctl-show-ssh-trixie-socket-activated.txt"))
    idle = fs.parse_sshd_activation(lines(FIXTURES / "ssh" / "systemctl-show-ssh-trixie-socket-idle.txt"))
    assert running.socket_activated and running.service_active == "active" and running.ports == [22]
    assert idle.socket_activated and idle.service_active == "inactive" and idle.ports == [22]
    missing = fs.parse_sshd_activation(lines(FIXTURES / "ssh" / "systemctl-show-nosuch-socket-trixie.txt"))
    assert missing.socket_load == "" and not missing.socket_activated  # ssh.socket absent: its block is nosuch's
    assert fs.parse_sshd_activation([]) == fs.SshdActivationData()  # no systemd: a plain daemon
    with pytest.raises(fs.SshFactError):
        fs.parse_sshd_activation(["ActiveState=active", "", "Id=ssh.service"])


# Keywords Debian's packaging (hence Ubuntu's) adds to what `sshd -T` prints: debian-banner.patch
# and the GSSAPI key-exchange patch (gssapi.patch); upstream's dump_config() prints none of them
DISTRIBUTION_PRINTED = {"debianbanner", "gssapikeyexchange", "gssapistorecredentialsonrekey", "gssapikexalgorithms",
                        "gssapistrictacceptorcheck"}
# what dump_config() prints only when set (empty lists print nothing)
PRINTED_WHEN_SET = {"allowusers", "denyusers", "allowgroups", "denygroups", "hostcertificate", "setenv", "logverbose"}


def test_sshd_t_recorded_on_ubuntu_2404():
    """`sshd -T` of an Ubuntu 24.04.4 host whose port 22 is held by systemd (ssh.socket) and
    sshd (SOURCES.md): what the fact reads there, and that it is the 9.6p1 source's keyword list
    plus Debian's patches."""
    recorded = lines(SSHD_T["24.04"])
    config = fs.parse_sshd_t(recorded)
    assert config.ports == [22] and config.get_list("port") == ["22"]
    assert config.get_list("listenaddress") == ["[::]:22", "0.0.0.0:22"]
    assert config.get_list("hostkey") == ["/etc/ssh/ssh_host_rsa_key", "/etc/ssh/ssh_host_ecdsa_key",
                                          "/etc/ssh/ssh_host_ed25519_key"]
    assert config.get_list("subsystem") == ["sftp /usr/lib/openssh/sftp-server"]  # its trailing blank dropped
    assert (config.get("usepam"), config.get("kbdinteractiveauthentication"), config.get("debianbanner")) == (
        "yes", "no", "yes")
    assert config.algorithms("kexalgorithms")[0] == "sntrup761x25519-sha512@openssh.com"
    assert "mlkem768x25519-sha256" not in config.algorithms("kexalgorithms")
    families = {"kexalgorithms": "kex", "ciphers": "cipher", "macs": "mac", "hostkeyalgorithms": "HostKeyAlgorithms",
                "pubkeyacceptedalgorithms": "HostKeyAlgorithms", "casignaturealgorithms": "HostKeyAlgorithms"}
    for key, family in families.items():
        assert set(config.algorithms(key)) <= ssh_q("9.6p1", family), key
    printed = {line.split(" ", 1)[0] for line in recorded}
    derived = set(lines(UBUNTU / "openssh-9.6p1-sshd-T-keywords.txt"))
    assert printed - derived == DISTRIBUTION_PRINTED
    assert derived - printed == PRINTED_WHEN_SET
    # every key the hardening deploy checks after its change is one this sshd prints, here or,
    # for AllowUsers/AllowGroups the drop-in sets, once set
    sshd = fs.parse_openssh_version(lines(UBUNTU / "ssh-V-24.04.txt"))
    expected = set(_expected(sshd, CLASSIC))
    assert expected - printed == {"allowusers", "allowgroups"} and expected <= printed | PRINTED_WHEN_SET


# --- what each OpenSSH release accepts ------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_first_release_of_each_algorithm_matches_the_source(version):
    major_minor = VERSIONS[version]
    for family, since in sshd_support.SINCE.items():
        have = ssh_q(version, family)
        for name, first in since.items():
            assert (name in have) == (major_minor >= first), (version, family, name)


def test_mlkem_only_from_99_sntrup_in_89():
    assert "mlkem768x25519-sha256" not in ssh_q("8.9p1", "kex") | ssh_q("9.6p1", "kex")
    assert "mlkem768x25519-sha256" in ssh_q("9.9p1", "kex")
    assert "sntrup761x25519-sha512@openssh.com" in ssh_q("8.9p1", "kex")
    assert "sntrup761x25519-sha512" not in ssh_q("9.6p1", "kex")  # the un-suffixed alias is 9.9's


def _rendered(version: fs.OpenSshVersion, **over) -> str:
    settings = {"hardening_extra_kex": CLASSIC, **over}
    ctx = _ctx(version, settings["hardening_extra_kex"])
    return h.render("etc/ssh/sshd_config.d/00-gpufleet-hardening.conf.j2", **ctx)


def _settings(extra_kex, allow_users=("root",), allow_groups=("gpu",)):
    from types import SimpleNamespace

    return SimpleNamespace(**{**tier_defaults("dev"), "hardening_extra_kex": list(extra_kex),
                              "hardening_allow_users": list(allow_users), "hardening_allow_groups": list(allow_groups)})


def _ctx(version, extra_kex, **lists):
    return h.sshd_context(_settings(extra_kex, **lists), version)


def _expected(version, extra_kex, **lists) -> dict:
    """What the deploy checks in `sshd -T` after its reload (gpufleet/catalog/sshd_policy.py)."""
    settings = _settings(extra_kex, **lists)
    return expected_sshd(settings, h.sshd_algorithms(h.sshd_context(settings, version)))


@pytest.mark.parametrize("version, release", [("8.9p1", "22.04"), ("9.6p1", "24.04")])
def test_rendered_dropin_is_accepted_by_ubuntus_openssh(version, release):
    sshd = fs.parse_openssh_version(lines(UBUNTU / f"ssh-V-{release}.txt"))
    text = _rendered(sshd)
    table = keywords(version)
    families = {"kexalgorithms": "kex", "ciphers": "cipher", "macs": "mac", "hostkeyalgorithms": "HostKeyAlgorithms"}
    written = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, value = line.partition(" ")
        key = keyword.lower()
        written.append(key)
        if key in DISTRIBUTION_KEYWORDS:
            continue
        assert key in table, f"{keyword} is not an sshd_config keyword of OpenSSH {version}"
        assert table[key] not in ("sDeprecated", "sUnsupported"), f"{keyword} is {table[key]} in {version}"
        if key in families:
            unknown = set(value.split(",")) - ssh_q(version, families[key])
            assert not unknown, f"{keyword}: OpenSSH {version} has no {sorted(unknown)}"
    # what the socket-aware path relies on: never a listening option (ssh.socket owns those)
    assert not {"port", "listenaddress", "addressfamily"} & set(written)
    assert {"kexalgorithms", "ciphers", "macs", "hostkeyalgorithms", "debianbanner"} <= set(written)
    # every key the deploy then checks in `sshd -T` is one this sshd prints
    printed = set(lines(UBUNTU / f"openssh-{version}-sshd-T-keywords.txt"))
    expected = _expected(sshd, CLASSIC)
    assert set(expected) <= printed, sorted(set(expected) - printed)


def test_an_algorithm_the_host_lacks_is_refused_at_planning():
    jammy = fs.parse_openssh_version(lines(UBUNTU / "ssh-V-22.04.txt"))
    [problem] = sshd_support.rejected_algorithms(jammy, {"kex": ["mlkem768x25519-sha256", "curve25519-sha256"]})
    assert problem == ("KexAlgorithms: mlkem768x25519-sha256 (OpenSSH 9.9 and later); "
                       "this host's sshd is OpenSSH 8.9p1")
    assert sshd_support.rejected_algorithms(fs.OpenSshVersion(10, 0, 2), {"kex": ["mlkem768x25519-sha256"]}) == []
    assert sshd_support.rejected_algorithms(jammy, {"kex": ["no-such-kex@gpufleet.invalid"]}) == []  # left to sshd -t
    assert "mlkem768x25519-sha256" not in sshd_support.available(jammy, "kex")


# --- the deploy, planned by pyinfra on canned Ubuntu 24.04 facts -------------------------------


# `sshd -T` recorded on Ubuntu 24.04.4 with ssh.socket listening (SOURCES.md); for 22.04 no full
# public recording was found: the Debian 12 recording of the same packaging stands in there
SSHD_T = {"24.04": UBUNTU / "sshd-T-24.04.txt", "22.04": FIXTURES / "ssh" / "sshd-T-bookworm-debian-default.txt"}


def _canned(activation_file: Path, version_file: Path, needrestart: bool = True, sshd_t: Path = SSHD_T["24.04"]) -> dict:
    return {
        "SshdVersion": fs.parse_openssh_version(lines(version_file)),
        "SshdActivation": fs.parse_sshd_activation(lines(activation_file)),
        "SshdEffectiveConfig": fs.parse_sshd_t(lines(sshd_t)),
        "AuthorizedKeys": fs.parse_authorized_keys(lines(FIXTURES / "ssh" / "authorized-keys-trixie-root.txt")),
        "SmallModuli": fs.parse_moduli_counts(lines(FIXTURES / "ssh" / "moduli-trixie-debian-default.txt")),
        "SshdFiles": sf.parse_sshd_files(lines(FIXTURES / "ssh" / "sshd-files-trixie-debian-default.txt")),
        "NftablesCapability": nf.parse_nftables_state(lines(FIXTURES / "ssh" / "nftables-state-trixie-container.txt")),
        ("Directory", "/etc/needrestart"): {"mode": 755} if needrestart else None,
    }


def plan(monkeypatch, canned: dict, host_data: dict | None = None):
    """Plan deploys/hardening.py with pyinfra's own API for one SSH host whose facts are
    `canned` (anything else: the fact's default, as for a fresh host). Returns
    (state, host, [(operation name, [command text])])."""

    def get_fact(self, cls, *args, **kwargs):
        key = (cls.__name__, kwargs.get("path"))
        if key in canned:
            return canned[key]
        if cls.__name__ in canned:
            return canned[cls.__name__]
        return cls.default()

    monkeypatch.setattr(Host, "get_fact", get_fact)
    name = "gpu-ubuntu.example.internal"
    inventory = Inventory(([(name, {"tier": "dev", "ssh_user": "root", **(host_data or {})})], {}))
    state = State(inventory, Config())
    host = inventory.get_host(name)
    state.activate_host(host)
    ops = []
    with ctx_state.use(state):
        add_deploy(state, h.hardening)
        with ctx_host.use(host):
            for op_hash in state.get_op_order():
                [op_name] = state.op_meta[op_hash].names
                data = state.get_op_data_for_host(host, op_hash)
                commands = [str(getattr(c, "get_raw_value", lambda c=c: c)()) for c in data.command_generator()]
                ops.append((op_name.split(" | ", 1)[1], commands))
    return state, host, ops


def test_hardening_on_ubuntu_2404_with_ssh_socket_plans_the_socket_aware_path(monkeypatch):
    canned = _canned(UBUNTU / "systemctl-show-ssh-24.04-socket.txt", UBUNTU / "ssh-V-24.04.txt")
    _, _, ops = plan(monkeypatch, canned)
    names = [name for name, _ in ops]
    # install, arm, restart, prove and disarm in one operation: the revert timer spans this
    # host's own steps, never the rest of the fleet's operations
    [(name, commands)] = [(n, c) for n, c in ops if n.startswith("Install the hardened sshd drop-in")]
    assert "restart a running socket-activated sshd" in name and "ssh.socket and its ports (22) alone" in name
    install, restart, prove = commands[-3:]
    assert "systemd-run" in install and "sshd -t" in install  # revert timer armed, candidate judged
    assert "systemctl try-restart ssh.service" in restart and "is-active --quiet ssh.socket" in restart
    assert "_verify_or_restore" in prove  # the fresh login, which disarms the timer or restores
    every = " ".join(" ".join(c) for _, c in ops)
    assert "systemctl reload ssh.service" not in every.replace("else systemctl reload ssh.service", "")
    assert "sshd.service" not in every  # Ubuntu 24.04 has no such alias under socket activation
    assert not re.search(r"(restart|stop|start|reload)[^;]*ssh\.socket", every), "ssh.socket is never touched"
    assert not any(n.startswith("Reload sshd") for n in names)
    # the drop-in written holds OpenSSH 9.6's algorithms only
    [put] = [c for n, c in ops if n.startswith("Install the hardened sshd drop-in")]
    assert "mlkem768x25519" not in " ".join(put)
    # needrestart asks nothing and restarts nothing, before the first apt install
    quiet = names.index("Quiet needrestart")
    assert quiet < names.index("Install nftables and unattended-upgrades")
    # the firewall opens the socket's port
    assert any("Load the firewall atomically" in n or "Write the firewall ruleset" in n for n in names)


def test_the_firewall_opens_the_port_ssh_socket_listens_on(monkeypatch):
    canned = _canned(UBUNTU / "systemctl-show-ssh-24.04-socket-idle-port-2222.txt", UBUNTU / "ssh-V-24.04.txt")
    seen = {}
    real = h.nftables_context
    monkeypatch.setattr(h, "nftables_context", lambda settings, ports: seen.setdefault("ports", ports) and real(settings, ports))
    _, _, ops = plan(monkeypatch, canned)
    assert seen["ports"] == [22, 2222]  # sshd -T's port 22 and the socket's 2222: both stay reachable
    assert any("its ports (2222) alone" in n for n, _ in ops)


def test_plain_daemon_keeps_the_reload(monkeypatch):
    canned = _canned(UBUNTU / "systemctl-show-ssh-22.04.txt", UBUNTU / "ssh-V-22.04.txt", needrestart=False,
                     sshd_t=SSHD_T["22.04"])
    _, _, ops = plan(monkeypatch, canned)
    names = [n for n, _ in ops]
    [name] = [n for n in names if n.startswith("Install the hardened sshd drop-in")]
    assert "reload sshd," in name and "socket-activated" not in name
    assert not any("needrestart" in n for n in names)  # not installed: nothing written


def test_ubuntu_2204_refuses_a_kex_its_openssh_lacks_before_any_change(monkeypatch, caplog):
    canned = _canned(UBUNTU / "systemctl-show-ssh-22.04.txt", UBUNTU / "ssh-V-22.04.txt", sshd_t=SSHD_T["22.04"])
    with caplog.at_level(logging.ERROR, logger="pyinfra"), pytest.raises(Exception, match="No hosts remaining"):
        plan(monkeypatch, canned, {"hardening_extra_kex": ["mlkem768x25519-sha256", "curve25519-sha256@libssh.org"]})
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "refused (hardening_extra_kex): KexAlgorithms: mlkem768x25519-sha256 (OpenSSH 9.9 and later)" in message
    assert "OpenSSH 8.9p1" in message
    assert "Fix: use only what this host's sshd offers: " in message and "curve25519-sha256" in message


def test_needrestart_never_restarts_nor_asks():
    text = needrestart.NEEDRESTART_TEXT
    assert "$nrconf{restart} = 'l';" in text       # list only: no service restarted behind a job
    assert "$nrconf{kernelhints} = -1;" in text    # kernel hints to stderr, no acknowledgement
    assert needrestart.NEEDRESTART_CONF.startswith("/etc/needrestart/conf.d/")


def test_unattended_upgrades_origins_for_ubuntu_and_debian():
    text = h.render("etc/apt/apt.conf.d/51gpufleet-unattended-upgrades.j2", blacklist=list(h.GPU_PACKAGE_BLACKLIST))
    block = text.split("Unattended-Upgrade::Origins-Pattern {", 1)[1].split("};", 1)[0]
    patterns = re.findall(r'"([^"]+)"', block)

    def allowed(origin: dict) -> bool:  # unattended-upgrades' match_whitelist_string, keys o/l/a/n
        keys = {"origin": "o", "label": "l", "archive": "a", "codename": "n"}
        for pattern in patterns:
            fields = dict(part.split("=", 1) for part in pattern.split(","))
            if all(origin.get(keys[k]) == v.replace("${distro_codename}", origin["codename_of_host"])
                   for k, v in fields.items()):
                return True
        return False

    # Release files: Ubuntu's pockets (Origin/Label Ubuntu, Suite noble-*), Debian's security archive
    noble = {"o": "Ubuntu", "l": "Ubuntu", "n": "noble", "codename_of_host": "noble"}
    assert allowed({**noble, "a": "noble-security"}) and allowed({**noble, "a": "noble"})
    assert not allowed({**noble, "a": "noble-updates"}) and not allowed({**noble, "a": "noble-proposed"})
    assert allowed({"o": "UbuntuESMApps", "l": "Ubuntu", "a": "noble-apps-security", "n": "noble",
                    "codename_of_host": "noble"})
    assert allowed({"o": "Debian", "l": "Debian-Security", "a": "stable-security", "n": "bookworm-security",
                    "codename_of_host": "bookworm"})
    assert not allowed({"o": "Debian", "l": "Debian", "a": "stable-updates", "n": "bookworm-updates",
                        "codename_of_host": "bookworm"})
    assert not allowed({"o": "NVIDIA", "l": "NVIDIA CUDA", "a": "", "n": "", "codename_of_host": "noble"})
    blacklist = re.findall(r'^\t"(\^[^"]+)";$', text, re.M)
    for package in ["linux-modules-nvidia-550-server-generic", "linux-modules-nvidia-570-6.8.0-60-generic",
                    "linux-objects-nvidia-570-6.8.0-60-generic", "linux-signatures-nvidia-6.8.0-60-generic",
                    "nvidia-driver-570-server-open", "nvidia-dkms-570-open", "libnvidia-compute-570"]:
        assert any(re.match(p, package) for p in blacklist), package
    for package in ["linux-image-generic", "linux-headers-generic", "linux-modules-6.8.0-60-generic", "openssh-server"]:
        assert not any(re.match(p, package) for p in blacklist), package


def test_every_reload_path_is_socket_aware():
    # the revert timer, the in-run restore, settle_pending and host-key reloads all decide on
    # the host: restart ssh.service under ssh.socket, reload a plain daemon
    for script in (ssh_ops._REVERT, ssh_ops._RESTORE_SCRIPT, ssh_ops.RELOAD_SSHD_SCRIPT):
        assert "is-active --quiet ssh.socket; then systemctl try-restart ssh.service" in script
    from gpufleet.operations import sshd_files
    assert "is-active --quiet ssh.socket; then systemctl try-restart ssh.service" in sshd_files._RESTORE_KEY_SCRIPT
