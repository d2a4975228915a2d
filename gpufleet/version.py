"""gpufleet's version, as every command's `--version` prints it.

The installed distribution's metadata is the answer (a wheel, or `pip install -e .` in a
checkout); a checkout run without installing (tools/compat puts the checkout on sys.path) reads
its pyproject.toml. pyinfra's version is printed beside it: the deploys are tied to pyinfra 3.10.
"""
from __future__ import annotations

import argparse
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def version() -> str:
    try:
        return metadata.version("gpufleet")
    except metadata.PackageNotFoundError:
        pass
    try:
        project = tomllib.loads(PYPROJECT.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
    return str(project["version"]) if project.get("name") == "gpufleet" else "unknown"


def version_line(prog: str) -> str:
    """`gpufleet-deploy (gpufleet) 0.1.0; pyinfra 3.10.0`: the command, gpufleet's version, pyinfra's."""
    try:
        pyinfra = metadata.version("pyinfra")
    except metadata.PackageNotFoundError:
        pyinfra = "not installed"
    return f"{prog} (gpufleet) {version()}; pyinfra {pyinfra}"


def add_version(parser: argparse.ArgumentParser) -> None:
    """`--version` on an application's parser: print version_line and exit 0."""
    parser.add_argument("--version", action="version", version=version_line(parser.prog),
                        help="print gpufleet's version (and pyinfra's) and exit")
