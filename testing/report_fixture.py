"""Record tests/fixtures/report/sandbox-fleet.json: the fleet report of this checkout's
tools/fleet-report on sandbox-shaped test hosts (GPUs SIMULATED by testing/gpusim, NVIDIA's
repositories by the stand-in of testing/aptrepo), converged by deploys/all.py and then changed
by hand the way tests/fixtures/report/README.md lists. Run as root:

    .venv/bin/python -m testing.report_fixture [--keep] [--again] [--out tests/fixtures/report/sandbox-fleet.json]

Test infrastructure, not production code. The report's rows are the report code's own output
on real hosts, never written by hand: re-run this whenever the rows gain a field (the browser
test and tests/unit/test_report_view.py render them). Its own pool (`htmlreport`, hence the
host names), stopped at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from testing import aptrepo, testhosts, torch_standin
from testing.inventory import TEST_DRIVER, environment_data, write_inventory

REPO = Path(__file__).resolve().parents[1]
POOL = "htmlreport"
OUT = REPO / "tests" / "fixtures" / "report" / "sandbox-fleet.json"
# what the old sandbox-fleet.json named: the README's picture was made from it
INVENTORY_NAME = "inventories/sandbox.py"
LOADED = "535.247.01"  # the T4's loaded module after the change: not the installed 535.309.01
CUDNN_BY_HAND = "9.16.0.29-1"
# what every host's data adds: the test machine's RAM is not a server's (the tiers expect 32 to
# 1024 GB), and the fixture is about the report, not about the machine it was recorded on
COMMON = {"validate_min_ram_gb": 16}

# (name, release, simulated GPUs, tier, overrides), in inventory order (groups dev, research, hgx)
HOSTS = (
    ("gf-htmlreport-1", "bookworm", "t4", "dev", {}),
    ("gf-htmlreport-2", "bookworm", f"a100x4@{TEST_DRIVER}", "research", {}),
    ("gf-htmlreport-4", "bookworm", f"a100x4@{TEST_DRIVER}", "research", {}),
    ("gf-htmlreport-5", "bookworm", f"a100x4@{TEST_DRIVER}", "research", {}),
    ("gf-htmlreport-3", "trixie", f"h200x2@{TEST_DRIVER}", "hgx",
     {"tier_mismatch": "warn", "tuning_nccl_socket_ifname": "auto"}),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep", action="store_true", help="leave the hosts and the repository up")
    ap.add_argument("--again", action="store_true",
                    help="the hosts a --keep run left: no all.py, the changes again (each idempotent), then the report")
    args = ap.parse_args()
    record = testhosts.pool_dir(POOL) / "aptrepo.json"
    try:
        repo = aptrepo.load(record)
        if repo is None:
            record.parent.mkdir(parents=True, exist_ok=True)
            repo = aptrepo.serve(testhosts.pool_dir(POOL) / "aptrepo")
            aptrepo.save(repo, record)
        running = {h.name: h for h in testhosts.list_hosts(POOL)}
        testhosts.set_sudo_password(list(running.values()))  # kept hosts: this process's password
        for name, release, gpu, _, _ in HOSTS:
            if name not in running:
                running[name] = testhosts.up(1, release=release, gpu=gpu, pool=POOL, names=[name])[0]
        hosts = [running[name] for name, *_ in HOSTS]
        data = {h.name: {**environment_data(h, tier, repo), **COMMON, **extra}
                for h, (_, _, _, tier, extra) in zip(hosts, HOSTS)}
        groups = {"dev": [HOSTS[0][0]], "research": [n for n, _, _, t, _ in HOSTS if t == "research"],
                  "hgx": [HOSTS[-1][0]]}
        with tempfile.TemporaryDirectory() as tmp:
            inv = write_inventory(Path(tmp) / "sandbox.py", hosts, data, groups)
            if not args.again:
                _run([str(REPO / ".venv/bin/pyinfra"), "-y", str(inv), "deploys/all.py"])
            change(hosts)
            # one more entry, on an address of the pool's /24 that no host uses
            net = hosts[0].address.rsplit(".", 1)[0]
            ghost = {**hosts[1].pyinfra_data(), **data[hosts[1].name], "ssh_hostname": f"{net}.250"}
            inv.write_text(inv.read_text() + f"\nghosts = [('gf-htmlreport-ghost', {ghost!r})]\n")
            out = Path(tmp) / "out"
            report = subprocess.run([str(REPO / "tools/fleet-report"), str(inv), "--out", str(out), "--quiet"],
                                    cwd=REPO, text=True, capture_output=True)
            print(report.stdout[-3000:], report.stderr[-3000:], sep="\n")
            doc = json.loads((out / "fleet-report.json").read_text())
        doc["inventory"] = INVENTORY_NAME  # it named the temporary file
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"written: {args.out} ({len(doc['hosts'])} hosts)")
        return 0
    finally:
        if not args.keep:
            testhosts.down(POOL)
            aptrepo.stop_saved(record)


def change(hosts: list[testhosts.Host]) -> None:
    """What was done after all.py converged the hosts (tests/fixtures/report/README.md)."""
    dev, by_hand, healthy, sick, hgx = hosts
    # the loaded module (simulated /proc) is not the installed user space: mismatch-pending
    proc = dev.root / "usr/lib/gpusim/kernel/proc-driver/nvidia/version"
    proc.write_text(re.sub(r"\b\d{3}\.\d+\.\d+\b", LOADED, proc.read_text(), count=1))
    # cuDNN downgraded by hand, where the tier resolves a newer release
    names = testhosts.ssh(by_hand, "dpkg-query -W -f '${Package}\\n' 'libcudnn9*'").stdout.split()
    pinned = " ".join(f"{n}={CUDNN_BY_HAND}" for n in names)
    testhosts.ssh(by_hand, "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --allow-downgrades "
                  f"--allow-change-held-packages {pinned}", timeout=300)
    # PyTorch builds (the recorded values of real wheels, a test double): one the GPUs and the
    # driver take, one built for CUDA 12.8 on the dev host's Debian driver branch 535
    torch_standin.install(healthy, "2.11.0+cu128")
    torch_standin.install(hgx, "2.11.0+cu126")
    torch_standin.install(dev, "2.11.0+cu128")
    # a GPU to act on: a row remap pending on GPU 2 (the health check's "reset")
    testhosts.ssh(sick, "gpusimctl fault --clear && gpusimctl fault --gpu 2 row-remap-pending")


def _run(cmd: list[str]) -> None:
    print("==", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")


if __name__ == "__main__":
    sys.exit(main())


def recorded_document(count: int | None = None, names: tuple[str, ...] = ()) -> dict:
    """A report document of recorded rows (OUT): the hosts `names` (in inventory order), or the
    whole recording repeated up to `count` hosts, each repeat renamed (`gf-htmlreport-2-b`), the
    summary made again by the report code. Rows are never edited otherwise."""
    import copy

    from gpufleet.apps.report.render import document

    recorded = json.loads(OUT.read_text())
    rows = recorded["hosts"]
    if names:
        rows = [r for r in rows if r["host"] in names]
    elif count is not None:
        rows = [copy.deepcopy(rows[i % len(rows)]) for i in range(count)]
        for i, row in enumerate(rows):
            repeat = i // len(recorded["hosts"])
            if repeat:
                row["host"] += "-" + "abcdefghijklmnopqrstuvwxyz"[repeat]
    return json.loads(json.dumps(document(rows, recorded["inventory"], recorded["seconds"])))
