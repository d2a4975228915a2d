"""CPU operations: the cpufreq governor (tuning_cpu_governor).

``governor``: write the tier's governor to the CPUs not running it yet (planned by
gpufleet.plans.tuning.plan_governor from the host's cpufreq, as it was before this run); a host
without cpufreq (a container, many VMs) or `unmanaged` gets a no-op saying why.
"""
from __future__ import annotations

from collections.abc import Generator

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from gpufleet.config.hostfacts import cpu_freq
from gpufleet.plans.tuning import plan_governor

# A fixed script given the governor and the sysfs files as arguments ($1, then the files).
_SET_GOVERNOR = 'g=$1; shift; for f in "$@"; do echo "$g" > "$f"; done'


@operation()
def governor(setting: str) -> Generator[StringCommand, None, None]:
    """Run every CPU with cpufreq on the ``setting`` governor; nothing for CPUs already on it.

    + setting: performance | schedutil | ondemand | unmanaged (a governor the host's cpufreq
      driver does not offer is refused at planning time by the tuning deploy)
    """
    plan = plan_governor(setting, cpu_freq(host))
    if plan.governor is None:
        host.noop(plan.reason)
        return
    if not plan.cpus:
        host.noop(f"all {len(cpu_freq(host).governors)} CPUs already run the {plan.governor} governor")
        return
    yield StringCommand("sh", "-c", QuoteString(_SET_GOVERNOR), "gpufleet-cpu-governor",
                        QuoteString(plan.governor), *(QuoteString(path) for path in plan.files))
