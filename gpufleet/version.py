"""gpufleet's version, as every command's `--version` prints it.

A checkout (run through `pip install -e .`, or without installing: tools/compat puts the
checkout on sys.path) reads its pyproject.toml; an installed wheel, which has none beside its
package, its distribution's metadata. pyinfra's version is printed beside it: the deploys are tied to pyinfra 3.10.
"""
from __future__ import annotations

import argparse
import platform
import sys
import tomllib
from typing import Any, Sequence
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def version() -> str:
    # a checkout's pyproject.toml first: an editable install's metadata keeps the version it was
    # installed at until pip runs again (tools/bootstrap), and would name the previous release
    try:
        project = tomllib.loads(PYPROJECT.read_text())["project"]
        if project.get("name") == "gpufleet":
            return str(project["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        pass
    try:
        return metadata.version("gpufleet")
    except metadata.PackageNotFoundError:
        return "unknown"


def version_line(prog: str) -> str:
    """`gpufleet-deploy (gpufleet) 0.2.0; pyinfra 3.10.0`: the command, gpufleet's version, pyinfra's."""
    try:
        pyinfra = metadata.version("pyinfra")
    except metadata.PackageNotFoundError:
        pyinfra = "not installed"
    return f"{prog} (gpufleet) {version()}; pyinfra {pyinfra}"


def add_version(parser: argparse.ArgumentParser) -> None:
    """`--version` and `--support` on an application's parser: print version_line (or
    support_text) and exit 0."""
    parser.add_argument("--version", action="version", version=version_line(parser.prog),
                        help="print gpufleet's version (and pyinfra's) and exit")
    add_support(parser)


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _os() -> str:
    try:
        name = platform.freedesktop_os_release().get("PRETTY_NAME", "")
    except OSError:
        name = ""
    return f"{name or platform.system()} ({platform.system()} {platform.release()}, {platform.machine()})"


def support_text() -> str:
    """What a bug report needs, as `pyinfra --support` prints it: the versions of gpufleet, pyinfra,
    paramiko and Python (and which Python), and the controller's OS."""
    return "\n".join([
        "Support information (paste it into a bug report):",
        f"    gpufleet: {version()}",
        f"    pyinfra: {_installed('pyinfra')}",
        f"    paramiko: {_installed('paramiko')}",
        f"    Python: {platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        f"    OS: {_os()}",
    ]) + "\n"


class _Support(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stdout.write(support_text())
        parser.exit(0)


def add_support(parser: argparse.ArgumentParser) -> None:
    """`--support` on an application's parser: print support_text and exit 0."""
    parser.add_argument("--support", action=_Support,
                        help="print gpufleet's, pyinfra's, paramiko's, Python's and the OS's versions for a bug "
                             "report and exit")
