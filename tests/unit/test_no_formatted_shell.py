"""No shell text is built by string formatting (GUIDE: "Shell text is never built with f-strings
or `%`"): a value pasted into shell text can break out of its quotes. This walks the code that
builds remote commands and fails on any f-string, `%`-format or `.format()` whose result reaches
the shell unquoted:

- yielded by an @operation (pyinfra runs a yielded string or StringCommand as shell);
- returned by a fact's command() / requires_command();
- an argument of StringCommand(...), of run_shell_command(...), or a `commands=` argument;
- returned by a function whose result reaches one of those (followed across the modules
  walked), or held in a variable that does.

Inside QuoteString(...) or shlex.quote(...) a formatted value is one quoted word: allowed. So are
f-strings anywhere else (operation names, log and failure messages, file contents).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
WALKED = ("operations", "deploys", "facts", "gpufleet")

#: calls whose result is quoted (one shell word) or is not shell text at all
_OPAQUE = {"QuoteString", "quote", "FunctionCommand", "len", "int", "float", "bool", "repr", "sha256",
           "sha1", "hexdigest", "dumps", "noop", "log", "log_styled"}


def _formatted(node: ast.AST) -> bool:
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return isinstance(node.left, (ast.JoinedStr, ast.Constant)) and isinstance(
            getattr(node.left, "value", None) if isinstance(node.left, ast.Constant) else "", str)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
    return False


def _callee(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return ""


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    functions: dict[str, ast.AST] = field(default_factory=dict)   # top-level and class methods
    imports: dict[str, str] = field(default_factory=dict)         # local name -> dotted target
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)


class Checker:
    def __init__(self, sources: dict[str, tuple[str, str]]):
        """sources: module name -> (path shown in messages, source text)."""
        self.modules: dict[str, Module] = {}
        for name, (path, text) in sources.items():
            mod = Module(name, path, ast.parse(text))
            for node in ast.walk(mod.tree):
                for child in ast.iter_child_nodes(node):
                    mod.parents[child] = node
            for node in mod.tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    mod.functions[node.name] = node
                elif isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            mod.functions.setdefault(f"{node.name}.{item.name}", item)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    for alias in node.names:
                        mod.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        mod.imports[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0])
            self.modules[name] = mod
        self.problems: list[str] = []
        self._seen: set[int] = set()

    # --- where shell text goes --------------------------------------------------------------

    def run(self) -> list[str]:
        for mod in self.modules.values():
            for node in ast.walk(mod.tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    is_op = any(_decorator_name(d) == "operation" for d in node.decorator_list)
                    is_command = node.name in ("command", "requires_command") and isinstance(
                        mod.parents.get(node), ast.ClassDef)
                    for inner in _own_nodes(node):
                        if is_op and isinstance(inner, ast.Yield) and inner.value is not None:
                            self.sink(mod, inner.value, node, "yielded by an operation")
                        if is_command and isinstance(inner, ast.Return) and inner.value is not None:
                            self.sink(mod, inner.value, node, "returned by a fact's command()")
                if isinstance(node, ast.Call):
                    name = _callee(node)
                    scope = _enclosing_function(mod, node)
                    if name == "StringCommand":
                        for prev, arg in zip([None, *node.args], node.args):
                            if isinstance(prev, ast.Constant) and prev.value == "-c" and isinstance(arg, ast.Call) \
                                    and _callee(arg) in ("QuoteString", "quote") and arg.args:
                                arg = arg.args[0]  # sh -c WORD: the quoted word is itself a script
                            self.sink(mod, arg, scope, "given to StringCommand")
                    elif name == "run_shell_command" and node.args:
                        self.sink(mod, node.args[0], scope, "given to run_shell_command")
                    for kw in node.keywords:
                        if kw.arg == "commands":
                            self.sink(mod, kw.value, scope, "given as commands=")
        return sorted(set(self.problems))

    def sink(self, mod: Module, expr: ast.AST, scope: ast.AST | None, why: str) -> None:
        key = id(expr)
        if key in self._seen:
            return
        self._seen.add(key)
        if _formatted(expr):
            self.problems.append(f"{mod.path}:{expr.lineno}: formatted string {why}: {ast.unparse(expr)[:90]}")
            return
        if isinstance(expr, ast.Call):
            name = _callee(expr)
            if name in _OPAQUE:
                return
            if name == "StringCommand":
                return  # its arguments are sinks of their own
            target = self.resolve(mod, expr.func)
            if target is None:  # unknown function: whatever it is given may come back
                for arg in [*expr.args, *(kw.value for kw in expr.keywords)]:
                    self.sink(mod, arg, scope, why)
                if isinstance(expr.func, ast.Attribute):
                    self.sink(mod, expr.func.value, scope, why)  # "sep".join(...), x.strip()
                return
            tmod, fn = target
            returned = set()
            for inner in _own_nodes(fn):
                if isinstance(inner, ast.Return) and inner.value is not None:
                    self.sink(tmod, inner.value, fn, f"{why} (returned by {fn.name}())")
                    returned |= {n.id for n in ast.walk(inner.value) if isinstance(n, ast.Name)}
            # a known function: its own text is checked above; of what it is given, only what
            # its returns name (a parameter handed back into the command)
            params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
            if params and params[0] in ("self", "cls") and isinstance(expr.func, ast.Attribute):
                params = params[1:]
            for param, arg in zip(params, expr.args):
                if param in returned:
                    self.sink(mod, arg, scope, why)
            for kw in expr.keywords:
                if kw.arg in returned:
                    self.sink(mod, kw.value, scope, why)
            return
        if isinstance(expr, ast.Attribute):
            return  # a field of some object: not followed
        if isinstance(expr, ast.Name):
            for value in self.assignments(mod, scope, expr.id):
                self.sink(mod, value, scope, f"{why} (through {expr.id})")
            return
        if isinstance(expr, (ast.Lambda, ast.FunctionDef)):
            return
        if isinstance(expr, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            self.sink(mod, expr.elt, scope, why)
            return
        if isinstance(expr, ast.Compare):
            return
        for child in ast.iter_child_nodes(expr):
            if isinstance(child, ast.expr):
                self.sink(mod, child, scope, why)

    # --- following names and calls ----------------------------------------------------------

    def assignments(self, mod: Module, scope: ast.AST | None, name: str) -> list[ast.AST]:
        values = []
        for where in ([scope] if scope is not None else []) + [mod.tree]:
            nodes = _own_nodes(where) if where is not mod.tree else mod.tree.body
            for node in nodes:
                if isinstance(node, ast.Assign) and any(_binds(t, name) for t in node.targets):
                    values.append(node.value)
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None \
                        and _binds(node.target, name):
                    values.append(node.value)
                elif isinstance(node, ast.For) and _binds(node.target, name):
                    values.append(node.iter)
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("append", "extend", "insert") \
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == name:
                    values.extend(node.args)  # steps.append(...): what the list will hold
            if values:
                break
        return values

    def resolve(self, mod: Module, func: ast.AST) -> tuple[Module, ast.AST] | None:
        if isinstance(func, ast.Name):
            if func.id in mod.functions:
                return mod, mod.functions[func.id]
            target = mod.imports.get(func.id)
            if target:
                owner, _, fname = target.rpartition(".")
                if owner in self.modules and fname in self.modules[owner].functions:
                    return self.modules[owner], self.modules[owner].functions[fname]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = mod.imports.get(func.value.id)
            if target in self.modules and func.attr in self.modules[target].functions:
                return self.modules[target], self.modules[target].functions[func.attr]
        if isinstance(func, ast.Attribute):
            # obj.method(): a method of that name defined once in this module (self.x(), or an
            # object of a class of this module, e.g. script.text())
            methods = [qual for qual in mod.functions if "." in qual and qual.split(".", 1)[1] == func.attr]
            if len(methods) == 1:
                return mod, mod.functions[methods[0]]
        return None


def _decorator_name(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _own_nodes(fn: ast.AST):
    """The nodes of a function, not of the functions or classes defined inside it."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _enclosing_function(mod: Module, node: ast.AST) -> ast.AST | None:
    while node in mod.parents:
        node = mod.parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node
    return None


def _binds(target: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target))


def check_sources(sources: dict[str, str]) -> list[str]:
    """Problems in {module name: source}; module names double as paths in messages."""
    return Checker({name: (name, text) for name, text in sources.items()}).run()


def project_sources() -> dict[str, tuple[str, str]]:
    sources = {}
    for top in WALKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT)
            name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            sources[name] = (str(rel), path.read_text())
    return sources


# --- the check ---------------------------------------------------------------------------------


def test_no_shell_text_is_built_by_formatting():
    problems = Checker(project_sources()).run()
    assert not problems, "shell text built by string formatting:\n" + "\n".join(problems)


# --- the checker can fail ----------------------------------------------------------------------

BAD = {
    "yield f-string": '''
from pyinfra.api import operation
@operation()
def op(url):
    yield f"curl -fsS '{url}' | gpg --dearmor"
''',
    "yield %": '''
@operation()
def op(path):
    yield "rm -f %s" % path
''',
    "yield .format": '''
@operation
def op(path):
    yield "rm -f {}".format(path)
''',
    "variable": '''
@operation()
def op(path):
    cmd = "test -e " + f"{path}"
    yield cmd
''',
    "StringCommand": '''
@operation()
def op(path):
    yield StringCommand("sh", "-c", f"echo {path}")
''',
    "fact command": '''
class Thing(FactBase):
    def command(self, name):
        return f"systemctl show {name}"
''',
    "helper": '''
def script(url):
    return "set -e; " + f"curl {url}"
@operation()
def op(url):
    yield StringCommand(script(url))
''',
    "helper in another module": {
        "lib": '''
def script(url):
    return "curl '%s'" % url
''',
        "ops": '''
from lib import script
@operation()
def op(url):
    yield script(url)
''',
    },
    "run_shell_command": '''
def check(state, host, path):
    return host.run_shell_command(f"test -e {path}")
''',
    "commands=": '''
server.shell(name="x", commands=[f"echo {value}"])
''',
    "through a parameter": '''
def wrap(body):
    return "set -e; " + body
@operation()
def op(path):
    yield wrap(f"rm {path}")
''',
    "method of an object": '''
class Script:
    def text(self):
        return "".join(f"echo {t}; " for t in self.parts)
def run(host):
    script = Script()
    host.run_shell_command(script.text())
''',
    "list built up": '''
@operation()
def op(packages):
    steps = ["set -e"]
    for p in packages:
        steps.append(f"apt-get install {p}")
    yield StringCommand("sh", "-c", QuoteString("; ".join(steps)))
    yield "; ".join(steps)
''',
    "sh -c quoted script": '''
@operation()
def op(url):
    yield StringCommand("sh", "-c", QuoteString(f"curl {url} | sh"))
''',
    "join": '''
@operation()
def op(names):
    yield " ".join(["apt-get", "install", f"{names[0]}"])
''',
}

GOOD = '''
from pyinfra.api import QuoteString, StringCommand, operation, FunctionCommand
import shlex
SCRIPT = 'set -e; echo "$1"'

def _fail(state, host, message):
    return False

@operation(is_idempotent=False)
def op(url, path):
    host.noop(f"{path} is already there")
    name = f"the file {path}"
    yield StringCommand("sh", "-c", QuoteString(SCRIPT), "gpufleet-x", QuoteString(f"{url}/key.gpg"))
    yield "rm -f " + shlex.quote(f"{path}.old")
    yield FunctionCommand(_fail, (f"cannot fetch {url}",), {})
    yield from files.put._inner(src=f"{path}", dest=f"{path}.new")

class Thing(FactBase):
    def command(self, name):
        return StringCommand("systemctl", "show", QuoteString(name))

    def process(self, output):
        return f"{output[0]} seen"
'''


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_checker_finds_formatted_shell(case):
    source = BAD[case]
    sources = source if isinstance(source, dict) else {"snippet": source}
    assert check_sources(sources), f"{case}: not found"


def test_the_checker_leaves_names_messages_and_quoted_words_alone():
    assert check_sources({"snippet": GOOD}) == []
