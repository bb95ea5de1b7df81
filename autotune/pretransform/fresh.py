"""Fingerprints of what a cache froze, so a cache never outlives it (NOTE [ Fresh caches ]).

# NOTE [ Fresh caches ]
# A cache freezes code run once: the dataset's own ``__getitem__`` (the raw read, or the whole sample)
# and the transform steps it applied (Resize, Normalize, a user's step). Its samples stay right only
# while every input of that code stays as it was, so the inputs are fingerprinted when the cache is
# built, and again whenever a loader is made (``prepare``) and at every epoch start
# (``Prepared.stale_reason``); on a change the cache is rebuilt, with a StaleCacheWarning naming it.
# 1. Each frozen step's attributes (its ``vars``: Resize's size, a user step's epoch counter).
# 2. The dataset's length and instance attributes, all of them, not only those its code names (one
#    read through ``getattr`` or a helper object counts too; one never read costs a rebuild, never a
#    stale sample). Left out: ``transform``, whose frozen steps are item 1 and whose random rest is
#    not frozen, and the attributes the dataset's own code assigns or changes in place (a read
#    counter, a memo dict, a file handle opened on first use): that is its bookkeeping, and the proof
#    showed its samples do not change read after read.
# 3. The class attributes of the dataset and of each user step, along the MRO (functions and other
#    descriptors aside), and the module globals their code looks up (``LOAD_GLOBAL``: an attribute
#    of the same name, ``h.digest()``, is no read of a global ``digest``) in ``__getitem__`` or
#    ``__call__``/``forward`` and their nested code, followed FOLLOW_DEPTH calls into the methods and
#    global functions named there. A global module or class stands for the attributes the code names
#    on it (``cfg.SCALE``); a function for its code, closure, defaults and the globals it names.
#    Code and classes of LIBRARIES (torch, torchvision, ...) are taken as fixed.
# 4. The raw data's files (size and modification time, STAT_FILES at most), a table's fingerprint.
#    The files are those the dataset lists (an ImageFolder's ``samples``, a list of paths among its
#    attributes). The probes' reads record every file they open (``opened_files``, from Python's
#    ``open`` audit events): a dataset whose samples read a file it does not list (a path made from
#    the index) is not cached, since a file rewritten between epochs could not be seen.
# ``Snapshot`` makes a value comparable: numbers, strings and small tensors or arrays by value; large
# ones by identity, shape, dtype, in-place version (tensors) and SAMPLE_ITEMS evenly spread elements;
# containers item by item (LIST_ITEMS at most); other objects by their attributes, MAX_DEPTH deep.
# An object whose state it cannot see (a file handle, an RNG, a C extension's object) cannot be
# fingerprinted cheaply: frozen code that names one is not cached (the prefix stops before that
# step, or the dataset is refused, with the reason). A check reads attributes, a few thousand
# elements and one ``stat`` per file; never a sample.
# Not seen: a write inside a large array between the sampled elements, a file rewritten with the
# same size and modification time, code reached only through computed names or deeper than
# FOLLOW_DEPTH, and state deeper than MAX_DEPTH or inside an object compared by identity.
"""

from __future__ import annotations

import collections
import dis
import enum
import functools
import io
import logging
import os
import reprlib
import sys
import threading
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import ConcatDataset

SMALL_VALUE_BYTES = 1 << 16
"""Tensors and arrays up to this size are compared by value; larger ones by identity and a sample."""

VALUE_BYTES = 8 << 20
"""Bytes one snapshot compares by value at most; further small tensors and arrays count as large."""

SAMPLE_ITEMS = 1024
"""Elements of a large tensor or array compared by value, evenly spread: writes in place show there."""

STAT_FILES = 20_000
"""Up to this many files are stat'ed for a fingerprint (about 20 ms); beyond, an even sample of them."""

LIST_ITEMS = 100_000
"""Containers up to this long are compared item by item; longer ones by identity, length and a sample."""

MAX_DEPTH = 4
"""How deep attributes of attributes are compared; deeper objects are compared by identity."""

REPR_CHARS = 60
"""How much of an old and a new value a staleness message shows."""

LIBRARIES = frozenset(
    {"torch", "torchvision", "numpy", "PIL", "datasets", "builtins", "typing", "abc", "collections"}
)
"""Top-level packages whose code and classes are taken as fixed: their globals are not an input."""

PLAIN_TYPES = (
    torch.dtype, torch.layout, torch.memory_format, logging.Logger, logging.LoggerAdapter,
    logging.Handler, type(threading.Lock()), type(threading.RLock()), threading.Condition,
    threading.Event, threading.Semaphore,
)
"""Objects compared by identity whose state is never a sample's input (types, loggers, locks)."""


class _Ref:
    """An object compared by identity (kept alive, so its id cannot be reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ref) and other.obj is self.obj

    __hash__ = None  # type: ignore[assignment]


def is_library(obj: Any) -> bool:
    """Whether ``obj`` (a function, class or module) belongs to one of LIBRARIES."""
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return isinstance(name, str) and name.partition(".")[0] in LIBRARIES


class Snapshot:
    """Makes values comparable with ``==`` now and later (see NOTE [ Fresh caches ]).

    ``skip``: attribute names left out of every object's attributes. ``opaque``: the types of the
    objects met whose state could not be seen (each compared by identity only).
    """

    def __init__(self, skip: Iterable[str] = ()) -> None:
        self.skip = frozenset(skip)
        self.opaque: list[str] = []
        self.value_bytes = VALUE_BYTES
        self._memo: dict[int, tuple[Any, Any]] = {}
        """id -> (the object, kept alive so that its id is not reused; its snapshot)."""

    def take(self, obj: Any, depth: int = 0) -> Any:
        if obj is None or isinstance(obj, (bool, int, str, bytes, complex, range, enum.Enum)):
            return obj
        if isinstance(obj, float):
            return ("float", obj.hex())  # NaN compares equal to itself this way
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, np.ndarray):
            return self._array(obj)
        if isinstance(obj, (np.generic, np.dtype, torch.device, torch.Size)):
            return ("value", obj)
        if isinstance(obj, os.PathLike):
            return ("path", os.fspath(obj))
        if isinstance(obj, (types.ModuleType, type, *PLAIN_TYPES)) or depth >= MAX_DEPTH:
            return _Ref(obj)
        if isinstance(obj, (types.BuiltinFunctionType, types.MethodWrapperType, np.ufunc)):
            return _Ref(obj)
        key = id(obj)
        if key in self._memo:  # shared (or cyclic) objects: snapshot once
            return self._memo[key][1]
        self._memo[key] = (obj, _Ref(obj))
        value = self._compound(obj, depth)
        self._memo[key] = (obj, value)
        return value

    def _compound(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, (list, tuple, collections.deque)):
            if len(obj) > LIST_ITEMS:  # an even sample of the items, and who holds them
                step = -(-len(obj) // LIST_ITEMS)
                return (type(obj).__name__, _Ref(obj), len(obj), self.take(list(obj)[::step], depth))
            if _all_plain(obj):  # labels, paths, (path, class) pairs: compared as they are
                return (type(obj).__name__, tuple(obj))
            return (type(obj).__name__, tuple(self.take(v, depth + 1) for v in obj))
        if isinstance(obj, dict):
            items = list(obj.items())
            if len(items) > LIST_ITEMS:
                items = items[:: -(-len(items) // LIST_ITEMS)]
            return ("dict", len(obj), tuple((repr(k), self.take(v, depth + 1)) for k, v in items))
        if isinstance(obj, (set, frozenset)):
            if len(obj) > LIST_ITEMS:
                return (type(obj).__name__, _Ref(obj), len(obj))
            return (type(obj).__name__, tuple(sorted(repr(v) for v in obj)))
        if isinstance(obj, bytearray):
            return ("bytearray", bytes(obj))
        if isinstance(obj, Image.Image):
            return ("image", obj.mode, obj.size, self.take(np.asarray(obj), depth))
        if isinstance(obj, (types.FunctionType, types.MethodType)):
            return self._function(obj, depth)
        if isinstance(obj, functools.partial):
            return ("partial", self.take(obj.func, depth + 1), self.take(obj.args, depth + 1),
                    self.take(obj.keywords, depth + 1))
        if isinstance(obj, io.IOBase):
            return self._opaque(obj)
        if hasattr(obj, "__dict__"):
            attrs = {k: v for k, v in vars(obj).items() if k not in self.skip}
            return (type(obj).__qualname__, self.take(attrs, depth + 1))
        slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
        if slots and not isinstance(obj, types.GeneratorType):
            values = {s: getattr(obj, s, None) for s in slots if s not in self.skip}
            return (type(obj).__qualname__, self.take(values, depth + 1))
        if callable(obj):
            return _Ref(obj)  # a C callable: what it does is its identity
        if type(obj).__hash__ is not None and type(obj).__eq__ is not object.__eq__:
            return ("value", obj)  # hashable with its own equality: an immutable value (a date)
        return self._opaque(obj)

    def _opaque(self, obj: Any) -> Any:
        self.opaque.append(type(obj).__qualname__)
        return _Ref(obj)

    def _function(self, fn: Any, depth: int) -> Any:
        """A function: its code, what it closes over, its defaults and the globals its code names."""
        bound = fn.__self__ if isinstance(fn, types.MethodType) else None
        fn = fn.__func__ if isinstance(fn, types.MethodType) else fn
        cells = tuple(c.cell_contents for c in (fn.__closure__ or ()) if _filled(c))
        named = {} if is_library(fn) else globals_named(fn)
        return (
            "function", _Ref(fn.__code__), _Ref(bound) if bound is not None else None,
            self.take(cells, depth + 1), self.take(fn.__defaults__, depth + 1),
            self.take(named, depth + 1),
        )

    def _tensor(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        who = ("tensor", _Ref(t), t._version, tuple(t.shape), t.dtype)
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
            return who  # no copy to the host: identity and in-place version only
        if nbytes <= min(SMALL_VALUE_BYTES, self.value_bytes):
            self.value_bytes -= nbytes
            return ("tensor", t.dtype, tuple(t.shape), _raw_bytes(t))
        if nbytes <= SMALL_VALUE_BYTES:
            return who  # small, past VALUE_BYTES: many of them, each as cheap as can be
        index = torch.from_numpy(_spread(t.numel()))
        return (*who, _raw_bytes(torch.take(t.detach(), index)))

    def _array(self, a: np.ndarray) -> Any:
        if a.dtype.hasobject:  # Python objects: item by item, as a list
            if a.size > LIST_ITEMS:
                return ("ndarray", _Ref(a), a.shape)
            return ("ndarray", a.dtype.str, a.shape, self.take(a.ravel().tolist()))
        if a.nbytes <= min(SMALL_VALUE_BYTES, self.value_bytes):
            self.value_bytes -= a.nbytes
            return ("ndarray", a.dtype.str, a.shape, a.tobytes())
        if a.nbytes <= SMALL_VALUE_BYTES:
            return ("ndarray", _Ref(a), a.shape, a.dtype.str)
        index = _spread(a.size)
        return ("ndarray", _Ref(a), a.shape, a.dtype.str, a.flat[index].tobytes() if a.size else b"")


_PLAIN = frozenset({int, str, bytes, bool, type(None)})
"""Immutable types that compare exactly as they are (float aside: NaN is not equal to itself)."""


def _all_plain(items: Iterable[Any]) -> bool:
    """Whether every item is of a _PLAIN type, or a tuple of them (at C speed where it can)."""
    kinds = set(map(type, items))
    if kinds <= _PLAIN:
        return True
    return kinds == {tuple} and all(set(map(type, item)) <= _PLAIN for item in items)


def _spread(n: int) -> np.ndarray:
    """SAMPLE_ITEMS indices (or fewer, for fewer items) spread evenly over range(n), both ends in."""
    k = min(SAMPLE_ITEMS, n)
    return np.arange(k, dtype=np.int64) * (n - 1) // max(1, k - 1)


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes, whatever its dtype (NumPy has no bfloat16)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # a cell not assigned yet
        return False
    return True


# ---------------------------------------------------------------------------------- what code reads


FOLLOW_DEPTH = 2
"""How many calls deep code is followed into the methods and global functions it names."""


MUTATORS = frozenset(
    {"append", "extend", "insert", "update", "setdefault", "add", "pop", "popitem", "clear", "remove",
     "discard", "appendleft", "__setitem__"}
)
"""Methods that change a container in place: an attribute they are called on is code's bookkeeping."""


@functools.lru_cache(maxsize=4096)
def code_names(code: types.CodeType) -> tuple[frozenset[str], frozenset[str]]:
    """(the names ``code`` uses: globals and attributes, the attribute names it assigns, deletes or
    changes in place), with its nested code (comprehensions, lambdas, inner functions)."""
    names, stored = set(code.co_names), set()
    recent: list[Any] = [None, None]
    for ins in dis.get_instructions(code):
        if ins.opname in ("STORE_ATTR", "DELETE_ATTR"):
            stored.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval in MUTATORS and _attr(recent[-1]):
            stored.add(recent[-1].argval)  # self.cache.setdefault(...), self.seen.add(...)
        elif ins.opname in ("STORE_SUBSCR", "DELETE_SUBSCR") and _attr(recent[-2]):
            stored.add(recent[-2].argval)  # self.cache[key] = ...
        recent = [recent[-1], ins]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner_names, inner_stored = code_names(const)
            names |= inner_names
            stored |= inner_stored
    return frozenset(names), frozenset(stored)


@functools.lru_cache(maxsize=4096)
def global_loads(code: types.CodeType) -> frozenset[str]:
    """The names ``code`` and its nested code look up as globals (``co_names`` also holds every
    attribute name: ``h.digest()`` names ``digest`` without reading a global of that name)."""
    loads = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            loads |= global_loads(const)
    return frozenset(loads)


def _attr(ins: Any) -> bool:
    return ins is not None and ins.opname == "LOAD_ATTR"


def globals_named(fn: types.FunctionType, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The module globals ``fn``'s code names, as ``{module.name: value}``; for a global module or
    class of the user's, the attributes the code names on it (``cfg.SCALE``), not the whole of it."""
    if names is None:
        names = code_names(fn.__code__)[0]
    names = frozenset(names)
    namespace = fn.__globals__
    module = namespace.get("__name__", "?")
    out: dict[str, Any] = {}
    for name in sorted(global_loads(fn.__code__) & namespace.keys()):
        value = namespace[name]
        out[f"{module}.{name}"] = value
        if isinstance(value, types.ModuleType) and not is_library(value):
            for attr in sorted(names & vars(value).keys()):
                if not attr.startswith("__"):
                    out[f"{value.__name__}.{attr}"] = vars(value)[attr]
        elif isinstance(value, type) and not is_library(value):
            for label, attr_value in class_attributes(value).items():
                if label.rpartition(".")[2] in names:
                    out[f"{module}.{label}"] = attr_value
    return out


def class_attributes(cls: type) -> dict[str, Any]:
    """``{Class.name: value}`` of the data attributes of ``cls`` and its bases, outside LIBRARIES
    (functions, properties and other descriptors aside)."""
    out: dict[str, Any] = {}
    for klass in cls.__mro__:
        if klass is object or is_library(klass):
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") or hasattr(type(value), "__get__"):
                continue
            out[f"{klass.__qualname__}.{name}"] = value
    return out


@dataclass(frozen=True)
class CodeReads:
    """What the code of an object's methods reads, as far as it can be seen (NOTE [ Fresh caches ])."""

    functions: dict[str, types.FunctionType]
    """The user's functions reached: the entry points, and methods and global functions they name."""
    names: frozenset[str]
    """Every name that code uses (globals and attributes)."""
    stored: frozenset[str]
    """Attribute names that code assigns or deletes."""
    globals: dict[str, Any]
    """``{module.name: value}`` of the globals that code names (see ``globals_named``)."""


def code_reads(owner: type, entry_points: Sequence[str]) -> CodeReads:
    """What the methods ``entry_points`` of ``owner`` read, following the methods and global
    functions they name FOLLOW_DEPTH calls deep."""
    queue = [(fn, 0) for name in entry_points if (fn := _function(owner, name)) is not None]
    functions: dict[str, types.FunctionType] = {}
    names: set[str] = set()
    stored: set[str] = set()
    found: dict[str, Any] = {}
    seen: set[types.CodeType] = set()
    while queue:
        fn, depth = queue.pop(0)
        if fn.__code__ in seen:
            continue
        seen.add(fn.__code__)
        used, assigned = code_names(fn.__code__)
        names |= used
        stored |= assigned
        if is_library(fn):
            continue
        functions[f"{fn.__module__}.{fn.__qualname__}"] = fn
        found.update(globals_named(fn, used))
        if depth >= FOLLOW_DEPTH:
            continue
        loads = global_loads(fn.__code__)
        for name in sorted(used):
            for callee in (_function(owner, name), fn.__globals__.get(name) if name in loads else None):
                if isinstance(callee, types.FunctionType) and not is_library(callee):
                    queue.append((callee, depth + 1))
    return CodeReads(functions, frozenset(names), frozenset(stored), found)


RNG_STATE_NAMES = frozenset({"manual_seed", "seed", "set_rng_state", "fork_rng", "setstate",
                             "set_state", "initial_seed"})
"""Names whose use in a dataset's code sets or restores the process-wide random state (torch's,
``random``'s, NumPy's): torchvision's ``FakeData`` seeds torch per index and restores it after."""

_ITEM_METHODS = ("__getitem__", "__getitems__")


def reseeds_global_rng(dataset: Any) -> bool:
    """Whether loading a sample may set the process-wide random state (NOTE [ Speed only ] in
    loader.py): thread workers share it, so two threads doing so at once change each other's
    samples, where worker processes, each with its own, do not. Read from the code ``code_reads``
    follows from ``__getitem__``/``__getitems__`` (not run); an item method whose code cannot be
    read (an extension's) counts as one that may, a C container's (a list's) as one that does not."""
    cls = type(dataset)
    for name in _ITEM_METHODS:
        found = getattr(cls, name, None)
        if found is not None and _function(cls, name) is None and not isinstance(
                found, (types.BuiltinFunctionType, types.WrapperDescriptorType,
                        types.MethodWrapperType, types.MethodDescriptorType)):
            return True
    return bool(RNG_STATE_NAMES & code_reads(cls, _ITEM_METHODS).names)


def _function(owner: type, name: str) -> types.FunctionType | None:
    """The plain function behind ``owner.name`` (a method, static or class method, property)."""
    for klass in owner.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            break
    else:
        return None
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    return value if isinstance(value, types.FunctionType) else None


# ------------------------------------------------------------------------------------------ parts


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, REPR_CHARS, REPR_CHARS


def _short(value: Any) -> str:
    """A value in a message, shortened without building the whole of a long repr."""
    if isinstance(value, types.FunctionType):
        code = value.__code__
        where = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
        text = f"<function {value.__qualname__} at {where}>"
    elif isinstance(value, (torch.Tensor, np.ndarray)) and value.size != 1 and value.ndim:
        text = f"<{type(value).__name__} {tuple(value.shape)} {value.dtype}>"
    else:
        text = _REPR.repr(value)
    return text if len(text) <= REPR_CHARS else text[: REPR_CHARS - 3] + "..."


@dataclass(frozen=True)
class Part:
    """One frozen thing: what it is called in a message, and its snapshot per attribute."""

    label: str
    attrs: tuple[tuple[str, Any, str], ...]
    """(attribute, snapshot, short repr of the value when fingerprinted)."""
    opaque: tuple[str, ...] = ()
    """Attributes that hold an object whose state cannot be seen (``Snapshot.opaque``) and that the
    frozen code names: then the code cannot be cached safely."""


def part(label: str, values: dict[str, Any], *, named: Iterable[str] = (), skip: Iterable[str] = ()) -> Part:
    """``values`` snapshotted one by one; an opaque one is reported when its name is in ``named``
    (its last dotted component, for ``module.name`` and ``Class.name``)."""
    snap = Snapshot(skip)
    attrs, opaque = [], []
    named = frozenset(named)
    for name, value in values.items():
        before = len(snap.opaque)
        attrs.append((name, snap.take(value), _short(value)))
        if len(snap.opaque) > before and name.rpartition(".")[2] in named:
            opaque.append(f"{name}, a {snap.opaque[before]}")
    return Part(label, tuple(attrs), tuple(opaque))


STEP_CODE = ("__call__", "forward")
"""The methods a transform step runs (``forward`` for a ``torch.nn.Module``)."""

DATASET_CODE = ("__getitem__",)
"""The method a cache runs once of a dataset."""


def _attributes(obj: Any) -> dict[str, Any]:
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
    return {s: getattr(obj, s) for s in slots if hasattr(obj, s)} if slots else {"value": obj}


def step_parts(label: str, step: Any) -> list[Part]:
    """A frozen step: its attributes, and for a step of the user's, what its code reads."""
    if is_library(type(step)):
        return [part(label, _attributes(step))]
    reads = code_reads(type(step), STEP_CODE)
    return [part(label, _attributes(step), named=reads.names), *_code_parts(label, type(step), reads)]


def concatenated(dataset: Any) -> list[Any] | None:
    """The datasets a torch ``ConcatDataset`` reads, each once, in order; None for any other dataset."""
    if not isinstance(dataset, ConcatDataset):
        return None
    return list({id(d): d for d in dataset.datasets}.values())


def dataset_parts(dataset: Any, label: str = "the dataset") -> list[Part]:
    """What the dataset's own ``__getitem__`` reads: its code, the globals it names, the class
    attributes, and the instance attributes but those its code assigns and ``transform``. A
    ``ConcatDataset``: which datasets it joins, their lengths, and what each of them reads."""
    if (joined := concatenated(dataset)) is not None:
        out = [identity_part(f"{label}'s parts", datasets=tuple(dataset.datasets)),
               value_part(f"{label}'s parts", lengths=tuple(len(d) for d in dataset.datasets))]
        for k, d in enumerate(joined):
            out += dataset_parts(d, f"{label} (part {k})")
        return out
    reads = code_reads(type(dataset), DATASET_CODE)
    if isinstance(dataset, (list, tuple)):
        attrs = {"items": dataset}
    else:
        skip = reads.stored | {"transform", "transforms"}
        attrs = {k: v for k, v in _attributes(dataset).items() if k not in skip}
    return [
        *_code_parts(label, type(dataset), reads),
        part(f"{label}'s attributes", attrs, named=reads.names | {"items"}, skip=reads.stored),
    ]


def _code_parts(label: str, owner: type, reads: CodeReads) -> list[Part]:
    code = tuple((name, _Ref(fn.__code__), _short(fn)) for name, fn in reads.functions.items())
    # The code last: a global function replaced shows as the global that changed, by its name.
    return [
        part(f"the globals {label}'s code reads", reads.globals, named=reads.names),
        part(f"{label}'s class attributes", class_attributes(owner), named=reads.names),
        Part(f"{label}'s code", code),
    ]


def value_part(label: str, **values: Any) -> Part:
    return part(label, values)


def identity_part(label: str, **objs: Any) -> Part:
    """Objects compared by identity (tuples of them item by item): which objects, not their state."""

    def ident(v: Any) -> Any:
        return tuple(_Ref(x) for x in v) if isinstance(v, tuple) else _Ref(v)

    return Part(label, tuple((name, ident(v), _short(v)) for name, v in objs.items()))


def opaque_reason(parts: Sequence[Part], what: str) -> str | None:
    """Why ``what`` cannot be cached, when one of ``parts`` holds an opaque input; else None."""
    for p in parts:
        if p.opaque:
            where = "" if p.label == what else f" ({p.label})"
            return (
                f"{what} reads {p.opaque[0]}{where}, whose state cannot be fingerprinted cheaply:"
                " a change to it could not be seen, so it is not cached"
            )
    return None


_recording = threading.local()
_hooked = False
_hook_lock = threading.Lock()


def _on_audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open":
        return
    paths = getattr(_recording, "paths", None)
    if paths is None or not args:
        return
    path = args[0]
    if isinstance(path, (str, bytes, os.PathLike)):
        paths.append(os.fsdecode(path))


def _library_file(path: str) -> bool:
    """Python's own files (an import while reading), and devices and kernel files."""
    if path.endswith((".py", ".pyc", ".so", ".pth")) or path.startswith(("/proc/", "/sys/", "/dev/")):
        return True
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return any(root and path.startswith(root + os.sep) for root in roots)


class opened_files:
    """A context in which the files this thread opens are recorded (``paths``): Python's ``open``
    audit events, which ``open``, ``io.open`` and PIL's and NumPy's file reads raise. The hook is
    added once per process (one cannot be removed) and does nothing outside such a context."""

    def __enter__(self) -> opened_files:
        global _hooked
        with _hook_lock:
            if not _hooked:
                sys.addaudithook(_on_audit)
                _hooked = True
        self._outer = getattr(_recording, "paths", None)
        self._paths: list[str] = []
        _recording.paths = self._paths
        return self

    def __exit__(self, *exc: Any) -> None:
        _recording.paths = self._outer
        if self._outer is not None:
            self._outer.extend(self._paths)

    @property
    def paths(self) -> list[str]:
        """The regular files opened, absolute, in order, each once (Python's own left out)."""
        out: dict[str, None] = {}
        for p in self._paths:
            full = os.path.abspath(p)
            if not _library_file(full) and os.path.isfile(full):
                out[full] = None
        return list(out)


def listed_paths(dataset: Any) -> list[str]:
    """The files ``dataset`` lists: an ImageFolder's ``samples`` (path, target) pairs, or among its
    attributes a path, or a list or tuple of paths (strings or ``os.PathLike`` naming files); for a
    ``ConcatDataset``, those its datasets list."""
    if (joined := concatenated(dataset)) is not None:
        return list(dict.fromkeys(p for d in joined for p in listed_paths(d)))
    samples = getattr(dataset, "samples", None)
    if isinstance(samples, list) and samples and isinstance(samples[0], tuple):
        paths = [s[0] for s in samples if isinstance(s[0], str)]
        if paths:
            return paths
    out: list[str] = []
    for value in _attributes(dataset).values():
        if _names_a_file(value):
            out.append(os.fspath(value))
        elif isinstance(value, (list, tuple)) and value and _names_a_file(value[0]):
            out += [os.fspath(v) for v in value if isinstance(v, (str, os.PathLike))]
    return out


def _names_a_file(value: Any) -> bool:
    if not isinstance(value, (str, os.PathLike)):
        return False
    try:
        return os.path.isfile(os.fspath(value))
    except (ValueError, OSError, TypeError):  # a NUL in a string, a path too long
        return False


def file_stats(paths: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime_ns) of the files, or an even sample of STAT_FILES of them."""
    stride = max(1, -(-len(paths) // STAT_FILES))
    out = []
    for path in paths[::stride]:
        try:
            st = os.stat(path)
            out.append((path, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((path, -1, -1))
    return tuple(out)


def difference(old: Sequence[Part], new: Sequence[Part]) -> str | None:
    """What changed between two fingerprints, in words; None when nothing did."""
    for before, after in zip(old, new, strict=False):
        if before.label != after.label:
            return f"the pipeline changed ({before.label} became {after.label})"
        if before.attrs == after.attrs:
            continue
        names_before = [a[0] for a in before.attrs]
        names_after = [a[0] for a in after.attrs]
        if names_before != names_after:
            added = [n for n in names_after if n not in names_before]
            removed = [n for n in names_before if n not in names_after]
            what = ", ".join([*(f"+{n}" for n in added), *(f"-{n}" for n in removed)]) or "their order"
            return f"{before.label} changed ({what})"
        for (name, snap_a, text_a), (_, snap_b, text_b) in zip(before.attrs, after.attrs, strict=True):
            if snap_a != snap_b:
                shown = f": {text_a} -> {text_b}" if text_a != text_b else ""
                return f"{before.label} changed ({name}{shown})"
    if len(old) != len(new):
        return f"the pipeline changed ({len(old)} frozen parts became {len(new)})"
    return None
