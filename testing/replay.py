"""TEST DOUBLE FOR THE NETWORK: a pyinfra connector that answers from recorded real host output.

bench/controller.py measures what one controller spends on all.py's no-op for N hosts without
N machines: every host's commands are answered here, in the controller's process, from the
recording of one converged real test host (tests/fixtures/controller/noop-recording.json,
made by `bench/controller.py --record`), with that host's name and address replaced by each
replayed host's own. pyinfra's planner, gpufleet's deploys and its fact cache run for real;
only SSH (and the hosts' side of the work) is replaced.

What a host is asked, it answers as the recorded host did:
- the fact cache's prefetch script (gpufleet/controller/factcache.py, Script): each of its sections is
  looked up by its exact shell text and answered with the recorded lines and exit status,
  framed by the script's own markers and packed (gzip + base64) as the real script packs them
  on the host. That packing is the hosts' work, done here on the controller: replay_cpu_s says
  how much of the figure it is;
- any other command: its recorded answer by its exact text, else a failure ("not recorded"),
  counted, so that a run which would send more than the recording has shows it.
File uploads and downloads succeed without doing anything and are counted (a no-op has none).

The connector is registered under pyinfra's public plugin mechanism (a `pyinfra.connectors`
entry point, `@replay/NAME`) by register(), only in the bench's own process; it is never
installed with gpufleet. gpufleet's fact speed-ups accept it only after
pyinfra_private.admit_test_double_connector() says so, which only bench code calls.
"""
from __future__ import annotations

import base64
import json
import os
import re
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

from pyinfra.connectors.ssh import SSHConnector
from pyinfra.connectors.util import CommandOutput, OutputLine

REPO = Path(__file__).resolve().parents[1]
RECORDING = REPO / "tests" / "fixtures" / "controller" / "noop-recording.json"
RECORDING_FORMAT = 1
#: The host nonce the replayed hosts "draw" (the real host draws 16 random bytes)
HOST_NONCE = "0123456789abcdef" * 2

# Per run, in this process: what each replayed host was asked.
COMMANDS: Counter[str] = Counter()        # host name -> commands run (facts and operations)
UPLOADS: Counter[str] = Counter()         # host name -> files put or got
UNRECORDED: Counter[str] = Counter()      # host name -> commands or prefetch sections not in the recording
PREFETCH_SECTIONS: dict[str, int] = {}    # host name -> sections of its prefetch script
PREFETCH_DIGESTS: dict[str, str] = {}     # host name -> sections_digest() of its prefetch script
FIRST_COMMANDS: dict[str, list[str]] = {}  # the first few hosts: a short label of each command
REPLAY_CPU_S = [0.0]                      # CPU spent here doing the hosts' side (framing, gzip)
_LABELLED_HOSTS = 5

_recording: dict[str, Any] | None = None
_template: tuple[str, str] | None = None


def load(path: Path | str | None = None) -> dict[str, Any]:
    """The recording (GPUFLEET_REPLAY_RECORDING, else the one in tests/fixtures)."""
    global _recording
    if _recording is None:
        chosen = Path(path or os.environ.get("GPUFLEET_REPLAY_RECORDING") or RECORDING)
        doc = json.loads(chosen.read_text())
        if doc.get("format") != RECORDING_FORMAT:
            raise ValueError(f"{chosen}: not a replay recording of format {RECORDING_FORMAT}")
        names = (doc["host"]["name"], doc["host"]["address"])
        # each section's lines that name the recorded host: only those are renamed per host
        doc["_by_text"] = {s["text"]: (s["lines"], s["status"], [i for i, line in enumerate(s["lines"])
                                                                 if any(n in line for n in names)])
                           for s in doc["sections"]}
        doc["_commands"] = {c["text"]: (c["lines"], c["status"]) for c in doc.get("commands", [])}
        _recording = doc
    return _recording


def section_template() -> tuple[str, str]:
    """(prefix, suffix) around each section's shell text in the fact cache's prefetch script,
    taken from factcache.Script itself (so a change of the script's shape is followed here)."""
    global _template
    if _template is None:
        from gpufleet.controller import factcache

        one, two = "@@REPLAY-ONE@@", "@@REPLAY-TWO@@"
        single = factcache.Script(single=[(None, None, None, None, one)], nonce="0" * 16).text()
        double = factcache.Script(single=[(None, None, None, None, one), (None, None, None, None, two)],
                                  nonce="0" * 16).text()
        head, tail = single.split(one)
        mid = double.split(one)[1].split(two)[0]   # suffix + prefix
        for k in range(len(mid) + 1):
            if tail.startswith(mid[:k]) and head.endswith(mid[k:]):
                _template = (mid[k:], mid[:k])
                break
        else:
            raise RuntimeError("cannot find the prefetch script's section frame")
    return _template


def prefetch_sections(script: str) -> tuple[str, list[str]] | None:
    """(controller nonce, section texts) of a prefetch script, None if it is not one."""
    from gpufleet.controller import factcache

    m = re.search(re.escape(factcache._MARK) + r"([0-9a-f]{16})::host ", script)
    if not m:
        return None
    prefix, suffix = section_template()
    start, end = script.find(prefix), script.rfind(suffix)
    if start < 0 or end < start:
        return None
    return m[1], script[start + len(prefix):end].split(suffix + prefix)


def sections_digest(texts: list[str]) -> str:
    """One SHA-1 over a prefetch script's section texts, in order: what a host was asked."""
    import hashlib

    return hashlib.sha1("\0".join(texts).encode()).hexdigest()


def prefetch_texts_in_log(log: str, host_name: str) -> list[str] | None:
    """The section texts of the prefetch pyinfra sent `host_name`, from its --debug output
    (`Running command on HOST: (pty=False) sh -c '...'`, up to the next log record)."""
    import shlex

    m = re.search(r"Running command on " + re.escape(host_name) + r": \(pty=\w+\) (.*?)\n(?=    \[[\w.-]+\] |--> )",
                  log, re.S)
    if not m:
        return None
    try:
        script = shlex.split(m[1])[-1]
    except ValueError:
        return None
    found = prefetch_sections(script)
    return None if found is None else found[1]


class Renamer:
    """The recorded host's name and address replaced by a replayed host's, and back."""

    def __init__(self, recorded_name: str, recorded_address: str, name: str, address: str) -> None:
        self.pairs = [(recorded_name, name), (recorded_address, address)]
        self._to = [(re.compile(r"(?<![\w.-])" + re.escape(old) + r"(?![\w-]|\.\d)"), new) for old, new in self.pairs]
        self._back = [(re.compile(r"(?<![\w.-])" + re.escape(new) + r"(?![\w-]|\.\d)"), old) for old, new in self.pairs]

    def to_host(self, text: str) -> str:
        for rx, new in self._to:
            text = rx.sub(new, text)
        return text

    def to_recorded(self, text: str) -> str:
        for rx, old in self._back:
            text = rx.sub(old, text)
        return text


def answer_prefetch(nonce: str, texts: list[str], renamer: Renamer, host_name: str) -> list[str]:
    """The output lines the recorded host would print for this prefetch script: packed."""
    from gpufleet.controller import factcache

    rec = load()
    by_text = rec["_by_text"]
    head = f"{factcache._MARK}{nonce}::host {HOST_NONCE}"
    mark, rc = f"{factcache._MARK}{nonce}-{HOST_NONCE}::", f"{factcache._RC}{nonce}-{HOST_NONCE}::"
    out = [head]
    for i, text in enumerate(texts):
        found = by_text.get(text) or by_text.get(renamer.to_recorded(text))
        if found is None:
            UNRECORDED[host_name] += 1
            lines, status = [], 127
        else:
            lines, status, renamed = found
            if renamed:
                lines = list(lines)
                for n in renamed:
                    lines[n] = renamer.to_host(lines[n])
        out.append(mark + str(i))
        out.extend(lines)
        out.append("")
        out.append(rc + str(status))
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)   # gzip -1, as the host packs it
    packed = packer.compress(("\n".join(out) + "\n").encode()) + packer.flush()
    return [factcache._PACKED, base64.b64encode(packed).decode()]


class ReplayConnector(SSHConnector):
    """TEST DOUBLE for the network (see the module's docstring): answers every command from
    the recording of one real converged host; never opens a connection.

    A subclass of pyinfra's ssh connector only so that gpufleet plans for it what it plans for
    an SSH host (the hardening deploy refuses hosts no fresh SSH login can prove, and a no-op
    plans those operations too): every method that would touch the network is replaced here."""

    handles_execution = True

    @staticmethod
    def make_names_data(name: str | None = None) -> Any:
        """`@replay/COUNT`: COUNT hosts (gpu0001...), each with its own loopback address;
        `@replay/NAME`: one. One inventory entry for many hosts, as @terraform's: pyinfra
        looks its connectors up anew for each `@` entry (a scan of every installed package's
        entry points, ~3 ms), a cost an inventory of plain SSH host names does not have."""
        if not name:
            raise ValueError("@replay needs a host count or name: @replay/COUNT, @replay/NAME")
        if name.isdigit():
            for i in range(int(name)):
                yield host_name(i), {"ssh_hostname": host_address(i)}, []
        else:
            yield name, {}, []

    def disconnect(self) -> None:
        pass

    def connect(self) -> None:
        rec = load()
        address = str(self.host.data.get("ssh_hostname") or self.host.name)
        self.renamer = Renamer(rec["host"]["name"], rec["host"]["address"], self.host.name, address)

    def _label(self, text: str) -> None:
        if len(FIRST_COMMANDS) < _LABELLED_HOSTS or self.host.name in FIRST_COMMANDS:
            FIRST_COMMANDS.setdefault(self.host.name, []).append(text)

    def run_shell_command(self, command: Any, print_output: bool = False, print_input: bool = False,
                          **arguments: Any) -> tuple[bool, CommandOutput]:
        started = time.process_time()
        name = self.host.name
        COMMANDS[name] += 1
        text = command.get_raw_value() if hasattr(command, "get_raw_value") else str(command)
        parsed = prefetch_sections(text)
        try:
            if parsed is not None:
                nonce, texts = parsed
                PREFETCH_SECTIONS[name] = len(texts)
                PREFETCH_DIGESTS[name] = sections_digest([self.renamer.to_recorded(t) for t in texts])
                self._label(f"prefetch: {len(texts)} sections")
                lines = answer_prefetch(nonce, texts, self.renamer, name)
                return True, CommandOutput([OutputLine("stdout", line) for line in lines])
            self._label("command: " + text[:200])
            rec = load()["_commands"]
            found = rec.get(text) or rec.get(self.renamer.to_recorded(text))
            if found is None:
                UNRECORDED[name] += 1
                return False, CommandOutput([OutputLine("stderr", "replay test double: command not recorded")])
            lines, status = found
            return status == 0, CommandOutput([OutputLine("stdout", self.renamer.to_host(line)) for line in lines])
        finally:
            REPLAY_CPU_S[0] += time.process_time() - started

    def put_file(self, filename_or_io: Any, remote_filename: str, remote_temp_filename: Any = None,
                 print_output: bool = False, print_input: bool = False, **arguments: Any) -> bool:
        UPLOADS[self.host.name] += 1
        self._label(f"put_file {remote_filename}")
        return True

    def get_file(self, remote_filename: str, filename_or_io: Any, remote_temp_filename: Any = None,
                 print_output: bool = False, print_input: bool = False, **arguments: Any) -> bool:
        UPLOADS[self.host.name] += 1
        self._label(f"get_file {remote_filename}")
        return True



def register() -> Path:
    """Make `@replay/NAME` known to pyinfra in this process: a `pyinfra.connectors` entry point
    in a distribution folder put on sys.path (pyinfra finds its connectors by entry point)."""
    import atexit
    import shutil
    import sys

    root = Path(tempfile.mkdtemp(prefix="gpufleet-replay-ep-"))
    atexit.register(shutil.rmtree, root, True)
    info = root / "gpufleet_replay_test_double-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gpufleet-replay-test-double\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pyinfra.connectors]\nreplay = testing.replay:ReplayConnector\n")
    sys.path.append(str(root))
    return root


def inventory_source(count: int, recording: dict[str, Any]) -> str:
    """A pyinfra inventory of `count` replayed hosts (`@replay/COUNT`): the recorded host's
    data, each host with its own name and loopback address (`ssh_hostname`; never connected to).

    The rest of the data is the recorded host's as it is, monitoring_listen_address included:
    the test hosts share the machine's network, so each was given its own loopback address to
    listen on, and the files that name it are answered by the recorded host's checksums. A
    fleet on its own network keeps the default (`all`), the same on every host, so the same
    value on every replayed host is what a real fleet plans."""
    data = {k: v for k, v in recording["data"].items() if k != "ssh_hostname"}
    return "\n".join([
        '"""Generated by bench/controller.py: replayed hosts (testing/replay.py, a TEST DOUBLE for the network)."""',
        "", f"test_hosts = [('@replay/{count}', {data!r})]", ""])


def host_name(i: int) -> str:
    return f"gpu{i + 1:04d}"


def host_address(i: int) -> str:
    return f"127.31.{(i // 250) % 256}.{i % 250 + 2}"
