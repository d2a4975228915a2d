"""The inventory of tools/rollout, tools/rollback and tools/fleet-report, taken the way the
pyinfra command line takes it: `--limit` and `--exclude` (host names, fnmatch patterns or
group names),
`--data key=value` (pyinfra's value parsing: true/false, integers, JSON, else text), the
`config.py` pyinfra reads (the current directory's; else the one beside the inventory) and the
`group_data/` folders pyinfra_cli.inventory.make_inventory reads (current directory's and the
inventory's). The inventory and config file are loaded by pyinfra_cli's own functions (through
gpufleet/pyinfra_private.py: no public API loads them); --data values and --limit patterns
follow pyinfra's documented rules with its public Inventory API. tests/unit/test_inventory_source.py
compares the result with what the `pyinfra` command itself loads (`debug-inventory`).
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from gpufleet import pyinfra_private


class SourceError(ValueError):
    """A --limit, --exclude, --data or config.py the tool cannot use: one line, for exit code 2."""


def add_arguments(parser: argparse.ArgumentParser, limit: bool = True) -> None:
    if limit:
        parser.add_argument("--limit", action="append", default=[], metavar="PATTERN",
                            help="only these hosts: a group name, a host name or an fnmatch pattern, as for "
                                 "`pyinfra --limit` (repeat for more)")
    parser.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                        help="leave these hosts out, never contacted nor counted: a group name, a host name or "
                             "an fnmatch pattern, as for `pyinfra --exclude` (repeat for more)")
    parser.add_argument("--data", action="append", default=[], metavar="KEY=VALUE", type=data_arg,
                        help="override a setting for every host, as `pyinfra --data` does (true/false, numbers "
                             "and JSON are parsed as pyinfra parses them); checked like inventory data")
    parser.add_argument("--config", metavar="FILE",
                        help="pyinfra config file (default: config.py in the current directory, else beside the "
                             "inventory)")


def data_arg(text: str) -> tuple[str, Any]:
    """argparse type of --data: KEY=VALUE, the value parsed as `pyinfra --data` parses it."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), cli_value(value)


def cli_value(text: str) -> Any:
    """A --data value as pyinfra's command line reads it: false/true (any case), an integer,
    JSON, else the text itself."""
    if text.lower() in ("false", "true"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


def pattern_matches(inventory: Any, pattern: str) -> list[Any]:
    """The hosts a --limit pattern selects, as `pyinfra --limit` selects them: a group's hosts
    if a group has that name, else the hosts whose name matches it (fnmatch)."""
    from pyinfra.api.exceptions import NoGroupError

    try:
        return list(inventory.get_group(pattern))
    except NoGroupError:
        return [host for host in inventory if fnmatch(host.name, pattern)]


@dataclass
class InventorySource:
    """An inventory path with the command line's --limit, --exclude, --data and config file.
    str() and os.fspath() give the path, so it goes wherever the path went."""

    path: str
    limit: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    config_file: str | None = None
    cwd: str = field(default_factory=os.getcwd)
    _config: Any = field(default=None, repr=False)
    exclude: list[str] = field(default_factory=list)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InventorySource:
        config = args.config
        if config is not None and not Path(config).is_file():
            raise SourceError(f"argument --config: no such file: {config}")
        if config is None:
            beside = Path(args.inventory).resolve().parent / "config.py"
            here = Path.cwd() / "config.py"
            config = str(here) if here.is_file() else str(beside) if beside.is_file() else None
        return cls(args.inventory, list(getattr(args, "limit", None) or []), dict(args.data), config,
                   exclude=list(getattr(args, "exclude", None) or []))

    def __str__(self) -> str:
        return self.path

    def __fspath__(self) -> str:
        return self.path

    def load(self) -> Any:
        """The whole inventory, as `pyinfra INVENTORY ... --data ...` loads it."""
        from pyinfra.api import State
        from pyinfra.context import ctx_state

        with ctx_state.use(State()):
            try:
                return pyinfra_private.make_inventory(self.path, cwd=self.cwd, override_data=dict(self.data) or None)
            except Exception as exc:  # noqa: BLE001 - a broken inventory or group_data file
                raise SourceError(f"inventory {self.path}: {_why(exc)}") from None

    def hosts(self, inventory: Any) -> list[Any]:
        """The hosts --limit selects (all without it) less those --exclude names, in inventory
        order; a pattern that matches nothing is an error (pyinfra only warns: the run would
        quietly do less, or, for --exclude, contact the host the operator meant to leave out)."""
        chosen = set(self._matches(inventory, "--limit", self.limit)) if self.limit else set(inventory)
        left_out = set(self._matches(inventory, "--exclude", self.exclude))
        return [h for h in inventory if h in chosen and h not in left_out]

    def excluded(self, inventory: Any) -> list[str]:
        """Names of the hosts --exclude leaves out, in inventory order."""
        left_out = set(self._matches(inventory, "--exclude", self.exclude))
        return [h.name for h in inventory if h in left_out]

    def _matches(self, inventory: Any, option: str, patterns: list[str]) -> list[Any]:
        found: list[Any] = []
        for pattern in patterns:
            hosts = pattern_matches(inventory, pattern)
            if not hosts:
                groups = ", ".join(sorted(g for g in inventory.groups if g != "all")) or "none"
                raise SourceError(f"{option} {pattern!r}: no group or host of {self.path} matches "
                                  f"(groups: {groups})")
            found += hosts
        return found

    def config(self) -> Any:
        """A fresh pyinfra Config with the config file applied, as the pyinfra CLI applies it."""
        from pyinfra.api import Config

        if self._config is None:
            config = Config()
            if self.config_file:
                from pyinfra.api import State
                from pyinfra.context import ctx_config, ctx_state

                with ctx_state.use(State()), ctx_config.use(config):
                    try:
                        pyinfra_private.exec_file(self.config_file)
                    except Exception as exc:  # noqa: BLE001 - any error in the operator's file
                        raise SourceError(f"config file {self.config_file}: {_why(exc)}") from None
            self._config = config
        return self._config.copy()


def _why(exc: BaseException) -> str:
    """One line for an error in the operator's file (pyinfra wraps those in its own exception)."""
    inner = getattr(exc, "exception", None)
    exc = inner if isinstance(inner, BaseException) else exc
    text = " ".join(str(exc).split()) if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_inventory(source: InventorySource | str) -> Any:
    """The inventory of `source` (a plain path: as `pyinfra PATH` loads it)."""
    return (source if isinstance(source, InventorySource) else InventorySource(str(source))).load()


def limited_names(source: InventorySource | str) -> list[str]:
    src = source if isinstance(source, InventorySource) else InventorySource(str(source))
    return [h.name for h in src.hosts(src.load())]


def config_of(source: InventorySource | str) -> Any:
    from pyinfra.api import Config

    return source.config() if isinstance(source, InventorySource) else Config()
