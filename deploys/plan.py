"""Plan view: what gpufleet would install on each host, and why. Changes nothing.

    pyinfra inventories/cloud.py deploys/plan.py

Per host: the tier, the settings the inventory overrides, the hardware found (from PCI, so it
works before any driver is installed), whether it matches the tier, and the exact versions the
resolver picks for these GPUs on this OS, the kernel-module packages for the running kernel
(Ubuntu: prebuilt and signed, or DKMS), and every package source line the deploys write
(gpufleet/plans/repos.py: the same functions write them). `pyinfra ... deploys/all.py --dry` shows the
operations themselves.

Clocks: where nvidia-smi works, the pair each GPU gets, from its own supported-clocks list (the
same plan deploys/tuning.py applies and the validation gate checks); before that, the compatibility
catalogue's estimate, said to be one. GPUs in MIG mode (gpu_mig) are left out, and the plan says so.

MIG: the partitions each GPU gets (gpu_mig), what it has now, and a refusal naming gpu_mig.

Scratch: which drives storage_scratch would format (the same plan deploys/storage.py applies),
the drives it leaves alone and why, or its refusal; and /dev/shm's size (storage_shm_size).
"""
import click
from pyinfra import host, state
from pyinfra.facts.server import Arch

from gpufleet.controller import askpass
from gpufleet.plans.cluster import missing_peers, training_networks
from gpufleet.plans.acceptance import plan_line as acceptance_line
from gpufleet.config.failures import Refusal
from gpufleet.plans.driver import plan_driver, read_driver_facts
from gpufleet.plans.driver_preconditions import mok_certificate
from gpufleet.catalog.compat import compat_data
from gpufleet.errors import Incompatible
from gpufleet.config.hostfacts import driver_state, hardware, kernel_plan, os_name, os_release, resolution, tier_mismatches
from gpufleet.plans.package_cache import summary as package_summary
from gpufleet.plans.repos import TOOLKIT_PACKAGES, dpkg_arch, repository_lines
from gpufleet.catalog.pytorch import mixed_gpus
from gpufleet.rollout.snapshot import command_name
from gpufleet.config.settings import host_settings, validate_inventory
from gpufleet.plans.storage import plan_scratch
from gpufleet.config.failures import Refused
from gpufleet.plans.tuning import clocks_summary, host_clocks, host_mig, mig_clock_skip
from gpufleet.plans.profiling import host_profiling

askpass.install()  # its facts run through sudo: the password never on the host's command line
validate_inventory(state.inventory)
settings = host_settings(host)
lines = [f"tier: {settings.tier}"]
for key in (k for k in settings.overridden if k != "tier"):
    value = settings[key]
    if key == "rollout_snapshot_command" and value:  # its arguments may hold a token
        words = value.split() if isinstance(value, str) else list(value)
        value = f"{command_name(words)} (arguments not shown)"
    lines.append(f"override: {key} = {value}")
lines.append(f"os: {os_name(host)}")
lines.append(f"hardware: {hardware(host).summary}")
if mixed := mixed_gpus(hardware(host).models):
    lines.append(f"MIXED: {mixed}")
for problem in tier_mismatches(host, settings):
    lines.append(f"MISMATCH ({settings.tier_mismatch}): {problem}")
lines.append(f"training peers: {training_networks(settings)}")
lines.append(f"acceptance: {acceptance_line(settings)}")
if warning := missing_peers(settings):
    lines.append(f"WARNING: {warning}")


def mig_lines() -> tuple[list[str], frozenset[str]]:
    """The MIG plan in words (the same plan deploys/tuning.py applies and the gate checks), and
    the GPUs whose clocks it takes out of the clock plan."""
    try:
        plan = host_mig(host, settings.gpu_mig)
    except Refused as refused:
        return [f"mig: REFUSED: {refused}"], frozenset()
    out = [f"mig: {plan.summary()}"]
    change = "to change (only while this GPU is idle; tools/rollout drains the host for it)"
    out += [f"mig: {g.label}: has {g.found}; " + (change if g.change else "as set") for g in plan.gpus if plan.managed]
    skip = mig_clock_skip(host, plan)
    if skip and settings.clock_policy not in ("unmanaged", "default"):
        out.append(f"mig: clocks are not settable in MIG mode: clock_policy {settings.clock_policy} leaves "
                   f"{len(skip)} GPU(s) in MIG mode at the driver's clocks")
    return out, skip


MIG_LINES, MIG_SKIP = mig_lines()


def profiling_line(res: object) -> str:
    """tuning_profiling's plan in words: the one the driver deploy applies and the gate checks."""
    try:
        return host_profiling(host, settings, res).summary()
    except Refused as refused:
        return f"REFUSED: {refused}"


def host_clock_line() -> str | None:
    """The host's own clock plan, when its nvidia-smi works (else None: the estimate stands)."""
    try:
        plans = host_clocks(host, settings.clock_policy, MIG_SKIP)
    except Refused as refused:
        return f"REFUSED: {refused}"
    if not plans:
        return "none set: every GPU is in MIG mode" if MIG_SKIP else None
    return f"{clocks_summary(plans)} (the GPUs' own supported clocks)"


res = None
try:
    res = resolution(host, settings)
    for key, value in res.describe().items():
        if key == "kernel_modules":
            kernel = kernel_plan(host, res)
            how = "prebuilt, signed: no DKMS, no MOK" if kernel.prebuilt else "DKMS: kernel headers, a MOK under Secure Boot"
            value = f"{' '.join(kernel.modules)} ({how}; kernel {kernel.release})" if kernel.modules else value
        if key == "notes":
            lines += [f"note: {note}" for note in value]
        elif key == "clocks":
            lines.append(f"clocks: {host_clock_line() or value}")
        else:
            lines.append(f"{key}: {value}")
    # the driver deploy's own plan (gpufleet/plans/driver.py): its refusal, or what it changes
    driver_plan = plan_driver(settings, read_driver_facts(host, settings))
    state_before, kernel = driver_state(host), kernel_plan(host, res)
    if state_before.secure_boot == "enabled":
        key = settings.driver_module_signing_key
        lines.append("secure_boot: enabled (" + ("modules prebuilt and signed by the distribution: no MOK"
                     if kernel.prebuilt else f"DKMS signs with the MOK {key}, certificate {mok_certificate(key)}"
                     if key != "none" else "DKMS builds need a MOK: driver_module_signing_key") + ")")
    if not kernel.prebuilt and settings.driver_kernel_headers == "require":
        headers = [f"linux-headers-{kernel.release}", *([kernel.headers_metapackage] if kernel.headers_metapackage else [])]
        lines.append(f"kernel_headers: {' '.join(headers)} (DKMS builds the module for this kernel and the ones that follow)")
    if isinstance(driver_plan, Refusal):
        lines.append(f"REFUSED ({driver_plan.area}): {driver_plan.reason}. Fix: {driver_plan.how_to_fix()} (key {driver_plan.key})")
    else:
        lines += driver_plan.summary()
except Incompatible as refused:
    lines.append(f"REFUSED: {refused.reason}" + (f" (key {refused.key})" if refused.key else ""))
lines += MIG_LINES
lines.append("profiling: " + profiling_line(res))


def storage_lines() -> list[str]:
    """The scratch plan in words (the same plan deploys/storage.py applies), and /dev/shm's size."""
    from gpufleet.facts.storage import ScratchSite
    from gpufleet.config.hostfacts import block_devices

    shm = settings.storage_shm_size
    out = ["shm: /dev/shm " + ("left as it is (unmanaged)" if shm == "unmanaged" else f"size={shm}, now and at boot")]
    if settings.storage_scratch == "none":
        return ["scratch: none"] + out
    try:
        plan = plan_scratch(settings.storage_scratch, settings.storage_scratch_devices, settings.storage_scratch_path,
                            block_devices(host), lambda: host.get_fact(ScratchSite, path=settings.storage_scratch_path))
    except Refused as refused:
        return [f"scratch: REFUSED: {refused}"] + out
    return [f"scratch: {plan.summary()}"] + [f"scratch: {note}" for note in plan.notes] + out


def pytorch_runtime_line() -> str:
    """Where the gate finds PyTorch, and what deploys/pytorch.py installs (pytorch_runtime: venv)."""
    from gpufleet.plans.pytorch_runtime import VENV, runtime_of, venv_plan

    runtime = runtime_of(settings)
    choice = res.pytorch if res is not None else None
    if runtime.kind == VENV and choice is not None:
        return f"{runtime.describe()}: installs {venv_plan(settings, choice).describe()}"
    return runtime.describe()


lines.append("pytorch_runtime: " + pytorch_runtime_line())
lines += storage_lines()
lines.append("packages: " + package_summary(settings))
release = os_release(host)
for what, line in repository_lines(settings, res, release.id, release.version_codename,
                                   dpkg_arch(host.get_fact(Arch) or "x86_64"), compat_data()):
    lines.append(f"{what}: {line}")
lines.append("toolkit: " + " ".join(f"{p}={settings.docker_toolkit_version}" for p in TOOLKIT_PACKAGES))
click.echo(f"--> Plan for {host.name}\n    " + "\n    ".join(lines), err=True)
