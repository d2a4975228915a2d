"""Facts and the pure pieces of the driver deploy on recorded Ubuntu 22.04 / 24.04 output
(tests/fixtures/ubuntu/, see SOURCES.md): what each fact reads there, and what the deploy
derives from it (kernel flavour and headers of HWE kernels, prebuilt modules, Secure Boot, the
archive components, the MOK certificate)."""
from __future__ import annotations

import re
import subprocess

import pytest

from gpufleet.plans.driver_preconditions import dkms_signing_conf, mok_certificate
from gpufleet.facts.driver import DebianArchiveSources, SourceEntry
from gpufleet.facts.kernel import DriverState
from gpufleet.facts.packages import AptCandidates, PackageVersions
from gpufleet.facts.system import OsRelease
from gpufleet.catalog.kernels import (image_metapackage_candidates, kernel_flavour, kernel_metapackages, module_packages,
                              package_flavour)
from gpufleet.operations.driver import _DEBIAN_ARCHIVE
from testing.ubuntu_host import MARK, UBUNTU, UbuntuHost, apt_cache_policy, recorded

RECORDED = UBUNTU / "recorded"  # whole recordings of one public host each (SOURCES.md)


def _apt_cache_stub(tmp_path, policy_file):
    """An apt-cache that prints `policy_file`'s block for the package asked (read-only)."""
    stub = tmp_path / "apt-cache"
    stub.write_text("#!/bin/sh\nawk -v p=\"$2:\" '$0==p{on=1;print;next} /^[a-z0-9]/{on=0} on' " + str(policy_file) + "\n")
    stub.chmod(0o755)
    return {"PATH": f"{tmp_path}:/usr/bin:/bin"}


@pytest.mark.parametrize("release,codename", [("22.04", "jammy"), ("24.04", "noble")])
def test_os_release(release, codename):
    rel = OsRelease().process(recorded(release, "os-release.txt"))
    assert (rel.id, rel.version_id, rel.version_codename, rel.id_like) == ("ubuntu", release, codename, ["debian"])


def test_driver_state_reads_the_running_kernel_and_secure_boot():
    jammy = DriverState().process(UbuntuHost("22.04", []).driver_state_output())
    assert (jammy.kernel_release, jammy.secure_boot, jammy.kernel_headers) == ("6.8.0-90-generic", "enabled", False)
    noble = DriverState().process(UbuntuHost("24.04", []).driver_state_output())
    assert (noble.kernel_release, noble.secure_boot) == ("6.8.0-60-generic", "disabled")
    assert noble.userspace_version is None and not noble.module_loaded


def test_secure_boot_on_recorded_two_line_mokutil_output():
    # mokutil --sb-state as recorded in setup mode (two lines; SOURCES.md): DriverState's command
    # joins its lines (tr '\n' ' '), the first decides
    recorded_lines = (RECORDED / "mokutil-sb-state-setup-mode.txt").read_text().splitlines()
    assert recorded_lines == ["SecureBoot disabled", "Platform is in Setup Mode"]
    out = [f"mokutil={' '.join(recorded_lines)} " if ln.startswith("mokutil=") else ln
           for ln in UbuntuHost("22.04", []).driver_state_output()]  # a host recorded with Secure Boot on
    assert "mokutil=SecureBoot disabled Platform is in Setup Mode " in out
    assert DriverState().process(out).secure_boot == "disabled"


def test_installed_image_metapackage_and_the_flavour_kernel_packages_follow():
    # 22.04 on the HWE kernel: the release string says "generic", the installed metapackage -hwe-22.04
    candidates = image_metapackage_candidates("6.8.0-90-generic", "ubuntu-22.04")
    assert candidates == ["linux-image-generic", "linux-image-generic-hwe-22.04"]
    installed = PackageVersions().process([f"{MARK} want {' '.join(candidates)}", f"{MARK} begin dpkg",
                                           *recorded("22.04", "dpkg-query-linux-image.txt")])
    assert installed == {"linux-image-generic": None, "linux-image-generic-hwe-22.04": "6.8.0-90.91~22.04.1",
                         # the glob's other matches: the server metapackage and its headers one
                         "linux-generic-hwe-22.04": "6.8.0-90.91~22.04.1",
                         "linux-headers-generic-hwe-22.04": "6.8.0-90.91~22.04.1"}
    assert kernel_flavour("6.8.0-90-generic") == "generic"
    assert package_flavour("6.8.0-90-generic", "ubuntu-22.04", installed) == "generic-hwe-22.04"
    # 24.04 on its GA kernel: plain generic
    candidates = image_metapackage_candidates("6.8.0-60-generic", "ubuntu-24.04")
    installed = PackageVersions().process([f"{MARK} want {' '.join(candidates)}", f"{MARK} begin dpkg",
                                           *recorded("24.04", "dpkg-query-linux-image.txt")])
    assert package_flavour("6.8.0-60-generic", "ubuntu-24.04", installed) == "generic"
    # cloud kernels have no HWE variant; Debian keeps its one metapackage
    assert image_metapackage_candidates("6.8.0-1015-aws", "ubuntu-24.04") == ["linux-image-aws"]
    assert image_metapackage_candidates("6.1.0-27-amd64", "debian-12") == ["linux-image-amd64"]


def test_apt_candidates_on_recorded_policy_and_the_module_choice():
    packages = ["linux-modules-nvidia-580-server-open-6.8.0-90-generic", "nvidia-headless-no-dkms-580-server-open"]
    policy = apt_cache_policy(recorded("22.04", "apt-cache-policy.txt"))
    got = AptCandidates().process([f"{p} {policy.get(p) or '(none)'}" for p in packages])
    assert got == {packages[0]: "6.8.0-90.91~22.04.1+1", packages[1]: "580.173.02-0ubuntu0.22.04.1"}
    prebuilt, dkms = "linux-modules-nvidia-580-server-open-{kernel}", "nvidia-dkms-580-server-open"
    assert module_packages(prebuilt, dkms, "6.8.0-90-generic", "generic-hwe-22.04", bool(got[packages[0]])) == (
        ["linux-modules-nvidia-580-server-open-generic-hwe-22.04",
         "linux-modules-nvidia-580-server-open-6.8.0-90-generic"], True)
    noble = apt_cache_policy(recorded("24.04", "apt-cache-policy.txt"))
    assert noble["linux-modules-nvidia-580-server-open-6.8.0-60-generic"] is None
    assert module_packages(prebuilt, dkms, "6.8.0-60-generic", "generic", False) == ([dkms], False)


def test_apt_cache_policy_reader_matches_the_facts_own_command(tmp_path):
    """AptCandidates' real command, with an apt-cache that prints the recorded policy (read-only)."""
    packages = ["linux-modules-nvidia-580-server-open-6.8.0-90-generic", "linux-headers-6.8.0-90-generic", "nvidia-nothing"]
    out = subprocess.run(["sh", "-c", AptCandidates().command(packages)], capture_output=True, text=True, check=True,
                         env=_apt_cache_stub(tmp_path, UBUNTU / "22.04" / "apt-cache-policy.txt")).stdout
    policy = apt_cache_policy(recorded("22.04", "apt-cache-policy.txt"))
    assert AptCandidates().process(out.splitlines()) == {p: policy.get(p) for p in packages}


def test_apt_candidates_on_a_recorded_noble_host(tmp_path):
    """AptCandidates' own command over `apt-cache policy` as recorded on an Ubuntu 24.04.4 host
    (kernel 6.8.0-134-generic, 2026-07-03): the candidates it reads, and the module choice they
    feed, with the recorded running kernel."""
    policy = RECORDED / "noble-llmserver-apt-cache-policy.txt"
    packages = ["nvidia-driver-595-open", "linux-modules-nvidia-595-open-generic",
                "linux-modules-nvidia-595-open-6.8.0-134-generic", "nvidia-dkms-595-open",
                "nvidia-firmware-595-595.58.03", "gpufleet-not-in-this-recording"]
    out = subprocess.run(["sh", "-c", AptCandidates().command(packages)], capture_output=True, text=True, check=True,
                         env=_apt_cache_stub(tmp_path, policy)).stdout
    got = AptCandidates().process(out.splitlines())
    assert got == {  # the recorded Candidate: lines, written out
        "nvidia-driver-595-open": "595.71.05-0ubuntu0.24.04.1",
        "linux-modules-nvidia-595-open-generic": "6.8.0-134.134",
        "linux-modules-nvidia-595-open-6.8.0-134-generic": "6.8.0-134.134",
        "nvidia-dkms-595-open": "595.71.05-0ubuntu0.24.04.1",
        "nvidia-firmware-595-595.58.03": "595.58.03-0ubuntu0.24.04.1",
        "gpufleet-not-in-this-recording": None,
    }
    assert got == {p: apt_cache_policy(policy.read_text().splitlines()).get(p) for p in packages}  # the double's reader
    # the recorded host: Ubuntu 24.04 on its GA kernel, generic flavour
    rel = OsRelease().process((RECORDED / "noble-llmserver-os-release.txt").read_text().splitlines())
    assert (rel.id, rel.version_id, rel.version_codename, rel.id_like) == ("ubuntu", "24.04", "noble", ["debian"])
    kernel = (RECORDED / "noble-llmserver-uname-a.txt").read_text().split()[2]  # `uname -r` is uname -a's 3rd field
    assert kernel == "6.8.0-134-generic" and kernel_flavour(kernel) == "generic"
    assert image_metapackage_candidates(kernel, "ubuntu-24.04") == ["linux-image-generic", "linux-image-generic-hwe-24.04"]
    # a prebuilt build for the running ABI exists: its flavour metapackage and the ABI's own
    # package, both names apt knows on that host; without it, DKMS
    modules, prebuilt = module_packages("linux-modules-nvidia-595-open-{kernel}", "nvidia-dkms-595-open", kernel,
                                        "generic", bool(got["linux-modules-nvidia-595-open-6.8.0-134-generic"]))
    assert (modules, prebuilt) == (["linux-modules-nvidia-595-open-generic",
                                    "linux-modules-nvidia-595-open-6.8.0-134-generic"], True)
    assert all(got[m] for m in modules)
    assert module_packages("linux-modules-nvidia-595-open-{kernel}", "nvidia-dkms-595-open", kernel, "generic",
                           bool(got["gpufleet-not-in-this-recording"])) == (["nvidia-dkms-595-open"], False)


def test_apt_candidate_on_a_recorded_jammy_host_with_an_older_version_installed(tmp_path):
    # Ubuntu 22.04, nvidia-driver-515 from restricted: installed (***) from -security, the
    # candidate a newer -updates build; the candidate is what the fact reports
    policy = RECORDED / "jammy-fileserver-apt-cache-policy.txt"
    out = subprocess.run(["sh", "-c", AptCandidates().command(["nvidia-driver-515"])], capture_output=True, text=True,
                         check=True, env=_apt_cache_stub(tmp_path, policy)).stdout
    assert AptCandidates().process(out.splitlines()) == {
        "nvidia-driver-515": "515.76+really.515.65.01-0ubuntu0.22.04.1"}
    assert apt_cache_policy(policy.read_text().splitlines()) == {
        "nvidia-driver-515": "515.76+really.515.65.01-0ubuntu0.22.04.1"}


def test_ubuntu_archive_sources_one_line_and_deb822():
    lines = [f"L /etc/apt/sources.list:{n}:{text}" for n, text in enumerate(recorded("22.04", "sources.list"), 1)
             if re.match(r"\s*deb\s", text)]
    jammy = DebianArchiveSources().process(lines)
    assert jammy[0] == SourceEntry("/etc/apt/sources.list", 2, "http://archive.ubuntu.com/ubuntu", ("main", "restricted"))
    assert all(_DEBIAN_ARCHIVE.match(e.uri) for e in jammy)
    assert [e.line for e in jammy if "restricted" not in e.components] == [4, 5, 6, 7, 10, 11]
    # deb822 (24.04): what the fact's awk prints for each stanza's Components: line
    text = recorded("24.04", "ubuntu.sources")
    stanzas = [(n, text[n - 3].split()[1], text[n - 1].split(":", 1)[1].strip())
               for n in range(1, len(text) + 1) if text[n - 1].startswith("Components:")]
    noble = DebianArchiveSources().process([f"S /etc/apt/sources.list.d/ubuntu.sources:{n}:{uri} {comps}"
                                            for n, uri, comps in stanzas])
    assert [(e.line, e.uri, e.components) for e in noble] == [
        (4, "http://archive.ubuntu.com/ubuntu/", ("main", "universe")),
        (10, "http://security.ubuntu.com/ubuntu/", ("main", "universe"))]
    assert all(_DEBIAN_ARCHIVE.match(e.uri) for e in noble)
    # still not: NVIDIA's, Docker's or a PPA
    for uri in ("https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64",
                "https://download.docker.com/linux/ubuntu", "https://download.docker.com/linux/debian",
                "https://ppa.launchpadcontent.net/graphics-drivers/ppa/ubuntu", "http://ppa.launchpad.net/graphics-drivers/ppa/ubuntu/"):
        assert not _DEBIAN_ARCHIVE.match(uri)


def test_deb822_awk_of_the_fact_reads_the_recorded_file(tmp_path):
    """DebianArchiveSources' own awk over the recorded ubuntu.sources (read-only, in a temp copy)."""
    command = DebianArchiveSources().command()
    sources = tmp_path / "sources.list.d"
    sources.mkdir()
    (sources / "ubuntu.sources").write_text((UBUNTU / "24.04" / "ubuntu.sources").read_text())
    out = subprocess.run(["sh", "-c", command.replace("/etc/apt/sources.list.d", str(sources))
                          .replace("/etc/apt/sources.list ", str(tmp_path / "none") + " ")],
                         capture_output=True, text=True, check=True).stdout
    entries = DebianArchiveSources().process(out.splitlines())
    assert [(e.line, e.uri, e.components) for e in entries] == [
        (4, "http://archive.ubuntu.com/ubuntu/", ("main", "universe")),
        (10, "http://security.ubuntu.com/ubuntu/", ("main", "universe"))]


def test_mok_certificate_follows_each_layout():
    # Ubuntu: shim-signed's MOK.priv / MOK.der (what update-secureboot-policy --new-key makes)
    assert mok_certificate("/var/lib/shim-signed/mok/MOK.priv") == "/var/lib/shim-signed/mok/MOK.der"
    # DKMS's own (Debian): mok.key / mok.pub; anything else: .pub beside it
    assert mok_certificate("/var/lib/dkms/mok.key") == "/var/lib/dkms/mok.pub"
    assert mok_certificate("/root/signing") == "/root/signing.pub"
    conf = dkms_signing_conf("/var/lib/shim-signed/mok/MOK.priv")
    assert "mok_certificate=/var/lib/shim-signed/mok/MOK.der\n" in conf


def test_kernel_flavour_metapackages_held_with_prebuilt_modules():
    # what brings new kernels: the plain flavour's and its HWE one's server, image and headers metapackages
    assert kernel_metapackages("6.8.0-90-generic", "ubuntu-22.04") == [
        "linux-generic", "linux-image-generic", "linux-headers-generic",
        "linux-generic-hwe-22.04", "linux-image-generic-hwe-22.04", "linux-headers-generic-hwe-22.04"]
    assert kernel_metapackages("6.8.0-1015-aws", "ubuntu-24.04") == ["linux-aws", "linux-image-aws", "linux-headers-aws"]
    assert kernel_metapackages("6.18.44-fc-v1045", "ubuntu-24.04") == []  # a custom kernel: nothing brings it
