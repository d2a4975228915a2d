"""
What a Prometheus exporter serves, asked on the host itself with curl (the validation gate's
check that each exporter the tier turns on answers with metrics). One small remote command;
``process()`` is pure and unit-tested (tests/unit/test_monitoring.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override

from ._common import JsonMixin, split_sections, with_values

_METRIC = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_URL = re.compile(r"http://[A-Za-z0-9.:\[\]-]+/[A-Za-z0-9/_.-]*")
MAX_SAMPLES = 256  # lines of the sample metric brought back (one per GPU for DCGM's)


@dataclass(frozen=True)
class MetricsEndpointData(JsonMixin):
    status: str  # ok | error (curl failed: refused, timeout, HTTP error) | no-curl
    error: str = ""  # curl's own words when it failed
    samples: int = 0  # lines starting with the family prefix
    lines: list[str] = field(default_factory=list)  # the sample metric's lines, as served

    def label_values(self, label: str) -> list[str]:
        """The values of one label over the sample lines, in order: gpu="0" -> "0"."""
        pattern = re.compile(r'[{,]\s*' + re.escape(label) + r'="([^"]*)"')
        return [m[1] for m in map(pattern.search, self.lines) if m]


def parse_metrics_endpoint(lines: list[str]) -> MetricsEndpointData:
    sections, values = split_sections(lines)
    if "no-curl" in values:
        return MetricsEndpointData(status="no-curl", error="curl is not installed")
    rc = values.get("rc")
    if rc != "0":
        error = " ".join(line.strip() for line in sections.get("error", []) if line.strip())[:300]
        return MetricsEndpointData(status="error", error=error or f"curl exited {rc}")
    samples = values.get("samples", "0")
    return MetricsEndpointData(status="ok", samples=int(samples) if samples.isdigit() else 0,
                               lines=[line.rstrip() for line in sections.get("sample", []) if line.strip()])


_SCRIPT = r"""
command -v curl >/dev/null 2>&1 || { echo '::gpufleet:: no-curl'; exit 0; }
body=$(mktemp) || exit 1
err=$(mktemp) || { rm -f "$body"; exit 1; }
curl -sS -f --max-time 10 -o "$body" "$url" 2>"$err"
echo "::gpufleet:: rc $?"
echo '::gpufleet:: begin error'
head -c 300 "$err"; echo
echo "::gpufleet:: samples $(grep -c "^$family" "$body")"
echo '::gpufleet:: begin sample'
grep -E "^$sample[{ ]" "$body" | head -n "$limit"
rm -f "$body" "$err"
true
"""


class MetricsEndpoint(FactBase[MetricsEndpointData]):
    """
    ``curl URL`` on the host: whether it answered, how many samples of a metric family it
    served, and the lines of one metric:

    .. code:: python

        host.get_fact(MetricsEndpoint, url="http://127.0.0.1:9400/metrics",
                      family="DCGM_FI_", sample="DCGM_FI_DEV_GPU_TEMP")
        MetricsEndpointData(status="ok", samples=42,
                            lines=['DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-..."} 34'])
    """

    # Asked by the validation gate at the end of a run only: a deploy run's prefetch leaves it
    # out (its answer would never be used there), the fleet report's keeps it (gpufleet/controller/factcache.py).
    gpufleet_end_of_run = True

    @override
    @staticmethod
    def default() -> MetricsEndpointData:
        return MetricsEndpointData(status="error", error="no answer")

    @override
    def command(self, url: str, family: str, sample: str) -> StringCommand:
        if not _URL.fullmatch(url):
            raise ValueError(f"not a plain http:// metrics URL: {url!r}")
        if not _METRIC.fullmatch(family) or not _METRIC.fullmatch(sample):
            raise ValueError(f"not metric names: {family!r}, {sample!r}")
        return StringCommand("sh", "-c", QuoteString(with_values(
            _SCRIPT, url=url, family=family, sample=sample, limit=MAX_SAMPLES)))

    @override
    def process(self, output: list[str]) -> MetricsEndpointData:
        return parse_metrics_endpoint(output)
