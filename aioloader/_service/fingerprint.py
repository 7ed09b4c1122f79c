"""What makes two Loaders "the same", as a digest every rank of a node computes alike.

Pickles cannot say it: cloudpickle names each class and function it sends by value with a
fresh id, and sets iterate in an order that changes with each process's hash seed. Here a value
is described by what it is instead: plain data by value, sets sorted, a function by its module,
name, code, defaults and closure, any other object by its class and the state it would pickle
(`__reduce_ex__`).

What cloudpickle sends by value (a script's functions and classes, lambdas, closures) is what
the service will run, so it is described whole, as it is sent: a function with the globals its
code names, a class with its bases and body. Two ranks whose decode reads a global that differs
(`args.size`), or whose class differs in an attribute or a method, differ here too. What goes by
reference (a function or class of an importable module) is the module's, which the service
imports itself: its name says it.
"""

from __future__ import annotations

import copyreg
import hashlib
import types
from typing import Any

import numpy as np
from cloudpickle import cloudpickle

_SKIPPED_MEMBERS = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__"})

_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)


def fingerprint(value: Any) -> str:
    digest = hashlib.sha256()
    _describe(value, digest, {})
    return digest.hexdigest()


def _describe(value: Any, digest: Any, seen: dict[int, tuple[int, Any]]) -> None:
    """Feed `value` to `digest`. `seen` numbers what was met, and keeps it alive so that no
    id is reused by a temporary made on the way (the state of an object, say)."""
    def tag(text: str) -> None:
        digest.update(text.encode() + b"\0")

    if isinstance(value, _PLAIN):
        tag(f"{type(value).__name__}:{value!r}")
        return
    if isinstance(value, np.ndarray):
        tag(f"array:{value.dtype.str}:{value.shape}")
        digest.update(np.ascontiguousarray(value).tobytes() if value.dtype != object else b"")
        if value.dtype == object:
            _describe(value.tolist(), digest, seen)
        return
    if isinstance(value, (types.ModuleType, types.BuiltinFunctionType)) or (
            isinstance(value, type) and not _by_value(value)):
        tag(f"{type(value).__name__}:{getattr(value, '__module__', '')}."
            f"{getattr(value, '__qualname__', getattr(value, '__name__', ''))}")
        owner = getattr(value, "__self__", None)  # a bound builtin: labels.get, rng.integers
        if owner is not None and not isinstance(owner, types.ModuleType):
            _describe(owner, digest, seen)
        return
    if id(value) in seen:
        tag(f"again:{seen[id(value)][0]}")  # a cycle, or the n-th object met, met again
        return
    seen[id(value)] = (len(seen), value)
    if isinstance(value, (list, tuple)):
        tag(f"{type(value).__name__}:{len(value)}")
        for item in value:
            _describe(item, digest, seen)
    elif isinstance(value, dict):
        tag(f"dict:{len(value)}")
        for key, item in sorted(value.items(), key=lambda pair: _alone(pair[0])):
            _describe(key, digest, seen)
            _describe(item, digest, seen)
    elif isinstance(value, (set, frozenset)):
        tag(f"set:{len(value)}")
        for member in sorted(_alone(member) for member in value):
            tag(member)
    elif isinstance(value, type):  # sent by value: its bases and body
        tag(f"class:{value.__module__}.{value.__qualname__}")
        _describe(value.__bases__, digest, seen)
        _describe({name: member for name, member in vars(value).items()
                   if name not in _SKIPPED_MEMBERS}, digest, seen)
    elif isinstance(value, types.FunctionType):
        tag(f"function:{value.__module__}.{value.__qualname__}")
        closure = [cell.cell_contents for cell in value.__closure__ or ()]
        parts: list[Any] = [value.__code__, value.__defaults__, value.__kwdefaults__, closure]
        if _by_value(value):  # its globals travel with it
            names = _global_names(value.__code__)
            parts.append({name: value.__globals__[name] for name in sorted(names)
                          if name in value.__globals__})
        for part in parts:
            _describe(part, digest, seen)
    elif isinstance(value, (staticmethod, classmethod)):
        tag(type(value).__name__)
        _describe(value.__func__, digest, seen)
    elif isinstance(value, property):
        tag("property")
        _describe([value.fget, value.fset, value.fdel], digest, seen)
    elif isinstance(value, types.CodeType):
        tag(f"code:{value.co_name}")
        for code_part in (value.co_code, value.co_consts, value.co_names):
            _describe(code_part, digest, seen)
    elif isinstance(value, types.MethodType):
        _describe(value.__func__, digest, seen)
        _describe(value.__self__, digest, seen)
    else:
        tag("object")
        _describe(type(value), digest, seen)
        _describe(_state(value), digest, seen)


def _by_value(value: Any) -> bool:
    """Whether cloudpickle sends `value` whole rather than by its module and name (its own
    rule, which `register_pickle_by_value` changes)."""
    try:
        return not cloudpickle._should_pickle_by_reference(value)
    except Exception:
        return True


def _global_names(code: types.CodeType) -> set[str]:
    """The names a function's code, and the code nested in it, may look up as globals."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _global_names(constant)
    return names


def _alone(value: Any) -> str:
    """A member's own digest: the order of a set's members or a dict's keys."""
    return fingerprint(value)


def _state(value: Any) -> Any:
    """What pickling `value` would keep of it, iterators made lists."""
    try:
        reduced = value.__reduce_ex__(4)
    except Exception:
        return None  # cannot travel anyway; the Loader says so when it is built
    if isinstance(reduced, str):
        return reduced
    parts = list(reduced)
    if parts and parts[0] is getattr(copyreg, "__newobj__", None):
        parts = parts[1:]  # (cls, *args): the class is named already
    return [list(part) if isinstance(part, types.GeneratorType) or hasattr(part, "__next__")
            else part for part in parts]
