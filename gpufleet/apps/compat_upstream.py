"""tools/compat-upstream: which rows of compat.yaml disagree with NVIDIA's and PyTorch's own
published files, or are missing from it (a maintainer's command, issue 47).

    tools/compat-upstream DIR [--json]

DIR holds downloaded copies of upstream files, any subset of:

- ``*table3*.md``: "Table 3: CUDA Toolkit and Corresponding Driver Versions" of the CUDA release
  notes, as markdown rows ``| 13.2 Update 2 | >= 595.71.05 | N/A |`` (the Linux x86_64 column);
- ``redistrib_*.json``: CUDA redistrib manifests (developer.download.nvidia.com/compute/cuda/redist/):
  ``release_label`` and the ``nvidia_driver`` component's ``version``;
- ``*cudnn*support-matrix*.txt``: the text of the cuDNN support matrix's "Supported NVIDIA Hardware
  and CUDA Version" table, one cell a line (as a browser's copy gives it);
- ``*build_cuda.sh*``: PyTorch's wheel build script (.ci/manywheel/build_cuda.sh): the
  ``TORCH_CUDA_ARCH_LIST`` of each CUDA variant.

Prints one line per finding, ``DISAGREE <row>: compat.yaml says X; <file> says Y`` or ``MISSING
<row>: <file> says Y``, and exits 1 when there is any, 0 when every row agrees, 2 on bad
arguments. Reads files only; nothing here touches a host.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from gpufleet.apps.exits import epilog
from gpufleet.version import add_version

FOUND = 1


@dataclass(frozen=True)
class Finding:
    kind: str  # DISAGREE | MISSING
    row: str  # where in compat.yaml: "cuda_releases.13.2.updates.13.2.2"
    ours: str | None  # what compat.yaml says (None: nothing)
    theirs: str  # what the upstream file says
    file: str
    note: str = ""  # e.g. the other sources compat.yaml cites for the row

    def line(self) -> str:
        if self.kind == "MISSING":
            return f"MISSING {self.row}: {self.file} says {self.theirs}" + (f" ({self.note})" if self.note else "")
        return (f"DISAGREE {self.row}: compat.yaml says {self.ours}; {self.file} says {self.theirs}"
                + (f" ({self.note})" if self.note else ""))


# --- CUDA: Table 3 and redistrib manifests -----------------------------------------------------

_ROW = re.compile(r"^\|\s*(?:CUDA\s+)?(\d+)\.(\d+)(?:\.\d+)?\s+(GA|Update\s+(\d+))\s*\|\s*>=\s*([\d.]+)\s*\|")


def table3_updates(text: str) -> dict[str, str]:
    """Table 3's rows -> {"13.2.2": "595.71.05", "13.2.0": "595.45.04", ...} (Linux x86_64)."""
    out = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            update = m.group(4) or "0"
            out[f"{m.group(1)}.{m.group(2)}.{update}"] = m.group(5)
    return out


def redistrib_update(text: str) -> tuple[str, str] | None:
    """A redistrib manifest -> (release_label, nvidia_driver version), None without a driver."""
    manifest = json.loads(text)
    driver = (manifest.get("nvidia_driver") or {}).get("version")
    label = manifest.get("release_label")
    return (str(label), str(driver)) if label and driver else None


def _cuda_findings(updates: dict[str, str], name: str, data: Any) -> list[Finding]:
    from gpufleet.versions import parse

    releases = data.cuda_releases
    oldest = min(releases, key=parse)
    out = []
    for update, driver in sorted(updates.items(), key=lambda item: parse(item[0])):
        minor = ".".join(update.split(".")[:2])
        if parse(minor) < parse(oldest):
            continue  # older than any release gpufleet installs: not a row it keeps
        release = releases.get(minor)
        if release is None:
            out.append(Finding("MISSING", f"cuda_releases.{minor}", None, f"CUDA {update} needs driver >= {driver}",
                               name))
        elif update not in release.updates:
            out.append(Finding("MISSING", f"cuda_releases.{minor}.updates.{update}", None,
                               f"CUDA {update} needs driver >= {driver}", name))
        elif release.updates[update] != driver:
            out.append(Finding("DISAGREE", f"cuda_releases.{minor}.updates.{update}", release.updates[update],
                               driver, name))
    return out


# --- cuDNN support matrix ----------------------------------------------------------------------

_CUDNN = re.compile(r"^cuDNN (\d+\.\d+\.\d+) for CUDA (\d+)\.x$")
_BULLET = re.compile(r"^[•*-]\s*(\d+\.\d+)(?:\s*\[\d+\])?$")
_DRIVER = re.compile(r"^>=\s*([\d.]+)$")


@dataclass(frozen=True)
class CudnnRow:
    version: str
    cuda_major: str
    cuda_versions: tuple[str, ...]
    min_driver: str | None
    compute_capabilities: tuple[str, ...]


def cudnn_rows(text: str) -> list[CudnnRow]:
    """The support matrix's rows, read cell by cell: the CUDA toolkits, the static-linking cell,
    the Linux driver, the Windows driver, the compute capabilities, the architectures."""
    rows: list[CudnnRow] = []
    current: dict[str, Any] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        header = _CUDNN.match(line)
        if header:
            if current:
                rows.append(CudnnRow(**current))
            current = {"version": header.group(1), "cuda_major": header.group(2), "cuda_versions": (),
                       "min_driver": None, "compute_capabilities": ()}
            continue
        if current is None:
            continue
        bullet, driver = _BULLET.match(line), _DRIVER.match(line)
        if bullet:
            key = "cuda_versions" if current["min_driver"] is None else "compute_capabilities"
            current[key] = (*current[key], bullet.group(1))
        elif driver and current["min_driver"] is None:
            current["min_driver"] = driver.group(1)
        elif line.startswith("Note") or (not line and current["compute_capabilities"]):
            rows.append(CudnnRow(**current))
            current = None
    if current:
        rows.append(CudnnRow(**current))
    return rows


def _cudnn_findings(rows: list[CudnnRow], name: str, data: Any) -> list[Finding]:
    from gpufleet.versions import parse

    out = []
    for row in rows:
        ours = [b for b in data.cudnn_builds if b.version == row.version and b.cuda_major == row.cuda_major]
        where = f"cudnn_releases[{row.version}, CUDA {row.cuda_major}]"
        if not ours:
            out.append(Finding("MISSING", where, None,
                               f"CUDA {', '.join(row.cuda_versions)}, driver >= {row.min_driver}, "
                               f"CC {', '.join(row.compute_capabilities)}", name))
            continue
        # several builds of one row (9.10.2's 12.8/12.9 build): compare their union / the lowest floor
        cuda = sorted({v for b in ours for v in b.cuda_versions}, key=parse)
        ccs = sorted({c for b in ours for c in b.compute_capabilities}, key=parse)
        floor = min((b.min_driver for b in ours), key=parse)
        for what, mine, theirs in (("cuda_versions", cuda, sorted(row.cuda_versions, key=parse)),
                                   ("compute_capabilities", ccs, sorted(row.compute_capabilities, key=parse))):
            if mine != theirs:
                out.append(Finding("DISAGREE", f"{where}.{what}", ", ".join(mine), ", ".join(theirs), name))
        if row.min_driver and floor != row.min_driver:
            out.append(Finding("DISAGREE", f"{where}.min_driver", floor, row.min_driver, name))
    return out


# --- PyTorch: the wheels' architecture lists ---------------------------------------------------

_BASE = re.compile(r'^TORCH_CUDA_ARCH_LIST="([^"$]*)"')
_AARCH64_ONLY = re.compile(r'\$\(\[\[ "\$ARCH" == "aarch64" \]\] && echo "[^"]*" \|\| echo ""\)')
_CASE = re.compile(r"^(\d+\.\d+)\)\s*(?:TORCH_CUDA_ARCH_LIST=\"(.*?)\"\s*(?:;;|#|$)|$)")


def build_arch_lists(text: str) -> dict[str, tuple[str, ...]]:
    """build_cuda.sh -> {"12.6": ("5.0", "6.0", "7.0", ...), ...}: the Linux x86_64 lists of wheels
    (libtorch-only and aarch64 edits left out)."""
    base: tuple[str, ...] = ()
    out: dict[str, tuple[str, ...]] = {}
    pending = None
    for raw in text.splitlines():
        line = raw.strip()
        m = _BASE.match(line)
        if m and pending is None and not out:
            base = tuple(a for a in m.group(1).split(";") if a)
            continue
        case = _CASE.match(line)
        if case:
            pending = case.group(1)
            if case.group(2) is None:
                continue
            line = f'TORCH_CUDA_ARCH_LIST="{case.group(2)}"'
        if pending and line.startswith('TORCH_CUDA_ARCH_LIST="'):
            value = line[line.index('="') + 2:line.rindex('"')]
            value = value.replace("${TORCH_CUDA_ARCH_LIST}", ";".join(base))
            value = _AARCH64_ONLY.sub("", value)  # x86_64 wheels: the aarch64-only entry is left out
            out[pending] = tuple(a for a in value.split(";") if a)
            pending = None
    return out


def _pytorch_findings(lists: dict[str, tuple[str, ...]], name: str) -> list[Finding]:
    from gpufleet.catalog.compat import packaged_mapping
    from gpufleet.catalog.pytorch import pytorch_data

    torch = pytorch_data()
    raw = packaged_mapping()["pytorch"]["releases"]
    out = []
    for release in torch.versions:
        if torch.status.get(release) != "derived":
            continue  # only rows derived from the build script are held to it
        for variant in torch.releases[release]:
            theirs = lists.get(variant.cuda)
            if theirs is not None and tuple(variant.archs) != theirs:
                cited = raw[release].get("source")
                cited = [cited] if isinstance(cited, str) else list(cited or [])
                out.append(Finding("DISAGREE", f"pytorch.releases.{release}.{variant.name}", ", ".join(variant.archs),
                                   ", ".join(theirs), name, note=f"compat.yaml cites {', '.join(cited)} for {release}"))
    return out


# --- the command -------------------------------------------------------------------------------


def check(folder: Path, data: Any = None) -> tuple[list[Finding], list[str]]:
    """Every finding of the upstream files in ``folder``, and the files read."""
    from gpufleet.catalog.compat import compat_data

    data = data or compat_data()
    findings: list[Finding] = []
    read: list[str] = []
    files = sorted(p for p in folder.iterdir() if p.is_file())
    redist: dict[str, str] = {}
    for path in files:
        name, text = path.name, path.read_text(encoding="utf-8")
        if "table3" in name:
            findings += _cuda_findings(table3_updates(text), name, data)
        elif name.startswith("redistrib_") and name.endswith(".json"):
            found = redistrib_update(text)
            if found:
                redist[found[0]] = found[1]
                findings += _cuda_findings({found[0]: found[1]}, name, data)
        elif "cudnn" in name and "support-matrix" in name:
            findings += _cudnn_findings(cudnn_rows(text), name, data)
        elif "build_cuda.sh" in name:
            findings += _pytorch_findings(build_arch_lists(text), name)
        else:
            continue
        read.append(name)
    return findings, read


def parser(prog: str = "compat-upstream") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, epilog=epilog("tools/compat-upstream"),
        description="Compare gpufleet/data/compat.yaml with downloaded copies of NVIDIA's and PyTorch's published "
                    "files (CUDA release notes Table 3, redistrib_*.json manifests, the cuDNN support matrix, "
                    "PyTorch's build_cuda.sh): one line per row that disagrees or is missing.")
    p.add_argument("folder", type=Path, metavar="DIR", help="folder of downloaded upstream files")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_version(p)
    return p


def main(argv: Iterable[str] | None = None, prog: str = "compat-upstream") -> int:
    p = parser(prog)
    args = p.parse_args(None if argv is None else list(argv))
    if not args.folder.is_dir():
        p.error(f"{args.folder} is not a folder")
    findings, read = check(args.folder)
    if not read:
        p.error(f"{args.folder} holds no upstream file this command reads (see --help)")
    if args.json:
        print(json.dumps({"read": read, "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        print(f"read: {', '.join(read)}")
        for finding in findings:
            print(finding.line())
        print(f"{len(findings)} finding{'s' if len(findings) != 1 else ''}")
    return FOUND if findings else 0


if __name__ == "__main__":
    sys.exit(main())
