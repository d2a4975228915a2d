"""Fewer round trips: answer a fact again from memory while nothing on the host has changed,
and ask the facts a host needed last time in one remote command.

pyinfra 3 runs a remote command for every fact an operation asks for, even when an earlier
operation asked the same question and nothing has run on the host since. On a re-run where
nothing changes that is almost all of the cost (measured: 124 commands and 8.7 s for one host,
see bench/fleet.py). Two mechanisms, both exact:

- memo: a fact asked again with the same arguments is answered from memory, as long as no
  command other than a fact has run on that host since (any operation command, file upload or
  reboot forgets everything the host's memo held, so a converging run reads fresh facts after
  each change);
- prefetch: the (fact, arguments) a host asked for in its previous run are recorded on the
  controller (.gpufleet/factplans/<host>.json); at the host's first fact of the next run they
  are all run in one remote script, each with the fact's own command and its own process(),
  and the answers seed the memo. An entry that fails, is missing its tool, or was never asked
  simply falls back to pyinfra's normal path, so a stale plan costs nothing but a little time.
  The plan holds fact names and plain arguments only, never executor arguments (a sudo or su
  password would be one): only facts asked with the host's default executor arguments are
  recorded, and the prefetch runs with those, taken from the inventory at run time. The file
  is 0600 in a 0700 directory, and since it names commands the hosts run, it is checked when
  read: a fact not on the allow-list (gpufleet's own facts, pyinfra's in PYINFRA_ARGUMENTS) or an
  argument not of a shape that fact's grammar lists is ignored with a warning and never run
  (under --dry too). The answers come back in sections framed by markers no fact output can
  forge (Script), checked strictly: anything else drops every answer.
  pyinfra's many file and unit facts share one process per family (gpufleet/controller/factbatch.py), and
  the answers come back as one compressed line. A deploy run's prefetch leaves out the facts
  only the validation gate's end-of-run checks ask (`gpufleet_end_of_run`, the exporters'
  scrape): a re-run that changes nothing does not ask them, one that changes the host asks them
  fresh after its changes; the fleet report's prefetch keeps them (it asks them every time).

Installed by deploys/all.py (and the other entry points) with `install()`; deploys/all.py also
calls `prefetch_all()` first thing, so every host works on its answers while the controller
imports and plans.
"""
from __future__ import annotations

import base64
import copy
import json
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra import logger
from pyinfra.api import FactBase
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.host import Host

from gpufleet.facts._common import with_values
from gpufleet.controller import askpass
from gpufleet.controller import factbatch
from gpufleet.controller import controller_files
from gpufleet import pyinfra_private
from gpufleet.config.hostcontext import fleet_context, host_context
from gpufleet.controller.run_end import at_host_end

PLAN_DIR = Path(".gpufleet/factplans")
PLAN_FORMAT = 2
_OWN_FACT = re.compile(r"gpufleet\.facts\.[a-z][a-z0-9_]*\.[A-Z][A-Za-z0-9]*")
# A word: what paths, unit, user, group and package names are made of (no blank, quote, `$`,
# backtick, `;`, `|`, `&`, redirection, brace, backslash or control character), never starting
# with `-` (an option to the tool it is given to).
_WORD = re.compile(r"[A-Za-z0-9_.,:/@+=*~%^!?#\[\]][A-Za-z0-9_.,:/@+=*~%^!?#\[\]-]{0,1023}")
# FindInFile's pattern (files.line): a regular expression, which pyinfra quotes as one word
# unless interpolate_variables (then it is pasted into double quotes: never prefetched).
_REGEX_TEXT = re.compile(r"[A-Za-z0-9_.,:/@+=*~%^!?#\[\] ()|{}$\\-]{0,1024}")
_UNIT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@-]{0,255}")
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.:~-]{0,255}")


def _is_word(value: Any) -> bool:
    return isinstance(value, str) and _WORD.fullmatch(value) is not None


def _is_path(value: Any) -> bool:
    return _is_word(value) and value.startswith("/")


def _is_units(value: Any) -> bool:
    names = [value] if isinstance(value, str) else value
    return isinstance(names, list) and 0 < len(names) <= 256 and all(
        isinstance(n, str) and _UNIT.fullmatch(n) is not None for n in names)


def _is_pattern(value: Any) -> bool:
    return isinstance(value, str) and _REGEX_TEXT.fullmatch(value) is not None


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_false(value: Any) -> bool:
    return value is False


def _is_none(value: Any) -> bool:
    return value is None


def _is_package(value: Any) -> bool:
    return isinstance(value, str) and _PACKAGE.fullmatch(value) is not None


_FILE = {"path": _is_path}
_SYSTEMD = {"services": _is_units, "user_mode": _is_false, "machine": _is_none, "user_name": _is_none}
#: pyinfra's own facts the prefetch may ask, each with the arguments it may be asked with: the
#: ones gpufleet's operations and the pyinfra operations they call ask on a run of
#: deploys/all.py, in the shapes they ask them. pyinfra pastes some arguments into the command
#: unquoted (systemd's machine and user_name: `--machine={machine}`), so a plan entry is run
#: only when every argument it names is listed here for its fact and has the listed shape.
#: Nothing that runs a command it is given.
PYINFRA_ARGUMENTS: dict[str, dict[str, Any]] = {
    "pyinfra.facts.files.File": _FILE, "pyinfra.facts.files.Directory": _FILE, "pyinfra.facts.files.Link": _FILE,
    "pyinfra.facts.files.Sha1File": _FILE, "pyinfra.facts.files.Sha256File": _FILE,
    "pyinfra.facts.files.Md5File": _FILE, "pyinfra.facts.files.FileContents": _FILE,
    "pyinfra.facts.files.FindInFile": {"path": _is_path, "pattern": _is_pattern,
                                       "interpolate_variables": _is_false, "extended_regex": _is_bool},
    "pyinfra.facts.systemd.SystemdStatus": _SYSTEMD, "pyinfra.facts.systemd.SystemdEnabled": _SYSTEMD,
    "pyinfra.facts.deb.DebPackages": {}, "pyinfra.facts.deb.DebPackage": {"package": _is_package},
    "pyinfra.facts.deb.DebArch": {}, "pyinfra.facts.apt.AptSources": {}, "pyinfra.facts.server.Arch": {},
    "pyinfra.facts.server.Os": {}, "pyinfra.facts.server.Date": {},
}
PYINFRA_FACTS = frozenset(PYINFRA_ARGUMENTS)
# gpufleet's own facts quote or check every argument themselves; a plan entry may name only
# the parameters of the fact's command(), each of the type it declares.
_OWN_TYPES: dict[str, Any] = {
    "str": lambda v: v == "" or _is_word(v), "bool": _is_bool, "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "Sequence[str]": lambda v: _is_word(v) or (isinstance(v, list) and len(v) <= 256 and all(map(_is_word, v))),
}
_MARK = "::gpufleet-prefetch::"
_RC = "::gpufleet-rc::"
_PACKED = "::gpufleet-gzip-base64::"
_HOST_NONCE = re.compile(r"[0-9a-f]{32}")
# A line of fact output starting like a marker: whatever follows, a forgery (or a fact printing
# gpufleet's own output), never an answer.
_LOOKALIKE = ("::gpufleet-prefetch", "::gpufleet-rc", _PACKED)
#: The most a host's packed answers may inflate to (issue 27): far above what a host's facts
#: say; a host that sends more (a gzip bomb) has its facts asked pyinfra's way instead.
MAX_ANSWERS = 32 * 1024 * 1024
_PACK_CHECK = "command -v gzip >/dev/null 2>&1 && command -v base64 >/dev/null 2>&1"
_installed = False


def gunzip_capped(data: bytes, limit: int = MAX_ANSWERS) -> bytes:
    """gzip.decompress that stops at `limit` bytes: ValueError beyond it (host output)."""
    inflater = zlib.decompressobj(wbits=31)   # gzip framing
    out = inflater.decompress(data, limit)
    if inflater.unconsumed_tail or len(out) >= limit and inflater.decompress(b"", 1):
        raise ValueError(f"packed fact answers inflate beyond {limit} bytes")
    if not inflater.eof:
        raise EOFError("truncated packed fact answers")
    return out


def _fact_path(cls: type) -> str:
    # one string per class, shared by every host's memo keys and plan (not one per question)
    path = _PATHS.get(cls)
    if path is None:
        path = _PATHS[cls] = f"{cls.__module__}.{cls.__qualname__}"
    return path


_PATHS: dict[type, str] = {}


def _key(state: Any, host: Host, cls: type, args: Any, kwargs: Any) -> tuple[Any, ...] | None:
    """(fact class path, its arguments as JSON, its executor arguments as JSON), or None.

    pyinfra's own way there (_handle_fact_kwargs) walks every global argument through the host's
    data layers for every fact: the largest controller cost left on a no-op run (py-spy). Its
    two halves are remembered apart: the executor arguments depend only on the connector
    arguments looked up below (inventory data and config being fixed for the run), per host;
    the fact's own arguments only on the fact and what it was asked, for everyone."""
    kwargs = kwargs or {}
    connector = pyinfra_private.connector_argument_keys()
    try:
        context = json.dumps([{k: v for k, v in (source or {}).items() if k in connector} for source in (
            kwargs, host.current_deploy_kwargs, host.current_op_global_arguments,
            host.current_op_deploy_data or host.current_deploy_data, host.data.override_datas)],
            sort_keys=True)
        question = json.dumps([_fact_path(cls), list(args or []), kwargs], sort_keys=True)
    except (TypeError, ValueError):
        return _pyinfra_key(state, host, cls, args, kwargs)
    executors = host_context(host).executors
    if context in executors and question in _FACT_ARGUMENTS:
        return (_fact_path(cls), _FACT_ARGUMENTS[question], executors[context])
    key = _pyinfra_key(state, host, cls, args, kwargs)
    if key is not None:
        executors[context], _FACT_ARGUMENTS[question] = key[2], key[1]
    return key


_FACT_ARGUMENTS: dict[str, str] = {}


def _pyinfra_key(state: Any, host: Host, cls: type, args: Any, kwargs: Any) -> tuple[Any, ...] | None:
    fact_kwargs, global_kwargs = pyinfra_private.handle_fact_kwargs(state, host, cls, args, kwargs)
    fact_kwargs = {k: v for k, v in fact_kwargs.items() if k != "self"}  # getcallargs includes it
    executor = {k: v for k, v in global_kwargs.items() if k in pyinfra_private.connector_argument_keys()}
    try:
        # Only plain JSON arguments: the key must say exactly what was asked (a repr'd object
        # could stand for another value and hand one question another's answer).
        return (_fact_path(cls), json.dumps(fact_kwargs, sort_keys=True),
                json.dumps(executor, sort_keys=True))
    except (TypeError, ValueError):
        return None


def _memo(host: Host) -> dict[Any, Any]:
    return host_context(host).fact_memo


def forget(host: Host) -> None:
    """Something ran on the host: no remembered fact may be trusted any more."""
    memo = host_context(host).fact_memo
    if memo:
        memo.clear()


@contextmanager
def fresh(host: Host) -> Iterator[None]:
    """Facts asked inside are read from the host now, each with its own command, never
    answered from memory or from the prefetch (their answers then replace the remembered
    ones): for decisions a forged answer must never shape, such as the ports the firewall
    opens."""
    host_context(host).fresh += 1
    try:
        yield
    finally:
        host_context(host).fresh -= 1


def _plan_file(host: Host) -> Path:
    return PLAN_DIR / f"{re.sub(r'[^A-Za-z0-9._-]', '_', host.name)}.json"


def _record(host: Host, cls: type, fact_kwargs_json: str, executor_json: str) -> None:
    """Remember (fact, arguments) for the next run's prefetch: only when asked with the host's
    default executor arguments, which are never written (they may hold a password)."""
    if executor_json != host_context(host).default_executor_json:
        return  # sudo/su/env variants of one operation: pyinfra asks those itself
    if getattr(cls, "gpufleet_no_prefetch", False):
        return  # a probe (GPU load, importing torch): asked only when a run means to
    entry = (_fact_path(cls), fact_kwargs_json)
    ok = _ALLOWED.get(entry)
    if ok is None:
        ok = _ALLOWED[entry] = allowed(*entry)
    if ok:  # the others (a path with a quote in it) are asked the normal way, every run
        seen = host_context(host).plan_seen
        if not seen:
            at_host_end(host.state, _save_plan)  # written as the host disconnects at the run's end
        seen[entry] = None


_ALLOWED: dict[tuple[str, str], bool] = {}
#: the executor arguments that decide which user reads a file (the others cannot change a checksum)
_PRIVILEGE_KEYS = ("_sudo", "_sudo_user", "_su_user", "_doas", "_doas_user", "_dzdo", "_dzdo_user")


def _record_upload(host: Host, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A file uploaded in this run is compared by its SHA-1 in the next one (pyinfra's files.put
    and files.template ask Sha1File once the file exists; this run asked only File, which said
    it did not): put that question in the plan, so that the first re-run after a converge asks
    it with the others, not in a command of its own per file. Only for an upload made with the
    host's default privileges, as _record."""
    dest = args[1] if len(args) > 1 else kwargs.get("remote_filename")
    default = host_context(host).default_executor
    if not isinstance(dest, str) or default is None:
        return
    if any(kwargs.get(key) != default.get(key) for key in _PRIVILEGE_KEYS if kwargs.get(key) or default.get(key)):
        return
    from pyinfra.facts.files import Sha1File

    _record(host, Sha1File, json.dumps({"path": dest}, sort_keys=True), host_context(host).default_executor_json or "")


def _save_plan(host: Host) -> None:
    """The facts this host asked this run, for the next run's prefetch (a run that asked none leaves the last)."""
    plan = host_context(host).plan_seen
    if not plan:
        return
    try:
        controller_files.write(PLAN_DIR / f"{re.sub(r'[^A-Za-z0-9._-]', '_', host.name)}.json",
                               json.dumps({"format": PLAN_FORMAT, "facts": [list(entry) for entry in plan]}))
    except OSError:
        pass  # the plan is only a hint for the next run


def _own_arguments(path: str) -> dict[str, Any] | None:
    """{parameter: check} of a gpufleet fact's command(), from its signature (None: no such
    fact, or a parameter of a type no plan entry may give)."""
    if path not in _OWN_ARGUMENTS:
        import inspect

        cls = _load_class(path)
        grammar: dict[str, Any] | None = None
        if cls is not None:
            try:
                params = list(inspect.signature(cls.command).parameters.values())[1:]  # self
            except (TypeError, ValueError):
                params = []
            grammar = {}
            for param in params:
                annotation = param.annotation if isinstance(param.annotation, str) else getattr(
                    param.annotation, "__name__", "")
                check = _OWN_TYPES.get(annotation)
                if check is None or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
                    grammar = None
                    break
                grammar[param.name] = check
        _OWN_ARGUMENTS[path] = grammar
    return _OWN_ARGUMENTS[path]


_OWN_ARGUMENTS: dict[str, dict[str, Any] | None] = {}


def allowed(path: Any, fact_kwargs_json: Any) -> bool:
    """Whether a plan entry may be run: an allowed fact asked with arguments of the shapes its
    grammar lists (PYINFRA_ARGUMENTS; for gpufleet's own facts, their command()'s signature)."""
    if not isinstance(path, str) or not isinstance(fact_kwargs_json, str):
        return False
    if path in PYINFRA_ARGUMENTS:
        grammar: dict[str, Any] | None = PYINFRA_ARGUMENTS[path]
    elif _OWN_FACT.fullmatch(path):
        grammar = _own_arguments(path)
    else:
        return False
    try:
        kwargs = json.loads(fact_kwargs_json)
    except ValueError:
        return False
    if grammar is None or not isinstance(kwargs, dict):
        return False
    return all(isinstance(k, str) and k in grammar and grammar[k](v) for k, v in kwargs.items())


def read_plan(path: Path, name: str = "") -> list[tuple[str, str]]:
    """The (fact path, arguments JSON) entries of a plan file that may be run. Anything else is
    ignored with a warning: a file others can write, an old format (which held executor
    arguments; rewritten at the end of this run), an entry not on the allow-list."""
    try:
        doc = json.loads(controller_files.read(path))   # checked and read on one descriptor
    except controller_files.UnsafePath as exc:
        logger.warning(f"{name or path}: ignoring the fact plan: {exc}")
        return []
    except (OSError, ValueError):
        return []
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or not isinstance(doc.get("facts"), list):
        logger.warning(f"{name or path}: ignoring the fact plan {path}: not format {PLAN_FORMAT} (rewritten at the end of this run)")
        return []
    entries, refused = [], 0
    for entry in doc["facts"]:
        key = (entry[0], entry[1]) if isinstance(entry, list) and len(entry) == 2 else None
        if key is None or not isinstance(key[0], str) or not isinstance(key[1], str):
            refused += 1
            continue
        ok = _ALLOWED.get(key)
        if ok is None:  # every host's plan names the same entries: judged once per run
            ok = _ALLOWED[key] = allowed(*key)
        if ok:
            entries.append(key)
        else:
            refused += 1
    if refused:
        logger.warning(f"{name or path}: ignored {refused} entr{'y' if refused == 1 else 'ies'} of the fact plan {path}: "
                       "not a fact gpufleet asks, or not with arguments of the shapes it asks; they are not run")
    return entries


def _load_class(path: str) -> type[FactBase[Any]] | None:
    import importlib

    if path not in PYINFRA_FACTS and not _OWN_FACT.fullmatch(path):
        return None  # never import what the allow-list does not name
    module, _, name = path.rpartition(".")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    if not isinstance(obj, type) or not issubclass(obj, FactBase) or _fact_path(obj) != path:
        return None
    return obj


def _command_text(fact: Any, fact_kwargs: dict[str, Any]) -> str | None:
    """The exact shell text pyinfra would run for this fact (requires_command guard included).
    Some facts keep their arguments on the instance for process() (pyinfra's hash facts do):
    the same instance must then process the output."""
    command = pyinfra_private.make_command(fact.command, dict(fact_kwargs))
    requires = pyinfra_private.make_command(fact.requires_command, dict(fact_kwargs))
    if requires:
        command = StringCommand("if", "command", "-v", requires, ">/dev/null", "2>&1;", "then", "(",
                                command, ");", "else", "echo",
                                QuoteString(pyinfra_private.missing_command_marker()), ";", "fi")
    if isinstance(command, StringCommand):
        return command.get_raw_value()
    return command if isinstance(command, str) else None


def _plan_entries(state: Any, host: Host) -> list[tuple[Any, ...]]:
    """Last run's facts for `host` that can be prefetched: (class, arguments JSON, executor
    JSON, fact instance, shell text) each."""
    executor_json = _default_executor_json(state, host)
    plan_file = _plan_file(host)
    if not plan_file.exists():
        return []
    entries = []
    deploy_run = fleet_context(state).deploy_run
    for path, fact_kwargs_json in read_plan(plan_file, host.name):
        template = _entry_template(path, fact_kwargs_json)
        if template is None:
            continue
        cls, fact, text = template
        if deploy_run and getattr(cls, "gpufleet_end_of_run", False):
            continue  # its answer would never be used (see the module's docstring)
        # each host processes its answer with its own instance, holding what command() set
        entries.append((cls, fact_kwargs_json, executor_json, copy.copy(fact), text))
    return entries


#: (fact path, arguments JSON) -> (class, an instance whose command() ran, its shell text), or None
_TEMPLATES: dict[tuple[str, str], tuple[type[FactBase[Any]], Any, str] | None] = {}


def _entry_template(path: str, fact_kwargs_json: str) -> tuple[type[FactBase[Any]], Any, str] | None:
    """A plan entry's fact class, instance and shell text, worked out once per run for every
    host that asks it: the text depends only on the fact and its arguments, and building it
    (pyinfra's file facts quote through shlex) was the largest part of a prefetch's controller
    cost at hundreds of hosts (bench/controller.py). None: not prefetched."""
    key = (path, fact_kwargs_json)
    if key not in _TEMPLATES:
        found = None
        cls = _load_class(path)
        if cls is not None and not getattr(cls, "shell_executable", None) and not getattr(cls, "gpufleet_no_prefetch", False):
            fact = cls()
            try:
                text = _command_text(fact, json.loads(fact_kwargs_json))
            except Exception:  # a fact whose arguments changed shape: ask it the normal way
                text = None
            if text:
                found = (cls, fact, text)
        _TEMPLATES[key] = found
    return _TEMPLATES[key]


@dataclass
class Script:
    """One remote script asking many facts: section i of its output answers texts[i]; the
    single facts come first, then one section per batch family (gpufleet/controller/factbatch.py).

    Fact output can hold text another local user wrote (a file they own, a unit they named),
    so the sections are framed by markers no such text can carry: each holds a nonce drawn
    here (`secrets`) and one drawn on the host from /dev/urandom into a shell variable of the
    script, which is never on a command line (ps shows the controller's nonce to every local
    user while the script runs; the host's is not in any process's arguments or environment).
    A marker that repeats, comes out of order, or a line shaped like one that is not the
    expected marker, drops every answer: the facts are then asked the normal way, one command
    each, and the run says why (see answers())."""

    single: list[tuple[Any, ...]] = field(default_factory=list)
    batches: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)  # family -> [(entry, keys)]
    batch_keys: dict[str, list[str]] = field(default_factory=dict)  # family -> all its keys
    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    #: why answers() dropped every answer (None: it did not)
    refused: str | None = None

    def _texts(self) -> list[str]:
        return [text for *_, text in self.single] + [
            factbatch.command(name, keys) for name, keys in self.batch_keys.items()]

    def text(self) -> str:
        # Section i: its marker and number, the fact's own shell text, a newline (so that the
        # status marker starts a line even after output without a final newline; answers()
        # takes it off again), its exit status.
        body = "".join("echo \"$gf_m$gf_i\"; ( " + text + " ) 2>/dev/null; gf_s=$?; echo; echo \"$gf_r$gf_s\"; "
                       "gf_i=$((gf_i + 1))\n" for text in self._texts())
        # The answers come back as one gzip+base64 line where the host has both tools: a
        # thousand lines trickling out as the facts run cost the controller an SSH packet (and
        # its MAC) and a readline each, the largest controller cost of a no-op run (py-spy).
        return with_values("gf_h=$(od -An -N16 -tx8 /dev/urandom 2>/dev/null) && set -- $gf_h && gf_h=$1$2\n"
                           "gf_m=$gf_mark$gf_h::; gf_r=$gf_rc$gf_h::\n"
                           "o=$(\necho \"$gf_head$gf_h\"\n" + body + ")\n"
                           "if " + _PACK_CHECK + "; then echo \"$gf_packed\"; printf '%s\\n' \"$o\" | gzip -1c | base64 -w0; "
                           "echo; else printf '%s\\n' \"$o\"; fi",
                           gf_head=_MARK + self.nonce + "::host ", gf_mark=_MARK + self.nonce + "-",
                           gf_rc=_RC + self.nonce + "-", gf_packed=_PACKED, gf_i=0)

    def sections(self, lines: list[str]) -> list[tuple[list[str], int]] | None:
        """[(output lines, exit status)] per section, or None (and `refused` says why) unless
        the output is exactly: the header with the host's nonce, then every section in order,
        each its marker, its lines, its status."""
        head = _MARK + self.nonce + "::host "
        if not lines or not lines[0].startswith(head) or not _HOST_NONCE.fullmatch(lines[0][len(head):]):
            self.refused = "its output did not start with the script's header and the host's nonce"
            return None
        host_nonce = lines[0][len(head):]
        mark, rc = f"{_MARK}{self.nonce}-{host_nonce}::", f"{_RC}{self.nonce}-{host_nonce}::"
        found: list[tuple[list[str], int]] = []
        current: list[str] | None = None
        for line in lines[1:]:
            if line.startswith(mark):
                if current is not None or line != mark + str(len(found)):
                    self.refused = f"a section marker repeated or out of order (section {len(found)} expected)"
                    return None
                current = []
            elif line.startswith(rc):
                if current is None or not line[len(rc):].isdigit():
                    self.refused = f"a status marker outside its section (after section {len(found) - 1})"
                    return None
                if current and current[-1] == "":
                    current.pop()  # the newline the script adds before the status
                found.append((current, int(line[len(rc):])))
                current = None
            elif line.startswith(_LOOKALIKE):
                self.refused = (f"the output of section {len(found)} holds a line shaped like the prefetch's markers "
                                "(text a local user wrote, trying to forge other facts' answers?)")
                return None
            elif current is None:
                self.refused = f"output outside any section (after section {len(found) - 1})"
                return None
            else:
                current.append(line)
        if current is not None or len(found) != len(self._texts()):
            self.refused = f"{len(found)} of {len(self._texts())} sections came back"
            return None
        return found

    def answers(self, lines: list[str]) -> dict[tuple[Any, ...], Any]:
        """Memo key -> answer, for every fact the output answers (the rest: pyinfra's way);
        none when the output is not exactly what the script prints (see sections())."""
        if lines and lines[0] == _PACKED:
            try:
                lines = gunzip_capped(base64.b64decode("".join(lines[1:]))).decode("utf-8", "replace").splitlines()
            except (ValueError, OSError, EOFError, zlib.error):
                return {}
        framed = self.sections(lines)
        if framed is None:
            return {}
        found: dict[tuple[Any, ...], Any] = {}
        for (cls, fact_kwargs_json, executor_json, fact, _), (out, status) in zip(self.single, framed):
            if status != 0 or out == [pyinfra_private.missing_command_marker()]:
                continue
            try:
                found[(_fact_path(cls), fact_kwargs_json, executor_json)] = fact.process(out) if out else fact.default()
            except Exception:
                continue  # let pyinfra's own path report the problem
        for name, (out, status) in zip(self.batch_keys, framed[len(self.single):]):
            if status != 0:
                continue
            missing, outputs = factbatch.split(name, self.batch_keys[name], out)
            for (cls, fact_kwargs_json, executor_json, fact, _), keys in self.batches[name]:
                try:
                    known, data = factbatch.answer(fact, keys, missing, outputs)
                except Exception:
                    continue
                if known:
                    found[(_fact_path(cls), fact_kwargs_json, executor_json)] = data
        return found


def prefetch_script(entries: list[tuple[Any, ...]]) -> Script:
    """The script for `entries` (see _plan_entries): facts of one batch family share one
    stat / sha1sum / systemctl run, the others run one after another."""
    script = Script()
    for entry in entries:
        kwargs = json.loads(entry[1])
        name = factbatch.family(entry[0], kwargs)
        if name:
            script.batches.setdefault(name, []).append((entry, factbatch.keys(name, kwargs)))
        else:
            script.single.append(entry)
    script.batch_keys = {name: sorted({key for _, keys in script.batches[name] for key in keys})
                         for name in sorted(script.batches)}
    return script


def _prefetch(state: Any, host: Host) -> None:
    """Run last run's facts for `host` in one command and seed the memo with their answers."""
    host_context(host).prefetched = True
    entries = _plan_entries(state, host)
    if len(entries) < 2:
        return
    script = prefetch_script(entries)
    host_context(host).in_fact += 1
    try:
        # With the executor arguments pyinfra gives a fact (sudo and its password included):
        # the answers stand for facts asked with them.
        status, output = host.run_shell_command(StringCommand(script.text()), print_output=False,
                                                print_input=False, **(host_context(host).default_executor or {}))
    except Exception:
        return
    finally:
        host_context(host).in_fact -= 1
    if status:
        answers = script.answers(output.stdout_lines)
        if script.refused:
            logger.warning(f"{host.name}: every prefetched fact answer dropped, the facts are asked one by one: "
                           f"{script.refused}")
        _memo(host).update(answers)


def prefetch_all(state: Any) -> None:
    """Send every connected host its prefetch now, each in its own greenlet, so the hosts work
    on their answers while the controller is still importing and planning (the first host's
    planning would otherwise send the first one about a second into a run). A host's first
    fact waits for its answers. Call once, at the top of a deploy file, after install(): it
    marks the run as a deploy run (the gate's end-of-run facts are not prefetched)."""
    import gevent
    from pyinfra.context import ctx_host, ctx_state

    if "pyinfra.api.facts._get_fact" not in pyinfra_private.patched():
        return  # pyinfra's own fact path: nothing to prefetch with
    state = ctx_state.get() if ctx_state.isset() else state  # the object, not pyinfra's proxy
    if fleet_context(state).prefetch_all_sent:
        return
    fleet_context(state).prefetch_all_sent = True
    fleet_context(state).deploy_run = True

    def run(host: Host) -> None:
        with ctx_state.use(state), ctx_host.use(host):
            _prefetch(state, host)

    for host in state.inventory.get_active_hosts():
        if host.connected and pyinfra_private.connector_verified(host) and not host_context(host).prefetched:
            host_context(host).prefetched = True
            host_context(host).prefetch = gevent.spawn(run, host)
    gevent.sleep(0)  # let each greenlet send its command before the caller goes on


def _default_executor_json(state: Any, host: Host) -> str:
    """The executor arguments a fact gets when nothing around it sets any (inventory data and
    config), as the memo key spells them; worked out once per host, kept in memory only."""
    known = host_context(host).default_executor_json
    if known is None:
        host_context(host).default_executor = _default_executor(state, host)
        known = host_context(host).default_executor_json = json.dumps(host_context(host).default_executor, sort_keys=True)
    return known


def _default_executor(state: Any, host: Host) -> dict[str, Any]:
    try:
        known: dict[str, Any] = json.loads(json.dumps(pyinfra_private.fact_executor_arguments(state, host, _Probe),
                                                      sort_keys=True))
        return known
    except (TypeError, ValueError):
        return {}


class _Probe(FactBase[None]):
    def command(self) -> str:
        return "true"


def sweep_old_plans(plan_dir: Path | None = None) -> list[Path]:
    """Plans an older gpufleet wrote (0644, with executor arguments: a sudo password could be
    among them) are removed, not merely skipped, and their folders made 0700. Only our own
    files; one stat per plan. Returns what was removed."""
    import os
    import stat

    plan_dir = plan_dir or PLAN_DIR
    removed: list[Path] = []
    try:
        entries = list(plan_dir.iterdir())
    except OSError:
        return removed
    for folder in (plan_dir, plan_dir.parent):
        try:
            st = folder.stat()
            if folder.name in ("factplans", ".gpufleet") and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(folder, controller_files.DIR_MODE)
        except OSError:
            pass
    for path in entries:
        try:
            st = path.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
                path.unlink()
                removed.append(path)
        except OSError:
            pass
    if removed:
        logger.warning(f"gpufleet: removed {len(removed)} fact plan(s) an older version left readable by others "
                       f"in {plan_dir} (they could hold connection secrets); they are rebuilt on the next run")
    return removed


def install() -> None:
    """Put the memo and the prefetch in front of pyinfra's fact loading (once per process),
    with the planning speed-ups of gpufleet/controller/speedups.py."""
    global _installed
    if _installed:
        return
    _installed = True
    askpass.install()  # sudo's password through a private file on the host, never a command line
    sweep_old_plans()
    from gpufleet.controller import speedups

    speedups.install()
    if not pyinfra_private.usable():
        return  # pyinfra's own fact path: the same answers (pyinfra_private warned why, once)
    original_get_fact = pyinfra_private.fact_loader()
    original_run = Host.run_shell_command
    original_put = Host.put_file

    def _get_fact(state: Any, host: Host, cls: Any, args: Any = None, kwargs: Any = None, ensure_hosts: Any = None,
                  apply_failed_hosts: bool = True) -> Any:
        if not pyinfra_private.connector_verified(host):  # a host met after install(): pyinfra's path
            return original_get_fact(state, host, cls, args, kwargs, ensure_hosts, apply_failed_hosts)
        key = _key(state, host, cls, args, kwargs)
        if key is not None:
            started = host_context(host).prefetch
            if started is not None:
                started.join()  # prefetch_all() sent it earlier: wait for its answers
                host_context(host).prefetch = None
            elif not host_context(host).prefetched and host.connected:
                _prefetch(state, host)
            if host_context(host).default_executor_json is None:
                _default_executor_json(state, host)
            _record(host, cls, key[1], key[2])
            memo = _memo(host)
            if key in memo and not host_context(host).fresh:
                return memo[key]
        host_context(host).in_fact += 1
        try:
            data = original_get_fact(state, host, cls, args, kwargs, ensure_hosts, apply_failed_hosts)
        finally:
            host_context(host).in_fact -= 1
        if key is not None and host not in state.failed_hosts:
            _memo(host)[key] = data
        return data

    def run_shell_command(self: Host, *args: Any, **kwargs: Any) -> Any:
        if not host_context(self).in_fact:
            forget(self)
        return original_run(self, *args, **kwargs)

    def put_file(self: Host, *args: Any, **kwargs: Any) -> Any:
        forget(self)
        _record_upload(self, args, kwargs)
        return original_put(self, *args, **kwargs)

    pyinfra_private.patch_fact_loading(_get_fact, run_shell_command, put_file)
