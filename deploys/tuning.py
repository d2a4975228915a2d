"""GPU persistence, clocks that survive reboots, and the NCCL / OMP / PyTorch environment.

Story of a host, part 5: once the driver works, the GPUs are kept initialised by NVIDIA's
persistence daemon (not the legacy ``nvidia-smi -pm 1``), run at the clocks the tier asks for,
and every job, from a login shell or a service, starts with the right environment.

1. persistence (``driver_persistence``): ``daemon`` installs ``nvidia-persistenced`` if missing,
   enables and starts it, then checks that every GPU reports persistence mode Enabled;
   ``legacy`` runs ``nvidia-smi -pm 1`` (and again at boot); ``off`` leaves it alone.
2. clocks (``clock_policy``): ``max`` = the highest pair in each GPU's own supported-clocks
   list, ``{memory, graphics}`` = that pair (refused at planning time, for this host only, when
   a GPU does not support it), ``default`` = driver defaults, ``unmanaged`` = hands off. Set with
   ``-ac`` before R595 and ``-lgc``/``-lmc`` from R595 (``-ac`` is deprecated there); only the
   GPUs not already there get a command. ``gpufleet-gpu-clocks.service`` (oneshot, after
   nvidia-persistenced) re-applies them at every boot from ``/etc/gpufleet/gpu-clocks.env``.
3. MIG (``gpu_mig``): ``none`` turns MIG off, a layout (``{"all": ["3g.71gb", "3g.71gb"]}`` or by
   GPU index) turns it on with those GPU instances, each with its full compute instance,
   ``unmanaged`` leaves it alone; a layout a GPU cannot have is refused at planning. Changed
   only through the gate: the idle check is in the very command that changes it, and with GPU
   work running the change is reported PENDING, not applied. ``gpufleet-gpu-mig.service``
   re-creates the partitions at every boot (before the clocks): a reboot or GPU reset loses
   them. The CDI spec is regenerated after a change (``docker_cdi``, where nvidia-ctk is
   installed). Clocks are not settable in MIG mode: clock_policy skips those GPUs, and says so.
4. environment: ``/etc/nccl.conf`` for the tier's ``nccl_profile`` (socket interface from the
   host's real NICs, RDMA HCAs when present, debugging variables only with
   ``tuning_nccl_debug_vars``); ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` (physical cores per
   GPU, or ``tuning_omp_threads``), ``PYTORCH_CUDA_ALLOC_CONF`` = ``PYTORCH_ALLOC_CONF``
   (``tuning_pytorch_alloc_conf``) and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` for login shells
   (/etc/profile.d), system services (systemd DefaultEnvironment) and user services
   (environment.d). Every file names the tier it came from.
5. CPU governor (``tuning_cpu_governor``): every CPU with cpufreq runs the tier's governor, kept
   across reboots by /etc/tmpfiles.d/gpufleet-cpu-governor.conf (and gpufleet-cpu-governor.service
   once the cpufreq drivers are loaded); a governor the host does not offer is refused at planning
   time; a host without cpufreq (a container, many VMs) is left alone with a no-op saying so.
5. GPUDirect RDMA (``nccl_profile`` ib / roce, on a host with RDMA devices): ``nvidia-peermem``,
   the driver's own module, loaded now when it matches the loaded driver, and at every boot
   (/etc/modules-load.d/gpufleet-nvidia-peermem.conf); a mismatch (a driver change waiting for
   its reboot) or a module not built for the kernel is said, and the gate fails on it.

Decisions use the host's state before this run (gpufleet.config.hostfacts): what this run installs
(the daemon package, for one) is never assumed to be there already.
"""
from __future__ import annotations

from io import StringIO
from typing import TYPE_CHECKING, Any

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import apt, files, server, systemd

from gpufleet.facts.gpu_tuning import LOCKED_CLOCKS_DIR
from gpufleet.facts.kernel import PeermemState
from gpufleet.plans import gpudirect
from gpufleet.config.hostfacts import driver_state, rdma_devices
from gpufleet.plans import tuning as t
from gpufleet.config.failures import Refused, real_host
from gpufleet.catalog.mig import setting_text
from gpufleet.controller.run_summary import outcome
from gpufleet.config.settings import host_settings
from gpufleet.explain import explained
from gpufleet.plans.tuning import TuningPlan, ac_deprecated_from, plan_tuning, policy_text
from gpufleet.operations import cpu, gpu
from gpufleet.operations.daemon_reload import reload_when
from gpufleet.operations.notice import say

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

#: Debian (non-free/contrib) and NVIDIA's CUDA repository both call the daemon's package this.
PERSISTENCED_PACKAGE = "nvidia-persistenced"
PERSISTENCED_SERVICE = "nvidia-persistenced.service"
CLOCKS_SERVICE = "gpufleet-gpu-clocks.service"
CLOCKS_UNIT = "/etc/systemd/system/gpufleet-gpu-clocks.service"
CLOCKS_ENV = "/etc/gpufleet/gpu-clocks.env"
CLOCKS_SCRIPT = "/usr/local/sbin/gpufleet-gpu-clocks"
SYSTEMD_ENV = "/etc/systemd/system.conf.d/gpufleet-gpu-env.conf"
GOVERNOR_TMPFILES = "/etc/tmpfiles.d/gpufleet-cpu-governor.conf"
GOVERNOR_SERVICE = "gpufleet-cpu-governor.service"
GOVERNOR_UNIT = "/etc/systemd/system/gpufleet-cpu-governor.service"
MIG_SERVICE = "gpufleet-gpu-mig.service"
MIG_UNIT = "/etc/systemd/system/gpufleet-gpu-mig.service"
MIG_ENV = "/etc/gpufleet/gpu-mig.env"
MIG_SCRIPT = gpu.MIG_SCRIPT
CDI_SPEC = "/etc/cdi/nvidia.yaml"  # where deploys/docker.py has nvidia-ctk write it


def _persistence(settings: Settings, plan: TuningPlan) -> None:
    mode = settings.driver_persistence
    if mode == "off":
        return
    if mode == "legacy":
        if plan.nvidia_ok:
            gpu.legacy_persistence(name=explained("Enable legacy persistence mode", "Turn on legacy persistence mode (nvidia-smi -pm 1) on every GPU"))
        return
    apt.packages(
        name=explained("Install nvidia-persistenced", "Install the NVIDIA persistence daemon, which keeps the GPUs initialised between jobs"),
        packages=[PERSISTENCED_PACKAGE],
        no_recommends=True,
    )
    if not plan.nvidia_ok:
        logger.warning(f"{host.print_prefix}nvidia-smi does not work ({plan.nvidia_status}): "
                       "nvidia-persistenced is enabled for the next boot but not started")
        systemd.service(name=explained("Enable nvidia-persistenced", "Start the NVIDIA persistence daemon at every boot (nvidia-smi does not work yet: not started now)"), service=PERSISTENCED_SERVICE,
                        running=None, enabled=True)
        return
    # the same question systemd.service asks next, so one answer serves both
    was_running = bool(host.get_fact(SystemdStatus, services=[PERSISTENCED_SERVICE]).get(PERSISTENCED_SERVICE))
    systemd.service(
        name=explained("Start nvidia-persistenced", "Run the NVIDIA persistence daemon now and at every boot"),
        service=PERSISTENCED_SERVICE,
        running=True,
        enabled=True,
    )
    gpu.persistence_enabled(
        name=explained("Check persistence mode", "Check that every GPU reports persistence mode Enabled"),
        daemon_was_running=was_running,
    )


def _profiles(settings: Settings, plan: TuningPlan) -> Any:
    changed = {}
    for path, text in plan.files.items():
        changed[path] = files.put(
            name=explained(f"Write {path}", "The GPU job environment, one file per reader: NCCL's system-wide settings for the "
                           "network profile (/etc/nccl.conf), login shells (threads, PyTorch allocator, device "
                           "order: /etc/profile.d), system services (systemd's DefaultEnvironment) and user "
                           "services (/etc/environment.d)"),
            src=StringIO(text),
            dest=path,
            mode="644",
        )
    return changed[SYSTEMD_ENV]


def _mig_busy(setting: Any) -> Any:
    """mig_partitions' if_busy: GPU work found, in the command that would change MIG, on GPUs it
    would change (it started after planning, or ran all along): those GPUs are left as they are,
    reported pending (the idle ones were changed); not a failure."""
    def busy(h: Any, running: str) -> bool:
        outcome(h).mig_pending = (f"gpu_mig: {setting_text(setting)}", running)
        logger.warning(f"{h.print_prefix}MIG PENDING: partitions not changed where GPU work is running: {running}")
        return True
    return busy


def _mig_reboot(h: Any, gpus: str) -> bool:
    """mig_partitions' if_reboot: a MIG mode change waits for a GPU reset that was refused."""
    outcome(h).mig_reboot = gpus
    logger.warning(f"{h.print_prefix}MIG NEEDS A REBOOT: {gpus}")
    return True


def _mig(settings: Settings, plan: TuningPlan, if_busy: Any = None, if_reboot: Any = _mig_reboot) -> None:
    setting = settings.gpu_mig
    mig = plan.mig
    if not mig.managed or not mig.gpus:  # unmanaged, or no GPU with MIG: nothing to make or undo
        return
    keep = any(g.mig_on for g in mig.gpus)  # partitions to re-create at every boot
    context = dict(tier=settings.tier, setting=setting_text(setting), plans=mig.gpus,
                   cdi=CDI_SPEC if settings.docker_cdi else "")
    script = t.render("usr/local/sbin/gpufleet-gpu-mig.j2", **context)
    if not plan.nvidia_ok:
        if keep:  # checked against the PCI models above; made by the first run nvidia-smi answers
            logger.warning(f"{host.print_prefix}nvidia-smi does not work ({plan.nvidia_status}): the MIG partitions "
                           "are made by the first run once the driver works")
        return
    if keep:
        files.put(name=explained("Install the MIG script", "Install the script that makes the MIG partitions"), src=StringIO(script), dest=MIG_SCRIPT,
                  mode="755")
        files.put(name=explained("Record the MIG layout", "Record each GPU's MIG partitions for the boot unit"),
                  src=StringIO(t.render("etc/gpufleet/gpu-mig.env.j2", **context)), dest=MIG_ENV, mode="644")
        unit = files.put(name=explained("Install the MIG unit", "Install the unit that re-creates the MIG partitions at every boot"),
                         src=StringIO(t.render("etc/systemd/system/gpufleet-gpu-mig.service.j2", **context)),
                         dest=MIG_UNIT, mode="644")
        reload_when(explained("Reload systemd: MIG unit", "Reload systemd so it sees the MIG unit"), unit)
        # enabled, not started now: the change itself goes through the gate (the operation below)
        systemd.service(name=explained("Enable the MIG unit", "Re-create the MIG partitions at every boot (not started now: the change goes through the idle gate)"), service=MIG_SERVICE, running=None,
                        enabled=True)
    else:
        systemd.service(name=explained("Disable the MIG unit", "Stop re-creating MIG partitions at boot (gpu_mig: none)"), service=MIG_SERVICE, running=None,
                        enabled=False)
        gone = [files.file(name=explained(f"Remove {path}", f"Remove {path}: gpu_mig is {setting_text(setting)}"), path=path, present=False)
                for path in (MIG_UNIT, MIG_ENV, MIG_SCRIPT)]
        reload_when(explained("Reload systemd: MIG unit gone", "Reload systemd so it forgets the MIG unit"), gone[0])
    for note in plan.notes:
        say(note)
    gpu.mig_partitions(name=explained("Make the MIG partitions", f"Make the MIG partitions gpu_mig sets ({mig.summary()}), on each GPU "
                                                               "only while it is idle (checked right before)"),
                       setting=setting, script=script, cdi=context["cdi"], if_busy=if_busy or _mig_busy(setting),
                       if_reboot=if_reboot)


@deploy("MIG partitions")
def mig_partitions(if_busy: Any = None, if_reboot: Any = None) -> None:
    """The MIG part of tuning() alone (script, boot unit and its record, the gated change), with
    the rollout's answers to GPU work found right before the change and to a refused GPU reset
    (the host's step fails: busy, or reboot-pending) instead of all.py's (reported pending)."""
    settings = host_settings(host)
    plan = _plan_or_refuse(settings)
    if plan is not None:
        _mig(settings, plan, if_busy=if_busy, if_reboot=if_reboot or _mig_reboot)


def _plan_or_refuse(settings: Settings) -> TuningPlan | None:
    """The host's tuning plan, or None once a refusal has been reported for it."""
    try:
        return plan_tuning(host, settings)
    except Refused as refused:
        refused.refusal.stop(host)
        return None


def _clocks(settings: Settings, plan: TuningPlan, env_file: Any) -> None:
    policy = settings.clock_policy
    if policy == "unmanaged":
        systemd.service(name=explained("Disable the clocks unit", "Stop re-applying gpufleet's GPU clocks at boot (clock_policy: unmanaged)"),
                        service=CLOCKS_SERVICE, running=None, enabled=False)
        removed = [files.file(name=explained(f"Remove {path}", f"Remove {path} (clock_policy: unmanaged)"), path=path, present=False)
                   for path in (CLOCKS_UNIT, CLOCKS_ENV, CLOCKS_SCRIPT)]
        reload_when(explained("Reload systemd: clocks unit gone", "Reload systemd so it sees the GPU environment and unit changes"), env_file,
                    removed[0])
        return
    if not plan.nvidia_ok:
        logger.warning(f"{host.print_prefix}nvidia-smi does not work ({plan.nvidia_status}): "
                       "GPU clocks are left alone until the driver works")
        reload_when(explained("Reload systemd: GPU environment", "Reload systemd so services get the GPU environment"), env_file)
        return
    context = dict(tier=settings.tier, policy=policy_text(policy), plans=plan.clocks,
                   ac_deprecated_from=ac_deprecated_from(), record_dir=LOCKED_CLOCKS_DIR,
                   legacy_persistence=settings.driver_persistence == "legacy",
                   persistence_daemon=settings.driver_persistence == "daemon")
    files.put(name=explained("Install the clocks script", "Install the script that applies the GPU clocks"),
              src=StringIO(t.render("usr/local/sbin/gpufleet-gpu-clocks.j2", **context)),
              dest=CLOCKS_SCRIPT, mode="755")
    files.put(name=explained("Record the target clocks", "Record each GPU's target clocks for the boot unit"),
              src=StringIO(t.render("etc/gpufleet/gpu-clocks.env.j2", **context)),
              dest=CLOCKS_ENV, mode="644")
    unit = files.put(name=explained("Install the clocks unit", "Install the unit that re-applies the GPU clocks at every boot"),
                     src=StringIO(t.render("etc/systemd/system/gpufleet-gpu-clocks.service.j2", **context)),
                     dest=CLOCKS_UNIT, mode="644")
    reload_when(explained("Reload systemd: clocks unit", "Reload systemd so it sees the GPU environment and the clocks unit"),
                env_file, unit)
    skip = sorted(t.mig_clock_skip(host, plan.mig))
    me = real_host(host)
    gpu.clocks(name=explained("Set the GPU clocks", f"Set each GPU's clocks for clock policy {policy_text(policy)}"),
               policy=policy, ac_deprecated_from=ac_deprecated_from(), skip=skip,
               # a MIG change found GPU work and was not made: GPUs it would have freed stay in MIG mode
               _if=lambda: not outcome(me).mig_pending)
    systemd.service(name=explained("Enable the clocks unit", "Re-apply the GPU clocks at every boot"), service=CLOCKS_SERVICE,
                    running=True, enabled=True)


def _governor(settings: Settings, plan: TuningPlan) -> None:
    setting = settings.tuning_cpu_governor
    if setting == "unmanaged":
        systemd.service(name=explained("Disable the governor unit", "Stop setting the CPU governor at boot (tuning_cpu_governor: unmanaged)"),
                        service=GOVERNOR_SERVICE, running=None, enabled=False)
        for path in (GOVERNOR_TMPFILES, GOVERNOR_UNIT):
            files.file(name=explained(f"Remove {path}", f"Remove {path} (tuning_cpu_governor: unmanaged)"), path=path, present=False)
    elif plan.governor.governor:  # only where the host has cpufreq: nothing to persist elsewhere
        context = dict(tier=settings.tier, governor=setting)
        files.put(name=explained("Write the governor tmpfiles.d", f"Keep the {setting} CPU governor across reboots (systemd-tmpfiles)"),
                  src=StringIO(t.render("etc/tmpfiles.d/gpufleet-cpu-governor.conf.j2", **context)),
                  dest=GOVERNOR_TMPFILES, mode="644")
        unit = files.put(name=explained("Install the governor unit", "Install the unit that sets the CPU governor once the cpufreq drivers are loaded"),
                         src=StringIO(t.render("etc/systemd/system/gpufleet-cpu-governor.service.j2", **context)),
                         dest=GOVERNOR_UNIT, mode="644")
        reload_when(explained("Reload systemd: governor unit", "Reload systemd so it sees the CPU governor unit"), unit)
        systemd.service(name=explained("Enable the governor unit", "Set the CPU governor at every boot"), service=GOVERNOR_SERVICE,
                        running=None, enabled=True)
    cpu.governor(name=explained(f"Set the CPU governor: {setting}", f"Run every CPU on the {setting} frequency governor"), setting=setting)


@deploy("Tuning")
def tuning() -> None:
    settings = host_settings(host)
    plan = _plan_or_refuse(settings)
    if plan is None:
        return
    _persistence(settings, plan)
    env_file = _profiles(settings, plan)
    _mig(settings, plan)
    _clocks(settings, plan, env_file)
    _governor(settings, plan)
    _gpudirect(settings)


def _gpudirect(settings: Settings) -> None:
    """GPUDirect RDMA on the ib / roce profiles where the host has RDMA devices: nvidia-peermem
    loaded now (when it is the loaded driver's) and at every boot (gpufleet/plans/gpudirect.py)."""
    rdma = rdma_devices(host)
    if not gpudirect.rdma_tier(settings) or not rdma:
        return  # nothing to load, nothing asked of the host (the gate says why)
    plan = gpudirect.plan_peermem(settings.nccl_profile, rdma, driver_state(host), host.get_fact(PeermemState))
    files.put(
        name=explained(f"Load {gpudirect.MODULE} at boot", f"Load {gpudirect.MODULE} (GPUDirect RDMA for NCCL) at every boot"),
        src=StringIO(gpudirect.BOOT_TEXT),
        dest=gpudirect.BOOT_FILE,
        mode="644",
    )
    if plan.load_now:
        server.shell(name=explained(f"Load {gpudirect.MODULE}", f"Load {gpudirect.MODULE} now ({plan.reason})"), commands=["modprobe nvidia-peermem"])
    elif plan.problem:
        logger.warning(f"{host.print_prefix}GPUDirect RDMA: {plan.problem}")
    else:
        host.noop(f"GPUDirect RDMA: {plan.reason}")


# `pyinfra INVENTORY deploys/tuning.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
