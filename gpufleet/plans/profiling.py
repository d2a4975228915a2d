"""GPU profiling for users (``tuning_profiling``), as a function of the setting, the host's
ProfilingState fact and the resolved CUDA toolkit: plan_profiling gives one host's plan, which
deploys/driver.py and deploys/tuning.py apply, and the plan view, the validation gate, the fleet
report and tools/rollout read.

* ``users``: gpufleet's modprobe.d file sets ``options nvidia NVreg_RestrictProfilingToAdminUsers=0``
  (every user may read the GPU performance counters: ``ncu`` no longer fails with
  ERR_NVGPUCTRPERM); with a host CUDA toolkit from NVIDIA's repository also Nsight Systems and
  Nsight Compute of that toolkit release (compat.yaml ``nsight_tools``), installed and held with it.
* ``admins`` (the driver's default): gpufleet's file is absent. Nsight packages gpufleet installed
  before are left installed and held (removing a profiler under a user is no one's wish).

A module option takes effect when the module is loaded: the loaded module keeps its value
(``RmProfilingAdminOnly`` in /proc/driver/nvidia/params) until the next load, in practice the
next boot. So a change is PENDING until a reboot the operator allows: the driver deploy's own
reboot on a new host (the file is written before the driver is installed), else tools/rollout,
which takes such a host through its gate (drain, idle right before, reboot, validate). A plain
re-run of deploys/all.py never reboots for it.

The initramfs is refreshed when the file changes (deploys/driver.py, with the nouveau blacklist):
a module loaded from the initramfs reads the modprobe.d copied into it, not /etc. Ubuntu's
packages put the nvidia modules there: nvidia-kernel-common-580(-server) installs the
initramfs-tools hook framebuffer-nvidia, which adds every updates/dkms/nvidia*.ko to the image, and
its postinst runs update-initramfs -u "so that the blacklist ends up in the initramfs"
(canonical/nvidia-graphics-drivers, branch 580-server: debian/framebuffer-nvidia,
debian/templates/nvidia-kernel-common-flavour.install.in and .postinst.in); mkinitramfs copies
/etc/modprobe.d/* into every image it builds (initramfs-tools' mkinitramfs, "module-init-tools").
A host without update-initramfs or dracut (a container) has nothing to refresh.

Another modprobe.d file setting the option (not gpufleet's) decides with it: with ``users``, one
that restricts is refused at planning (which line wins depends on file order: the operator
decides); with ``admins`` gpufleet leaves it alone, and the gate warns that users can read the
counters.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from gpufleet.config.failures import Refusal, Refused
from gpufleet.facts.kernel import PROFILING_OPTION, ProfilingStateData

from gpufleet.catalog.compat import UNVERIFIED, compat_data

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

KEY = "tuning_profiling"
ADMINS = "admins"
USERS = "users"
VALUES = (ADMINS, USERS)
#: gpufleet's own modprobe.d file (read by modprobe, and copied into the initramfs by mkinitramfs)
MODPROBE_FILE = "/etc/modprobe.d/gpufleet-nvidia-profiling.conf"
FILE_TEXT = ("# Managed by gpufleet (tuning_profiling: users). Do not edit: changes are reverted.\n"
             "# Every user may read the GPU performance counters (Nsight Compute, CUPTI). Takes effect\n"
             "# at the next load of the nvidia module (a reboot).\n"
             f"options nvidia {PROFILING_OPTION}=0\n")
#: the driver's default: performance counters for admins only (NVIDIA security bulletin 4738,
#: CVE-2018-6260, driver 418.43 and later)
DRIVER_DEFAULT = 1


def _refused(problem: str, allowed: str) -> Refused:
    """tuning_profiling cannot be honoured on this host (the one Refusal, gpufleet.config.failures)."""
    return Refused(Refusal("profiling", KEY, problem, allowed=allowed))


@dataclass(frozen=True)
class ProfilingPlan:
    setting: str
    file_text: str | None  # gpufleet's modprobe.d file; None: absent
    wanted: int  # RmProfilingAdminOnly the next load of the module gives
    loaded: int | None  # the loaded module's (None: no nvidia module loaded)
    others: Mapping[str, int] = field(default_factory=dict)  # other modprobe.d files setting the option
    nsight: Mapping[str, str] = field(default_factory=dict)  # package -> release, with the CUDA toolkit
    note: str = ""  # why no Nsight tools, when users get none
    next_load: int = DRIVER_DEFAULT  # what the next load gives with the files as they are now (before this run)

    @property
    def pending(self) -> bool:
        """The loaded module restricts otherwise than the next load will: a reboot makes it so."""
        return self.loaded is not None and self.loaded != self.wanted

    @property
    def reboot_helps(self) -> bool:
        """A reboot now changes the loaded module's value (the files already say the other one):
        what tools/rollout reboots a host for."""
        return self.loaded is not None and self.loaded != self.next_load

    def who(self, value: int | None) -> str:
        return "not loaded" if value is None else "admins only" if value else "every user"

    def summary(self) -> str:
        """One line for the plan view, the run output and the fleet report."""
        now = f"loaded module: {self.who(self.loaded)} (RmProfilingAdminOnly {self.loaded})" \
            if self.loaded is not None else "no nvidia module loaded"
        text = f"{KEY}: {self.setting}: GPU performance counters for {self.who(self.wanted)} from the next module load; {now}"
        if self.pending:
            text += "; PENDING until a reboot (tools/rollout)"
        if self.others:
            text += "; also set by " + ", ".join(f"{p} (={v})" for p, v in self.others.items())
        if self.nsight:
            text += "; Nsight: " + ", ".join(f"{p} {v}" for p, v in self.nsight.items())
        elif self.note:
            text += f"; {self.note}"
        return text


def nsight_packages(cuda_release: str | None) -> dict[str, str] | None:
    """compat.yaml's Nsight Systems / Compute packages for a CUDA toolkit release (None: no row)."""
    row = compat_data().nsight_tools_raw.get(cuda_release or "")
    if not row or row.get("status") == UNVERIFIED:
        return None
    return {str(p): str(v) for p, v in row["packages"].items()}


def nsight_releases() -> tuple[str, ...]:
    return tuple(r for r in compat_data().nsight_tools_raw if nsight_packages(r) is not None)


def plan_profiling(setting: str, state: ProfilingStateData, cuda_release: str | None, cuda_from_nvidia: bool
                   ) -> ProfilingPlan:
    """One host's plan from its ProfilingState and the CUDA toolkit release it resolves to
    (`cuda_from_nvidia`: installed from NVIDIA's repository, where the Nsight packages are)."""
    if setting not in VALUES:
        raise _refused(f"unknown value {setting!r}", " | ".join(VALUES))
    others = {p: v for p, v in state.options.items() if p != MODPROBE_FILE}
    loaded = state.admin_only if state.loaded else None
    now = _last(state.options)
    if setting == ADMINS:
        # gpufleet's file goes; another file's value stays
        return ProfilingPlan(setting, None, _last(others), loaded, others, next_load=now)
    against = {p: v for p, v in others.items() if v != 0}
    if against:
        raise _refused(", ".join(f"{p} sets {PROFILING_OPTION}={v}" for p, v in against.items())
                       + " (not gpufleet's file): which one the module gets depends on the files' order",
                       f"{ADMINS}, or remove that line from {', '.join(against)}")
    nsight: dict[str, str] = {}
    note = ""
    if not cuda_release or not cuda_from_nvidia:
        note = "no Nsight tools: no host CUDA toolkit from NVIDIA's repository (cuda_version none, or driver_source distro)"
    else:
        found = nsight_packages(cuda_release)
        if found is None:
            raise _refused(f"no Nsight Systems / Nsight Compute release is recorded for CUDA {cuda_release} "
                           "(compat.yaml nsight_tools), so none could be installed with it",
                           f"{ADMINS}, or a cuda_version whose release has them: "
                           + ", ".join(nsight_releases()))
        nsight = found
    return ProfilingPlan(setting, FILE_TEXT, 0, loaded, others, nsight, note, next_load=now)


def _last(options: Mapping[str, int]) -> int:
    """The value the module gets from these files: the last in modprobe's order (by file name),
    as 0 or 1; none: the driver's default."""
    if not options:
        return DRIVER_DEFAULT
    return int(bool(options[sorted(options, key=lambda p: p.rsplit("/", 1)[1])[-1]]))


def host_profiling(host: Any, settings: Settings, res: Any) -> ProfilingPlan:
    """plan_profiling for a pyinfra host: its ProfilingState fact and the resolution `res` (None:
    nothing resolves; the one deploy, gate, plan view and report all read). Raises Refused."""
    from gpufleet.facts.kernel import ProfilingState

    release = res.cuda_release if res is not None else None
    from_nvidia = res is not None and res.source == "nvidia" and bool(res.cuda_package)
    return plan_profiling(settings.tuning_profiling, host.get_fact(ProfilingState), release, from_nvidia)
