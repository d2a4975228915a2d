"""Exercises the GPU simulator (a test double, not NVIDIA software): SPEC parsing and the
controller-side installer that lays the simulator into a test host's root filesystem and
builds the fake /proc/driver/nvidia and /sys/bus/pci/devices views."""

import json
import os
import pathlib

import pytest

from testing.gpusim import parse_spec, install

pytestmark = [pytest.mark.unit, pytest.mark.gpusim]


@pytest.mark.parametrize("spec,model,count,version,flavour,loaded", [
    ("h200", "h200", 1, "580.159.04", "open", True),
    ("h200x2", "h200", 2, "580.159.04", "open", True),
    ("h100x8", "h100", 8, "580.159.04", "open", True),
    ("a100x4@535.247.01", "a100", 4, "535.247.01", "proprietary", True),
    ("t4@595.45.04", "t4", 1, "595.45.04", "open", True),
    ("v100", "v100", 1, "580.159.04", "proprietary", True),
    ("t4:nodriver", "t4", 1, "580.159.04", "open", False),
    ("h200x1@580.159.04:proprietary", "h200", 1, "580.159.04", "proprietary", True),
])
def test_parse_spec(spec, model, count, version, flavour, loaded):
    s = parse_spec(spec)
    assert (s.model, s.count, s.driver_version, s.flavour, s.driver_loaded) == (model, count, version, flavour, loaded)


@pytest.mark.parametrize("spec", ["", "b200", "h200x", "h200x0", "h200@abc", "t4:bogus", "v100:open", "t4:open:proprietary"])
def test_parse_spec_rejects(spec):
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    if spec == "b200":
        assert "known models: a100, h100, h200, t4, v100" in str(e.value)


def test_install_layout(tmp_path):
    root, work = tmp_path / "root", tmp_path / "work"
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/diversions").write_text("/usr/bin/foo\n/usr/bin/foo.distrib\n:\n")
    args = install(root, "h200x2", work)

    pci = (work / "gpusim-sys-bus-pci-devices").resolve()
    # /proc binds resolve inside the container: the source is a path in the host root
    assert args == ["--bind-ro=/usr/lib/gpusim/kernel/proc-driver:/proc/driver",
                    f"--bind-ro={pci}:/sys/bus/pci/devices"]
    assert (root / "usr/lib/gpusim/kernel/proc-driver/nvidia/version").is_file()
    assert all(os.path.isabs(a.split("=", 1)[1].split(":")[0]) for a in args)

    smi = root / "usr/bin/nvidia-smi"
    assert smi.is_symlink() and os.readlink(smi) == "../lib/gpusim/nvidia-smi"
    script = root / "usr/lib/gpusim/nvidia-smi"
    assert os.access(script, os.X_OK)
    head = script.read_text().splitlines()[:3]
    assert head[0].split()[0] == "#!/usr/bin/python3" and "GPU SIMULATOR" in head[1] and "NOT NVIDIA software" in head[1]
    assert (root / "usr/bin/gpusimctl").is_symlink()
    daemon = root / "usr/bin/nvidia-persistenced"
    assert daemon.is_symlink() and os.readlink(daemon) == "../lib/gpusim/nvidia-persistenced"
    head = (root / "usr/lib/gpusim/nvidia-persistenced").read_text().splitlines()[:2]
    assert "GPU SIMULATOR" in head[1] and "NOT NVIDIA software" in head[1]
    assert (root / "usr/lib/gpusim/templates/q.gpu.txt").exists()

    config = json.loads((root / "etc/gpusim/gpus.json").read_text())
    assert config["driver"]["version"] == "580.159.04"
    assert [g["uuid"] for g in config["gpus"]] == ["GPU-517ec679-1ea9-e774-b37b-eb2d336fd163",
                                                  "GPU-01a2546d-e3a6-eb7c-7d1e-f99be35fe827"]

    # A local dpkg diversion, as `dpkg-divert --local --rename` records it, appended once.
    diversions = (root / "var/lib/dpkg/diversions").read_text()
    assert diversions == ("/usr/bin/foo\n/usr/bin/foo.distrib\n:\n/usr/bin/nvidia-smi\n/usr/bin/nvidia-smi.distrib\n:\n"
                          "/usr/bin/nvidia-persistenced\n/usr/bin/nvidia-persistenced.distrib\n:\n")
    install(root, "h200x2", work)
    assert (root / "var/lib/dpkg/diversions").read_text() == diversions

    proc = root / "usr/lib/gpusim/kernel/proc-driver/nvidia"
    assert sorted(p.name for p in (proc / "gpus").iterdir()) == ["0000:00:06.0", "0000:00:07.0"]
    dev = pci / "0000:00:07.0"
    assert {f: (dev / f).read_text() for f in ("vendor", "device", "class", "subsystem_vendor", "subsystem_device")} == {
        "vendor": "0x10de\n", "device": "0x2335\n", "class": "0x030200\n",
        "subsystem_vendor": "0x10de\n", "subsystem_device": "0x18bf\n"}


def test_install_nodriver_has_no_proc_view(tmp_path):
    args = install(tmp_path / "root", "t4:nodriver", tmp_path / "work")
    # /proc/driver is still covered (a host without the driver has no nvidia entry there)
    assert len(args) == 2 and args[1].endswith(":/sys/bus/pci/devices")
    assert not (tmp_path / "root/usr/lib/gpusim/kernel/proc-driver/nvidia").exists()
    dev = tmp_path / "work/gpusim-sys-bus-pci-devices/0000:00:06.0"
    assert (dev / "device").read_text() == "0x1eb8\n"
    assert not (dev / "driver").exists() and not (dev / "driver").is_symlink()


def test_install_proprietary_proc_version(tmp_path):
    install(tmp_path / "root", "a100x4@535.247.01", tmp_path / "work")
    version = (tmp_path / "root/usr/lib/gpusim/kernel/proc-driver/nvidia/version").read_text()
    assert version.startswith("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.247.01  ")
    info = (tmp_path / "root/usr/lib/gpusim/kernel/proc-driver/nvidia/gpus/0000:00:09.0/information").read_text()
    assert "Model: \t\t NVIDIA A100-SXM4-40GB\n" in info and "Device Minor: \t 3\n" in info


def test_generated_identities_are_stable_and_distinct(tmp_path):
    a = json.loads(pathlib.Path(_installed(tmp_path / "a", "h100x8")).read_text())
    b = json.loads(pathlib.Path(_installed(tmp_path / "b", "h100x8")).read_text())
    uuids = [g["uuid"] for g in a["gpus"]]
    assert uuids == [g["uuid"] for g in b["gpus"]] and len(set(uuids)) == 8


def _installed(base, spec):
    install(base / "root", spec, base / "work")
    return base / "root/etc/gpusim/gpus.json"
