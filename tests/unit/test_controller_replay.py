"""bench/controller.py's replayed hosts do what the recorded real host's no-op did.

The recording (tests/fixtures/controller/noop-recording.json) holds a converged real test host's
answers to its no-op prefetch, the operations pyinfra planned for it and the commands it was
sent, all taken from a real run (bench/controller.py --record). Here deploys/all.py runs for
real (pyinfra's command line, gpufleet's deploys and fact cache) over 3 replayed hosts, each
with its own name and address, and each must get the same operations in the same order, the
same number of commands (1: the prefetch), the same prefetch sections as the real host was sent,
no upload; and a
recording whose file checksums no longer match must make the replay change files (the check
can fail). About 6 s (two pyinfra runs of 3 hosts).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from testing import replay

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import controller  # noqa: E402  (bench/controller.py)

_SHA1_LINE = re.compile(r"^[0-9a-f]{40}(\s|$)")


@pytest.fixture(scope="module")
def recording() -> dict:
    return json.loads(replay.RECORDING.read_text())


def test_recording_is_a_real_no_op(recording: dict) -> None:
    """What the replay is compared with: one command per host and no change, as docs/performance.md
    says a settled no-op sends, with the operations all.py plans."""
    assert recording["noop"]["commands_per_host"] == 1
    assert len(recording["noop"]["operations"]) > 50
    assert len(recording["sections"]) > 20 and all(s["status"] == 0 for s in recording["sections"])


def test_prefetch_sections_read_back_from_the_fact_caches_script() -> None:
    from gpufleet.controller import factcache

    texts = ["echo one", "printf 'two\\n'\necho three", "a=1; ( echo $a )"]
    script = factcache.Script(single=[(None, None, None, None, t) for t in texts])
    nonce, found = replay.prefetch_sections(script.text())
    assert (nonce, found) == (script.nonce, texts)
    assert replay.prefetch_sections("echo hello") is None


def test_replayed_answers_are_what_the_fact_cache_accepts(recording: dict) -> None:
    """The framed, packed answers the double returns parse, through factcache.Script, into the
    recorded sections with the replayed host's name and address."""
    from gpufleet.controller import factcache

    texts = [s["text"] for s in recording["sections"]]
    script = factcache.Script(single=[(None, None, None, None, t) for t in texts])
    renamer = replay.Renamer(recording["host"]["name"], recording["host"]["address"], "gpu0042", "127.31.0.44")
    lines = replay.answer_prefetch(script.nonce, texts, renamer, "gpu0042")
    import base64

    unpacked = factcache.gunzip_capped(base64.b64decode(lines[1])).decode().splitlines()
    sections = script.sections(unpacked)
    assert sections is not None, script.refused
    for section, (out, status) in zip(recording["sections"], sections):
        assert status == section["status"]
        assert out == [renamer.to_host(line) for line in section["lines"]]
    joined = "\n".join(line for out, _ in sections for line in out)
    assert recording["host"]["address"] not in joined and recording["host"]["name"] not in joined


def test_replayed_hosts_match_the_real_no_op(recording: dict) -> None:
    r = controller.bench(3, profile=False)
    assert r["rc"] == 0
    assert r["problems"] == []
    hosts = r["record"]["hosts"]
    assert sorted(hosts) == ["gpu0001", "gpu0002", "gpu0003"]
    for host in hosts.values():
        assert host["commands"] == recording["noop"]["commands_per_host"] == 1
        assert host["uploads"] == 0 and host["unrecorded"] == 0
        assert host["operations_digest"] == recording["noop"]["operations_digest"]
        assert host["prefetch_sections"] == len(recording["sections"])
        # the very sections the fact cache sent the real host in its no-op (its --debug output)
        assert host["prefetch_digest"] == recording["noop"]["prefetch_digest"]
    (operations,) = r["record"]["operation_lists"].values()
    assert operations == recording["noop"]["operations"]


def test_a_recording_that_does_not_match_shows(recording: dict, tmp_path: Path) -> None:
    """Checksums of the host's files no longer those all.py renders: the replayed run changes
    files, and the check says the hosts did not do what the real no-op did."""
    changed = json.loads(json.dumps(recording))
    flipped = 0
    for section in changed["sections"]:
        for i, line in enumerate(section["lines"]):
            if _SHA1_LINE.match(line):
                section["lines"][i] = ("0" if line[0] != "0" else "1") + line[1:]
                flipped += 1
    assert flipped
    path = tmp_path / "changed.json"
    path.write_text(json.dumps(changed))
    replay._recording = None  # this process's cache (the runs are subprocesses)
    r = controller.bench(2, profile=False, recording_path=path)
    replay._recording = None
    assert r["problems"]
    hosts = r["record"]["hosts"].values()
    assert all(h["commands"] > 1 or h["uploads"] > 0 for h in hosts)


def test_renaming_takes_whole_names_and_addresses_only() -> None:
    renamer = replay.Renamer("gf-h31-1", "127.0.2.10", "gpu0007", "127.31.0.9")
    assert renamer.to_host("listenaddress 127.0.2.10:22 root@gf-h31-1") == "listenaddress 127.31.0.9:22 root@gpu0007"
    for other in ("127.0.2.100", "127.0.2.10.5", "10.127.0.2.10", "gf-h31-10", "xgf-h31-1", "gf-h31-1-b"):
        assert renamer.to_host(other) == other
    assert renamer.to_recorded("127.31.0.9 gpu0007") == "127.0.2.10 gf-h31-1"


def test_replayed_hosts_have_their_own_names_and_addresses(recording: dict) -> None:
    names = list(replay.ReplayConnector.make_names_data("300"))
    assert len({n for n, _, _ in names}) == len({d["ssh_hostname"] for _, d, _ in names}) == 300
    assert all(d["ssh_hostname"].startswith("127.") for _, d, _ in names)  # loopback, never connected to
    source = replay.inventory_source(3, recording)
    assert "@replay/3" in source and "'ssh_hostname'" not in source  # each host's own, from the connector
