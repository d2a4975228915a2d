"""The host's record of its acceptance (docs/acceptance.md): written by the controller after an
acceptance passed (gpufleet-deploy after a first converge, tools/rollout after a batch), read
with what the host runs now, so that a record for another driver or CUDA toolkit is told apart.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, begin, split_sections, with_values
from .kernel import parse_proc_version
from .packages import STACK_RECORD

#: root's, 0600, in root's 0700 folder; written whole (a temporary file there, then mv), never
#: through a link (operations/remote_files.py)
RECORD_DIR = "/var/lib/gpufleet"
RECORD = RECORD_DIR + "/acceptance.json"
RECORD_FORMAT = 1
#: a CUDA toolkit's line in gpufleet's stack record (facts/packages.py STACK_RECORD)
_TOOLKIT_LINE = re.compile(r"^(cuda-toolkit-[0-9]+-[0-9]+) ([0-9][A-Za-z0-9.+~]*)$")

# The record is read only as a regular file that is not a link, and printed as one JSON line
# (json.dumps escapes every newline, so no line of it can pass for a section marker).
_SCRIPT = (
    begin("record") + '\nif [ -f "$record" ] && [ ! -L "$record" ]; then cat "$record"; fi\n'
    + begin("driver") + '\ncat /proc/driver/nvidia/version 2>/dev/null || true\n'
    + begin("stack") + '\ncat "$stack" 2>/dev/null || true'
)


@dataclass(frozen=True)
class AcceptanceRecordData(JsonMixin):
    #: the record as written (None: no record on the host)
    record: dict[str, Any] | None = None
    #: why the record could not be read ("": read, or none there)
    error: str = ""
    #: the driver loaded now (/proc/driver/nvidia/version; None: no module loaded)
    driver: str | None = None
    #: the CUDA toolkits gpufleet installed, as its stack record says now: {cuda-toolkit-X-Y: release}
    cuda: dict[str, str] = field(default_factory=dict)


class AcceptanceRecord(FactBase[AcceptanceRecordData]):
    """
    gpufleet's record of the host's last passed acceptance, and the driver and CUDA toolkit the
    host has now (gpufleet/plans/acceptance.py `standing` compares them):

    .. code:: python

        host.get_fact(AcceptanceRecord)
        AcceptanceRecordData(record={"format": 1, "accepted_at": "2026-12-06T18:40:00Z",
                                     "driver": "580.126.09", "cuda": {"cuda-toolkit-13-0": "13.0.2"}, ...},
                             driver="580.126.09", cuda={"cuda-toolkit-13-0": "13.0.2"})
    """

    # Asked by the validation gate at the end of a run that changed the host, and by
    # gpufleet-deploy and tools/rollout: a deploy run's prefetch leaves it out (gpufleet/controller/factcache.py).
    gpufleet_end_of_run = True

    @override
    def command(self) -> str:
        return with_values(_SCRIPT, record=RECORD, stack=STACK_RECORD)

    @override
    def process(self, output: list[str]) -> AcceptanceRecordData:
        sections, _ = split_sections(output, strict=True)
        driver, _flavour = parse_proc_version(sections.get("driver", []))
        cuda = {}
        for line in sections.get("stack", []):
            match = _TOOLKIT_LINE.match(line.strip())
            if match:
                cuda[match.group(1)] = match.group(2)
        text = "\n".join(sections.get("record", [])).strip()
        if not text:
            return AcceptanceRecordData(None, "", driver, cuda)
        try:
            record = json.loads(text)
        except ValueError:
            return AcceptanceRecordData(None, f"{RECORD} is not JSON", driver, cuda)
        if not isinstance(record, dict):
            return AcceptanceRecordData(None, f"{RECORD} is not a JSON object", driver, cuda)
        return AcceptanceRecordData(record, "", driver, cuda)
