"""The trusted side of a test run: holds the tests, calls the sandboxed solution through proxies, decides the verdict.

Started by `runner` as `python -I -S -B -c <stub> <this folder>`, with the job on stdin; stdlib only. The solution never
executes in this process: each of its top-level names is a `Remote` here, a call crosses to the sandbox as plain
data and its result comes back as plain data (`wire`), rebuilt from trusted types, so every comparison the tests make
runs on this interpreter's own values. A result that is not plain data comes back as a `Remote` too, which may be
called or have attributes read, but has no truth value and cannot be compared: a rigged `__eq__` never runs here.

Which names the tests see (`scope`): builtins (`exit` and `quit` included) and the standard modules of `STANDARD` are
the judge's own; `test_setup`'s definitions are the tests' own, except what it only declares; every other top-level
name of the solution is the solution's. A standard module's name that the solution binds too is the judge's module
wherever the tests read an attribute of it (`math.isclose`), the solution's only where the tests merely call or pass
it: a name both sides could mean goes against the solution.
"""

from __future__ import annotations

import builtins
import ctypes
import importlib
import os
import sys

try:
    from . import wire
except ImportError:  # run as a script from its folder (see the module docstring)
    import wire

_NOT_MAPPED = (StopIteration, StopAsyncIteration, GeneratorExit)
REPLY_BUDGET = 3 * 64 * 2**20  # address space the judge may grow by while it reads and rebuilds one reply (3 × 64 MiB)


class RemoteError(Exception):
    """An exception raised in the sandbox that has no builtin counterpart, or a broken exchange with it."""


class Remote:
    """An object that lives in the sandboxed solution's process."""

    __slots__ = ("_conn", "_id")

    def __init__(self, conn: Connection, id_: int) -> None:
        object.__setattr__(self, "_conn", conn)
        object.__setattr__(self, "_id", id_)

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._conn.request({"op": "call", "target": self._id}, args, kwargs)

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._conn.request({"op": "get", "target": self._id, "attr": attr})

    def __bool__(self) -> bool:
        raise TypeError("a sandboxed object has no truth value: only plain data can be judged")

    def __eq__(self, other: object) -> bool:
        raise TypeError("a sandboxed object cannot be compared: only plain data can be judged")

    __ne__ = __eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<sandboxed object #{self._id}>"


class _Budget:
    """While a reply is read and rebuilt, the address space may grow by `REPLY_BUDGET` at most (RLIMIT_AS, lowered
    for that time): a reply that would take more is refused, whatever its bytes are made of."""

    def __enter__(self) -> None:
        self.old = None
        try:
            import resource

            with open("/proc/self/statm", "rb") as f:
                used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            old = resource.getrlimit(resource.RLIMIT_AS)
            soft = used + REPLY_BUDGET
            if old[1] != resource.RLIM_INFINITY:
                soft = min(soft, old[1])
            if old[0] == resource.RLIM_INFINITY or soft < old[0]:
                resource.setrlimit(resource.RLIMIT_AS, (soft, old[1]))
                self.old = old
        except (ImportError, OSError, ValueError):  # no such limit here: the message bounds stand alone
            pass

    def __exit__(self, kind: type | None, error: BaseException | None, tb: object) -> None:
        if self.old is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, self.old)
        if kind is not None and issubclass(kind, MemoryError):
            raise RemoteError(f"the solution sent a value that takes over {REPLY_BUDGET >> 20} MiB to rebuild")


class Connection:
    def __init__(self, calls: int, replies: int) -> None:
        self.calls = calls
        self.reader = wire.Reader(replies, max_items=wire.MAX_ITEMS)
        self.scope: dict = {}  # the tests' globals
        self.class_names: list[str] = []  # the classes the setup and the tests define

    @property
    def classes(self) -> dict[str, type]:
        """The trusted classes whose instances cross by their fields: of `class_names`, those the tests' globals bind
        to a class now (not a TestCase: the tests' own checks stay here)."""
        unittest = sys.modules.get("unittest")
        found = {}
        for name in self.class_names:
            cls = self.scope.get(name)
            if isinstance(cls, type) and not (unittest is not None and issubclass(cls, unittest.TestCase)):
                found[name] = cls
        return found

    def send(self, message: dict) -> None:
        try:
            wire.send(self.calls, message)
        except OSError:
            raise RemoteError("the solution's process ended") from None

    def receive(self) -> dict:
        try:
            message = self.reader.receive()
        except wire.NotPlain as err:
            raise RemoteError(f"the solution sent {err}") from None
        if message is None:
            raise RemoteError("the solution's process ended")
        return message

    def value(self, tree: object) -> object:
        if type(tree) is list and tree[:1] == ["I"]:  # an iterator: its first items, then the rest on demand
            return self.items(*self.chunk(tree))
        try:
            value = wire.decode(tree, self.classes)
        except wire.NotPlain as err:
            raise RemoteError(f"the solution sent {err}") from None
        return Remote(self, value.id) if type(value) is wire.Handle else value

    def chunk(self, tree: list) -> tuple[list, object]:
        """An iterator's items so far, and what follows them: None (the end), a handle's id, or its exception."""
        if len(tree) != 3 or type(tree[2]) is not list:
            raise RemoteError("the solution sent a malformed iterator")
        items, more = self.value(tree[1]), tree[2]
        if type(items) is not list:
            raise RemoteError("the solution sent a malformed iterator")
        if more == ["n"]:
            return items, None
        if len(more) == 2 and more[0] == "h" and type(more[1]) is int:
            return items, more[1]
        if len(more) == 3 and more[0] == "X":
            return items, self.error(more[1:])
        raise RemoteError("the solution sent a malformed iterator")

    def items(self, items: list, more: object) -> object:
        while True:
            yield from items
            if more is None:
                return
            if isinstance(more, BaseException):
                raise more
            with _Budget():
                self.send({"op": "more", "target": more})
                reply = self.receive()
                if type(reply.get("ok")) is not list or reply["ok"][:1] != ["I"]:
                    self.answer(reply)
                    raise RemoteError("the solution sent a malformed iterator")
                items, more = self.chunk(reply["ok"])

    def argument(self, value: object) -> list:
        if type(value) is Remote and value._conn is self:
            return ["h", value._id]
        try:
            return wire.encode(value, self.classes)
        except wire.NotPlain as err:
            raise TypeError(f"only plain data can be passed to the solution: {err}") from None

    def request(self, message: dict, args: tuple = (), kwargs: dict | None = None) -> object:
        if message["op"] == "call":
            message["args"] = [self.argument(a) for a in args]
            message["kwargs"] = {k: self.argument(v) for k, v in (kwargs or {}).items()}
        with _Budget():
            self.send(message)
            return self.answer(self.receive())

    def answer(self, reply: dict) -> object:
        if "ok" in reply:
            return self.value(reply["ok"])
        raise self.error(reply.get("raise"))

    @staticmethod
    def error(raised: object) -> BaseException:
        """The judge's own exception for one raised in the sandbox: a builtin one by its name, else RemoteError."""
        if not (type(raised) is list and len(raised) == 2 and all(type(x) is str for x in raised)):
            return RemoteError("the solution sent a malformed reply")
        name, text = raised
        cls = getattr(builtins, name, None) if name.isidentifier() else None
        if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _NOT_MAPPED):
            try:
                return cls(text)
            except TypeError:  # one whose constructor wants more than a message
                pass
        return RemoteError(f"{name}: {text}")


# Modules the solution imported that the tests may use without importing them (MBPP's tests call `math.isclose`
# on the strength of the solution's `import math`): the judge imports its own copy, and only of these.
MODULES = frozenset({
    "bisect", "cmath", "collections", "copy", "datetime", "decimal", "fractions", "functools", "heapq", "itertools",
    "math", "operator", "random", "re", "statistics", "string", "typing",
})  # fmt: skip
# Names the tests may use without importing, and the judge's module each means whatever the solution binds.
STANDARD = {name: name for name in MODULES | {"array", "json", "sys", "types", "unittest"}} | {
    "np": "numpy",
    "numpy": "numpy",
}


def namespace(conn: Connection, names: object, modules: object = None) -> dict:
    """The solution's side of the tests' globals: its top-level names, except any that would shadow a builtin, and
    the judge's own copy of the `MODULES` it imported."""
    if type(names) is not dict or type(modules or {}) is not dict:
        raise RemoteError("the solution sent malformed names")
    scope: dict = {"__name__": "__main__"}
    for name, tree in names.items():
        if name.isidentifier() and not name.startswith("__") and not hasattr(builtins, name):
            scope[name] = conn.value(tree)
    for name, module in (modules or {}).items():
        if module in MODULES and name.isidentifier() and not hasattr(builtins, name) and name not in scope:
            scope[name] = importlib.import_module(module)
    return scope


def uses(sources: list[str]) -> tuple[set[str], set[str]]:
    """The names `sources` read, and those among them whose attributes they read (`math` of `math.pi`)."""
    import ast  # only a run with tests to read pays for it

    read, bases = set(), set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                read.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                bases.add(node.value.id)
    return read, bases


def lend_modules(scope: dict, sources: list[str], solution: set[str]) -> set[str]:
    """Bind in `scope` the judge's own module for each name of `STANDARD` that `sources` read: always where they
    read an attribute of it, else where the solution does not bind that name. Returns the names it decided for the
    judge; one whose module cannot be imported here (numpy) is left unbound, never the solution's."""
    read, bases = uses(sources)
    lent = set()
    for name in read & STANDARD.keys():
        if name in bases or name not in solution:
            lent.add(name)
            try:
                scope[name] = importlib.import_module(STANDARD[name])
            except ImportError:
                scope.pop(name, None)
    return lent


def _declared(node: object) -> bool:
    """A function whose body is nothing but a docstring, `...`, `pass` and imports, or a class of only such
    functions and those statements: declared, for someone else to define."""
    import ast

    inert = (ast.Pass, ast.Import, ast.ImportFrom)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body, allowed = node.body, inert
    elif isinstance(node, ast.ClassDef):
        body, allowed = node.body, (*inert, ast.FunctionDef, ast.AsyncFunctionDef)
        if any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _declared(s) for s in body):
            return False
    else:
        return False
    return all(isinstance(s, allowed) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in body)


def declared_only(setup: str) -> set[str]:
    """Top-level functions and classes of `setup` that are only declared (HumanEval's prompt declares the entry point
    with a docstring, /115 with an `import math`; LeetCode's, `class Solution:` with a stub): the solution's to
    define."""
    import ast

    return {node.name for node in ast.parse(setup).body if _declared(node)}


def setup_classes(setup: str) -> tuple[list[str], list[str]]:
    """The classes `setup` defines (not only declares), whose instances cross by their fields (`ListNode`), and the
    source the sandbox runs before the solution so that it has them too: those classes and the setup's imports."""
    import ast

    names, parts = [], []
    for node in ast.parse(setup).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            parts.append(ast.unparse(node))
        elif isinstance(node, ast.ClassDef) and not _declared(node):
            names.append(node.name)
            parts.append(ast.unparse(node))
    return names, parts


def class_names(tests: str) -> list[str]:
    """The classes the tests define at their top level: their instances cross by their fields too."""
    import ast

    return [node.name for node in ast.parse(tests).body if isinstance(node, ast.ClassDef)]


def run_setup(setup: str, scope: dict) -> tuple[set[str], set[str]]:
    """Run the trusted `setup` in the tests' globals: (the names it bound, those it only declared)."""
    before = dict(scope)
    exec(compile(setup, "setup.py", "exec", dont_inherit=True), scope)  # noqa: S102 - trusted, like the tests
    bound = {k for k, v in scope.items() if k not in before or before[k] is not v}
    return bound, declared_only(setup)


def scope_for(conn: Connection, hello: dict, tests: str, setup: str | None) -> dict:
    """The tests' globals, as the module docstring states them."""
    names, modules = hello.get("names"), hello.get("modules")
    if type(names) is not dict:
        raise RemoteError("the solution sent malformed names")
    module = type(sys)("__main__")  # unittest.main() finds the tests' TestCases in sys.modules["__main__"]
    sys.modules["__main__"] = module
    scope = module.__dict__
    lent = lend_modules(scope, [tests, setup or ""], set(names))
    bound, declared = run_setup(setup, scope) if setup else (set(), set())
    conn.scope = scope
    with _Budget():
        solution = namespace(conn, names, modules)
    for name, value in solution.items():
        if name not in lent and (name not in bound or name in declared) and name != "__name__":
            scope[name] = value
    for name in declared - solution.keys():
        scope.pop(name, None)
    return scope


def run_test_cases(scope: dict) -> bool | None:
    """Run the `unittest.TestCase`s the tests defined but did not run themselves: whether all passed (None: none)."""
    unittest = sys.modules.get("unittest")
    if unittest is None:
        return None
    cases = [v for v in scope.values() if isinstance(v, type) and issubclass(v, unittest.TestCase)]
    if not any(c.__module__ == "__main__" for c in cases):
        return None
    suite = unittest.TestLoader().loadTestsFromModule(sys.modules["__main__"])
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=1).run(suite)
    return result.wasSuccessful() and result.testsRun > 0


def judge(tests: str, conn: Connection, setup: str | None = None) -> tuple[bool, str]:
    """Run `setup`, then `tests`, against the solution: (passed, what failed)."""
    try:
        names, source = setup_classes(setup) if setup else ([], [])
        conn.class_names = names + [n for n in class_names(tests) if n not in names]
        conn.send({"op": "prelude", "source": source, "classes": conn.class_names})
        with _Budget():
            hello = conn.receive()
        if "error" in hello:
            return False, f"the solution raised while loading:\n{str(hello['error'])[-2000:]}"
        scope = scope_for(conn, hello, tests, setup)
        sys.argv[:] = ["tests.py"]
        exec(compile(tests, "tests.py", "exec", dont_inherit=True), scope)  # noqa: S102 - the trusted tests, in the judge
        if run_test_cases(scope) is False:
            return False, "the tests' TestCases failed"
    except SystemExit as exc:  # the tests' own exit (unittest.main()'s too): their status decides
        return exc.code in (None, 0), f"the tests exited with {exc.code!r}"
    except BaseException:  # noqa: BLE001 - whatever ends the tests early fails them
        import traceback  # only failing tests pay for it

        return False, traceback.format_exc(limit=-4)[-4000:]
    return True, ""


class _Quitter:
    """`exit` and `quit` as the site module makes them (the judge starts without it)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code: object = None) -> None:
        raise SystemExit(code)


def main() -> None:
    sys.path.pop(0)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no process of our uid may trace or open us
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # numpy's, should the tests use it
        os.environ.setdefault(name, "1")
    builtins.exit, builtins.quit = _Quitter("exit"), _Quitter("quit")
    job = wire.loads(sys.stdin.buffer.read())
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)
    calls, replies, verdict = job["fds"]
    sys.path += [p for p in job["path"] if p not in sys.path]
    passed, error = judge(job["tests"], Connection(calls, replies), job.get("setup"))
    wire.send(verdict, {"nonce": job["nonce"], "passed": passed, "error": error})
    os._exit(0)  # no atexit hooks or threads the tests may have left


if __name__ == "__main__":
    main()
