"""The trusted side of a test run: holds the tests, calls the sandboxed solution through proxies, decides the verdict.

Started by `runner` as `python -I -S -B -c <stub> <this folder>`, with the job on stdin; stdlib only. The solution never
executes in this process: each of its top-level names is a `Remote` here, a call crosses to the sandbox as plain
data and its result comes back as plain data (`wire`), so every comparison the tests make runs on this
interpreter's own builtin values. A result that is not plain data comes back as a `Remote` too, which may be called
or have attributes read, but has no truth value and cannot be compared: a rigged `__eq__` never runs here.
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


class Connection:
    def __init__(self, calls: int, replies: int) -> None:
        self.calls = calls
        self.reader = wire.Reader(replies)

    def receive(self) -> dict:
        try:
            message = self.reader.receive()
        except wire.NotPlain as err:
            raise RemoteError(f"the solution sent {err}") from None
        if message is None:
            raise RemoteError("the solution's process ended")
        return message

    def value(self, tree: object) -> object:
        try:
            value = wire.decode(tree)
        except wire.NotPlain as err:
            raise RemoteError(f"the solution sent {err}") from None
        return Remote(self, value.id) if type(value) is wire.Handle else value

    def argument(self, value: object) -> list:
        if type(value) is Remote and value._conn is self:
            return ["h", value._id]
        try:
            return wire.encode(value)
        except wire.NotPlain as err:
            raise TypeError(f"only plain data can be passed to the solution: {err}") from None

    def request(self, message: dict, args: tuple = (), kwargs: dict | None = None) -> object:
        if message["op"] == "call":
            message["args"] = [self.argument(a) for a in args]
            message["kwargs"] = {k: self.argument(v) for k, v in (kwargs or {}).items()}
        try:
            wire.send(self.calls, message)
        except OSError:
            raise RemoteError("the solution's process ended") from None
        reply = self.receive()
        if "ok" in reply:
            return self.value(reply["ok"])
        raised = reply.get("raise")
        if not (type(raised) is list and len(raised) == 2 and all(type(x) is str for x in raised)):
            raise RemoteError("the solution sent a malformed reply")
        name, text = raised
        cls = getattr(builtins, name, None) if name.isidentifier() else None
        if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, _NOT_MAPPED):
            try:
                error = cls(text)
            except TypeError:  # one whose constructor wants more than a message
                error = RemoteError(f"{name}: {text}")
            raise error
        raise RemoteError(f"{name}: {text}")


# Modules the solution imported that the tests may use without importing them (MBPP's tests call `math.isclose`
# on the strength of the solution's `import math`): the judge imports its own copy, and only of these.
MODULES = frozenset({
    "bisect", "cmath", "collections", "copy", "datetime", "decimal", "fractions", "functools", "heapq", "itertools",
    "math", "operator", "random", "re", "statistics", "string", "typing",
})  # fmt: skip


def namespace(conn: Connection, names: object, modules: object = None) -> dict:
    """The tests' globals: the solution's top-level names, except any that would shadow a builtin, and the judge's
    own copy of the `MODULES` it imported."""
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


def declared_only(setup: str) -> set[str]:
    """Top-level functions of `setup` that are only declared: a body of nothing but a docstring, `...`, `pass` and
    imports (HumanEval's prompt declares the entry point so, /115 with an `import math`): the solution's to define."""
    import ast  # only a run with a setup pays for it

    inert = (ast.Pass, ast.Import, ast.ImportFrom)
    names = set()
    for node in ast.parse(setup).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and all(
            isinstance(stmt, inert) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
            for stmt in node.body
        ):
            names.add(node.name)
    return names


def run_setup(setup: str, scope: dict) -> None:
    """Run the trusted `setup` in the tests' globals: what it defines shadows the solution's names for the tests
    (the solution's own calls, in the sandbox, still reach its own code), except what it only declares."""
    solution = dict(scope)
    exec(compile(setup, "setup.py", "exec"), scope)  # noqa: S102 - trusted, like the tests
    for name in declared_only(setup):
        if name in solution:
            scope[name] = solution[name]
        else:
            scope.pop(name, None)


def judge(tests: str, conn: Connection, setup: str | None = None) -> tuple[bool, str]:
    """Run `setup`, then `tests`, against the solution: (passed, what failed)."""
    try:
        hello = conn.receive()
        if "error" in hello:
            return False, f"the solution raised while loading:\n{str(hello['error'])[-2000:]}"
        scope = namespace(conn, hello.get("names"), hello.get("modules"))
        if setup:
            run_setup(setup, scope)
        exec(compile(tests, "tests.py", "exec"), scope)  # noqa: S102 - the trusted tests, in the judge
    except SystemExit as exc:  # the tests' own exit: their status decides
        return exc.code in (None, 0), f"the tests exited with {exc.code!r}"
    except BaseException:  # noqa: BLE001 - whatever ends the tests early fails them
        import traceback  # only failing tests pay for it

        return False, traceback.format_exc(limit=-4)[-4000:]
    return True, ""


def main() -> None:
    sys.path.pop(0)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no process of our uid may trace or open us
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
