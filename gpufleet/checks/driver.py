"""The validation gate, driver: the driver, CUDA toolkit and cuDNN, the kernels' module, fabric manager."""
from __future__ import annotations

from gpufleet.catalog.cuda_stack import (
    STACK_FAMILIES,
    component_drift,
    pending_message,
    stack_drift_message,
    stack_fact_packages,
    stack_pending_message,
    stack_renames,
    stack_states,
)
from gpufleet.checks.gate import (
    FAIL,
    FIX_DEPLOY,
    FIX_ROLLOUT,
    PASS,
    SKIP,
    WARN,
    Context,
    Result,
    check,
)
from gpufleet.errors import Incompatible
from gpufleet.facts.system import UnitActive


@check("driver")
def no_mismatch_pending(ctx: Context) -> Result:
    """Always checked: a loaded module that differs from the installed user space breaks every
    GPU program until the host reboots, whoever installed the driver."""
    name = "no driver mismatch is pending"
    drv, gpu = ctx.driver, ctx.gpu
    if drv.mismatch or gpu.status == "mismatch":
        loaded = drv.module_version or "?"
        installed = drv.userspace_version or gpu.nvml_version or "?"
        reboot = ctx.settings.driver_reboot
        how = ("run deploys/all.py (driver_reboot: allowed, so it reboots the host) or reboot the host"
               if reboot == "allowed" else
               f"reboot the host when it is idle (driver_reboot: {reboot} keeps deploys/all.py from doing it)")
        return Result("driver", name, FAIL, f"driver loaded {loaded} != installed {installed}", how)
    if drv.reboot_required:
        pkgs = ", ".join(drv.reboot_required_packages) or "unknown packages"
        return Result("driver", name, WARN, f"the OS asks for a reboot (/run/reboot-required: {pkgs})",
                      "reboot the host when it is idle")
    return Result("driver", name, PASS, f"loaded {drv.module_version or 'none'}, installed "
                                         f"{drv.userspace_version or 'none'}")


@check("driver")
def driver_versions_agree(ctx: Context) -> Result:
    name = "the loaded driver = the installed driver = the resolved driver"
    drv = ctx.driver
    found = f"loaded {drv.module_version or 'none'}, installed {drv.userspace_version or 'none'}"
    try:
        want = ctx.resolution().driver_version
    except Incompatible as refused:
        return Result("driver", name, SKIP, f"no driver resolves for this host: {refused.reason}")
    if drv.module_version == drv.userspace_version == want:
        return Result("driver", name, PASS, f"{want} ({drv.module_flavour or '?'})")
    if drv.userspace_version and drv.userspace_version != want and not ctx.settings.driver_upgrade_in_place:
        # the inventory moved on: a rollout's job, not a broken host (unless the operator says so)
        status = FAIL if ctx.settings.driver_upgrade_pending == "fail" else WARN
        return Result("driver", name, status, f"{pending_message(drv.userspace_version, want)} ({found})",
                      FIX_ROLLOUT)
    return Result("driver", name, FAIL, f"{found}, resolved {want}", FIX_DEPLOY)


FIX_STACK_DRIFT = ("tools/rollout INVENTORY puts it back at the resolved release through the gate (GPUs idle, "
                   "manifest first); deploys/all.py changes no installed CUDA toolkit or cuDNN")


FIX_COMPONENT_DRIFT = ("put each back at the version its CUDA toolkit release ships: apt-get install --allow-downgrades "
                       "--allow-change-held-packages PACKAGE=VERSION (apt-cache madison PACKAGE), then apt-mark hold "
                       "PACKAGE; tools/rollout moves the components with a toolkit release")


@check("driver")
def cuda_cudnn_releases_exact(ctx: Context) -> Result:
    """The CUDA toolkit and cuDNN on the host are exactly the resolved releases: a presence check
    would pass a cuDNN changed by hand or left behind by an inventory change. gpufleet's record
    of what it installed tells the two apart: an inventory change is a pending upgrade (as
    for the driver: WARN, or FAIL with driver_upgrade_pending: fail), a hand change a FAIL."""
    from gpufleet.facts.packages import StackPackages

    name = "the CUDA toolkit and cuDNN are the resolved releases"
    try:
        res = ctx.resolution()
    except Incompatible as refused:
        return Result("driver", name, SKIP, f"nothing resolves for this host: {refused.reason}")
    wanted = res.stack_versions
    if not wanted:
        return Result("driver", name, SKIP, "the tier installs no host CUDA toolkit or cuDNN from NVIDIA's repository")
    found = ctx.fact(StackPackages, packages=stack_fact_packages(wanted))
    installed = found.installed
    renames = stack_renames(wanted, installed)
    renamed = {p for what, family in STACK_FAMILIES if what in renames for p in wanted if family.match(p)}
    missing = [p for p in sorted(wanted) if not installed.get(p) and p not in renamed]
    states = stack_states(wanted, installed, found.recorded)
    drift = [stack_drift_message(p, have, mine or "?", wanted[p])
             for p, (state, have, mine) in states.items() if state == "drift"]
    moves: dict[str, tuple[str, str]] = {}
    for p, (state, have, _) in states.items():
        if state == "pending":
            what = "CUDA toolkit" if p == res.cuda_package else "cuDNN"
            moves.setdefault(what, (have, wanted[p]))
    moves.update((what, (old, new)) for what, (_, old, new) in renames.items())
    pending = [stack_pending_message(what, *v) for what, v in moves.items()]
    components = component_drift(found.components, wanted, installed)
    not_installed = f"not installed: {', '.join(missing)}" if missing else ""
    if drift or components:
        fix = FIX_STACK_DRIFT if drift else FIX_COMPONENT_DRIFT
        return Result("driver", name, FAIL, "; ".join([*drift, *components, *pending]
                                                      + ([not_installed] if missing else [])), fix)
    if missing:
        return Result("driver", name, FAIL, "; ".join([*pending, not_installed]), FIX_DEPLOY)
    if pending:
        status = (FAIL if ctx.settings.driver_upgrade_pending == "fail" or ctx.settings.driver_upgrade_in_place
                  else WARN)
        fix = (FIX_DEPLOY + " (driver_upgrade_in_place: it moves the packages when the GPUs are idle, manifest first)"
               if ctx.settings.driver_upgrade_in_place else FIX_ROLLOUT)
        return Result("driver", name, status, "; ".join(pending), fix)
    shown = [f"CUDA {res.cuda_release}"] if res.cuda_release else []
    shown += [f"cuDNN {res.cudnn_release}"] if res.cudnn_release else []
    return Result("driver", name, PASS, ", ".join(shown))


@check("driver")
def stack_held(ctx: Context) -> Result:
    """The driver, CUDA and cuDNN packages held and NVIDIA's version-locking package present, as
    deploys/driver.py leaves them: an `apt-mark unhold` by hand lets the next `apt upgrade` move
    the stack past the gate."""
    from gpufleet.facts.packages import HeldPackages, PackageVersions

    name = "the driver, CUDA and cuDNN are held and nvidia-driver-pinning-* is installed"
    if not ctx.settings.driver_hold:
        return Result("driver", name, SKIP, "driver_hold: false")
    try:
        res = ctx.resolution()
    except Incompatible as refused:
        return Result("driver", name, SKIP, f"nothing resolves for this host: {refused.reason}")
    wanted = sorted({*res.package_versions, *res.stack_versions})
    pinning = [res.pinning_package] if res.pinning_package else []
    versions = ctx.fact(PackageVersions, packages=[*wanted, *pinning])
    installed = [p for p in wanted if versions.get(p)]
    if not installed:
        return Result("driver", name, SKIP, "no driver package installed")
    held = set(ctx.fact(HeldPackages))
    loose = [p for p in installed if p not in held]
    missing_pin = [p for p in pinning if not versions.get(p)]
    if loose:
        found = f"not held: {', '.join(loose)}" + (f"; {missing_pin[0]} not installed" if missing_pin else "")
        return Result("driver", name, FAIL, found,
                      f"apt-mark hold {' '.join(loose)} (or {FIX_DEPLOY}, which holds them)")
    if missing_pin:
        # A driver installed before gpufleet (or by hand) has no version lock, and all.py keeps a
        # driver it would not install itself (tools/rollout moves drivers): a warning, not a stop.
        return Result("driver", name, WARN, f"{len(installed)} held, but {missing_pin[0]} is not installed "
                      "(NVIDIA's version lock: apt may move the driver past the holds' versions on an upgrade)",
                      f"apt-get install {missing_pin[0]}")
    return Result("driver", name, PASS, f"{len(installed)} held" + (f", {pinning[0]}" if pinning else ""))


@check("driver")
def kernels_have_the_module(ctx: Context) -> Result:
    """A kernel installed after the driver (unattended upgrades) boots without GPUs unless DKMS
    built the module for it, which needs that kernel's headers (linux-headers-<flavour>), or,
    with Ubuntu's prebuilt modules, unless their package for that kernel came with it."""
    from gpufleet.catalog.kernels import headers_metapackage

    name = "every installed kernel has the nvidia module"
    drv = ctx.driver
    if not drv.userspace_version:
        return Result("driver", name, SKIP, "no NVIDIA driver installed")
    if not drv.installed_kernels:
        return Result("driver", name, SKIP, "no kernel in /lib/modules (a container runs its host's kernel)")
    missing = [release for release, has in sorted(drv.installed_kernels.items())
               if not has and not (release == drv.kernel_release and drv.module_loaded)]
    if not missing:
        return Result("driver", name, PASS, f"{len(drv.installed_kernels)} kernel(s)")
    prebuilt = sorted(n for n, e in drv.packages.items() if n.startswith("linux-modules-nvidia-") and e.installed)
    if prebuilt:
        # Ubuntu's prebuilt modules: no DKMS builds them for a kernel that came alone (held with
        # the driver by deploys/driver.py, so one installed by hand or before the holds)
        return Result("driver", name, WARN, f"no prebuilt nvidia module for {', '.join(missing)}: booting "
                      f"{'it' if len(missing) == 1 else 'one'} leaves the GPUs without a driver",
                      "kernels move with their prebuilt modules only through tools/rollout INVENTORY (it moves "
                      "the held kernel and linux-modules-nvidia-* flavour metapackages together); install "
                      "linux-modules-nvidia-<series>-RELEASE for each, or remove that kernel")
    meta = sorted({m for m in map(headers_metapackage, missing) if m})
    how = (f"install {' '.join(meta)} (deploys/all.py does, for the running kernel's flavour), then "
           "`dkms autoinstall -k RELEASE` for each" if meta else "install their headers, then `dkms autoinstall -k RELEASE`")
    return Result("driver", name, WARN, f"no nvidia module for {', '.join(missing)}: booting "
                  f"{'it' if len(missing) == 1 else 'one'} leaves the GPUs without a driver", how)


@check("driver")
def fabric_manager_active(ctx: Context) -> Result:
    name = "Fabric Manager is active where NVSwitch is present"
    if not ctx.hardware().nvswitch:
        return Result("driver", name, SKIP, "no NVSwitch on this host")
    state = ctx.fact(UnitActive, unit="nvidia-fabricmanager.service")
    if state == "active":
        return Result("driver", name, PASS, "nvidia-fabricmanager.service active")
    return Result("driver", name, FAIL, f"nvidia-fabricmanager.service is {state}",
                  "systemctl start nvidia-fabricmanager, or run deploys/all.py")


