"""gpufleet/versions.py: Debian version order (dpkg's algorithm), which decides whether a rollout
move passes apt --allow-downgrades (operations/driver_upgrade.py)."""
import shutil
import subprocess

import pytest

from gpufleet.versions import debian_compare, debian_older, downgraded

pytestmark = pytest.mark.unit

# (a, b, expected sign of a compared to b): deb-version(7) and dpkg's own test cases
CASES = [
    ("580.95.05-1", "580.126.09-1", -1),       # numeric, not lexical: 95 < 126
    ("580.126.09-1", "580.95.05-1", 1),
    ("580.95.05-1", "580.95.05-1", 0),
    ("580.95.05-1", "580.95.5-1", 0),          # leading zeros do not count
    ("1:580.95.05-1", "580.126.09-1", 1),      # the epoch first
    ("0:580.95.05-1", "580.95.05-1", 0),       # no epoch is epoch 0
    ("1:9.17.0.29-1", "2:9.16.0.29-1", -1),
    ("10:1.0", "9:2.0", 1),                    # epochs compare numerically
    ("1.0~rc1-1", "1.0-1", -1),                # a tilde sorts before the end
    ("1.0~~", "1.0~", -1),
    ("1.0~", "1.0", -1),
    ("1.0~rc1", "1.0~rc2", -1),
    ("1.0~beta", "1.0~alpha", 1),
    ("1.0+b1", "1.0", 1),                      # anything else sorts after the end
    ("1.0a", "1.0+", -1),                      # letters before non-letters
    ("1.0a", "1.0", 1),
    ("580.95.05-1", "580.95.05-2", -1),        # then the revision
    ("580.95.05-10", "580.95.05-9", 1),
    ("580.95.05-1ubuntu1", "580.95.05-1", 1),
    ("580.95.05-0ubuntu0.24.04.2", "580.95.05-0ubuntu0.24.04.10", -1),
    ("1.0", "1.0-0", 0),                       # a missing revision is empty, like "0"
    ("1.2-3-4", "1.2-3-5", -1),                # the revision is after the last hyphen
    ("1.2-3-4", "1.2-4", 1),                   # upstreams "1.2-3" > "1.2": a hyphen sorts after the end
    ("1:2:3-1", "1:2:4-1", -1),                # colons in upstream once there is an epoch
    ("13.0.2-1", "13.0.2~rc1-1", 1),
    ("2.30.3-1", "2.30.10-1", -1),
    ("0.9", "0.10", -1),
]


@pytest.mark.parametrize("a,b,sign", CASES)
def test_debian_order(a, b, sign):
    assert debian_compare(a, b) == sign
    assert debian_compare(b, a) == -sign
    assert debian_older(a, b) == (sign < 0)


@pytest.mark.skipif(not shutil.which("dpkg"), reason="no dpkg to compare with")
@pytest.mark.parametrize("a,b,sign", CASES)
def test_agrees_with_dpkg(a, b, sign):
    op = {-1: "lt", 0: "eq", 1: "gt"}[debian_compare(a, b)]
    assert subprocess.run(["dpkg", "--compare-versions", a, op, b]).returncode == 0, (a, op, b)


@pytest.mark.parametrize("bad", ["", "a1.0", "x:1.0", "1:", "-1"])
def test_not_a_debian_version_is_refused(bad):
    with pytest.raises(ValueError):
        debian_compare(bad, "1.0")


def test_downgraded_names_only_packages_going_older():
    installed = {"nvidia-open": "580.126.09-1", "nvidia-fabricmanager": "580.126.09-1",
                 "libcudnn9-cuda-13": "9.17.0.29-1", "nvidia-driver-pinning-580.95.05": None}
    targets = {"nvidia-open": "580.95.05-1", "nvidia-fabricmanager": "580.126.09-1",
               "libcudnn9-cuda-13": "1:9.16.0.29-1", "nvidia-driver-pinning-580.95.05": "580.95.05-1"}
    assert downgraded(installed, targets) == ["nvidia-open"]
    assert downgraded({"nvidia-open": "580.95.05-1"}, {"nvidia-open": "580.126.09-1"}) == []
    assert downgraded({}, {"nvidia-open": "580.95.05-1"}) == []
