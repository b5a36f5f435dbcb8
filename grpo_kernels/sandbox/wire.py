"""Plain data across the sandbox boundary: the only values a judge accepts from the code it judges.

A value crosses as a tagged JSON tree, rebuilt on the far side from the builtin types alone, so nothing of the sender's
objects (a rigged `__eq__`, an `int` subclass, a lazy `__repr__`) survives the trip. Plain data is `None`, `bool`,
`int`, `float` (nan and inf included), `str`, `bytes` and `list`, `tuple`, `dict`, `set`, `frozenset` of plain data,
nested at most `MAX_DEPTH` deep. Anything else is sent as a handle: an opaque number naming an object that stays in
the sandbox. This module is stdlib-only: the sandboxed launcher and the judge import it as a top-level module.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # `typing` costs the launcher and the judge milliseconds at each start: annotations only
if TYPE_CHECKING:
    from typing import Any

MAX_DEPTH = 64
MAX_MESSAGE = 16 * 2**20  # bytes of one message: a larger one is refused, not buffered


class NotPlain(TypeError):
    """The value is not plain data (or a handle where handles are not allowed)."""


class Callable_:
    """Marks a callable the sandbox offers by name: a function, a class or a bound method."""

    __slots__ = ()


CALLABLE = Callable_()


class Handle:
    """An object that stays in the sandbox, named by a number; compares equal to nothing but itself."""

    __slots__ = ("id",)

    def __init__(self, id_: int) -> None:
        self.id = id_

    def __repr__(self) -> str:
        return f"<sandboxed object #{self.id}>"


_SCALARS = {type(None): "n", bool: "b", int: "i", float: "f", str: "s", bytes: "y"}
_CONTAINERS = {list: "l", tuple: "t", set: "S", frozenset: "F"}


def encode(value: Any, depth: int = 0) -> list:
    """The tagged tree of a plain value; `NotPlain` for anything else (exact types only: no subclasses)."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    kind = type(value)
    if value is CALLABLE:
        return ["c"]
    if kind is Handle:
        return ["h", value.id]
    tag = _SCALARS.get(kind)
    if tag is not None:
        if kind is int:
            try:
                return [tag, str(value)]
            except ValueError:  # over the interpreter's limit on int digits
                raise NotPlain("an int too long to print") from None
        if kind is float:
            return [tag, repr(value)]
        if kind is bytes:
            return [tag, value.hex()]
        return [tag] if kind is type(None) else [tag, value]
    tag = _CONTAINERS.get(kind)
    if tag is not None:
        return [tag, [encode(v, depth + 1) for v in value]]
    if kind is dict:
        return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise NotPlain(f"{kind.__name__} is not plain data")


def decode(tree: Any, depth: int = 0) -> Any:
    """The value a tagged tree describes, built from builtin types only; `NotPlain` for a malformed tree."""
    if depth > MAX_DEPTH or type(tree) is not list or not tree or type(tree[0]) is not str:
        raise NotPlain("malformed value")
    tag, rest = tree[0], tree[1:]
    try:
        if tag == "n" and not rest:
            return None
        if tag == "c" and not rest:
            return CALLABLE
        (arg,) = rest
        if tag == "b" and type(arg) is bool:
            return arg
        if tag == "i" and type(arg) is str and len(arg) <= 4301:
            return int(arg)
        if tag == "f" and type(arg) is str and len(arg) < 64:
            return float(arg)
        if tag == "s" and type(arg) is str:
            return arg
        if tag == "y" and type(arg) is str:
            return bytes.fromhex(arg)
        if tag == "h" and type(arg) is int:
            return Handle(arg)
        if tag in ("l", "t", "S", "F") and type(arg) is list:
            items = [decode(v, depth + 1) for v in arg]
            return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
        if tag == "d" and type(arg) is list:
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in _pairs(arg)}
    except (ValueError, TypeError, OverflowError) as err:  # a wrong arity, unhashable key, bad number or hex
        raise NotPlain(f"malformed value: {err}") from None
    raise NotPlain(f"malformed value (tag {tag!r})")


def _pairs(items: list) -> list:
    if not all(type(p) is list and len(p) == 2 for p in items):
        raise NotPlain("malformed dict")
    return items


# ----------------------------------------------------------------------------------------------------------------
# JSON text, as `json.dumps(value, separators=(",", ":"))` and `json.loads` write and read it


class _Decoding:
    """What `_json`'s scanner reads from a `json.JSONDecoder`: strict, with no hooks, and no NaN or Infinity."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name: str) -> None:
        raise ValueError(f"{name} is not plain JSON")


def _refuse(value: object) -> None:
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


try:  # CPython's JSON accelerator, without the `json` package: that imports `re` and `enum`, a third of the start
    import _json  # of the launcher and of the judge (each sample starts both)

    _scan = _json.make_scanner(_Decoding())
    _encode = _json.make_encoder({}, _refuse, _json.encode_basestring_ascii, None, ":", ",", False, False, True)
except (ImportError, AttributeError, TypeError):  # another interpreter, or another signature: the json package
    _scan = _encode = None


def dumps(value: object) -> str:
    if _encode is None:
        import json

        return json.dumps(value, separators=(",", ":"))
    return "".join(_encode(value, 0))


def loads(text: str | bytes) -> Any:
    """The value of JSON `text`; ValueError if it is not exactly one JSON value (RecursionError if too deep)."""
    if _scan is None:
        import json

        return json.loads(text)
    text = (text.decode() if isinstance(text, bytes) else text).strip(" \t\n\r")
    try:
        value, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("extra data after a JSON value")
    return value


def send(fd: int, message: dict) -> None:
    """Write one message (a JSON object on one line) to `fd`."""
    data = dumps(message).encode() + b"\n"
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Reader:
    """Reads newline-framed JSON messages from a file descriptor, refusing any over `MAX_MESSAGE` bytes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray()

    def receive(self) -> dict | None:
        """The next message, or None at end of file; `NotPlain` when it is too long or not a JSON object."""
        end = self.buffer.find(b"\n")
        while end < 0:
            if len(self.buffer) > MAX_MESSAGE:
                raise NotPlain(f"a message over {MAX_MESSAGE} bytes")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            newline = chunk.find(b"\n")
            end = -1 if newline < 0 else len(self.buffer) + newline
            self.buffer += chunk
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        try:
            message = loads(line)
        except (ValueError, RecursionError) as err:
            raise NotPlain(f"malformed message: {err}") from None
        if type(message) is not dict:
            raise NotPlain("malformed message")
        return message
