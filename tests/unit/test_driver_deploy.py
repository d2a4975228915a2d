"""Driver deploy pieces without a host: the facts' parsers, the exact-version match, preconditions."""
from __future__ import annotations


import subprocess
from types import SimpleNamespace

from gpufleet.plans.driver_preconditions import preconditions
from gpufleet.facts.driver import DebianArchiveSources, SourceEntry
from gpufleet.facts.packages import AptCandidates, KeyringFingerprints
from gpufleet.facts.kernel import DriverStateData
from gpufleet.plans.package_plan import at_release
from gpufleet.versions import offered_at

FPR = "EB693B3035CD5710E231E123A4B469963BF863CC"


def test_keyring_fingerprints_parse():
    assert KeyringFingerprints().process([FPR, ""]) == [FPR]


def test_apt_candidates_parse():
    assert AptCandidates().process(["linux-headers-6.1.0-26-amd64 (none)", "nvidia-driver 535.309.01-0+deb12u1"]) == {
        "linux-headers-6.1.0-26-amd64": None, "nvidia-driver": "535.309.01-0+deb12u1"}


def test_debian_sources_parse_one_line_and_deb822():
    entries = DebianArchiveSources().process([
        "L /etc/apt/sources.list:1:deb http://deb.debian.org/debian bookworm main",
        "L /etc/apt/sources.list:2:deb [signed-by=/k.gpg] http://deb.debian.org/debian-security bookworm-security main contrib # c",
        "L /etc/apt/sources.list.d/gpufleet-cuda.list:2:deb [signed-by=/k.gpg] http://127.0.0.1:1/x/ /",
        "S /etc/apt/sources.list.d/debian.sources:4:http://deb.debian.org/debian main non-free-firmware",
    ])
    assert entries == [
        SourceEntry("/etc/apt/sources.list", 1, "http://deb.debian.org/debian", ("main",)),
        SourceEntry("/etc/apt/sources.list", 2, "http://deb.debian.org/debian-security", ("main", "contrib")),
        SourceEntry("/etc/apt/sources.list.d/debian.sources", 4, "http://deb.debian.org/debian", ("main", "non-free-firmware")),
    ]


def test_a_release_is_its_whole_upstream_part_at_any_revision_and_epoch():
    for good in ("580.95.05-1", "1:580.95.05-0ubuntu1"):
        assert at_release(good, "580.95.05")
    for bad in ("580.95.051-1", "580x95.05-1", "580.95.0-5", None):
        assert not at_release(bad, "580.95.05")
    # the newest revision of the release, never one that merely starts like it
    assert offered_at("9.17.0.29", ["9.17.0.290-1", "9.17.0.29-1", "9.17.0.29-2", "1:9.17.0.2-9"]) == "9.17.0.29-2"
    assert offered_at("13.0.88-1", ["13.0.96-1", "13.0.88-1"]) == "13.0.88-1"


def settings(**kw):
    return SimpleNamespace(**{"driver_module_signing_key": "none", "driver_kernel_headers": "require", **kw})


def test_preconditions_secure_boot_needs_a_key():
    state = DriverStateData(secure_boot="enabled", kernel_headers=True, kernel_release="6.1.0-26-amd64")
    key, msg, fix = preconditions(settings(), state, False, None, None, None)
    assert key == "driver_module_signing_key" and "Secure Boot is enabled" in msg and "mokutil --import" in fix
    mok = settings(driver_module_signing_key="/var/lib/dkms/mok.key")
    key, msg, fix = preconditions(mok, state, False, False, None, None)
    assert "does not exist" in msg and "private key" in fix
    key, msg, fix = preconditions(mok, state, False, True, False, None)
    assert "/var/lib/dkms/mok.pub" in msg and "certificate" in fix
    assert preconditions(mok, state, False, True, True, None) is None
    assert preconditions(settings(), state, True, None, None, None) is None  # prebuilt, signed modules


def test_preconditions_kernel_headers():
    state = DriverStateData(secure_boot="disabled", kernel_headers=False, kernel_release="6.1.0-26-amd64")
    key, msg, fix = preconditions(settings(), state, False, None, None, False)
    assert key == "driver_kernel_headers" and "linux-headers-6.1.0-26-amd64" in msg
    assert fix.startswith("install the headers")
    assert preconditions(settings(), state, False, None, None, True) is None  # the deploy installs them
    assert preconditions(settings(driver_kernel_headers="skip"), state, False, None, None, False) is None


BAD_KEYS = ['/root/mok".key', "/root/$(touch /tmp/x).key", "/root/`id`.key", "/root/a;b.key", "/root/a\nb.key",
            "/root/../etc/shadow", "relative/mok.key", "/root/a b.key", "/root/mok.key'"]


def test_preconditions_refuse_a_signing_key_that_is_not_a_plain_path():
    state = DriverStateData(secure_boot="disabled", kernel_headers=True, kernel_release="6.1.0-26-amd64")
    for bad in BAD_KEYS:
        key, msg, fix = preconditions(settings(driver_module_signing_key=bad), state, False, None, None, None)
        assert key == "driver_module_signing_key" and "not a plain absolute path" in msg, bad
        assert fix.startswith("set it to none"), bad


def test_dkms_signing_conf_reads_back_exactly_in_bash(tmp_path):
    import pytest

    from gpufleet.plans.driver_preconditions import dkms_signing_conf

    conf = tmp_path / "signing.conf"
    conf.write_text(dkms_signing_conf("/var/lib/dkms/mok-2.key"))
    out = subprocess.run(["bash", "-c", '. "$1"; printf "%s|%s" "$mok_signing_key" "$mok_certificate"', "x", str(conf)],
                         capture_output=True, text=True, check=True).stdout
    assert out == "/var/lib/dkms/mok-2.key|/var/lib/dkms/mok-2.pub"
    for bad in BAD_KEYS:
        with pytest.raises(ValueError):
            dkms_signing_conf(bad)
