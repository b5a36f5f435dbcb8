"""Plain data across the sandbox boundary: the only values a judge accepts from the code it judges.

A value crosses as a tagged JSON tree, rebuilt on the far side from trusted types alone, so nothing of the sender's
objects (a rigged `__eq__`, an `int` subclass, a lazy `__repr__`) survives the trip. Plain data is `None`, `bool`,
`int` (any size), `float` (nan and inf included), `complex`, `str`, `bytes`, `list`, `tuple`, `dict`, `set`,
`frozenset`, `range`, the dict views, `Fraction`, `Decimal`, `Counter`, `OrderedDict`, `defaultdict` (its factory
when it is a builtin type), namedtuples (rebuilt as a namedtuple of the same name and fields), numpy arrays and scalars
of numbers, strings and times (rebuilt by the receiver's own numpy), and instances of the classes the receiver names
(`classes`: rebuilt as the receiver's class from their fields, cycles and long chains included), nested at most
`MAX_DEPTH` deep. Anything else is sent as a handle: an opaque number naming an object that stays in the sandbox.
Long lists of ints, floats or strings are packed (a 10**6-element list crosses in milliseconds). This module is
stdlib-only: the sandboxed launcher and the judge import it as a top-level module.
"""

from __future__ import annotations

import builtins
import os
import sys
from array import array
from binascii import a2b_base64, b2a_base64

TYPE_CHECKING = False  # `typing` costs the launcher and the judge milliseconds at each start: annotations only
if TYPE_CHECKING:
    from typing import Any

MAX_DEPTH = 64
MAX_MESSAGE = 64 * 2**20 + 2**16  # bytes of one message (64 MiB of payload and its framing): a larger one is refused
MAX_ITEMS = 2**21  # JSON arrays and objects in one message, counted before it is parsed: a larger count is refused
PACKED = 8  # the shortest list of ints, floats or strings sent packed
_BIG_INT_BITS = 4000  # ints longer than this cross in hex, which has no limit on its digits


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


_CONTAINERS = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_BUILT = {"l": list, "t": tuple, "S": set, "F": frozenset}
_VIEWS = {type({}.keys()): "K", type({}.values()): "V", type({}.items()): "E"}
_FACTORIES = ("int", "float", "complex", "str", "bytes", "bool", "list", "tuple", "dict", "set", "frozenset")
_NUMPY_KINDS = "biufcUSmM"  # bool, ints, floats, complex, strings, times: never objects or raw records


def _b64(data: bytes) -> str:
    return b2a_base64(data, newline=False).decode("ascii")


def encode(value: Any, classes: dict | None = None) -> list:
    """The tagged tree of a plain value; `NotPlain` for anything else. `classes`: name -> class (or a tuple of
    classes) whose instances cross by their fields."""
    enc = _Encoder(classes or {})
    root = enc.value(value, 0)
    if not enc.objects:
        return root
    table, done = [], 0
    while done < len(enc.objects):  # fields may reach more objects: a worklist, not recursion (long chains)
        obj = enc.objects[done]
        table.append([type(obj).__name__, {k: enc.value(v, 1) for k, v in _fields(obj).items()}])
        done += 1
    return ["G", root, table]


def _fields(obj: object) -> dict:
    fields = {k: v for k, v in getattr(obj, "__dict__", {}).items() if not k.startswith("__")}
    for name in _slots(type(obj)):
        if name not in fields and hasattr(obj, name):
            fields[name] = getattr(obj, name)
    return fields


_SLOTS: dict[type, tuple[str, ...]] = {}


def _slots(kind: type) -> tuple[str, ...]:
    """The slot names of a class and its bases (once per class: a chain of 10**5 nodes asks 10**5 times)."""
    if kind not in _SLOTS:
        names = [n for c in kind.__mro__ for n in getattr(c, "__slots__", ()) if not n.startswith("__")]
        _SLOTS[kind] = tuple(dict.fromkeys(names))
    return _SLOTS[kind]


class _Encoder:
    def __init__(self, classes: dict) -> None:
        self.classes = classes
        self.objects: list = []
        self.index: dict[int, int] = {}

    def value(self, value: Any, depth: int) -> list:
        if depth > MAX_DEPTH:
            raise NotPlain(f"nested deeper than {MAX_DEPTH}")
        kind, deeper = type(value), depth + 1
        if value is CALLABLE:
            return ["c"]
        if kind is Handle:
            return ["h", value.id]
        if value is None:
            return ["n"]
        if kind is bool:
            return ["b", value]
        if kind is int:
            return ["i", str(value)] if value.bit_length() <= _BIG_INT_BITS else ["x", hex(value)]
        if kind is float:
            return ["f", repr(value)]
        if kind is str:
            return ["s", value]
        if kind is bytes:
            return ["y", _b64(value)]
        allowed = self.classes.get(kind.__name__) if self.classes else None
        if allowed is not None and (kind is allowed or (type(allowed) is tuple and kind in allowed)):
            if id(value) not in self.index:
                self.index[id(value)] = len(self.objects)
                self.objects.append(value)
            return ["o", self.index[id(value)]]
        if kind is list:
            packed = _packed(value)
            if packed is not None:
                return packed
        tag = _CONTAINERS.get(kind)
        if tag is not None:
            return [tag, [self.value(v, deeper) for v in value]]
        if kind is dict:
            return ["d", self.pairs(value, deeper)]
        if kind is complex:
            return ["j", repr(value.real), repr(value.imag)]
        if kind is range:
            return ["r", *(self.value(n, deeper) for n in (value.start, value.stop, value.step))]
        tag = _VIEWS.get(kind)
        if tag is not None:
            return [tag, self.value(list(value), deeper)]
        module = getattr(kind, "__module__", "")
        if module == "fractions" and kind.__name__ == "Fraction":
            return ["Q", self.value(value.numerator, deeper), self.value(value.denominator, deeper)]
        if module in ("decimal", "_decimal", "_pydecimal") and kind.__name__ == "Decimal":
            return ["M", str(value)]
        if module == "collections" and kind.__name__ in ("Counter", "OrderedDict", "defaultdict"):
            return self.collection(value, kind.__name__, deeper)
        if module == "numpy":
            return _numpy(value, kind)
        if issubclass(kind, tuple) and type(getattr(kind, "_fields", None)) is tuple:  # a namedtuple
            fields = [str(f) for f in kind._fields]
            return ["N", kind.__name__, fields, [self.value(v, deeper) for v in tuple.__iter__(value)]]
        raise NotPlain(f"{kind.__name__} is not plain data")

    def pairs(self, value: dict, depth: int) -> list:
        return [[self.value(k, depth), self.value(v, depth)] for k, v in value.items()]

    def collection(self, value: Any, name: str, depth: int) -> list:
        if name == "defaultdict":  # its factory crosses when it is a builtin type, else it is left out
            factory = getattr(value.default_factory, "__name__", None)
            builtin = factory in _FACTORIES and value.default_factory is getattr(builtins, factory)
            return ["D", factory if builtin else None, self.pairs(value, depth)]
        return ["C" if name == "Counter" else "O", self.pairs(value, depth)]


def _packed(value: list) -> list | None:
    """A long list of exact ints within 64 bits, of exact floats, or of exact strs, packed; else None."""
    if len(value) < PACKED:
        return None
    kinds = set(map(type, value))
    if kinds == {str}:
        return ["ls", value]
    if kinds == {int}:
        try:
            return ["q", _b64(array("q", value).tobytes())]
        except OverflowError:
            return None
    if kinds == {float}:
        return ["e", _b64(array("d", value).tobytes())]
    return None


def _numpy(value: Any, kind: type) -> list:
    np = sys.modules["numpy"]
    if kind is np.ndarray:
        array_ = value
    elif isinstance(value, np.generic):
        array_ = np.asarray(value)
    else:
        raise NotPlain(f"numpy.{kind.__name__} is not plain data")
    if array_.dtype.kind not in _NUMPY_KINDS:
        raise NotPlain(f"a numpy {array_.dtype} array is not plain data")
    tag = "A" if kind is np.ndarray else "a"
    return [tag, array_.dtype.str, list(array_.shape), _b64(np.ascontiguousarray(array_).tobytes())]


def decode(tree: Any, classes: dict | None = None) -> Any:
    """The value a tagged tree describes, built from trusted types only; `NotPlain` for a malformed tree.
    `classes`: name -> the class that instances of that name are rebuilt as (others are refused)."""
    try:
        if type(tree) is list and len(tree) == 3 and tree[0] == "G":
            return _Decoder(classes or {}, tree[2]).graph(tree[1])
        return _Decoder(classes or {}, []).value(tree, 0)
    except (ValueError, TypeError, OverflowError, AttributeError, ArithmeticError) as err:
        if isinstance(err, NotPlain):
            raise
        raise NotPlain(f"malformed value: {err}") from None  # a wrong arity, unhashable key, bad number or base64


class _Decoder:
    def __init__(self, classes: dict, table: Any) -> None:
        if type(table) is not list:
            raise NotPlain("malformed object table")
        self.classes = classes
        self.table = table
        self.objects: list = []

    def graph(self, root: Any) -> Any:
        """Make every object of the table first (empty), then fill their fields: cycles and long chains are fine."""
        for entry in self.table:
            if not (type(entry) is list and len(entry) == 2 and type(entry[0]) is str and type(entry[1]) is dict):
                raise NotPlain("malformed object table")
            cls = self.classes.get(entry[0])
            if not isinstance(cls, type):
                raise NotPlain(f"an instance of {entry[0][:80]!r}, a class this side does not rebuild")
            self.objects.append(cls.__new__(cls))
        for obj, (_, fields) in zip(self.objects, self.table):
            for name, tree in fields.items():
                if not name.isidentifier() or name.startswith("__"):
                    raise NotPlain(f"malformed field {name[:80]!r}")
                object.__setattr__(obj, name, self.value(tree, 1))
        return self.value(root, 0)

    def value(self, tree: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or type(tree) is not list or not tree or type(tree[0]) is not str:
            raise NotPlain("malformed value")
        tag, rest, deeper = tree[0], tree[1:], depth + 1
        if tag == "n" and not rest:
            return None
        if tag == "c" and not rest:
            return CALLABLE
        if tag == "r" and len(rest) == 3:
            return range(*(self.whole(t, deeper) for t in rest))
        if tag == "j" and len(rest) == 2:
            return complex(self.real(rest[0]), self.real(rest[1]))
        if tag == "Q" and len(rest) == 2:
            from fractions import Fraction

            return Fraction(self.whole(rest[0], deeper), self.whole(rest[1], deeper))
        if tag == "N" and len(rest) == 3:
            return self.namedtuple(*rest, deeper)
        if tag == "D" and len(rest) == 2:
            return self.defaultdict(*rest, deeper)
        if tag in ("A", "a") and len(rest) == 3:
            return _numpy_value(tag, *rest)
        (arg,) = rest
        if tag == "b" and type(arg) is bool:
            return arg
        if tag == "i" and type(arg) is str and len(arg) <= 4301:
            return int(arg)
        if tag == "x" and type(arg) is str and arg.lstrip("-")[:2] == "0x":
            return int(arg, 16)
        if tag == "f":
            return self.real(arg)
        if tag == "s" and type(arg) is str:
            return arg
        if tag == "y" and type(arg) is str:
            return a2b_base64(arg)
        if tag == "h" and type(arg) is int:
            return Handle(arg)
        if tag == "o" and type(arg) is int and 0 <= arg < len(self.objects):
            return self.objects[arg]
        if tag in _BUILT and type(arg) is list:
            return _BUILT[tag]([self.value(v, deeper) for v in arg])
        if tag == "ls" and type(arg) is list and all(type(s) is str for s in arg):
            return arg
        if tag in ("q", "e") and type(arg) is str:
            return array("q" if tag == "q" else "d", a2b_base64(arg)).tolist()
        if tag in ("d", "C", "O"):
            pairs = self.pairs(arg, deeper)
            if tag == "d":
                return dict(pairs)
            import collections

            return collections.Counter(dict(pairs)) if tag == "C" else collections.OrderedDict(pairs)
        if tag in ("K", "V", "E"):
            items = self.value(arg, deeper)
            if type(items) is not list:
                raise NotPlain("malformed dict view")
            if tag == "K":
                return dict.fromkeys(items).keys()
            return dict(enumerate(items)).values() if tag == "V" else dict(items).items()
        if tag == "M" and type(arg) is str and len(arg) < 10_000:
            from decimal import Decimal

            return Decimal(arg)
        raise NotPlain(f"malformed value (tag {tag[:20]!r})")

    def whole(self, tree: Any, depth: int) -> int:
        value = self.value(tree, depth)
        if type(value) is not int:
            raise NotPlain("malformed value: an int expected")
        return value

    @staticmethod
    def real(text: Any) -> float:
        if type(text) is not str or len(text) >= 64:
            raise NotPlain("malformed float")
        return float(text)

    def pairs(self, items: Any, depth: int) -> list:
        if type(items) is not list or not all(type(p) is list and len(p) == 2 for p in items):
            raise NotPlain("malformed dict")
        return [(self.value(k, depth), self.value(v, depth)) for k, v in items]

    def namedtuple(self, name: Any, fields: Any, items: Any, depth: int) -> tuple:
        if type(name) is not str or type(fields) is not list or not all(type(f) is str for f in fields):
            raise NotPlain("malformed namedtuple")
        if type(items) is not list or len(items) != len(fields):
            raise NotPlain("malformed namedtuple")
        cls = self.classes.get(name)
        if not (isinstance(cls, type) and issubclass(cls, tuple) and list(getattr(cls, "_fields", ())) == fields):
            cls = _namedtuple_class(name, tuple(fields))
        return cls(*(self.value(v, depth) for v in items))

    def defaultdict(self, factory: Any, items: Any, depth: int) -> dict:
        import collections

        if factory is not None and factory not in _FACTORIES:
            raise NotPlain("malformed defaultdict")
        made = collections.defaultdict(None if factory is None else getattr(builtins, factory))
        made.update(self.pairs(items, depth))
        return made


_NAMEDTUPLES: dict = {}


def _namedtuple_class(name: str, fields: tuple) -> type:
    """The namedtuple class of that name and fields, made once (namedtuple checks they are identifiers)."""
    if (name, fields) not in _NAMEDTUPLES:
        if len(_NAMEDTUPLES) > 1000 or len(fields) > 1000:
            raise NotPlain("too many kinds of namedtuple")
        import collections

        _NAMEDTUPLES[name, fields] = collections.namedtuple(name, fields)
    return _NAMEDTUPLES[name, fields]


def _numpy_value(tag: str, dtype: Any, shape: Any, data: Any) -> Any:
    """A numpy array (or scalar) of this side's own numpy, from its dtype, shape and bytes."""
    if type(dtype) is not str or type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
        raise NotPlain("malformed numpy value")
    if type(data) is not str or len(dtype) > 32 or len(shape) > 32:
        raise NotPlain("malformed numpy value")
    try:
        import numpy as np
    except ImportError:
        raise NotPlain("a numpy value, and numpy cannot be imported here") from None
    kind = np.dtype(dtype)
    if kind.kind not in _NUMPY_KINDS or kind.hasobject:
        raise NotPlain(f"a numpy {kind} value is not plain data")
    value = np.frombuffer(a2b_base64(data), dtype=kind).reshape(shape).copy()
    if tag == "a":
        if value.shape != ():
            raise NotPlain("malformed numpy scalar")
        return value[()]
    return value


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
    """Write one message (a JSON object on one line) to `fd`, in one write where it fits the pipe (a forked child of
    the solution may hold the same pipe: a short message and its newline never interleave with another's)."""
    chunks = [dumps(message)] if _encode is None else _encode(message, 0)
    data = "".join([*chunks, "\n"]).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Reader:
    """Reads newline-framed JSON messages from a file descriptor, refusing before it parses one any over `max_bytes`
    or, where `max_items` is given (the judge's `MAX_ITEMS`), with more JSON arrays and objects than that (brackets
    inside strings count too: it errs on the side of refusing), so that what parsing one costs is bounded."""

    def __init__(self, fd: int, max_bytes: int = MAX_MESSAGE, max_items: int | None = None) -> None:
        self.fd = fd
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.buffer = bytearray()

    def arrays(self, end: int) -> int:
        """An upper bound on the JSON arrays and objects of the buffer's first `end` bytes."""
        return self.buffer.count(b"[", 0, end) + self.buffer.count(b"{", 0, end)

    def receive(self) -> dict | None:
        """The next message, or None at end of file; `NotPlain` when it is too long or not a JSON object."""
        end = self.buffer.find(b"\n")
        while end < 0:
            if len(self.buffer) > self.max_bytes:
                self.buffer = bytearray()
                raise NotPlain(f"a message over {self.max_bytes} bytes")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            newline = chunk.find(b"\n")
            end = -1 if newline < 0 else len(self.buffer) + newline
            self.buffer += chunk
        if end > self.max_bytes:
            self.buffer = self.buffer[end + 1 :]
            raise NotPlain(f"a message over {self.max_bytes} bytes")
        try:
            if self.max_items is not None and self.arrays(end) > self.max_items:
                raise NotPlain(f"a message of over {self.max_items} arrays and objects")
            with memoryview(self.buffer) as view:
                text = str(view[:end], "utf-8")
        except UnicodeDecodeError as err:
            raise NotPlain(f"malformed message: {err}") from None
        finally:
            self.buffer = self.buffer[end + 1 :]  # a copy of what follows: the message's own bytes are freed
        try:
            message = loads(text)
        except (ValueError, RecursionError) as err:
            raise NotPlain(f"malformed message: {err}") from None
        if type(message) is not dict:
            raise NotPlain("malformed message")
        return message
