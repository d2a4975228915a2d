"""tools/compat: what would gpufleet install for these GPUs, without a host.

    tools/compat --gpu "NVIDIA H200" [--gpu ...] --os ubuntu-24.04 [--driver-branch 580]
                 [--cuda 13.0] [--cudnn 9.17.0] [--pytorch 2.11] [--json]

Prints the driver, CUDA toolkit, cuDNN and PyTorch wheel the resolver picks (the same resolver and
GPU catalog the deploys use), or the refusal with its reason and what would be allowed. Every value
is checked by the grammar of the inventory key it stands for (gpufleet/config/schema.py). Exit code 0
when everything fits, 3 when the combination is refused, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from typing import Any, Callable, Sequence

from gpufleet.apps.exits import epilog
from gpufleet.version import add_version

REFUSED = 3

#: option -> (inventory key, default)
OPTIONS = {
    "driver_source": ("--driver-source", "nvidia"),
    "driver_branch": ("--driver-branch", "auto"),
    "driver_version": ("--driver-version", "auto"),
    "driver_flavour": ("--driver-flavour", "auto"),
    "cuda_version": ("--cuda", "none"),
    "cuda_driver_compat": ("--cuda-driver-compat", "toolkit"),
    "cudnn_version": ("--cudnn", "none"),
    "pytorch_version": ("--pytorch", "none"),
}


def _grammar(key: str) -> Callable[[str], Any]:
    """argparse type: the inventory key's own grammar, so the tool accepts what an inventory does."""
    def check(text: str) -> Any:
        from gpufleet.config.schema import KEYS, BadValue

        try:
            return KEYS[key].validate(text)
        except BadValue as bad:
            raise argparse.ArgumentTypeError(f"{bad.problem}; allowed: {bad.allowed}") from None

    check.__name__ = key  # argparse names the type in some messages
    return check


def _gpu(text: str) -> Any:
    from gpufleet.catalog.gpus import model_for_name, model_for_pci, model_names

    model = model_for_name(text) or (model_for_pci(text) if text.lower().startswith("0x") else None)
    if model is None:
        close = similar_gpus(text, model_names())
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise argparse.ArgumentTypeError(
            f"unknown GPU {text!r}{hint}; allowed: an nvidia-smi name or PCI device id from compat.yaml "
            "(tools/compat --list-gpus)")
    return model


def similar_gpus(text: str, names: Sequence[str]) -> list[str]:
    """The GPU names a mistyped or partial one may mean: those containing it as a word ("H100",
    "nvidia a100"), else the closest spellings."""
    words = text.lower().split()
    containing = [n for n in names if words and all(w in n.lower().replace("-", " ").split() for w in words)]
    return containing[:5] or difflib.get_close_matches(text, names, n=3, cutoff=0.5)


def parser(prog: str = "compat") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, epilog=epilog("gpufleet-compat"),
        description="What gpufleet would install for these GPUs on this OS (driver, CUDA, cuDNN, PyTorch "
                    "wheel), or why it refuses.")
    p.add_argument("--gpu", action="append", type=_gpu, metavar="NAME",
                   help="a GPU of the host: nvidia-smi name (\"NVIDIA H200\") or PCI id (0x2335); once per GPU")
    p.add_argument("--os", type=_grammar("validate_os_release"), metavar="OS", help="OS release, e.g. ubuntu-24.04")
    for key, (flag, default) in OPTIONS.items():
        p.add_argument(flag, dest=key, type=_grammar(key), default=default, metavar=key.upper(),
                       help=f"as the inventory key {key} (default {default})")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--list-gpus", action="store_true",
                   help="print every GPU gpufleet knows (architecture, compute capability, the newest driver branch, "
                        "CUDA and PyTorch wheel that support it, open/proprietary modules) and exit; with --json, a list")
    add_version(p)
    return p


def module_packages(prebuilt: str | None, dkms: str | None, os_release: str) -> dict[str, Any]:
    """A distribution driver's kernel modules (Ubuntu): the prebuilt, signed flavour metapackage
    per kernel flavour (the GA `generic` kernel and the release's HWE one, S35 in compat.yaml),
    the build for one kernel ABI (`<uname -r>`), and the DKMS package where no build exists."""
    out: dict[str, Any] = {"prebuilt": None, "prebuilt_kernel": None, "dkms": dkms}
    if prebuilt:
        flavours = ["generic"]
        if os_release.startswith("ubuntu-"):
            flavours.append(f"generic-hwe-{os_release.split('-', 1)[1]}")
        out["prebuilt"] = {flavour: prebuilt.format(kernel=flavour) for flavour in flavours}
        out["prebuilt_kernel"] = prebuilt.format(kernel="<uname -r>")
    return out


def answer(gpus: list[Any], os_release: str, wishes: dict[str, Any]) -> dict[str, Any]:
    """The resolver's answer as a plain dict (the --json object)."""
    from gpufleet.errors import Incompatible
    from gpufleet.catalog.pytorch import mixed_gpus
    from gpufleet.config.resolver import resolve

    out: dict[str, Any] = {
        "gpus": [{"name": m.name, "compute_capability": m.compute_capability} for m in gpus],
        "os": os_release,
        "driver": None, "cuda": None, "cudnn": None, "pytorch": None,
        "notes": [], "refused": None, "refused_key": None, "allowed": None,
    }
    mixed = mixed_gpus(gpus)
    if mixed:
        out["notes"].append(mixed)
    try:
        r = resolve(gpus, wishes, os_release)
    except Incompatible as refused:
        allowed = [item.strip() for item in refused.allowed.split(",") if item.strip()] if refused.allowed else None
        out.update(refused=refused.reason, refused_key=refused.key, allowed=allowed)
        return out
    out["driver"] = {"source": r.source, "branch": r.driver_branch, "version": r.driver_version,
                     "flavour": r.flavour, "packages": list(r.driver_packages)}
    if r.prebuilt_modules or r.dkms_modules:
        out["driver"]["modules"] = module_packages(r.prebuilt_modules, r.dkms_modules, os_release)
    if r.cuda_version:
        out["cuda"] = {"version": r.cuda_version, "package": r.cuda_package, "release": r.cuda_release}
    if r.cudnn_version:
        out["cudnn"] = {"version": r.cudnn_version, "package": r.cudnn_package, "release": r.cudnn_release,
                        "packages": list(r.cudnn_packages)}
    if r.pytorch:
        p = r.pytorch
        out["pytorch"] = {"version": p.version, "cuda_variant": p.variant, "cuda": p.cuda,
                          "index_url": p.index_url, "pip": p.pip, "experimental": p.experimental,
                          "archs": list(p.archs), "data_status": p.data_status}
    out["notes"] += list(r.notes)
    return out


def gpu_rows() -> list[dict[str, Any]]:
    """--list-gpus: every GPU of the catalogue with the newest stack that still supports it."""
    from dataclasses import asdict

    from gpufleet.catalog.gpu_support import newest_stack
    from gpufleet.catalog.gpus import catalog

    rows = []
    for model in catalog():
        row = asdict(newest_stack(model))
        row["modules"] = list(row["modules"])
        row["pci_ids"] = list(model.pci_ids)
        rows.append(row)
    return rows


GPU_COLUMNS = ("gpu", "arch", "cc", "class", "newest branch", "CUDA 13", "newest CUDA", "newest PyTorch", "modules")


def render_gpus(rows: list[dict[str, Any]]) -> str:
    """One line per GPU, tab-separated, under a header: the newest branch (and the
    architecture's last one, when it has ended), CUDA and PyTorch wheel that support it."""
    lines = ["\t".join(GPU_COLUMNS)]
    for r in rows:
        branch = f"R{r['branch']} ({r['driver']})" if r["branch"] else "none"
        if r["last_branch"]:
            branch += f", last R{r['last_branch']}"
        lines.append("\t".join([
            r["gpu"], r["arch"], r["compute_capability"], r["gpu_class"], branch, "yes" if r["cuda13"] else "no",
            f"{r['cuda']} ({r['cuda_release']})" if r["cuda"] else "none",
            f"{r['pytorch']} {r['pytorch_variant']}" if r["pytorch"] else "none",
            "/".join(r["modules"]) or "none",
        ]))
    return "\n".join(lines)


def render(out: dict[str, Any]) -> str:
    gpus: dict[str, int] = {}
    for g in out["gpus"]:
        label = f"{g['name']} (compute capability {g['compute_capability']})"
        gpus[label] = gpus.get(label, 0) + 1
    lines = [f"gpus:    {', '.join(f'{n} x {label}' for label, n in gpus.items())}", f"os:      {out['os']}"]
    if out["refused"]:
        lines.append(f"REFUSED: {out['refused']}")
        if out["refused_key"]:
            lines.append(f"key:     {out['refused_key']}")
        if out["allowed"]:
            lines.append(f"allowed: {', '.join(out['allowed'])}")
    else:
        d = out["driver"]
        lines.append(f"driver:  R{d['branch']} {d['version']} ({d['flavour']}, {d['source']}): {' '.join(d['packages'])}")
        m = d.get("modules")
        if m and m["prebuilt"]:
            lines.append("modules: prebuilt, signed (Secure Boot without a MOK), per kernel flavour: "
                         + ", ".join(f"{package} ({flavour})" for flavour, package in m["prebuilt"].items())
                         + f", with {m['prebuilt_kernel']} where the archive has a build for the running kernel"
                         + (f"; else {m['dkms']} (DKMS)" if m["dkms"] else ""))
        elif m and m["dkms"]:
            lines.append(f"modules: {m['dkms']} (DKMS)")
        c, n, p = out["cuda"], out["cudnn"], out["pytorch"]

        def at(x: dict[str, Any]) -> str:  # the exact release installed and held (None: the distribution's)
            return f" at {x['release']}" if x.get("release") else ""

        lines.append(f"cuda:    {c['version']} ({c['package']}){at(c)}" if c else "cuda:    none")
        lines.append(f"cudnn:   {n['version']} ({n['package']}){at(n)}" if n else "cudnn:   none")
        if p:
            lines.append(f"pytorch: {p['version']} {p['cuda_variant']} (CUDA {p['cuda']}; wheels built for "
                         f"{', '.join(p['archs'])})" + (" experimental in PyTorch's matrix" if p["experimental"] else ""))
            lines.append(f"         {p['pip']}")
        else:
            lines.append("pytorch: none")
    lines += [f"note:    {note}" for note in out["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "compat") -> int:
    p = parser(prog)
    args = p.parse_args(argv)
    if args.list_gpus:
        rows = gpu_rows()
        print(json.dumps(rows, indent=2) if args.json else render_gpus(rows))
        return 0
    if not args.gpu:
        p.error("at least one --gpu is needed")
    if not args.os:
        p.error("--os is needed (e.g. --os ubuntu-24.04)")
    if args.driver_version != "auto" and args.driver_branch == "auto":
        p.error("argument --driver-version: pinning a driver needs --driver-branch")
    wishes = {key: getattr(args, key) for key in OPTIONS}
    out = answer(args.gpu, args.os, wishes)
    print(json.dumps(out, indent=2) if args.json else render(out))
    return REFUSED if out["refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
