"""Unit: the dev-sec sshd control table (tests/e2e/devsec_sshd.py) says what the baseline says.

Read from the copied profile (tests/fixtures/dev-sec-ssh-baseline/, commit in SOURCE.txt): every
sshd control is in the table once, each keyword and expected value is the spec's (inputs at
their defaults, version-dependent values for OpenSSH >= 8.5 from ssh_crypto.rb), and every
control where gpufleet differs has its reason in gpufleet/data/tiers.yaml."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tests.e2e.devsec_sshd import CONTROLS, SAME, Control, evaluate

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "tests" / "fixtures" / "dev-sec-ssh-baseline"
SPEC = (PROFILE / "sshd_spec.rb").read_text()
CRYPTO = (PROFILE / "ssh_crypto.rb").read_text()
BY_ID = {c.id: c for c in CONTROLS}


def _blocks() -> dict[str, str]:
    parts = re.split(r"^control '(sshd-\d+)' do$", SPEC, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _inputs() -> dict[str, str]:
    return {m[1]: m[2].strip("'") for m in re.finditer(r"^(\w+) = input\('\w+', value: ([^)]+)\)$", SPEC, re.M)}


def _crypto(name: str) -> str:
    return re.search(rf"^\s*{name} = '([^']+)'$", CRYPTO, re.M)[1]


def _resolve(arg: str):
    arg = arg.strip()
    if arg.startswith("'"):
        return arg.strip("'")
    if arg.startswith("/"):
        return arg.strip("/")
    value = _inputs().get(arg, arg)
    return {"ssh_crypto.valid_ciphers": _crypto("ciphers66"), "ssh_crypto.valid_kexs": _crypto("kex85"),
            "ssh_crypto.valid_macs": _crypto("macs66")}.get(value, value)


def test_every_control_once():
    ids = list(_blocks())
    assert len(ids) == 49 and "sshd-26" not in ids  # the profile has no sshd-26
    assert [c.id for c in CONTROLS] == ids


@pytest.mark.parametrize("control", CONTROLS, ids=lambda c: c.id)
def test_keyword_and_value_are_the_specs(control: Control):
    block = _blocks()[control.id]
    its = re.search(r"its\('(\w+)'\) \{ should (eq|cmp|match)\((.+?)\) \}", block)
    if control.kind in ("eq", "match") and control.key != "HostKey":
        assert its and its[1] == control.key
        assert _resolve(its[3]) == str(control.baseline)
        assert (its[2] == "match") == (control.kind == "match")
    elif control.kind == "absent":
        assert its and its[1] == control.key
        if control.id == "sshd-10":  # Protocol: only on OpenSSH < 7.6, which has no such keyword after
            assert "only_if { ssh_crypto.ssh_version < 7.6 }" in block and its[3] == "'2'"
        else:  # UseLogin, UsePrivilegeSeparation: nil (gone) on OpenSSH >= 7.4 / 7.5
            assert "nil" in its[3] or its[3] == "sshd_valid_privseparation"
            assert "ps75 = nil" in CRYPTO
    elif control.kind == "present":
        assert f"its('{control.key}') {{ should_not eq nil }}" in block
    elif control.key == "HostKey":
        assert "its('HostKey') { should cmp sshd_valid_hostkeys }" in block
        algs = re.search(r"alg66 = %w\(([^)]+)\)", CRYPTO)[1].split()
        assert control.baseline == [f"/etc/ssh/ssh_host_{a}_key" for a in algs]
    elif control.kind in ("dir", "file"):
        described = "sshd_custom_path" if control.kind == "dir" else '"#{sshd_custom_path}/sshd_config"'
        assert f"describe file({described})" in block
        assert ("should be_directory" if control.kind == "dir" else "should be_file") in block
        assert "should_not be_writable.by('group')" in block
    elif control.kind == "banner":
        assert "its('DebianBanner') { should eq('no') }" in block
    elif control.kind == "moduli":
        assert "$5 < 2047" in block
    elif control.kind == "procs":
        assert "processes('sshd -D')" in block and all(f"/{o}/" in block for o in control.baseline)
    elif control.kind == "rsa_bits":
        assert "'$1 < 4096 { print $1 }'" in block and "ssh_host_rsa_key" in block
    else:
        pytest.fail(f"unknown kind {control.kind}")


def test_inputs_and_versions_used():
    assert _inputs()["sshd_max_auth_tries"] == "2" and BY_ID["sshd-19"].baseline == "2"
    assert _crypto("kex85") == BY_ID["sshd-02"].baseline


def test_every_difference_is_explained_in_tiers_yaml():
    tiers = (ROOT / "gpufleet" / "data" / "tiers.yaml").read_text()
    deviating = sorted(c.id for c in CONTROLS if c.gpufleet is not SAME)
    assert deviating == ["sshd-02", "sshd-03", "sshd-14"]
    for cid in deviating:
        assert re.search(rf"#.*dev-sec {cid}\b", tiers), f"tiers.yaml does not say why gpufleet differs from {cid}"
    # stricter, never looser: gpufleet's lists are the baseline's minus weak entries, plus PQ hybrids
    for release, kex in BY_ID["sshd-02"].gpufleet.items():
        extra = set(kex.split(",")) - set(BY_ID["sshd-02"].baseline.split(","))
        assert all(k.startswith(("mlkem", "sntrup")) for k in extra), release
    assert set(BY_ID["sshd-03"].gpufleet.split(",")) < set(BY_ID["sshd-03"].baseline.split(","))
    assert set(BY_ID["sshd-14"].gpufleet) < set(BY_ID["sshd-14"].baseline)


def _recorded_sshd_t(name: str) -> dict:
    sshd_t: dict[str, list[str]] = {}
    for line in (ROOT / "tests/fixtures/ssh" / name).read_text().splitlines():
        key, _, value = line.partition(" ")
        sshd_t.setdefault(key, []).append(value)
    return {"sshd_t": sshd_t}


SSHD_T_KINDS = ("eq", "match", "present", "absent")


def test_gpufleet_before_the_baseline_failed_about_a_dozen():
    """sshd -T recorded after the hardening deploy as it was before this work
    (tests/fixtures/ssh/sshd-T-bookworm-hardened.txt), judged by the baseline's own values: the
    issue's "about a dozen" (plus sshd-05 mode, sshd-47 banner and sshd-50 RSA size, not in sshd -T)."""
    state = _recorded_sshd_t("sshd-T-bookworm-hardened.txt")
    failing = [c.id for c in CONTROLS if c.kind in SSHD_T_KINDS
               and not evaluate(dataclasses.replace(c, gpufleet=SAME), state, "bookworm")[0]]
    assert failing == ["sshd-02", "sshd-03", "sshd-13", "sshd-14", "sshd-19", "sshd-21", "sshd-24",
                       "sshd-31", "sshd-35", "sshd-36", "sshd-45"]


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_recorded_hardened_sshd_t_passes_every_control(release):
    """The same on sshd -T recorded after today's deploy: nothing fails (with gpufleet's recorded
    values), and exactly the three documented differences fail the baseline's own values."""
    state = _recorded_sshd_t(f"sshd-T-{release}-devsec.txt")
    assert [c.id for c in CONTROLS if c.kind in SSHD_T_KINDS and not evaluate(c, state, release)[0]] == []
    strict = [c.id for c in CONTROLS if c.kind in SSHD_T_KINDS
              and not evaluate(dataclasses.replace(c, gpufleet=SAME), state, release)[0]]
    assert strict == ["sshd-02", "sshd-03", "sshd-14"]
