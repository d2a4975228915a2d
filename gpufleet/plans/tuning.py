"""What deploys/tuning.py decides, as functions of the settings and the host's facts; plan_tuning
puts them together for one host, and the validation gate checks the host against that same plan.

* clocks: the pair each GPU should run at (``max`` = the highest pair in that GPU's own
  supported-clocks list, so mixed GPUs each get theirs), the method the driver allows
  (application clocks ``-ac`` before R595, locked clocks ``-lgc``/``-lmc`` from R595 where
  ``-ac`` is deprecated), and the nvidia-smi commands needed to get there from the current
  state: none when the GPU is already there;
* thread counts for OMP / MKL (physical cores per GPU, at least 1, or the tier's integer);
* MIG (gpu_mig, gpufleet/catalog/mig.py): the partitions each GPU gets; a GPU in MIG mode has no
  settable clocks, so the clock plan leaves out the GPUs that are (or are turned) in MIG mode;
* NCCL values: the socket interface from the host's real NICs, the RDMA HCAs;
* rendering of the templates in templates/.

A request the host cannot honour raises Refused(Refusal) (gpufleet.config.failures: key, problem,
allowed values): the deploy
turns it into a planning-time failure of that one host.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from gpufleet.facts.gpu import ClockPair, GpuInfo
from gpufleet.facts.network import NetInterface, RdmaDevice
from gpufleet.rendering import render
from gpufleet.config.failures import Refusal as Refusal
from gpufleet.config.failures import Refused as Refused

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

AC = "ac"  # nvidia-smi -ac MEM,GFX: application clocks
LGC = "lgc"  # nvidia-smi -lgc GFX,GFX and -lmc MEM,MEM: locked clocks
#: compute capability from which nvidia-smi can lock graphics (Volta) and memory (Ampere) clocks
LOCK_GRAPHICS_FROM = (7, 0)
LOCK_MEMORY_FROM = (8, 0)

NCCL_DEBUG_ONLY = ("NCCL_IB_DISABLE", "NCCL_NET_GDR_LEVEL", "NCCL_P2P_LEVEL", "NCCL_ALGO", "NCCL_PROTO",
                   "NCCL_DEBUG")


def _refused(key: str, problem: str, allowed: str) -> Refused:
    """A setting this host cannot honour (the one Refusal, gpufleet.config.failures), raised from
    inside the plan. str() reads: key 'x': problem; allowed: ..."""
    return Refused(Refusal("tuning", key, problem, allowed=allowed))


# --- clocks -------------------------------------------------------------------------------------


def driver_branch(version: str | None) -> int | None:
    match = re.match(r"(\d+)\.", version or "")
    return int(match.group(1)) if match else None


def clock_method(driver_version: str | None, ac_deprecated_from: int) -> str:
    """-ac on drivers that still support application clocks, -lgc/-lmc from the deprecating branch."""
    branch = driver_branch(driver_version)
    return LGC if branch is not None and branch >= ac_deprecated_from else AC


def _cc(gpu: GpuInfo) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in (gpu.compute_cap or "").split("."))
    except ValueError:
        return ()


def describe_supported(supported: Mapping[int, Sequence[int]]) -> str:
    """'memory 3201 with graphics 1980..345 (step 15); memory 2201 with ...' (highest first)."""
    parts = []
    for mem in sorted(supported, reverse=True):
        gfx = sorted(set(supported[mem]), reverse=True)
        if not gfx:
            continue
        steps = {a - b for a, b in zip(gfx, gfx[1:])}
        if len(gfx) > 3 and len(steps) == 1:
            text = f"{gfx[0]}..{gfx[-1]} (step {steps.pop()})"
        else:
            text = ", ".join(map(str, gfx))
        parts.append(f"memory {mem} with graphics {text}")
    return "; ".join(parts) or "none"


def choose_pair(policy: Any, supported: Mapping[int, Sequence[int]], label: str) -> ClockPair:
    """The (memory, graphics) pair for one GPU: ``max`` = highest supported memory clock with its
    highest graphics clock; an explicit pair must be in the GPU's supported list."""
    usable = {mem: list(gfx) for mem, gfx in supported.items() if gfx}
    if not usable:
        raise _refused("clock_policy", f"{label} reports no supported clocks, so its clocks cannot be set",
                       "default | unmanaged")
    if policy == "max":
        mem = max(usable)
        return ClockPair(mem, max(usable[mem]))
    wanted = ClockPair(int(policy["memory"]), int(policy["graphics"]))
    if wanted.gfx not in usable.get(wanted.mem, []):
        raise _refused("clock_policy",
                       f"clock pair memory {wanted.mem} MHz, graphics {wanted.gfx} MHz is not supported by {label}",
                       f"{describe_supported(usable)}; or max | default | unmanaged")
    return wanted


@dataclass(frozen=True)
class GpuClocks:
    """One GPU's clock plan: the target (None = driver default), and what it takes to get there."""

    bus_id: str
    label: str
    method: str
    target: ClockPair | None
    commands: tuple[tuple[str, ...], ...] = ()  # nvidia-smi argument lists, in order
    record: str | None = None  # locked clocks: new content of the boot record, "" = remove it

    @property
    def entry(self) -> str:
        """How the boot unit's env file names this GPU's target: BUS=MEM,GFX or BUS=default."""
        return f"{self.bus_id}={self.target.mem},{self.target.gfx}" if self.target else f"{self.bus_id}=default"


def plan_clocks(policy: Any, gpus: Sequence[GpuInfo], supported: Mapping[str, Mapping[int, Sequence[int]]],
                driver_version: str | None, locked: Mapping[str, str], ac_deprecated_from: int) -> list[GpuClocks]:
    """Per GPU: target and the nvidia-smi commands still needed (none when already there).

    `locked` is what gpufleet recorded in /run when it locked clocks (nvidia-smi cannot read
    locked clocks back; /run is wiped by a reboot, like the locks themselves)."""
    if policy == "unmanaged":
        return []
    method = clock_method(driver_version, ac_deprecated_from)
    plans = []
    for gpu in gpus:
        label = f"GPU {gpu.index} {gpu.name} ({gpu.bus_id})"
        cc = _cc(gpu)
        bus = gpu.bus_id
        if policy == "default":
            if method == AC:
                needs = gpu.app_clocks is not None and gpu.default_app_clocks is not None \
                    and gpu.app_clocks != gpu.default_app_clocks
                plans.append(GpuClocks(bus, label, method, None, (("-i", bus, "-rac"),) if needs else ()))
            else:
                cmds: tuple[tuple[str, ...], ...] = ()
                if bus in locked:
                    cmds = (("-i", bus, "-rgc"),) + ((("-i", bus, "-rmc"),) if cc >= LOCK_MEMORY_FROM else ())
                plans.append(GpuClocks(bus, label, method, None, cmds, "" if bus in locked else None))
            continue

        if method == LGC and cc < LOCK_MEMORY_FROM:
            branch = driver_branch(driver_version)
            why = ("memory clocks can only be locked (-lmc) on Ampere or newer" if cc >= LOCK_GRAPHICS_FROM
                   else "clocks can only be locked (-lgc/-lmc) on Volta/Ampere or newer")
            raise _refused("clock_policy",
                           f"{label} (compute capability {gpu.compute_cap}) has no settable clock pair on driver "
                           f"{driver_version}: application clocks (-ac) are deprecated from R{ac_deprecated_from} "
                           f"(this is R{branch}) and {why}", "default | unmanaged")
        if method == AC and gpu.app_clocks is None:
            raise _refused("clock_policy",
                           f"{label} does not report application clocks on driver {driver_version}, "
                           "so they cannot be set", "default | unmanaged")
        target = choose_pair(policy, supported.get(bus, {}), label)
        if method == AC:
            cmds = () if gpu.app_clocks == target else (("-i", bus, "-ac", f"{target.mem},{target.gfx}"),)
            plans.append(GpuClocks(bus, label, method, target, cmds))
        else:
            want = f"{target.mem},{target.gfx}"
            cmds = () if locked.get(bus) == want else (
                ("-i", bus, "-lgc", f"{target.gfx},{target.gfx}"), ("-i", bus, "-lmc", f"{target.mem},{target.mem}"))
            plans.append(GpuClocks(bus, label, method, target, cmds, want if cmds else None))
    return plans


# --- CPU threads --------------------------------------------------------------------------------


def omp_threads(setting: Any, physical_cores: int, gpu_count: int) -> int:
    """OMP_NUM_THREADS / MKL_NUM_THREADS: physical cores per GPU (>= 1), or the tier's integer."""
    if setting != "auto":
        return int(setting)
    return max(1, physical_cores // max(1, gpu_count))


# --- NCCL ---------------------------------------------------------------------------------------

# Never chosen automatically for NCCL's sockets: plumbing, tunnels and dummies (lo, docker, veth,
# bridges are already dropped by the interfaces fact).
_NOT_FOR_NCCL = re.compile(r"^(lo|docker.*|veth.*|br-.*|virbr.*|ifb.*|dummy.*|tun.*|tap.*|wg.*|tailscale.*|cni.*|flannel.*|cali.*|vxlan.*)$")


_NEVER_FOR_NCCL = re.compile(r"^(lo|docker.*|veth.*)$")


def auto_socket_ifname(interfaces: Iterable[NetInterface]) -> str | None:
    """'=eth0' (exact names) from the host's up Ethernet/IB interfaces: bonds first, then NICs with a
    device behind them, then any other up interface; None when there is none."""
    up = [i for i in interfaces if i.operstate in ("up", "unknown") and i.kind in ("ethernet", "infiniband")
          and not _NOT_FOR_NCCL.match(i.name)]
    if not up:
        return None
    ethernet = [i for i in up if i.kind == "ethernet"] or up
    bonds = [i for i in ethernet if i.name.startswith("bond")]
    physical = [i for i in ethernet if not i.virtual]
    chosen = bonds or physical or ethernet
    return "=" + ",".join(sorted(i.name for i in chosen))


def socket_ifname(setting: str, interfaces: Sequence[NetInterface]) -> str | None:
    """NCCL_SOCKET_IFNAME: the tier's value checked against the host's interfaces, or auto-detected."""
    if setting == "auto":
        return auto_socket_ifname(interfaces)
    names = sorted(i.name for i in interfaces)
    allowed = "auto, or " + (", ".join(f"={n}" for n in names) if names else "(no usable interface on this host)")
    if setting.startswith("^"):
        return setting
    exact = setting.startswith("=")
    for item in setting.lstrip("=").split(","):
        if _NEVER_FOR_NCCL.match(item):
            raise _refused("tuning_nccl_socket_ifname", f"{item} is not an interface for NCCL traffic", allowed)
        found = item in names if exact else any(n.startswith(item) for n in names)
        if not found:
            raise _refused("tuning_nccl_socket_ifname",
                           f"{setting!r} names {item}, which this host does not have", allowed)
    return setting


def ib_hca(setting: str, profile: str, rdma: Sequence[RdmaDevice]) -> str | None:
    """NCCL_IB_HCA for the ib / roce profiles: '=mlx5_0,mlx5_1' (exact names) of the host's RDMA
    devices of the profile's link layer, the tier's value (checked), or None."""
    if profile not in ("ib", "roce"):
        return None
    names = sorted(d.name for d in rdma)
    if setting != "auto":
        if not setting.startswith("^"):
            for item in setting.lstrip("=").split(","):
                hca = item.split(":")[0]
                if hca not in names:
                    raise _refused("tuning_nccl_ib_hca", f"{setting!r} names {hca}, which this host does not have",
                                   "auto, or " + (",".join(names) if names else "(no RDMA device on this host)"))
        return setting
    if not rdma:
        return None
    layer = "InfiniBand" if profile == "ib" else "Ethernet"
    matching = [d.name for d in rdma if d.link_layer in (layer, None)] or names
    return "=" + ",".join(sorted(matching))


def nccl_variables(profile: str, ifname: str | None, hca: str | None, rdma_present: bool,
                   debug_vars: bool) -> list[tuple[str, str]]:
    """The KEY=VALUE lines of /etc/nccl.conf, in order (the template adds the comments)."""
    out: list[tuple[str, str]] = []
    if ifname:
        out.append(("NCCL_SOCKET_IFNAME", ifname))
    if hca and profile in ("ib", "roce"):
        out.append(("NCCL_IB_HCA", hca))
    if debug_vars:
        out.append(("NCCL_DEBUG", "WARN"))
        if profile == "tcp" and rdma_present:
            out.append(("NCCL_IB_DISABLE", "1"))
    return out


# --- CPU frequency governor ----------------------------------------------------------------------

CPU_GOVERNOR_FILE = "/sys/devices/system/cpu/{cpu}/cpufreq/scaling_governor"


@dataclass(frozen=True)
class GovernorPlan:
    """tuning_cpu_governor on one host: the governor to set (None: leave the CPUs alone, and
    why), and the CPUs not running it yet."""

    governor: str | None
    cpus: tuple[str, ...] = ()
    reason: str = ""

    @property
    def files(self) -> list[str]:
        return [CPU_GOVERNOR_FILE.format(cpu=cpu) for cpu in self.cpus]


def plan_governor(setting: str, cpufreq: Any) -> GovernorPlan:
    """From the CpuFreq fact: nothing without cpufreq (containers, many VMs) or when unmanaged;
    a governor the host's cpufreq driver does not offer is refused (key, what it offers)."""
    if setting == "unmanaged":
        return GovernorPlan(None, reason="tuning_cpu_governor: unmanaged, the CPU governor is left alone")
    if not cpufreq.present:
        return GovernorPlan(None, reason=f"no cpufreq on this host (no /sys/devices/system/cpu/cpu*/cpufreq: a "
                                         f"container, or a VM without frequency scaling): tuning_cpu_governor: "
                                         f"{setting} does not apply")
    if setting not in cpufreq.available:
        offered = " | ".join(cpufreq.available) or "(none listed)"
        raise _refused("tuning_cpu_governor", f"this host's cpufreq driver offers no {setting} governor",
                       f"{offered} | unmanaged")
    todo = tuple(sorted((c for c, g in cpufreq.governors.items() if g != setting), key=lambda c: int(c[3:])))
    return GovernorPlan(setting, todo)


# --- environment --------------------------------------------------------------------------------


def gpu_environment(threads: int, alloc_conf: str) -> list[tuple[str, str]]:
    env = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("OMP_NUM_THREADS", str(threads)), ("MKL_NUM_THREADS", str(threads))]
    if alloc_conf:
        env += [("PYTORCH_CUDA_ALLOC_CONF", alloc_conf), ("PYTORCH_ALLOC_CONF", alloc_conf)]
    return env


def render_profiles(tier: str, profile: str, nccl: list[tuple[str, str]], env: list[tuple[str, str]],
                    rdma_present: bool, notes: Sequence[str] = ()) -> dict[str, str]:
    common = {"tier": tier, "env": env}
    return {
        "/etc/nccl.conf": render("etc/nccl.conf.j2", tier=tier, profile=profile, variables=nccl,
                                 rdma_present=rdma_present, notes=list(notes)),
        "/etc/profile.d/gpufleet-gpu.sh": render("etc/profile.d/gpufleet-gpu.sh.j2", **common),
        "/etc/systemd/system.conf.d/gpufleet-gpu-env.conf":
            render("etc/systemd/system.conf.d/gpufleet-gpu-env.conf.j2", **common),
        "/etc/environment.d/60-gpufleet-gpu.conf": render("etc/environment.d/60-gpufleet-gpu.conf.j2", **common),
    }


# --- the plan for one host ------------------------------------------------------------------------
# What deploys/tuning.py does and what the validation gate checks come from this one plan, so
# the two can never disagree on a GPU's target clocks or a profile's text.


def policy_text(policy: Any) -> str:
    if isinstance(policy, str):
        return policy
    return f"memory {policy['memory']} MHz, graphics {policy['graphics']} MHz"


def ac_deprecated_from() -> int:
    from gpufleet.catalog.compat import compat_data

    return int(compat_data().app_clocks_deprecated_from_branch)


def _no_mig() -> Any:
    from gpufleet.catalog.mig import MigPlan

    return MigPlan("unmanaged")


@dataclass
class TuningPlan:
    nvidia_ok: bool
    nvidia_status: str
    clocks: list[GpuClocks] = field(default_factory=list)
    mig: Any = field(default_factory=_no_mig)  # gpufleet.catalog.mig.MigPlan
    notes: list[str] = field(default_factory=list)  # what the plan leaves out, and why
    files: dict[str, str] = field(default_factory=dict)  # rendered environment files by path
    threads: int = 1
    governor: GovernorPlan = GovernorPlan(None)


def host_clocks(host: Any, policy: Any, skip: frozenset[str] = frozenset()) -> list[GpuClocks]:
    """The clock plan of the host's GPUs from its nvidia-smi (empty when it does not work or the
    policy is unmanaged): what the deploy applies, the gate checks and the plan view shows.
    `skip`: bus ids of GPUs in MIG mode, whose clocks are not settable."""
    from gpufleet.config.hostfacts import locked_clocks

    from gpufleet.config.hostfacts import gpu_state

    state = gpu_state(host)
    if not (state.ok and state.gpus) or policy == "unmanaged":
        return []
    gpus = [g for g in state.gpus if g.bus_id not in skip]
    return plan_clocks(policy, gpus, state.supported_clocks, state.driver_version, locked_clocks(host),
                       ac_deprecated_from())


def host_mig(host: Any, setting: Any) -> Any:
    """The MIG plan of the host (gpufleet.catalog.mig.MigPlan) from its nvidia-smi; raises Refusal
    naming gpu_mig for a layout a GPU cannot have."""
    from gpufleet.config.hostfacts import gpu_state, mig_state
    from gpufleet.catalog.mig import KEY, MigRefusal, plan_mig

    from gpufleet.facts.mig import MigStateData

    state = gpu_state(host)
    if setting == "unmanaged":
        return plan_mig(setting, [], MigStateData(ok=False))
    try:
        if not (state.ok and state.gpus):
            # no nvidia-smi yet (the driver comes in this run): the layout is checked against the
            # models PCI shows, in PCI order, and applied by a later run or the boot unit
            from gpufleet.config.hostfacts import hardware

            gpus = [GpuInfo(index=i, uuid="", name=m.name, bus_id="PCI", device_id=None, driver_version=None,
                            memory_mib=None, persistence=None, app_clocks=None, default_app_clocks=None,
                            max_clocks=None, compute_cap=None) for i, m in enumerate(hardware(host).models)]
            return plan_mig(setting, gpus, MigStateData(ok=False))
        return plan_mig(setting, state.gpus, mig_state(host))
    except MigRefusal as refused:
        raise _refused(KEY, refused.problem, refused.allowed) from None


def mig_clock_skip(host: Any, mig: Any) -> frozenset[str]:
    """GPUs whose clocks the plan leaves alone: in MIG mode after this run (turned on, or left on)."""
    from gpufleet.config.hostfacts import gpu_state, mig_state

    if not mig.managed:
        state = gpu_state(host)
        if not (state.ok and state.gpus):
            return frozenset()
        return frozenset(g.bus_id for g in mig_state(host).gpus if g.current == "Enabled")
    return frozenset(mig.mig_buses)


#: how the report names the driver's clock method
METHOD_NAMES = {AC: "application", LGC: "locked"}


@dataclass(frozen=True)
class AppliedClocks:
    """One GPU's clocks in the plan's model, as the fleet report shows them: the pair in effect
    by the method the driver uses (application clocks as nvidia-smi reads them; locked clocks as
    gpufleet recorded them, since nvidia-smi cannot read locks back) beside the plan's target."""

    index: int
    name: str
    bus_id: str
    method: str  # AC | LGC
    applied: ClockPair | None  # None: not locked (LGC), not reported (AC)
    planned: ClockPair | None  # None: the driver default, or no plan (managed False)
    managed: bool  # the host has a clock plan (policy not unmanaged, not refused)
    at_plan: bool | None  # the gate's test: no command left to run; None without a plan


def _record_pair(record: str | None) -> ClockPair | None:
    mem, _, gfx = (record or "").partition(",")
    return ClockPair(int(mem), int(gfx)) if mem.isdigit() and gfx.isdigit() else None


def applied_clocks(gpus: Sequence[GpuInfo], method: str, locked: Mapping[str, str],
                   plans: Sequence[GpuClocks]) -> list[AppliedClocks]:
    """Per GPU: applied pair, planned pair, and whether the GPU is at its plan, which is exactly
    the validation gate's test (the plan has no command left for it)."""
    by_bus = {p.bus_id: p for p in plans}
    out = []
    for gpu in gpus:
        applied = gpu.app_clocks if method == AC else _record_pair(locked.get(gpu.bus_id))
        plan = by_bus.get(gpu.bus_id)
        out.append(AppliedClocks(gpu.index, gpu.name, gpu.bus_id, method, applied, plan.target if plan else None,
                                 plan is not None, not plan.commands if plan else None))
    return out


def host_applied_clocks(host: Any, policy: Any, skip: frozenset[str] = frozenset()
                        ) -> tuple[str, list[AppliedClocks], str | None] | None:
    """(method, per-GPU applied and planned pairs, refusal or None) from the host's nvidia-smi and
    gpufleet's lock records, with the plan the deploy applies and the gate checks (host_clocks);
    None when nvidia-smi does not work. `skip`: GPUs in MIG mode (no clock plan: not managed)."""
    from gpufleet.config.hostfacts import gpu_state, locked_clocks

    state = gpu_state(host)
    if not (state.ok and state.gpus):
        return None
    method = clock_method(state.driver_version, ac_deprecated_from())
    refused = None
    try:
        plans = host_clocks(host, policy, skip)
    except Refused as error:
        plans, refused = [], str(error)
    locked = locked_clocks(host) if method == LGC else {}  # host_clocks asked already (answered from memory)
    return method, applied_clocks(state.gpus, method, locked, plans), refused


def clocks_summary(plans: Sequence[GpuClocks]) -> str:
    """'-ac 1215,1410 on GPU 0, 1, 2, 3 (NVIDIA A100-SXM4-40GB)': one wording of the targets for
    the plan view and the gate."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for c in plans:
        index, _, rest = c.label.removeprefix("GPU ").partition(" ")
        name = rest.rsplit(" (", 1)[0]
        how = {AC: "-ac", LGC: "-lgc/-lmc"}.get(c.method, c.method)
        target = f"{how} {c.target.mem},{c.target.gfx}" if c.target else "driver default"
        groups.setdefault((target, name, c.method), []).append(index)
    return "; ".join(f"{target} on GPU {', '.join(indices)} ({name})" for (target, name, _), indices in groups.items())


def plan_tuning(host: Any, settings: Settings) -> TuningPlan:
    """Everything the tuning deploy will do on this host, from its facts; raises Refusal."""
    from gpufleet.config.hostfacts import cpu_freq, gpu_state, hardware, interfaces, rdma_devices, resources

    state = gpu_state(host)
    plan = TuningPlan(nvidia_ok=state.ok and bool(state.gpus), nvidia_status=state.status)
    plan.mig = host_mig(host, settings.gpu_mig)
    skip = mig_clock_skip(host, plan.mig)
    plan.clocks = host_clocks(host, settings.clock_policy, skip)
    if skip and settings.clock_policy not in ("unmanaged", "default"):
        from gpufleet.catalog.mig import CLOCKS_NOTE

        plan.notes.append(CLOCKS_NOTE.format(gpus=", ".join(
            f"GPU {g.index}" for g in state.gpus if g.bus_id in skip) or ", ".join(sorted(skip))))

    nics, rdma = interfaces(host), rdma_devices(host)
    ifname = socket_ifname(settings.tuning_nccl_socket_ifname, nics)
    hca = ib_hca(settings.tuning_nccl_ib_hca, settings.nccl_profile, rdma)
    notes = [] if ifname else ["No up network interface found for NCCL's sockets: NCCL picks one itself."]
    nccl = nccl_variables(settings.nccl_profile, ifname, hca, bool(rdma), settings.tuning_nccl_debug_vars)

    gpu_count = len(state.gpus) if plan.nvidia_ok else len(hardware(host).gpu_pci_ids)
    plan.threads = omp_threads(settings.tuning_omp_threads, resources(host).physical_cores, gpu_count)
    env = gpu_environment(plan.threads, settings.tuning_pytorch_alloc_conf)
    plan.files = render_profiles(settings.tier, settings.nccl_profile, nccl, env, bool(rdma), notes)
    plan.governor = plan_governor(settings.tuning_cpu_governor, cpu_freq(host))
    return plan
