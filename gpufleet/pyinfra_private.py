"""The one place gpufleet touches pyinfra names that are not its documented API.

gpufleet's planning speed-ups (gpufleet/controller/speedups.py) and its fact memo and prefetch
(gpufleet/controller/factcache.py, gpufleet/controller/factbatch.py) need a few of pyinfra's private functions and
replace some of them process-wide. Everything private goes through here, behind one gate:

- the pyinfra release must be one the patches were compared with (VERIFIED_PYINFRA), and
  every private name they use must still be there;
- every host must be reached through a connector they were checked with (VERIFIED_CONNECTORS,
  by pyinfra's own `pyinfra.connectors` entry points: ssh, which @vagrant and @terraform hosts
  use too, and @local, which the unit tests use).

Otherwise nothing is patched (or, for a host met after installation, its facts take pyinfra's
own path) and gpufleet runs on pyinfra's plain public path: the same answers, one remote
command per fact. One warning says so, once. The tests that compare the patched answers with
pyinfra's own are tests/unit/test_pyinfra_private.py, tests/unit/test_speedups.py,
tests/unit/test_factcache.py and tests/e2e/test_pyinfra_private.py; docs/upstream-proposal.md
lists what is used here and what we would ask pyinfra for instead.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import lru_cache
from importlib.metadata import entry_points, version
from typing import Any

from pyinfra import logger
from pyinfra.api.host import Host

#: pyinfra releases the patches were compared with (the tests named above); any other release
#: runs pyinfra's own code.
VERIFIED_PYINFRA: tuple[str, ...] = ("3.10.",)
#: names of pyinfra's `pyinfra.connectors` entry points the fact memo and prefetch were
#: checked with (the connector class must be exactly that entry point's class).
VERIFIED_CONNECTORS: tuple[str, ...] = ("ssh", "local")

# Every private name used, by module path (`from pyinfra.api import operation` is the
# decorator, not its module). available() is False unless all of them are present.
REQUIRED: dict[str, tuple[str, ...]] = {
    "pyinfra.api.facts": ("_get_fact", "_handle_fact_kwargs", "_make_command",
                          "_MISSING_COMMAND_MARKER", "all_global_arguments", "pop_global_arguments"),
    "pyinfra.api.arguments": ("all_global_arguments", "CONNECTOR_ARGUMENT_KEYS", "pop_global_arguments"),
    "pyinfra.api.deploy": ("pop_global_arguments",),
    "pyinfra.api.operation": ("get_operation_order_from_stack", "pop_global_arguments"),
    "pyinfra.api.util": ("get_operation_order_from_stack", "PYINFRA_INSTALL_DIR"),
    "pyinfra.facts.files": ("LINUX_STAT_COMMAND",),
    "pyinfra.connectors.util": ("make_unix_command", "make_unix_command_for_host", "SUDO_ASKPASS_ENV_VAR",
                                "SU_ASKPASS_ENV_VAR"),
}

_warned: set[str] = set()
_installed: list[str] = []  # what was patched, in order


def pyinfra_version() -> str:
    return version("pyinfra")


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _module(path: str) -> Any:
    return importlib.import_module(path)


def _get(path: str, name: str, default: Any = None) -> Any:
    return getattr(_module(path), name, default)


def missing_names() -> list[str]:
    """The private names of REQUIRED this pyinfra no longer has."""
    return [f"{path}.{name}" for path, names in REQUIRED.items() for name in names
            if not hasattr(_module(path), name)]


def available() -> bool:
    """Whether this pyinfra release may be patched: verified, with every name still there."""
    found = pyinfra_version()
    if not found.startswith(VERIFIED_PYINFRA):
        _warn_once("release", f"gpufleet: pyinfra {found} is not a release gpufleet's speed-ups were verified "
                              f"against ({', '.join(v + '*' for v in VERIFIED_PYINFRA)}): they stay off and "
                              "pyinfra's own code runs (the same answers, one command per fact)")
        return False
    missing = missing_names()
    if missing:
        _warn_once("names", f"gpufleet: pyinfra {found} lacks {', '.join(missing)}: gpufleet's speed-ups "
                            "stay off and pyinfra's own code runs")
        return False
    return True


@lru_cache(maxsize=1)
def verified_connector_classes() -> tuple[type, ...]:
    """The classes pyinfra registers for VERIFIED_CONNECTORS (its public entry points)."""
    return tuple(ep.load() for ep in entry_points(group="pyinfra.connectors")
                 if ep.name in VERIFIED_CONNECTORS)


def connector_name(host: Host) -> str:
    """The entry-point name of the host's connector (`@docker`...), else its class path."""
    cls = host.connector_cls
    for ep in entry_points(group="pyinfra.connectors"):
        if ep.value == f"{cls.__module__}:{cls.__qualname__}":
            return ep.name
    return f"{cls.__module__}.{cls.__qualname__}"


_verified_by_class: dict[type, bool] = {}
#: connector classes a benchmark declared test doubles of the network (admit_test_double_connector)
_test_doubles: list[type] = []


def admit_test_double_connector(cls: type) -> None:
    """Let the fact memo and prefetch run over `cls`, a TEST DOUBLE of the network that answers
    run_shell_command as a verified connector would (testing/replay.py's, for
    bench/controller.py). Only bench code calls this, in its own process, before install();
    gpufleet itself never does, so no real connector gets in this way."""
    if cls not in _test_doubles:
        _test_doubles.append(cls)
        _verified_by_class.pop(cls, None)


def connector_verified(host: Host) -> bool:
    """Whether the host's connector is one the fact memo and prefetch were checked with;
    warns once per connector when not."""
    cls = host.connector_cls
    ok = _verified_by_class.get(cls)
    if ok is None:
        ok = _verified_by_class[cls] = cls in verified_connector_classes() or cls in _test_doubles
        if not ok:
            _warn_once(f"connector:{cls.__module__}.{cls.__qualname__}",
                       f"gpufleet: {host.name} is reached through the {connector_name(host)} connector, which "
                       f"gpufleet's fact speed-ups were not verified with ({', '.join(VERIFIED_CONNECTORS)}): "
                       "its facts take pyinfra's own path (the same answers, one command per fact)")
    return ok


def usable() -> bool:
    """available(), and every host of the running pyinfra state (if any) on a verified
    connector: the gate every patch goes through."""
    if not available():
        return False
    from pyinfra.context import ctx_state

    if ctx_state.isset():
        state = ctx_state.get()
        inventory = getattr(state, "inventory", None)
        if inventory is not None and not all([connector_verified(host) for host in inventory]):
            return False
    return True


def installed() -> bool:
    """Whether any pyinfra function is replaced in this process."""
    return bool(_installed)


def patched() -> tuple[str, ...]:
    return tuple(_installed)


# -- private names, read (only ever called once available() said yes) ------------------------

def handle_fact_kwargs(state: Any, host: Host, cls: type, args: Any, kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """pyinfra.api.facts._handle_fact_kwargs: (the fact's arguments, the global arguments)."""
    result: tuple[dict[str, Any], dict[str, Any]] = _get("pyinfra.api.facts", "_handle_fact_kwargs")(
        state, host, cls, args, kwargs)
    return result


def fact_executor_arguments(state: Any, host: Host, cls: type) -> dict[str, Any]:
    """The connector arguments (sudo and its password, su, env...) pyinfra gives a fact of `cls`
    on `host` when nothing around it sets any: what a command run for a fact's reader uses."""
    _, global_kwargs = handle_fact_kwargs(state, host, cls, [], {})
    keys = connector_argument_keys()
    return {k: v for k, v in global_kwargs.items() if k in keys}


def make_command(command_attribute: Any, host_args: dict[str, Any]) -> Any:
    """pyinfra.api.facts._make_command: a fact's command (or requires_command) for its arguments."""
    return _get("pyinfra.api.facts", "_make_command")(command_attribute, host_args)


def missing_command_marker() -> str:
    return str(_get("pyinfra.api.facts", "_MISSING_COMMAND_MARKER", "##PYINFRA_NOCMD##"))


@lru_cache(maxsize=1)
def connector_argument_keys() -> frozenset[str]:
    """The global arguments pyinfra hands a fact's connector (sudo, su, env...)."""
    return frozenset(_get("pyinfra.api.arguments", "CONNECTOR_ARGUMENT_KEYS", ()))


def linux_stat_command() -> str:
    """pyinfra's `stat` command for its file facts ("" where it has none)."""
    return str(_get("pyinfra.facts.files", "LINUX_STAT_COMMAND", ""))


@lru_cache(maxsize=1)
def pyinfra_install_dir() -> str:
    return str(_get("pyinfra.api.util", "PYINFRA_INSTALL_DIR", ""))


def original_all_global_arguments() -> Callable[[], list[tuple[str, type]]]:
    """pyinfra.api.arguments.all_global_arguments as pyinfra defined it (before any patch)."""
    fn: Callable[[], list[tuple[str, type]]] = _ORIGINALS.get(
        "all_global_arguments", _get("pyinfra.api.arguments", "all_global_arguments"))
    return fn


@lru_cache(maxsize=1)
def original_pop_global_arguments() -> Callable[..., Any]:
    """pyinfra.api.arguments.pop_global_arguments (that module's name is never replaced)."""
    fn: Callable[..., Any] = _get("pyinfra.api.arguments", "pop_global_arguments")
    return fn


def planned_change(operation_meta: Any) -> bool:
    """Whether planning found that an operation would change its host, as `pyinfra --dry`
    prints it (OperationMeta._maybe_is_change; the public will_change would run the
    operation's commands generator again, in whatever context is current). On a release
    without it: True (reported as drift, never hidden)."""
    return bool(getattr(operation_meta, "_maybe_is_change", True))


def root_command(host: Host, command: Any) -> str:
    """`command` (a StringCommand) as pyinfra would run it as root on `host`: directly when the
    run logs in as root, else through sudo as the host's data (or `pyinfra --sudo`) says, its
    password handed over as every command's is (gpufleet/controller/askpass.py: a private file on the
    host, never the command line). Only sudo to root: the host's `_sudo_user`, su and doas
    settings are for its operations, not for the lock (gpufleet/controller/hostlock.py). Builds through
    pyinfra.connectors.util.make_unix_command_for_host as it is now (gpufleet's, once
    gpufleet/controller/askpass.py is installed), not behind the gate: the lock is a safety, on any release."""
    from pyinfra.api.command import StringCommand
    from pyinfra.connectors import util

    config = host.state.config
    sudo = host.data.get("_sudo", getattr(config, "SUDO", False))
    arguments: dict[str, Any] = {"_shell_executable": None}
    if sudo:
        arguments.update(_sudo=True, _sudo_password=host.data.get("_sudo_password",
                                                                  getattr(config, "SUDO_PASSWORD", None)) or "")
    wrapped = util.make_unix_command_for_host(host.state, host, command, **arguments)
    # exec: the login shell (dash does not exec a last command) would otherwise keep the
    # command line in every local user's `ps` for as long as the lock is held
    text: str = StringCommand("exec", wrapped).get_raw_value()
    return text


# -- sudo and su passwords (gpufleet/controller/askpass.py) -------------------------------------------

#: what pyinfra's make_unix_command is given as the password: it then builds its askpass form
#: of the command (`sudo -A -k`, su's pipe), and the environment assignment that would carry
#: the password (carrying only this word) is taken out again (_without_password_env)
PASSWORD_MARK = "gpufleet-askpass-file"
#: connector modules that imported make_unix_command_for_host by name (pyinfra 3.10)
_CONNECTOR_MODULES = ("pyinfra.connectors.ssh", "pyinfra.connectors.local", "pyinfra.connectors.docker",
                      "pyinfra.connectors.dockerssh", "pyinfra.connectors.chroot")


def carries_password(host: Host, arguments: dict[str, Any]) -> bool:
    """Whether pyinfra would send a sudo or su password with a command of these arguments."""
    sudo = bool(arguments.get("_sudo")) and bool(arguments.get("_sudo_password")
                                                  or host.connector_data.get("prompted_sudo_password"))
    return sudo or bool(arguments.get("_su_user") and arguments.get("_su_password"))


def unix_command_with_askpass(host: Host, command: Any, askpass_path: Callable[[Host, str, str], str],
                              **arguments: Any) -> Any:
    """pyinfra's make_unix_command_for_host, but the password goes to `askpass_path(host, kind,
    password)` (the host's askpass program that prints it), never into the command: pyinfra's
    make_unix_command only ever sees PASSWORD_MARK."""
    util = _module("pyinfra.connectors.util")
    if arguments.get("_sudo"):
        password = arguments.get("_sudo_password") or host.connector_data.get("prompted_sudo_password")
        if password:
            arguments["_sudo_askpass_path"] = askpass_path(host, "sudo", str(password))
            arguments["_sudo_password"] = PASSWORD_MARK
    if arguments.get("_su_user") and arguments.get("_su_password"):
        arguments["_su_askpass_path"] = askpass_path(host, "su", str(arguments["_su_password"]))
        arguments["_su_password"] = PASSWORD_MARK
    return _without_password_env(util.make_unix_command(command, **arguments))


def _without_password_env(command: Any) -> Any:
    """pyinfra's command without its `PYINFRA_SUDO_PASSWORD=...` / `PYINFRA_SU_PASSWORD=...` words
    (top level: `env SUDO_ASKPASS=... sudo ...`, `env <askpass> | su ...` remain)."""
    from pyinfra.api.command import StringCommand

    util = _module("pyinfra.connectors.util")
    names = (util.SUDO_ASKPASS_ENV_VAR, util.SU_ASKPASS_ENV_VAR)
    bits = [bit for bit in command.bits
            if not (isinstance(bit, StringCommand) and bit.bits and bit.bits[0] in names)]
    return StringCommand(*bits)


def original_make_unix_command_for_host() -> Callable[..., Any]:
    fn: Callable[..., Any] = _ORIGINALS.get("make_unix_command_for_host",
                                            _get("pyinfra.connectors.util", "make_unix_command_for_host"))
    return fn


def patch_askpass(make_command: Callable[..., Any], refusing: Callable[..., Any],
                  close: Callable[[Host], None]) -> bool:
    """Put gpufleet/controller/askpass.py's command building where pyinfra's connectors look it up, and its
    cleanup into Host.disconnect. On a release gpufleet has not verified: `refusing` instead,
    which lets commands without a password through and refuses the others (a safety: on any
    release, as far as the name is there). True when the askpass way is in place."""
    verified = available()
    if not hasattr(_module("pyinfra.connectors.util"), "make_unix_command_for_host"):
        _warn_once("askpass", "gpufleet: this pyinfra has no make_unix_command_for_host: gpufleet cannot keep "
                              "a sudo password off the host's command line; give the deploy user sudo without "
                              "a password, or log in as root")
        return False
    new = make_command if verified else refusing
    _replace("pyinfra.connectors.util", "make_unix_command_for_host", new, "make_unix_command_for_host")
    for path in _CONNECTOR_MODULES:
        try:
            module = _module(path)
        except ImportError:
            continue
        if hasattr(module, "make_unix_command_for_host"):
            _replace(path, "make_unix_command_for_host", new, f"{path}.make_unix_command_for_host")
    original_disconnect = Host.disconnect

    def disconnect(self: Host, *args: Any, **kwargs: Any) -> Any:
        close(self)  # never raises: a connection already gone took the holder with it
        return original_disconnect(self, *args, **kwargs)

    for name, wrapper in (("disconnect", disconnect),):
        setattr(Host, name, wrapper)
        _installed.append(f"pyinfra.api.host.Host.{name}")
    return verified


# -- patches (each one only through the gate) ----------------------------------------------

_ORIGINALS: dict[str, Any] = {}


def _replace(path: str, name: str, new: Any, key: str) -> None:
    module = _module(path)
    _ORIGINALS.setdefault(key, getattr(module, name))
    setattr(module, name, new)
    _installed.append(f"{path}.{name}")


def patch_planning(operation_order: Callable[[Any], list[int]],
                   global_arguments: Callable[[], list[tuple[str, type]]],
                   pop_arguments: Callable[..., Any]) -> bool:
    """Put gpufleet/controller/speedups.py's functions where pyinfra looks them up. pop_global_arguments
    is replaced where it is called (operations, facts, deploys), not in pyinfra.api.arguments,
    whose own is what the replacement calls."""
    if not usable():
        return False
    _ORIGINALS.setdefault("all_global_arguments", _get("pyinfra.api.arguments", "all_global_arguments"))
    _replace("pyinfra.api.operation", "get_operation_order_from_stack", operation_order, "order")
    _replace("pyinfra.api.arguments", "all_global_arguments", global_arguments, "all_global_arguments")
    _replace("pyinfra.api.facts", "all_global_arguments", global_arguments, "facts.all_global_arguments")
    for path in ("pyinfra.api.operation", "pyinfra.api.facts", "pyinfra.api.deploy"):
        _replace(path, "pop_global_arguments", pop_arguments, f"{path}.pop_global_arguments")
    return True


def fact_loader() -> Callable[..., Any]:
    """pyinfra.api.facts._get_fact as it is now (pyinfra's, or a wrapper installed earlier)."""
    fn: Callable[..., Any] = _get("pyinfra.api.facts", "_get_fact")
    return fn


def patch_fact_loading(get_fact: Callable[..., Any], run_shell_command: Callable[..., Any],
                       put_file: Callable[..., Any]) -> bool:
    """Put gpufleet/controller/factcache.py's fact loading in place of pyinfra.api.facts._get_fact, and
    its wrappers of Host.run_shell_command and Host.put_file (which forget the memo)."""
    if not usable():
        return False
    _replace("pyinfra.api.facts", "_get_fact", get_fact, "_get_fact")
    for name, new in (("run_shell_command", run_shell_command), ("put_file", put_file)):
        _ORIGINALS.setdefault(f"Host.{name}", getattr(Host, name))
        setattr(Host, name, new)
        _installed.append(f"pyinfra.api.host.Host.{name}")
    return True


def patch_for_locking(get_fact: Callable[..., Any], run_shell_command: Callable[..., Any],
                      put_file: Callable[..., Any], disconnect: Callable[..., Any]) -> None:
    """gpufleet/controller/hostlock.py's wrappers, which take a host's lock before its first change. Not
    a speed-up but a safety, so not behind the gate: on any release. Its wrappers only count
    and delegate (*args, **kwargs); the fact loader is wrapped only where pyinfra still has
    it (without it, a fact during execution takes the lock a little early: still one run at a
    time)."""
    for name, new in (("run_shell_command", run_shell_command), ("put_file", put_file),
                      ("disconnect", disconnect)):
        setattr(Host, name, new)
        _installed.append(f"pyinfra.api.host.Host.{name}")
    if hasattr(_module("pyinfra.api.facts"), "_get_fact"):
        _replace("pyinfra.api.facts", "_get_fact", get_fact, "lock._get_fact")


def patch_transfers(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """gpufleet/controller/staging.py's wrapper of Host.put_file and Host.get_file, whose
    `remote_temp_filename` (the third positional argument of pyinfra's connectors) names the
    file a sudo transfer stages through. Public methods, private behaviour: that pyinfra stages
    in the host's temp folder under a predictable name. A safety: on any release."""
    for name in ("put_file", "get_file"):
        setattr(Host, name, wrap(getattr(Host, name)))
        _installed.append(f"pyinfra.api.host.Host.{name}")


# -- pyinfra_cli: how the `pyinfra` command loads an inventory and a config file -------------
# No public API does this; gpufleet's tools must read an inventory exactly as the command
# line does (tests/unit/test_inventory_source.py compares them with `pyinfra ... debug-inventory`).

def make_inventory(path: str, cwd: str, override_data: dict[str, Any] | None) -> Any:
    from pyinfra_cli.inventory import make_inventory as cli_make_inventory

    return cli_make_inventory(path, cwd=cwd, override_data=override_data)


def exec_file(path: str) -> None:
    """Run a config or deploy file as the `pyinfra` command runs it (its error wrapping, its
    note of the file being run)."""
    from pyinfra_cli.util import exec_file as cli_exec_file

    cli_exec_file(path)


def cli_params(argv: list[str]) -> dict[str, Any]:
    """The `pyinfra` command line's parameters for `argv`, parsed by pyinfra's own command."""
    from pyinfra_cli.cli import cli

    params: dict[str, Any] = cli.make_context("pyinfra", argv, resilient_parsing=True).params
    return params


def cli_value_options() -> frozenset[str]:
    """The `pyinfra` command's options that take a value (`--limit PATTERN`, `--data KEY=VALUE`,
    ...), from pyinfra's own click command: what follows them is not a positional argument."""
    import click
    from pyinfra_cli.cli import cli

    return frozenset(name for param in cli.params if isinstance(param, click.Option) and not param.is_flag
                     for name in (*param.opts, *param.secondary_opts))
