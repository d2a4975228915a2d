"""The validation gate's frame: Result, the Context a check reads, and the registry each area's
module (gpufleet/checks/<area>.py) adds its checks to; gpufleet/checks/validation.py runs them."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

from gpufleet.config.hostcontext import host_context
from gpufleet.errors import Incompatible
from gpufleet.facts.gpu import GpuState, GpuStateData
from gpufleet.facts.kernel import DriverState, DriverStateData

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

PASS, FAIL, WARN, SKIP = "pass", "fail", "warn", "skip"
STATUSES = (PASS, FAIL, WARN, SKIP)
MARKER = "/etc/gpufleet/managed"
FIX_DEPLOY = "run deploys/all.py"
FIX_ROLLOUT = "tools/rollout INVENTORY (canary, batches, drain, snapshot); all.py changes no driver of a provisioned host"


AREAS = ("base", "preflight", "driver", "docker", "tuning", "storage", "monitoring", "hardening", "health", "probe",
         "pytorch", "acceptance")


@dataclass(frozen=True)
class Result:
    area: str
    name: str  # reads as a sentence: "the gpufleet marker matches the tier"
    status: str
    message: str = ""  # what was found
    fix: str = ""  # what to do when it failed

    def line(self) -> str:
        text = f"[{self.status.upper()}] {self.area}: {self.name}"
        if self.message:
            text += f": {self.message}"
        if self.fix and self.status in (FAIL, WARN):
            text += f" -> fix: {self.fix}"
        return text

    def to_json(self) -> dict[str, str]:
        return {"area": self.area, "name": self.name, "status": self.status,
                "message": self.message, "fix": self.fix}


@contextlib.contextmanager
def fresh_host_facts(host: Any) -> Iterator[None]:
    """gpufleet.config.hostfacts caches planning-time facts on the host; the gate must see the host
    as it is now, so run with an empty cache and put the planning cache back afterwards."""
    context = host_context(host)
    saved = context.facts
    context.facts = {}
    try:
        yield
    finally:
        context.facts = saved


class Context:
    """What a check may read: the host, its settings, facts (each asked once per run)."""

    def __init__(self, host: Any, settings: Settings | None, probe: bool = True, probe_skip: str = "probes turned off",
                 torch_probe: bool | None = None, scrape_skip: str = "", health_skip: str = ""):
        self.host = host
        # None only for the fleet report's row of a host whose settings do not validate: it reads
        # the facts (gpu, driver) through the Context and runs no check
        self.settings = cast("Settings", settings)
        self.probe = probe
        self.probe_skip = probe_skip  # why, when probe is False
        # reading the host's PyTorch build (imports torch there: seconds of CPU, no GPU load);
        # with the probes unless said otherwise (the fleet report always reads it)
        self.torch_probe = probe if torch_probe is None else torch_probe
        # why the exporters are not scraped on this run ("": they are); all.py's no-op re-run
        # leaves them alone: each scrape costs the host what a tenth of its whole no-op costs
        self.scrape_skip = scrape_skip
        self.health_skip = health_skip   # why the GPU health is not read on this run ("": it is)
        self._facts: dict[Any, Any] = {}

    def fact(self, cls: Any, **kwargs: Any) -> Any:
        key = (cls, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in self._facts:
            self._facts[key] = self.host.get_fact(cls, **kwargs)
        return self._facts[key]

    @property
    def gpu(self) -> GpuStateData:
        return cast(GpuStateData, self.fact(GpuState, processes=False))  # no check looks at processes

    @property
    def driver(self) -> DriverStateData:
        return cast(DriverStateData, self.fact(DriverState))

    @property
    def runtime(self) -> Any:
        """Where the host's PyTorch lives (gpufleet/plans/pytorch_runtime.py: the tier's pytorch_runtime)."""
        from gpufleet.plans.pytorch_runtime import runtime_of

        return runtime_of(self.settings)

    def wanted_pytorch(self) -> Any:
        """The resolver's PyTorch wheel for this host (None: none asked, or none fits)."""
        try:
            return self.resolution().pytorch
        except Incompatible:
            return None

    def hardware(self) -> Any:
        from gpufleet.config.hostfacts import hardware

        return hardware(self.host)

    def resolution(self) -> Any:
        from gpufleet.config.hostfacts import resolution

        return resolution(self.host, self.settings)


Check = Callable[[Context], "Result | list[Result]"]
CHECKS: list[tuple[str, Check]] = []


def check(area: str) -> Callable[[Check], Check]:
    def register(func: Check) -> Check:
        CHECKS.append((area, func))
        return func
    return register


