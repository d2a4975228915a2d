"""Test double: "the kernel loads the installed NVIDIA module at boot", for simulated hosts.

Test infrastructure, not production code. The GPU simulator's loaded driver version is fixed when
the host is made (/proc/driver/nvidia/version and /etc/gpusim/gpus.json). On a real host a driver
upgrade takes effect at the next boot, when the new kernel module is loaded. This installs a boot
unit into a test host that does the same to the simulator: at every boot it sets the simulated
loaded version to the version of the installed kernel-module package (nvidia-kernel-open-dkms or
nvidia-kernel-dkms from the stand-in apt repository). Before any reboot nothing changes, exactly
like a real host whose new module is installed but not loaded.

`fail_module_load(host_root, True)` simulates a module that does not load at the next boot (e.g.
DKMS failed): the previous version stays loaded, so validation sees the old driver.
"""
from __future__ import annotations

from pathlib import Path

UNIT = "gpusim-module-load.service"
SCRIPT = "usr/lib/gpusim/load-installed-module"
FAIL_FLAG = "etc/gpusim/module-load-fails"

_SCRIPT = r'''#!/usr/bin/python3
# gpufleet GPU SIMULATOR (TEST DOUBLE): make the simulated loaded driver follow the installed
# kernel-module package at boot, as a real kernel loading the new module would.
import json, os, re, subprocess, sys
if os.path.exists("/etc/gpusim/module-load-fails"):
    print("gpusim: simulated module load failure: the previous module stays loaded")
    sys.exit(0)
version = None
for pkg in ("nvidia-kernel-open-dkms", "nvidia-kernel-dkms"):
    r = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev} ${Version}", pkg], capture_output=True, text=True)
    parts = r.stdout.split()
    if r.returncode == 0 and len(parts) == 2 and parts[0][1] == "i":
        version = parts[1].split(":", 1)[-1].rsplit("-", 1)[0]
        break
if not version:
    sys.exit(0)
cfg_path = "/etc/gpusim/gpus.json"
with open(cfg_path) as f:
    cfg = json.load(f)
old = cfg["driver"]["version"]
cfg["driver"]["version"] = version
for gpu in cfg["gpus"]:
    if gpu.get("gsp_fw") not in (None, "N/A"):
        gpu["gsp_fw"] = version
with open(cfg_path + ".tmp", "w") as f:
    json.dump(cfg, f, indent=1)
os.replace(cfg_path + ".tmp", cfg_path)
proc = "/usr/lib/gpusim/kernel/proc-driver/nvidia/version"
if os.path.exists(proc):
    with open(proc) as f:
        text = f.read()
    with open(proc, "w") as f:
        f.write(text.replace(f"  {old}  ", f"  {version}  "))
print(f"gpusim: loaded simulated driver module {version} (was {old})")
'''

_UNIT = """# gpufleet GPU SIMULATOR (TEST DOUBLE): load the installed (simulated) driver module at boot
[Unit]
Description=gpusim: load the installed NVIDIA module version (test double)
DefaultDependencies=no
After=local-fs.target
Before=ssh.service nvidia-persistenced.service sysinit.target

[Service]
Type=oneshot
ExecStart=/usr/lib/gpusim/load-installed-module

[Install]
WantedBy=sysinit.target
"""


def install_module_loader(root: Path) -> None:
    """Install and enable the boot unit in the host root (takes effect from the next boot)."""
    root = Path(root)
    script = root / SCRIPT
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(_SCRIPT)
    script.chmod(0o755)
    unit = root / "etc/systemd/system" / UNIT
    unit.write_text(_UNIT)
    wants = root / "etc/systemd/system/sysinit.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / UNIT
    if not link.is_symlink():
        link.symlink_to(f"/etc/systemd/system/{UNIT}")


def fail_module_load(root: Path, fail: bool = True) -> None:
    flag = Path(root) / FAIL_FLAG
    if fail:
        flag.write_text("simulated: the new module does not load at the next boot\n")
    else:
        flag.unlink(missing_ok=True)
