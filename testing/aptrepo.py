"""A local, signed stand-in for NVIDIA's apt repositories, served on loopback.

Test infrastructure, not production code. NVIDIA's CUDA network repository and the
libnvidia-container repository are out of reach from the test machines, so the deploys' `nvidia`
package-source path is tested against this: tiny .deb files that carry NVIDIA's real package
names, versions and dependency structure, but only install a marker file
(/usr/share/doc/<pkg>/STAND-IN) and, where the project checks for one, a clearly labelled
harmless stand-in script or systemd unit. Nothing here is NVIDIA software.

Layout served (the same flat form as production, so a deploy's sources line has the same shape):

    http://127.0.0.1:PORT/compute/cuda/repos/<distro>/x86_64/          (distro: debian12 debian13 ubuntu2404)
        InRelease Release Release.gpg Packages Packages.gz *.deb  cuda-keyring_1.1-1_all.deb
    http://127.0.0.1:PORT/libnvidia-container/stable/deb/amd64/        (container toolkit repo)
    http://127.0.0.1:PORT/unsigned/...   http://127.0.0.1:PORT/wrongkey/...   (negative variants)
    http://127.0.0.1:PORT/pytorch/whl/<variant>/torch/   (a PyTorch index holding the TEST DOUBLE
        torch wheel of testing/torch_standin.py, as download.pytorch.org/whl/<variant>)

    deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] http://127.0.0.1:PORT/compute/cuda/repos/debian12/x86_64/ /

Use from a test module or conftest:

    from testing.aptrepo import aptrepo   # noqa: F401  (session fixture; re-export it)

    def test_x(aptrepo):                  # AptRepo
        aptrepo.base_url("debian12"), aptrepo.keyring, aptrepo.key_armored, aptrepo.cuda_repos_url

Every request is logged to `repo.access_log` ("METHOD PATH STATUS"); `repo.fetches(".deb")` counts the
package files served, so a test can tell how often a file was fetched from this "upstream".

or without pytest: `repo = serve(tmpdir); ...; repo.stop()`. The package table is
`default_packages()` (built from DRIVERS / CUDA_TOOLKITS / CUDNN / DCGM / CONTAINER_TOOLKITS
below); add a release there, or pass your own `packages=[Pkg(...), ...]` to serve().
Debs are built once per content hash under $GPUFLEET_TESTHOSTS_CACHE/aptrepo/debs/.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CACHE_ROOT = Path(os.environ.get("GPUFLEET_TESTHOSTS_CACHE", "/var/cache/gpufleet-testhosts"))
DEB_CACHE = CACHE_ROOT / "aptrepo" / "debs"
BUILDER_VERSION = 1
SOURCE_DATE_EPOCH = 1735689600  # 2025-01-01: fixed mtimes make the .debs byte-identical per content
DISTROS = ("debian12", "debian13", "ubuntu2404")
STAND_IN_NOTE = "gpufleet test stand-in: NOT NVIDIA software; installs nothing that works."
LOG = "/var/log/gpufleet-stand-in.log"


# --------------------------------------------------------------------------------------------
# The package table
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pkg:
    name: str
    version: str
    depends: tuple[str, ...] = ()       # Debian relation strings, e.g. "nvidia-driver-cuda (= 580.95.05-1)"
    provides: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    files: tuple[tuple[str, str, int], ...] = ()   # (absolute path, content, mode), besides the marker
    description: str = ""
    arch: str = "amd64"
    repo: str = "cuda"                  # "cuda" (CUDA network repo) or "container" (libnvidia-container)
    source: str = ""                    # where the real name/version/relations come from (see SOURCES)
    postinst: str = ""                  # DEBIAN/postinst (shell), e.g. a slow one to interrupt an upgrade

    @property
    def filename(self) -> str:
        ver = self.version.split(":", 1)[-1]  # the epoch is not part of the file name
        return f"{self.name}_{ver}_{self.arch}.deb"


# Sources of the real names, versions and relations (report and unit tests refer to these keys).
SOURCES = {
    "compat": "gpufleet/data/reference/compat-data.md (CUDA 13.0 U2 -> driver >= 580.95.05; cuDNN/CUDA)",
    "pinning": "NVIDIA Driver Installation Guide r580/r590 'Version locking packages for Ubuntu / Debian'; "
               "apt-cache search output 'nvidia-driver-pinning-580 - APT driver pinning file for driver "
               "branch 580', 'nvidia-driver-pinning-580.105.08 - ... for driver version'",
    "driver-debian": "NVIDIA Driver Installation Guide, Debian: 'apt install nvidia-open' (open) / "
                     "'apt install cuda-drivers' (proprietary); compute-only nvidia-driver-cuda + "
                     "nvidia-kernel-open-dkms / nvidia-kernel-dkms; Debian-style library names "
                     "(libcuda1, libnvidia-ml1, nvidia-smi, nvidia-persistenced) as on packages.debian.org",
    "fm": "NVIDIA/apt-packaging-fabric-manager README ('version of fabricmanager must match the NVIDIA "
          "driver'); NVIDIA/gpu-driver-container#451: 'nvidia-fabricmanager-580 is a virtual package "
          "provided by nvidia-fabricmanager 580.65.06-1' (R580+ unversioned name); "
          "nvidia-fabricmanager.install: /usr/bin/nv-fabricmanager, nvidia-fabricmanager.service",
    "driver-versions": "580.95.05 = CUDA 13.0 Update 2 driver (compat-data.md 1b); 580.126.09 = "
                       "NVIDIA/gpu-driver-container#735 (compat-data.md S17)",
    "cuda": "cuda=13.0.2-1 (13.0 Update 2) and cuda-toolkit-12-8 12.8.1-1 (12.8 Update 1) in public "
            "Dockerfiles/scripts; cuda-toolkit-X-Y naming from compat.yaml",
    "cudnn": "libcudnn9-cuda-13 / libcudnn9-dev-cuda-13 / libcudnn9-headers-cuda-13 = 9.16.0.29-1 and "
             "9.17.0.29-1, libcudnn9-cuda-12 = 9.10.2.21-1 (public install scripts); nvidia-cudnn-cu12/-cu13 "
             "9.16.0.29, 9.17.0.29, 9.17.1.4 and 9.10.2.21 on PyPI (compat.yaml S34)",
    "nvcc": "cuda-nvcc 12.8.61 (CUDA 12.8.0), 12.8.93 (12.8.1), 13.0.88 (13.0.2): the nvidia channel's "
            "cuda-nvcc-tools labels cuda-12.8.0/12.8.1/13.0.2; 13.0.88 is also the crt of 13.0 Update 1 (its "
            "release notes, table 1); 13.0.96 (with the hypothetical 13.0.3) is a STAND-IN; cuda-compiler-X-Y "
            "as the intermediate meta package named in apt's install list of cuda-toolkit-12-8 "
            "(NVIDIA/nvidia-container-toolkit#883)",
    "cuda-later": "STAND-IN ONLY: cuda-toolkit-13-0 13.0.3-1 is a hypothetical later update (13.0 Update 2 is "
                  "the newest in compat-data.md 1b), there so that a test proves the pin, not apt's newest",
    "dcgm": "datacenter-gpu-manager-4-core=1:4.4.0-1 (public install scripts; epoch 1)",
    "dcgm-exporter": "datacenter-gpu-manager-exporter 4.5.0-1 (NVIDIA CUDA repo rhel8 .rpm named in a public "
                     "PKGBUILD, which depends on datacenter-gpu-manager-4-core>=4; the Debian revision and the "
                     "absence of an epoch are assumed); unit nvidia-dcgm-exporter.service as in NVIDIA/dcgm-exporter "
                     "packaging/config-files/systemd (Wants/After nvidia-dcgm.service, ExecStart /usr/bin/dcgm-exporter "
                     "-f /etc/dcgm-exporter/default-counters.csv); DCGM_EXPORTER_LISTEN / DCGM_REMOTE_HOSTENGINE_INFO "
                     "as in its pkg/cmd/app.go",
    "container": "NVIDIA Container Toolkit install guide: nvidia-container-toolkit, "
                 "nvidia-container-toolkit-base, libnvidia-container-tools, libnvidia-container1, "
                 "versions 1.17.8-1 / 1.18.0-1; flat repo .../libnvidia-container/stable/deb/$(ARCH) /",
    "keyring": "cuda-keyring_1.1-1_all.deb installs /usr/share/keyrings/cuda-archive-keyring.gpg and "
               "/etc/apt/sources.list.d/cuda-<distro>-x86_64.list",
    "stand-in": "structure only: not verified against NVIDIA's Packages file; kept small on purpose",
    "nsight": "nsight-systems-2025.3.2 2025.3.2.474-1 and nsight-compute-2025.3.1 2025.3.1.4-1 as the CUDA repo's "
              "ubuntu2404/x86_64 .deb names in public Dockerfiles; meta packages cuda-nsight-systems-X-Y / "
              "cuda-nsight-compute-X-Y at the toolkit release, depending on the release-named package "
              "(compat.yaml S38, S39); the (>=) bounds and the later builds are STAND-INS; the 13.0.1 meta "
              "packages name the 13.0.2 builds (STAND-IN); the chain cuda-toolkit-X-Y -> cuda-tools-X-Y -> "
              "cuda-visual-tools-X-Y -> cuda-nsight-compute-X-Y, cuda-nsight-systems-X-Y as apt's install lists "
              "of NVIDIA's repository show it for 10.1, 12.2 and 12.8 (compat.yaml S41; not seen for 13.0; "
              "modelled for the 13-0 toolkits only, without the chain's other members)",
}

# One branch, two real driver versions. Add a version (or branch) here.
DRIVERS = ("580.95.05", "580.126.09")
# (toolkit major-minor, package version, nvcc release string). Several releases per package,
# older and newer around the one compat.yaml resolves to (13.0 -> 13.0.2), so that tests prove
# the resolved release is the one installed, not apt's newest.
CUDA_TOOLKITS = (("13-0", "13.0.1-1", "13.0"), ("13-0", "13.0.2-1", "13.0"), ("13-0", "13.0.3-1", "13.0"),
                 ("12-8", "12.8.0-1", "12.8"), ("12-8", "12.8.1-1", "12.8"))
# The toolkit's components are versioned on their own (CUDA 11+; release notes "CUDA Toolkit Major
# Components"), and NVIDIA's meta packages ask for them with >= only: cuda-toolkit-X-Y depends on
# cuda-compiler-X-Y (>= its own release), which depends on cuda-nvcc-X-Y (>= the nvcc of that
# release). Toolkit package version -> the cuda-nvcc-X-Y version it shipped with (source "nvcc").
CUDA_NVCC = {"13.0.1-1": "13.0.88-1", "13.0.2-1": "13.0.88-1", "13.0.3-1": "13.0.96-1",
             "12.8.0-1": "12.8.61-1", "12.8.1-1": "12.8.93-1"}
# (cuda major, cuDNN package version): 9.17.0 resolves to 9.17.0.29 (9.16 older, 9.17.1 newer);
# for CUDA 12, 9.10.2 -> 9.10.2.21 with newer ones to move to
CUDNN = (("13", "9.16.0.29-1"), ("13", "9.17.0.29-1"), ("13", "9.17.1.4-1"),
         ("12", "9.10.2.21-1"), ("12", "9.16.0.29-1"), ("12", "9.17.0.29-1"))
# (toolkit major-minor, meta package version, Nsight Systems package and version, Nsight Compute
# package and version). 13.0.2 as compat.yaml's nsight_tools; 13.0.3 (a hypothetical update, as
# cuda-later) names later builds, so that a test proves the pin, not apt's newest.
NSIGHT = (("13-0", "13.0.1-1", "nsight-systems-2025.3.2", "2025.3.2.474-1", "nsight-compute-2025.3.1", "2025.3.1.4-1"),
          ("13-0", "13.0.2-1", "nsight-systems-2025.3.2", "2025.3.2.474-1", "nsight-compute-2025.3.1", "2025.3.1.4-1"),
          ("13-0", "13.0.3-1", "nsight-systems-2025.3.2", "2025.3.2.999-1", "nsight-compute-2025.3.1", "2025.3.1.9-1"))
DCGM = ("1:4.4.0-1",)
DCGM_EXPORTERS = ("4.5.0-1",)
CONTAINER_TOOLKITS = ("1.17.8-1", "1.18.0-1")

# Packages whose version is pinned by nvidia-driver-pinning-* (the driver and everything built
# from it, Fabric Manager included).
DRIVER_PACKAGES = (
    "nvidia-open", "cuda-drivers", "cuda-drivers-{branch}", "nvidia-driver", "nvidia-driver-cuda",
    "libcuda1", "libnvidia-ml1", "nvidia-smi", "nvidia-persistenced", "nvidia-kernel-open-dkms",
    "nvidia-kernel-dkms", "nvidia-kernel-support", "nvidia-fabricmanager",
)


def _script(name: str, body: str) -> str:
    return (f"#!/bin/sh\n# {name}: {STAND_IN_NOTE}\n"
            f"echo \"$(date -u +%FT%TZ) {name} $*\" >> {LOG} 2>/dev/null || true\n{body}\n")


# Stand-in `nvidia-ctk cdi generate --output=F` / `nvidia-ctk cdi list`: a small, clearly labelled
# spec with one device per GPU that `nvidia-smi -L` (the GPU simulator) shows, by index and UUID,
# plus "all"; `cdi list` prints kind=name for every device in /etc/cdi and /var/run/cdi specs.
_CTK_CDI = r"""if [ "$1" = cdi ] && [ "$2" = generate ]; then
  out=""; for a in "$@"; do case "$a" in --output=*) out="${a#--output=}";; esac; done
  gpus=$(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \([0-9]*\): .*(UUID: \([^)]*\)).*/\1 \2/p')
  [ -n "$gpus" ] || { echo "ERRO[0000] failed to generate CDI spec: no GPU found (stand-in)" >&2; exit 1; }
  spec=$(echo "# gpufleet test stand-in CDI spec: NOT generated by NVIDIA software"
    echo "cdiVersion: 0.5.0"; echo "kind: nvidia.com/gpu"; echo "devices:"
    echo "$gpus" | while read -r idx uuid; do echo "- name: \"$idx\""; echo "  containerEdits: {}"
      echo "- name: $uuid"; echo "  containerEdits: {}"; done
    echo "- name: all"; echo "  containerEdits: {}"; echo "containerEdits: {}")
  if [ -z "$out" ]; then echo "$spec"; exit 0; fi
  mkdir -p "$(dirname "$out")" && echo "$spec" > "$out.tmp" && mv "$out.tmp" "$out"
  echo "INFO[0000] Generated CDI spec with stand-in nvidia-ctk" >&2; exit 0
fi
if [ "$1" = system ] && [ "$2" = create-dev-char-symlinks ]; then
  # as the real one: a /dev/char/MAJ:MIN link to every NVIDIA device node (the real one, with
  # --create-all, also makes the nodes the loaded driver has; the simulator has no driver)
  for d in /dev/nvidia*; do [ -c "$d" ] || continue
    set -- $(stat -c '%t %T' "$d"); mm=$((0x$1)):$((0x$2))
    [ -e "/dev/char/$mm" ] || ln -s "../${d#/dev/}" "/dev/char/$mm"
  done; exit 0
fi
if [ "$1" = cdi ] && [ "$2" = list ]; then
  for f in /etc/cdi/*.yaml /var/run/cdi/*.yaml; do [ -f "$f" ] || continue
    kind=$(sed -n 's/^kind: *//p' "$f")
    sed -n 's/^- name: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$f" | while read -r n; do echo "$kind=$n"; done
  done; exit 0
fi
exit 0"""


# Stand-in `nvidia-container-runtime-hook prestart`: what the real hook does through
# nvidia-container-cli (mount the driver's user space into a GPU container before it starts),
# done for the GPU SIMULATOR: when the container asks for GPUs (NVIDIA_VISIBLE_DEVICES, which
# `docker run --gpus` sets), the simulator's nvidia-smi and its data are bind-mounted read-only
# into the container's root, inside its mount namespace (runc passes the state on stdin); its
# GPU state (/run/gpusim) read-write, as a container shares the real GPUs' state. The
# image must bring python3 (the simulator's interpreter), as a real image brings libc.
_HOOK = r"""[ "$1" = prestart ] || exit 0
exec python3 -c '
import json, os, subprocess, sys
state = json.load(sys.stdin)
bundle = state["bundle"]
with open(os.path.join(bundle, "config.json")) as f:
    cfg = json.load(f)
root = cfg["root"]["path"]
root = root if os.path.isabs(root) else os.path.join(bundle, root)
env = dict(e.split("=", 1) for e in cfg.get("process", {}).get("env", []) if "=" in e)
if env.get("NVIDIA_VISIBLE_DEVICES", "").strip().lower() in ("", "void", "none"):
    sys.exit(0)
script = "set -e\n"
for src, ro in (("/usr/lib/gpusim", True), ("/etc/gpusim", True), ("/run/gpusim", False)):
    if os.path.isdir(src):
        dst = root + src
        script += f"mkdir -p {dst} && mount --bind {src} {dst}\n"
        script += f"mount -o remount,bind,ro {dst}\n" if ro else ""
script += f"mkdir -p {root}/usr/bin && ln -sfn ../lib/gpusim/nvidia-smi {root}/usr/bin/nvidia-smi\n"
subprocess.run(["nsenter", "-t", str(state["pid"]), "-m", "sh", "-c", script], check=True)
'"""


# Stand-in `dcgmi diag -r 1|2|3 -j` against the GPU SIMULATOR, printing DCGM's JSON as dcgmi
# 4.x builds it (dcgmi/Diag.cpp HelperJsonBuildOutput, github.com/NVIDIA/DCGM 72fa3fe: per
# category, tests with per-GPU results, "warnings" {warning, error_id, error_category,
# error_severity}, a test_summary; entity_groups; metadata), which tests/unit checks against DCGM's
# own schema (tests/fixtures/dcgm/dcgm_diag_schema.json). The messages, error ids, severities
# and categories are DCGM's (dcgmlib/dcgm_errors.h, dcgm_errors.c); the verdicts come from what
# the simulated GPUs report: level 1 (Deployment: software) persistence and row remapping, level
# 2 adds Integration pcie (link width/generation below the maximum, an NVLink down) and Hardware
# memory (volatile double-bit ECC), level 3 adds Stress (hardware slowdown). Like the real dcgmi it
# needs the host engine (nvidia-dcgm.service) and exits non-zero (226) when a test fails.
_DCGMI = f"#!/usr/bin/python3\n# dcgmi: {STAND_IN_NOTE}\n" + r"""import json, subprocess, sys
args = sys.argv[1:]
if args[:1] in (["--version"], ["-v"]):
    print("dcgmi  version: 4.4.0 (gpufleet stand-in)"); sys.exit(0)
if args[:1] != ["diag"] or "-j" not in args or "-r" not in args or args[args.index("-r") + 1:][:1] not in (["1"], ["2"], ["3"]):
    sys.exit("gpufleet stand-in dcgmi: only 'dcgmi diag -r 1|2|3 -j'")
level = int(args[args.index("-r") + 1])
if subprocess.run(["systemctl", "is-active", "--quiet", "nvidia-dcgm.service"]).returncode:
    print("Error: unable to establish a connection to the specified host: localhost")
    print("Error: Unable to connect to host engine. Host engine connection invalid/disconnected.")
    sys.exit(255)
Q = ("index,pci.device_id,driver_version,persistence_mode,ecc.errors.uncorrected.volatile.total,"
     "remapped_rows.pending,remapped_rows.failure,pcie.link.gen.current,pcie.link.gen.max,"
     "pcie.link.width.current,pcie.link.width.max,clocks_event_reasons.hw_slowdown")
run = subprocess.run(["nvidia-smi", "--query-gpu=" + Q, "--format=csv,noheader,nounits"], capture_output=True, text=True)
gpus = [dict(zip(Q.split(","), (c.strip() for c in row.split(",")))) for row in run.stdout.splitlines() if row.strip()]
version = {"version": "4.4.0 (gpufleet stand-in)"}
if run.returncode or not gpus:
    print(json.dumps({"DCGM Diagnostic": {**version, "runtime_error": "Error: no GPUs found: " + (run.stdout + run.stderr).strip()[:200]}}, indent=3))
    sys.exit(226)
down = {}
gpu = None
for line in subprocess.run(["nvidia-smi", "nvlink", "-s"], capture_output=True, text=True).stdout.splitlines():
    if line.startswith("GPU "):
        gpu = int(line.split()[1].rstrip(":"))
    elif "Link " in line and "inactive" in line.lower() and gpu is not None:
        down.setdefault(gpu, []).append(int(line.split("Link ")[1].split(":")[0]))
def num(v):
    try:
        return int(float(v))
    except ValueError:
        return None
def err(msg, code, severity, category):
    return {"warning": msg, "error_id": code, "error_category": category, "error_severity": severity}
def software(g, i):
    out = []
    if g["persistence_mode"] != "Enabled":
        out.append(err(f"Persistence mode for GPU {i} is disabled.", 29, 5, 8))
    if g["remapped_rows.failure"] == "Yes":
        out.append(err(f"GPU {i} had uncorrectable memory errors and row remapping failed.", 80, 6, 10))
    if g["remapped_rows.pending"] == "Yes":
        out.append(err(f"GPU {i} had memory errors and row remappings are pending", 85, 6, 10))
    return out
def pcie(g, i):
    out = []
    gen, gen_max, width, width_max = (num(g[k]) for k in ("pcie.link.gen.current", "pcie.link.gen.max",
                                                          "pcie.link.width.current", "pcie.link.width.max"))
    if gen and gen_max and gen < gen_max:
        out.append(err(f"GPU {i} is running at PCI link generation {gen}, which is below the minimum allowed link "
                       f"generation of {gen_max} (parameter 'min_pci_generation')", 45, 4, 13))
    if width and width_max and width < width_max:
        out.append(err(f"GPU {i} is running at PCI link width {width}X, which is below the minimum allowed link "
                       f"generation of {width_max} (parameter 'min_pci_width')", 46, 5, 13))
    out += [err(f"GPU {i}'s NvLink link {k} is currently down", 14, 4, 11) for k in down.get(i, [])]
    return out
def memory(g, i):
    n = num(g["ecc.errors.uncorrected.volatile.total"]) or 0
    return [err(f"Detected {n} volatile double-bit ECC error(s) in GPU {i}.", 4, 2, 10)] if n else []
def stress(g, i):
    if g["clocks_event_reasons.hw_slowdown"] != "Active":
        return []
    return [err(f"Clocks are being optimized for GPU {i} because of clocks event reasons: hardware slowdown "
                "(DCGM_CLOCKS_EVENT_REASON_HW_SLOWDOWN)", 43, 1, 15)]
PLAN = [(1, "Deployment", "software", software), (2, "Integration", "pcie", pcie), (2, "Hardware", "memory", memory),
        (3, "Hardware", "diagnostic", lambda g, i: []), (3, "Stress", "targeted_stress", stress),
        (3, "Stress", "targeted_power", lambda g, i: []), (3, "Stress", "memory_bandwidth", lambda g, i: [])]
categories, failed = [], False
for lvl, category, name, check in PLAN:
    if lvl > level:
        continue
    results, all_errors = [], []
    for g in gpus:
        i = int(g["index"])
        errors = check(g, i)
        entry = {"entity_group": "GPU", "entity_group_id": 1, "entity_id": i, "status": "Fail" if errors else "Pass"}
        if errors:
            entry["warnings"] = errors
        results.append(entry)
        all_errors += errors
    summary = {"status": "Fail" if all_errors else "Pass"}
    if all_errors:
        summary["warnings"] = all_errors
    failed |= bool(all_errors)
    test = {"name": name, "results": results, "test_summary": summary}
    for c in categories:
        if c["category"] == category:
            c["tests"].append(test)
            break
    else:
        categories.append({"category": category, "tests": [test]})
doc = {"DCGM Diagnostic": {"test_categories": categories},
       "entity_groups": [{"entities": [{"device_id": g["pci.device_id"][2:6].lower(), "entity_id": int(g["index"])} for g in gpus],
                          "entity_group": "GPU", "entity_group_id": 1}],
       "metadata": {**version, "Driver Version Detected": gpus[0]["driver_version"]}}
print(json.dumps(doc, indent=3))
sys.exit(226 if failed else 0)
"""


# Stand-in `dcgm-exporter` serving the GPU SIMULATOR's state in dcgm-exporter's text format
# (Prometheus exposition: "# HELP", "# TYPE", then one line per GPU labelled gpu, UUID,
# pci_bus_id, device, modelName, Hostname, as in NVIDIA's documented sample output). Each
# request asks the simulator's nvidia-smi afresh. Like the real exporter pointed at a host engine
# (DCGM_REMOTE_HOSTENGINE_INFO) it refuses to start unless nvidia-dcgm.service runs, and it
# listens where DCGM_EXPORTER_LISTEN says (":9400" = every address).
# MIG, as the real exporter's default (flex) mode does it (NVIDIA/dcgm-exporter
# internal/pkg/devicemonitoring/device_monitoring.go, monitorAllGPUInstances: a GPU with GPU
# instances is watched per instance instead of as a whole; rendermetrics/render_metrics.go adds
# GPU_I_PROFILE and GPU_I_ID, the instance's profile name and NVML instance id, between modelName
# and Hostname): one line per GPU instance, learnt from the simulator's `nvidia-smi mig -lgi` ONCE
# at start, as the real exporter reads DCGM's entity hierarchy when it starts (instances made later
# need a restart to be seen). Simplification of this double: each instance's line carries its
# GPU's values.
_DCGM_EXPORTER = f"#!/usr/bin/python3\n# dcgm-exporter: {STAND_IN_NOTE}\n# It serves the GPU simulator's values.\n" + r"""import http.server, os, socket, subprocess, sys
FIELDS = (("temperature.gpu", "DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."),
          ("power.draw", "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
          ("clocks.sm", "DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."),
          ("clocks.mem", "DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz)."),
          ("utilization.gpu", "DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)."),
          ("memory.used", "DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)."),
          ("memory.free", "DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."))
if subprocess.run(["systemctl", "is-active", "--quiet", "nvidia-dcgm.service"]).returncode:
    sys.exit("dcgm-exporter (stand-in): cannot connect to the DCGM host engine at "
             + os.environ.get("DCGM_REMOTE_HOSTENGINE_INFO", "localhost:5555"))
def gpu_instances():
    found = {}
    lgi = subprocess.run(["nvidia-smi", "mig", "-lgi"], capture_output=True, text=True, timeout=20).stdout
    for line in lgi.splitlines():
        w = line.split()  # |  GPU  MIG  PROFILE  PROFILE-ID  GI-ID  PLACEMENT |
        if len(w) > 5 and w[0] == "|" and w[2] == "MIG" and w[1].isdigit() and w[5].isdigit():
            found.setdefault(w[1], []).append(f',GPU_I_PROFILE="{w[3]}",GPU_I_ID="{w[5]}"')
    return found
INSTANCES = gpu_instances()
def metrics():
    query = "index,uuid,name,pci.bus_id," + ",".join(f for f, _, _ in FIELDS)
    rows = subprocess.run(["nvidia-smi", "--query-gpu=" + query, "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=20).stdout.splitlines()
    gpus = [[c.strip() for c in row.split(",")] for row in rows if row.strip()]
    out = []
    for i, (_, name, text) in enumerate(FIELDS):
        out += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
        for g in gpus:
            value = g[4 + i] if len(g) > 4 + i else ""
            try:
                float(value)
            except ValueError:
                continue
            for instance in INSTANCES.get(g[0], [""]):
                labels = (f'gpu="{g[0]}",UUID="{g[1]}",pci_bus_id="{g[3]}",device="nvidia{g[0]}",'
                          f'modelName="{g[2]}"{instance},Hostname="{socket.gethostname()}"')
                out.append(f"{name}{{{labels}}} {value}")
    return ("\n".join(out) + "\n").encode()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404)
            return
        body = metrics()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
host, _, port = os.environ.get("DCGM_EXPORTER_LISTEN", ":9400").rpartition(":")
host = host.strip("[]")
class Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
print(f"dcgm-exporter (gpufleet stand-in) listening on {host or '*'}:{port}", flush=True)
Server((host, int(port)), Handler).serve_forever()
"""


def _unit(desc: str, exec_start: str, service_type: str = "simple") -> str:
    return (f"# {STAND_IN_NOTE}\n[Unit]\nDescription={desc} (gpufleet test stand-in)\n\n"
            f"[Service]\nType={service_type}\nExecStart={exec_start}\n\n[Install]\nWantedBy=multi-user.target\n")


def driver_packages(version: str, rev: str = "1") -> list[Pkg]:
    """The driver packages of one release, Debian-style names as in NVIDIA's debian12/13 repo."""
    v = f"{version}-{rev}"
    branch = version.split(".")[0]
    eq = lambda n: f"{n} (= {v})"  # noqa: E731
    ge = lambda n: f"{n} (>= {v})"  # noqa: E731
    src = "driver-debian"
    return [
        # Meta packages use >= (as NVIDIA's do): installing one at an old version without a
        # pinning package drags the newest libraries in. That is the real trap pinning solves.
        Pkg("nvidia-open", v, (ge("nvidia-driver"), ge("nvidia-kernel-open-dkms")),
            description="NVIDIA driver meta package, open kernel modules", source=src),
        Pkg("cuda-drivers", v, (ge("nvidia-driver"), f"nvidia-kernel-dkms (>= {v}) | nvidia-kernel-open-dkms (>= {v})"),
            description="NVIDIA driver meta package, proprietary kernel modules", source=src),
        Pkg(f"cuda-drivers-{branch}", v, (ge("cuda-drivers"),),
            description=f"NVIDIA driver meta package, branch {branch}", source=src),
        Pkg("nvidia-driver", v, (eq("nvidia-driver-cuda"), eq("libcuda1"), eq("nvidia-smi")),
            description="NVIDIA driver (libraries and tools)", source=src),
        Pkg("nvidia-driver-cuda", v,
            (eq("libcuda1"), eq("libnvidia-ml1"), eq("nvidia-smi"), eq("nvidia-persistenced")),
            description="NVIDIA driver CUDA integration components (compute-only)", source=src),
        Pkg("libcuda1", v, (eq("nvidia-kernel-support"),), description="NVIDIA CUDA Driver Library", source=src),
        Pkg("libnvidia-ml1", v, description="NVIDIA Management Library (NVML) runtime library", source=src),
        # No /usr/bin/nvidia-smi on purpose: the GPU simulator (testing/gpusim) owns that name.
        Pkg("nvidia-smi", v, (eq("libnvidia-ml1"),), description="NVIDIA System Management Interface", source=src),
        Pkg("nvidia-persistenced", v, (eq("libnvidia-ml1"),), files=(
            # Like the real daemon it forks into the background, and NVIDIA's unit is Type=forking
            # (a GPU simulator on the host replaces this binary through a dpkg diversion).
            ("/usr/bin/nvidia-persistenced",
             _script("nvidia-persistenced", "sleep infinity >/dev/null 2>&1 &\nexit 0"), 0o755),
            ("/lib/systemd/system/nvidia-persistenced.service",
             _unit("NVIDIA Persistence Daemon", "/usr/bin/nvidia-persistenced --verbose", "forking"), 0o644),
        ), description="daemon to maintain persistent software state in the NVIDIA driver", source=src),
        Pkg("nvidia-kernel-support", v, description="NVIDIA binary kernel module support files", source=src),
        Pkg("nvidia-kernel-open-dkms", v, (eq("nvidia-kernel-support"),),
            provides=(f"nvidia-kernel-{version}",), conflicts=("nvidia-kernel-dkms",),
            description="NVIDIA open kernel module DKMS source (no module: stand-in)", source=src),
        Pkg("nvidia-kernel-dkms", v, (eq("nvidia-kernel-support"),),
            provides=(f"nvidia-kernel-{version}",), conflicts=("nvidia-kernel-open-dkms",),
            description="NVIDIA proprietary kernel module DKMS source (no module: stand-in)", source=src),
        # R580+: one unversioned Fabric Manager package per repo, providing the old branch name.
        # Its exact dependency on the driver is what keeps FM and driver in lock step.
        Pkg("nvidia-fabricmanager", v, (eq("nvidia-driver-cuda"),),
            # Unversioned, as in NVIDIA's repo: `apt-get install nvidia-fabricmanager-580=<ver>`
            # fails with "virtual package" / "Version ... was not found" (gpu-driver-container#451).
            provides=(f"nvidia-fabricmanager-{branch}",),
            conflicts=(f"nvidia-fabricmanager-{branch}",), files=(
                ("/usr/bin/nv-fabricmanager", _script("nv-fabricmanager",
                 f'case "$1" in --version|-v) echo "Fabric Manager version is : {version}"; exit 0;; esac\n'
                 "exec sleep infinity"), 0o755),
                ("/lib/systemd/system/nvidia-fabricmanager.service",
                 _unit("NVIDIA fabric manager service",
                       "/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg"), 0o644),
                ("/usr/share/nvidia/nvswitch/fabricmanager.cfg", f"# {STAND_IN_NOTE}\nLOG_LEVEL=4\n", 0o644),
            ), description="Fabric Manager for NVSwitch based systems", source="fm"),
        Pkg(f"nvidia-driver-pinning-{version}", v,
            provides=("nvidia-driver-pinning",), conflicts=("nvidia-driver-pinning",),
            files=(("/etc/apt/preferences.d/nvidia-driver-pinning", _pin_file(branch, f"{version}-*"), 0o644),),
            description=f"APT driver pinning file for driver version {version}", source="pinning"),
    ]


def _pin_file(branch: str, pattern: str) -> str:
    names = " ".join(n.format(branch=branch) for n in DRIVER_PACKAGES)
    return (f"# {STAND_IN_NOTE}\n# Real apt preferences: the driver packages are held to {pattern}.\n"
            f"Package: {names}\nPin: version {pattern}\nPin-Priority: 1000\n")


def _has_nsight(mm: str, version: str) -> bool:
    """Whether the stand-in toolkit release brings Nsight meta packages (NSIGHT has a row)."""
    return any(row[0] == mm and row[1] == version for row in NSIGHT)


def default_packages() -> list[Pkg]:
    pkgs: list[Pkg] = []
    branches = sorted({d.split(".")[0] for d in DRIVERS})
    for d in DRIVERS:
        pkgs += driver_packages(d)
    for b in branches:
        pkgs.append(Pkg(f"nvidia-driver-pinning-{b}", f"{b}-1", provides=("nvidia-driver-pinning",),
                        conflicts=("nvidia-driver-pinning",),
                        files=(("/etc/apt/preferences.d/nvidia-driver-pinning", _pin_file(b, f"{b}.*"), 0o644),),
                        description=f"APT driver pinning file for driver branch {b}", source="pinning"))
    for mm, ver, rel in CUDA_TOOLKITS:
        major = mm.split("-")[0]
        root = f"/usr/local/cuda-{rel}"
        upstream = ver.rsplit("-", 1)[0]
        nvcc = CUDA_NVCC[ver]
        pkgs += [
            Pkg("cuda-toolkit-config-common", "13.0.96-1" if major == "13" else "12.8.90-1",
                description="Common config package for CUDA Toolkit", source="stand-in"),
            Pkg(f"cuda-toolkit-{major}-config-common", ver, description=f"Common config package for CUDA Toolkit {major}",
                source="stand-in"),
            Pkg(f"cuda-toolkit-{mm}-config-common", ver, description=f"Common config package for CUDA Toolkit {rel}",
                source="stand-in"),
            Pkg(f"cuda-nvcc-{mm}", nvcc, (f"cuda-toolkit-{mm}-config-common",), files=(
                (f"{root}/bin/nvcc", _script("nvcc", f'echo "nvcc: NVIDIA (R) Cuda compiler driver (gpufleet stand-in)"\n'
                 f'echo "Cuda compilation tools, release {rel}, V{nvcc.rsplit("-", 1)[0]}"'), 0o755),
            ), description=f"CUDA nvcc {rel}", source="nvcc"),
            Pkg(f"cuda-compiler-{mm}", ver, (f"cuda-nvcc-{mm} (>= {nvcc.rsplit('-', 1)[0]})",),
                description=f"CUDA compiler {rel} meta-package", source="nvcc"),
            Pkg(f"cuda-toolkit-{mm}", ver,
                ("cuda-toolkit-config-common", f"cuda-toolkit-{major}-config-common",
                 f"cuda-toolkit-{mm}-config-common", f"cuda-compiler-{mm} (>= {upstream})",
                 *((f"cuda-tools-{mm} (>= {upstream})",) if _has_nsight(mm, ver) else ())),
                description=f"CUDA Toolkit {rel} meta-package",
                source="cuda-later" if ver == "13.0.3-1" else "cuda"),
        ]
        if _has_nsight(mm, ver):
            # the toolkit brings Nsight through its tools (source "nsight")
            pkgs += [
                Pkg(f"cuda-tools-{mm}", ver, (f"cuda-visual-tools-{mm} (>= {upstream})",),
                    description=f"CUDA Tools {rel} meta-package", source="nsight"),
                Pkg(f"cuda-visual-tools-{mm}", ver,
                    (f"cuda-nsight-compute-{mm} (>= {upstream})", f"cuda-nsight-systems-{mm} (>= {upstream})"),
                    description=f"CUDA visual tools {rel} meta-package", source="nsight"),
            ]
    seen: set[tuple[str, str]] = set()
    for mm, meta, nsys, nsys_ver, ncu, ncu_ver in NSIGHT:
        nsys_rel, ncu_rel = nsys.rsplit("-", 1)[1], ncu.rsplit("-", 1)[1]
        pkgs += [] if (nsys, nsys_ver) in seen else [
            Pkg(nsys, nsys_ver, files=(
                (f"/opt/nvidia/nsight-systems/{nsys_rel}/bin/nsys",
                 _script("nsys", f'echo "NVIDIA Nsight Systems version {nsys_ver.rsplit("-", 1)[0]} (gpufleet stand-in)"'),
                 0o755),), description=f"Nsight Systems {nsys_rel}", source="nsight"),
            Pkg(ncu, ncu_ver, files=(
                (f"/opt/nvidia/nsight-compute/{ncu_rel}/ncu",
                 _script("ncu", f'echo "NVIDIA (R) Nsight Compute Command Line Profiler, version {ncu_ver.rsplit("-", 1)[0]} '
                                '(gpufleet stand-in)"'), 0o755),), description=f"Nsight Compute {ncu_rel}", source="nsight"),
        ]
        seen.add((nsys, nsys_ver))
        pkgs += [
            Pkg(f"cuda-nsight-systems-{mm}", meta, (f"{nsys} (>= {nsys_ver.rsplit('-', 1)[0]})",),
                description=f"Nsight Systems meta-package for CUDA {mm.replace('-', '.')}", source="nsight"),
            Pkg(f"cuda-nsight-compute-{mm}", meta, (f"{ncu} (>= {ncu_ver.rsplit('-', 1)[0]})",),
                description=f"Nsight Compute meta-package for CUDA {mm.replace('-', '.')}", source="nsight"),
        ]
    for cuda_major, ver in CUDNN:
        pkgs += [
            Pkg(f"libcudnn9-cuda-{cuda_major}", ver, description=f"cuDNN runtime libraries for CUDA {cuda_major}",
                source="cudnn"),
            Pkg(f"libcudnn9-headers-cuda-{cuda_major}", ver, description="cuDNN header files", source="cudnn"),
            Pkg(f"libcudnn9-dev-cuda-{cuda_major}", ver,
                (f"libcudnn9-cuda-{cuda_major} (= {ver})", f"libcudnn9-headers-cuda-{cuda_major} (= {ver})"),
                description=f"cuDNN development libraries for CUDA {cuda_major}", source="cudnn"),
        ]
    for ver in DCGM:
        pkgs.append(Pkg("datacenter-gpu-manager-4-core", ver, files=(
            ("/usr/bin/nv-hostengine", _script("nv-hostengine", "exec sleep infinity"), 0o755),
            ("/usr/bin/dcgmi", _DCGMI, 0o755),
            ("/lib/systemd/system/nvidia-dcgm.service", _unit("NVIDIA DCGM service", "/usr/bin/nv-hostengine -n"), 0o644),
        ), description="NVIDIA Datacenter GPU Management Tools (core)", source="dcgm"))
        for cm in ("12", "13"):
            pkgs.append(Pkg(f"datacenter-gpu-manager-4-cuda{cm}", ver, (f"datacenter-gpu-manager-4-core (= {ver})",),
                            description=f"DCGM CUDA {cm} support", source="dcgm"))
    for ver in DCGM_EXPORTERS:
        pkgs.append(Pkg("datacenter-gpu-manager-exporter", ver, ("datacenter-gpu-manager-4-core (>= 1:4.0.0)",), files=(  # python3: the GPU simulator's
            ("/usr/bin/dcgm-exporter", _DCGM_EXPORTER, 0o755),
            ("/etc/dcgm-exporter/default-counters.csv", f"# {STAND_IN_NOTE}\n"
             + "".join(f"{name}, gauge, {text}\n" for name, text in (
                 ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)."), ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)."),
                 ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)."))), 0o644),
            ("/lib/systemd/system/nvidia-dcgm-exporter.service",
             f"# {STAND_IN_NOTE}\n[Unit]\nDescription=NVIDIA DCGM-exporter service (gpufleet test stand-in)\n"
             "Wants=nvidia-dcgm.service\nAfter=nvidia-dcgm.service\n\n[Service]\nUser=root\n"
             "ExecStart=/usr/bin/dcgm-exporter -f /etc/dcgm-exporter/default-counters.csv\nRestart=on-abort\n\n"
             "[Install]\nWantedBy=multi-user.target\n", 0o644),
        ), description="NVIDIA DCGM exporter for Prometheus", source="dcgm-exporter"))
    for ver in CONTAINER_TOOLKITS:
        upstream = ver.rsplit("-", 1)[0]
        pkgs += [
            Pkg("libnvidia-container1", ver, description="NVIDIA container runtime library", repo="container",
                source="container"),
            Pkg("libnvidia-container-tools", ver, (f"libnvidia-container1 (>= {ver})",), files=(
                ("/usr/bin/nvidia-container-cli", _script("nvidia-container-cli", "exit 0"), 0o755),),
                description="NVIDIA container runtime library (command-line tools)", repo="container",
                source="container"),
            Pkg("nvidia-container-toolkit-base", ver, files=(
                ("/usr/bin/nvidia-ctk", _script("nvidia-ctk",
                 f'case "$1" in --version|-v) echo "NVIDIA Container Toolkit CLI version {upstream}"; '
                 'echo "commit: gpufleet-stand-in"; exit 0;; esac\n' + _CTK_CDI), 0o755),
                ("/usr/bin/nvidia-container-runtime", _script("nvidia-container-runtime", 'exec runc "$@"'), 0o755),),
                description="NVIDIA Container Toolkit Base", repo="container", source="container"),
            Pkg("nvidia-container-toolkit", ver,
                (f"nvidia-container-toolkit-base (= {ver})", f"libnvidia-container-tools (>= {ver})",
                 "libnvidia-container-tools (<< 2.0.0)"), files=(
                ("/usr/bin/nvidia-container-runtime-hook", _script("nvidia-container-runtime-hook", _HOOK), 0o755),),
                description="NVIDIA Container toolkit", repo="container", source="container"),
        ]
    seen: set[tuple[str, str]] = set()  # shared config packages come once per version
    return [p for p in pkgs if (p.name, p.version) not in seen and not seen.add((p.name, p.version))]


def keyring_package(distro: str, url: str, keyring: bytes) -> Pkg:
    """cuda-keyring for `distro`: the test key under NVIDIA's keyring name, plus its sources list."""
    return Pkg("cuda-keyring", "1.1-1", arch="all", files=(
        ("/usr/share/keyrings/cuda-archive-keyring.gpg", keyring, 0o644),
        (f"/etc/apt/sources.list.d/cuda-{distro}-x86_64.list",
         f"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] {url} /\n", 0o644),
    ), description="GPG keyring for the CUDA repository", source="keyring")


# --------------------------------------------------------------------------------------------
# Building .debs (deterministic, cached per content hash)
# --------------------------------------------------------------------------------------------

def _content_key(pkg: Pkg) -> str:
    d = dataclasses.asdict(pkg)
    d["files"] = [(p, c.hex() if isinstance(c, bytes) else c, m) for p, c, m in pkg.files]
    d["v"] = BUILDER_VERSION
    if not d["postinst"]:
        del d["postinst"]  # packages without one keep their cache key
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def control_text(pkg: Pkg, installed_size: int = 1) -> str:
    lines = [f"Package: {pkg.name}", f"Version: {pkg.version}", f"Architecture: {pkg.arch}",
             "Maintainer: gpufleet tests <gpufleet-tests@localhost>", f"Installed-Size: {installed_size}",
             "Section: multiverse/devel", "Priority: optional"]
    for key, rel in (("Depends", pkg.depends), ("Provides", pkg.provides), ("Conflicts", pkg.conflicts)):
        if rel:
            lines.append(f"{key}: {', '.join(rel)}")
    desc = pkg.description or pkg.name
    lines.append(f"Description: {desc} [gpufleet test stand-in]")
    lines.append(" " + STAND_IN_NOTE)
    lines.append(" It has the name, version and relations of the real package so that apt behaves")
    lines.append(" as it would against NVIDIA's repository.")
    return "\n".join(lines) + "\n"


def build_deb(pkg: Pkg, cache: Path = DEB_CACHE) -> Path:
    """Build `pkg` once per content hash; return the cached .deb."""
    out_dir = cache / _content_key(pkg)
    out = out_dir / pkg.filename
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
        root = Path(tmp) / "root"
        files = [(f"/usr/share/doc/{pkg.name}/STAND-IN",
                  f"{pkg.name} {pkg.version}\n{STAND_IN_NOTE}\nBuilt by gpufleet testing/aptrepo.py for tests only.\n",
                  0o644), *pkg.files]
        size = 0
        for path, content, mode in files:
            dest = root / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            data = content if isinstance(content, bytes) else content.encode()
            dest.write_bytes(data)
            dest.chmod(mode)
            size += len(data)
        (root / "DEBIAN").mkdir()
        (root / "DEBIAN/control").write_text(control_text(pkg, max(1, size // 1024)))
        if pkg.postinst:
            (root / "DEBIAN/postinst").write_text(pkg.postinst)
        for p in [root, *root.rglob("*")]:
            if p.is_dir() or p.name == "postinst":
                p.chmod(0o755)
        for p in sorted(root.rglob("*"), reverse=True) + [root]:
            os.utime(p, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH), follow_symlinks=False)
        tmp_out = Path(tmp) / pkg.filename
        env = dict(os.environ, SOURCE_DATE_EPOCH=str(SOURCE_DATE_EPOCH))
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(tmp_out)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        out_dir.mkdir(parents=True, exist_ok=True)
        os.replace(tmp_out, out)
    return out


# --------------------------------------------------------------------------------------------
# Signing key and repository metadata
# --------------------------------------------------------------------------------------------

def _gpg(home: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["gpg", "--homedir", str(home), "--batch", "--yes", "--no-tty", *args],
                          check=True, capture_output=True, **kw)


def make_key(home: Path, uid: str) -> tuple[str, bytes, str]:
    """A throwaway signing key (no passphrase) in GNUPGHOME `home`: (fingerprint, binary keyring, armor)."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    _gpg(home, "--passphrase", "", "--quick-gen-key", uid, "rsa3072", "sign", "never")
    out = _gpg(home, "--with-colons", "--list-secret-keys").stdout.decode()
    fpr = next(line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:"))
    binary = _gpg(home, "--export", fpr).stdout
    armored = _gpg(home, "--armor", "--export", fpr).stdout.decode()
    return fpr, binary, armored


def write_flat_repo(directory: Path, debs: list[Path], home: Path | None, fpr: str | None,
                    origin: str, label: str) -> None:
    """A flat repository (`deb URL /`) in `directory`; signed (InRelease + Release.gpg) if a key is given."""
    directory.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        dest = directory / deb.name
        if not dest.exists():
            try:
                os.link(deb, dest)
            except OSError:
                shutil.copy2(deb, dest)
    packages = subprocess.run(["apt-ftparchive", "packages", "."], cwd=directory, check=True,
                              capture_output=True).stdout
    (directory / "Packages").write_bytes(packages)
    with gzip.GzipFile(directory / "Packages.gz", "wb", mtime=SOURCE_DATE_EPOCH) as fh:
        fh.write(packages)
    release = subprocess.run([
        "apt-ftparchive",
        "-o", f"APT::FTPArchive::Release::Origin={origin}",
        "-o", f"APT::FTPArchive::Release::Label={label}",
        "-o", "APT::FTPArchive::Release::Architectures=amd64 all",
        "-o", "APT::FTPArchive::Release::Description=gpufleet test stand-in repository (not NVIDIA)",
        "release", "."], cwd=directory, check=True, capture_output=True).stdout
    (directory / "Release").write_bytes(release)
    if home is not None:
        _gpg(home, "--local-user", fpr, "--digest-algo", "SHA512", "--clearsign",
             "--output", str(directory / "InRelease"), str(directory / "Release"))
        _gpg(home, "--local-user", fpr, "--digest-algo", "SHA512", "--armor", "--detach-sign",
             "--output", str(directory / "Release.gpg"), str(directory / "Release"))


# --------------------------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------------------------

_SERVER = r"""
import functools, http.server, sys, threading
log, lock = open(sys.argv[2], "a", buffering=1), threading.Lock()
class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def log_request(self, code="-", size="-"):
        # the access log: one line per request, "METHOD PATH STATUS" (AptRepo.fetches reads it)
        with lock:
            log.write(f"{self.command} {self.path} {getattr(code, 'value', code)}\n")
h = functools.partial(Handler, directory=sys.argv[1])
if sys.argv[3] == "low":  # a port below 32768 (see serve)
    import random
    for port in random.sample(range(20000, 32768), 200):
        try:
            srv = http.server.ThreadingHTTPServer(("127.0.0.1", port), h)
            break
        except OSError:
            continue
else:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), h)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""


@dataclass
class AptRepo:
    url: str            # flat repo base for debian12, e.g. http://127.0.0.1:PORT/compute/cuda/repos/debian12/x86_64/
    keyring: Path       # binary public keyring file (controller side)
    key_armored: str    # ASCII-armored public key
    root: Path          # repo directory on the controller (document root of the server)
    pid: int = 0
    port: int = 0
    fingerprint: str = ""
    packages: list[Pkg] = field(default_factory=list, repr=False)
    timings: dict[str, float] = field(default_factory=dict)
    access_log: Path | None = None  # "METHOD PATH STATUS" per request served
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cuda_repos_url(self) -> str:
        """The value for the `driver_repo_url` setting (like https://.../compute/cuda/repos)."""
        return f"{self.origin}/compute/cuda/repos"

    def base_url(self, distro: str) -> str:
        """Flat CUDA repo for "debian12" / "debian13" / "ubuntu2404" (trailing slash; suite is "/")."""
        if distro not in DISTROS:
            raise ValueError(f"unknown distro dir {distro!r}; served: {', '.join(DISTROS)}")
        return f"{self.cuda_repos_url}/{distro}/x86_64/"

    def container_repo_base(self) -> str:
        """The value for the `docker_toolkit_repo_url` setting (like https://nvidia.github.io/libnvidia-container):
        the flat repo is at <base>/stable/deb/amd64/ and the armored key at <base>/gpgkey."""
        return f"{self.origin}/libnvidia-container"

    def container_url(self) -> str:
        """Flat libnvidia-container (NVIDIA Container Toolkit) repo, like .../stable/deb/amd64/."""
        return f"{self.origin}/libnvidia-container/stable/deb/amd64/"

    def variant_url(self, variant: str, distro: str = "debian12") -> str:
        """Negative variants of the CUDA repo: "unsigned" (no InRelease/Release.gpg) or
        "wrongkey" (signed by another throwaway key)."""
        if variant not in ("unsigned", "wrongkey"):
            raise ValueError(variant)
        return f"{self.origin}/{variant}/compute/cuda/repos/{distro}/x86_64/"

    @property
    def pytorch_index_url(self) -> str:
        """The value for the `pytorch_index_url` setting: the stand-in PyTorch index per variant."""
        return f"{self.origin}/pytorch/whl/{{variant}}"

    def sources_line(self, distro: str, keyring_path: str = "/usr/share/keyrings/cuda-archive-keyring.gpg") -> str:
        return f"deb [signed-by={keyring_path}] {self.base_url(distro)} /"

    def fetches(self, suffix: str = ".deb") -> dict[str, int]:
        """How often each path ending in `suffix` was served (status 200), from the access log."""
        counts: dict[str, int] = {}
        for line in (self.access_log.read_text().splitlines() if self.access_log and self.access_log.exists() else []):
            method, _, rest = line.partition(" ")
            path, _, status = rest.rpartition(" ")
            if method == "GET" and status == "200" and path.endswith(suffix):
                path = path.replace("/./", "/")  # flat repositories' Filename: ./name.deb
                counts[path] = counts.get(path, 0) + 1
        return counts

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None


def build(work: Path, packages: list[Pkg] | None = None, port: int | None = None) -> dict:
    """Build the repository tree under `work` (debs from the cache). Returns key material."""
    packages = default_packages() if packages is None else packages
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    debs = {p: build_deb(p) for p in packages}
    t_debs = time.monotonic() - t0
    home = Path(tempfile.mkdtemp(prefix="gnupg-", dir=work))
    fpr, binary, armored = make_key(home, "gpufleet test apt repo (throwaway, not NVIDIA) <gpufleet-tests@localhost>")
    bad_home = Path(tempfile.mkdtemp(prefix="gnupg-bad-", dir=work))
    bad_fpr, _, _ = make_key(bad_home, "gpufleet wrong key (throwaway) <gpufleet-tests@localhost>")
    (work / "cuda-archive-keyring.gpg").write_bytes(binary)
    (work / "cuda-archive-keyring.asc").write_text(armored)
    t_key = time.monotonic() - t0 - t_debs
    return {"debs": debs, "home": home, "fpr": fpr, "binary": binary, "armored": armored,
            "bad_home": bad_home, "bad_fpr": bad_fpr, "t_debs": t_debs, "t_key": t_key}


def serve(work: Path, packages: list[Pkg] | None = None, low_port: bool = False) -> AptRepo:
    """Build (debs cached) and serve the stand-in repositories on 127.0.0.1:<free port>.

    `low_port`: a port below 32768, outside the kernel's ephemeral range: Debian 12's apt-cacher-ng
    (3.7.4) answers "503 Connection refused" for an upstream on a port from 32768 up, even one in
    its AllowUserPorts (measured: 34531, 34999 refused, 18777 served)."""
    work = Path(work)
    packages = default_packages() if packages is None else list(packages)
    t0 = time.monotonic()
    material = build(work, packages)
    root = work / "www"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    # The port is needed for cuda-keyring's sources list, so the server starts first.
    access_log = work / "access.log"
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(root), str(access_log), "low" if low_port else "0"],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port = int(proc.stdout.readline().strip())
        repo = AptRepo(url="", keyring=work / "cuda-archive-keyring.gpg", key_armored=material["armored"],
                       root=root, pid=proc.pid, port=port, fingerprint=material["fpr"], packages=packages,
                       access_log=access_log, _proc=proc)
        repo.url = repo.base_url("debian12")
        t1 = time.monotonic()
        cuda_debs = [d for p, d in material["debs"].items() if p.repo == "cuda"]
        ctk_debs = [d for p, d in material["debs"].items() if p.repo == "container"]
        for distro in DISTROS:
            url = repo.base_url(distro)
            kr = build_deb(keyring_package(distro, url, material["binary"]), cache=work / "keyring-debs")
            rel = Path("compute/cuda/repos") / distro / "x86_64"
            write_flat_repo(root / rel, cuda_debs + [kr], material["home"], material["fpr"], "NVIDIA", "NVIDIA CUDA")
            if distro == "debian12" or distro == "debian13":
                write_flat_repo(root / "unsigned" / rel, cuda_debs + [kr], None, None, "NVIDIA", "NVIDIA CUDA")
                write_flat_repo(root / "wrongkey" / rel, cuda_debs + [kr], material["bad_home"],
                                material["bad_fpr"], "NVIDIA", "NVIDIA CUDA")
        # NVIDIA publishes the repo's key next to it: https://nvidia.github.io/libnvidia-container/gpgkey
        (root / "libnvidia-container").mkdir(parents=True, exist_ok=True)
        (root / "libnvidia-container/gpgkey").write_text(material["armored"])
        write_flat_repo(root / "libnvidia-container/stable/deb/amd64", ctk_debs, material["home"],
                        material["fpr"], "https://nvidia.github.io/libnvidia-container/stable/deb/amd64",
                        "libnvidia-container")
        from testing import torch_standin

        torch_standin.serve_index(root)
        repo.timings = {"debs_s": material["t_debs"], "keys_s": material["t_key"],
                        "repo_metadata_s": time.monotonic() - t1, "total_s": time.monotonic() - t0}
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    finally:
        # gpg started one agent per GNUPGHOME; nothing is signed after this point.
        for home in (material["home"], material["bad_home"]):
            subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"],
                           capture_output=True, check=False)
    return repo


# --------------------------------------------------------------------------------------------
# pytest fixture
# --------------------------------------------------------------------------------------------

def _missing_tools() -> list[str]:
    return [t for t in ("dpkg-deb", "apt-ftparchive", "gpg") if not shutil.which(t)]


try:
    import pytest
except ImportError:  # pragma: no cover - the module also works without pytest
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="session")
    def aptrepo(tmp_path_factory):
        """Session-wide served stand-in repository (an AptRepo); stopped at the end of the session."""
        missing = _missing_tools()
        if missing:
            msg = f"the stand-in apt repository needs {', '.join(missing)} (apt-utils, dpkg-dev, gnupg)"
            if os.environ.get("GPUFLEET_REQUIRE_E2E"):
                pytest.fail(msg)
            pytest.skip(msg)
        repo = serve(tmp_path_factory.mktemp("aptrepo"))
        yield repo
        repo.stop()

    aptrepo_fixture = aptrepo


# --------------------------------------------------------------------------------------------
# A repository that outlives the process that served it (the sandbox keeps one running)
# --------------------------------------------------------------------------------------------

def save(repo: AptRepo, path: Path) -> None:
    """Record a served repository so another process can use it (`load`) and stop it."""
    path.write_text(json.dumps({"url": repo.url, "keyring": str(repo.keyring), "root": str(repo.root),
                                "pid": repo.pid, "port": repo.port, "fingerprint": repo.fingerprint}))


def load(path: Path) -> AptRepo | None:
    """The repository recorded at `path`, if its server is still running."""
    try:
        info = json.loads(path.read_text())
        os.kill(info["pid"], 0)
    except (OSError, ValueError, KeyError):
        return None
    return AptRepo(url=info["url"], keyring=Path(info["keyring"]), key_armored="", root=Path(info["root"]),
                   pid=info["pid"], port=info["port"], fingerprint=info["fingerprint"])


def stop_saved(path: Path) -> None:
    """Stop the server recorded at `path` (by its PID, only if it is still our server)."""
    repo = load(path)
    if repo is not None:
        try:
            cmdline = Path(f"/proc/{repo.pid}/cmdline").read_bytes()
        except OSError:
            cmdline = b""
        if str(repo.root).encode() in cmdline:
            os.kill(repo.pid, 15)
    path.unlink(missing_ok=True)
