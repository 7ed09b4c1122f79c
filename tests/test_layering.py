"""The package's shape: its modules import one another one way only (also through imports
inside functions), and nested samples are walked by one walker that rebuilds only what it
changes."""

from __future__ import annotations

import ast
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import aioloader
from aioloader._ipc.messages import Chunk
from aioloader._ipc.transport import map_arrays

PACKAGE = Path(aioloader.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports anywhere in it."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = base if node.level else ""
                if node.module:
                    target = f"{target}.{node.module}" if target else node.module
                for alias in node.names:  # `from . import shm` names a module
                    module = f"{target}.{alias.name}"
                    found.add(module if module in modules else target)
        graph[name] = {module for module in found if module in modules and module != name}
    return graph


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A chain of imports from `start` back to it, if there is one."""
    todo: list[list[str]] = [[start]]
    seen: set[str] = set()
    while todo:
        chain = todo.pop()
        for module in sorted(graph[chain[-1]]):
            if module == start:
                return [*chain, start]
            if module not in seen:
                seen.add(module)
                todo.append([*chain, module])
    return None


def test_no_module_of_the_package_imports_itself_back_even_inside_a_function() -> None:
    graph = _imports()
    assert "aioloader._cache" in graph and "aioloader._processes.zygote" in graph
    cycles = [cycle for module in sorted(graph) if (cycle := _cycle_from(module, graph))]
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


class Record(Mapping[str, Any]):
    """A read-only mapping that cannot be rebuilt from a dict (as many library types)."""

    def __init__(self, **fields: Any) -> None:
        self._fields = fields

    def __getitem__(self, key: str) -> Any:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


class Pair(NamedTuple):
    image: Any
    label: Any


def test_a_walk_that_replaces_nothing_rebuilds_no_container() -> None:
    raw = [Record(name="a", size=3), (b"bytes", ["text", 1.5, None]), {"k": Pair(1, "x")}]
    assert map_arrays(raw, lambda array: array + 1) is raw


def test_a_walk_rebuilds_the_containers_of_what_it_replaces_with_their_types() -> None:
    sample = {"pair": Pair(np.arange(3), "cat"), "rest": [np.zeros(2), (np.ones(1), b"b")],
              "untouched": ["text"]}
    mapped = map_arrays(sample, lambda array: array + 1)
    assert type(mapped["pair"]) is Pair and mapped["pair"].image.tolist() == [1, 2, 3]
    assert mapped["pair"].label == "cat" and mapped["rest"][0].tolist() == [1, 1]
    assert type(mapped["rest"][1]) is tuple and mapped["rest"][1][0].tolist() == [2]
    assert mapped["untouched"] is sample["untouched"] and sample["rest"][0].tolist() == [0, 0]


def test_raw_items_of_any_mapping_travel_to_a_decode_process_once_torch_is_imported() -> None:
    import torch  # a chunk's raws are walked for tensor views only once torch is imported

    storage = torch.arange(1000)
    raws = [Record(name="a"), {"view": storage[:4]}]
    back = pickle.loads(pickle.dumps(Chunk(0, [0, 1], raws)))
    assert back.raws[0] == {"name": "a"} and back.raws[1]["view"].tolist() == [0, 1, 2, 3]
    assert back.raws[1]["view"].untyped_storage().nbytes() == 4 * storage.element_size()


def test_the_services_build_passes_with_the_factory_and_never_import_the_loader() -> None:
    """A service that built a Loader to reach its private wiring (`_new_storage`,
    `_decoder`, `_blocks`) broke whenever the Loader changed; the factory is the seam."""
    graph = _imports()
    for service in ("aioloader._service.server", "aioloader._service.node_server"):
        assert "aioloader._loader" not in graph[service], service
        assert "aioloader._pass.factory" in graph[service], service


NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


def _members_by_module() -> dict[str, set[str]]:
    """Per module: the names its classes define (methods, class attributes, `self.x = ...`)."""
    defined: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        names = defined.setdefault(_module_name(path), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
    return defined


def test_no_module_reaches_into_the_private_members_of_another_modules_classes() -> None:
    """`Loader` is a front: the services and the runtime use the factory and the handles,
    never `loader._x`; the same holds for every class (the cache's `attach`, `lookup`, `put`
    are the loader's way in, and say so)."""
    defined = _members_by_module()
    reached = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = getattr(node, "attr", "")
            if (not isinstance(node, ast.Attribute) or not name.startswith("_")
                    or name.startswith("__") or name in NAMEDTUPLE_API
                    or (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                continue
            owners = {m for m, names in defined.items() if name in names}
            if owners and module not in owners:
                reached.append(f"{module}:{node.lineno} .{name} of {sorted(owners)}")
    assert not reached, "\n".join(reached)


ROOMS = ["_ipc", "_worker", "_processes", "_scheduling", "_pass", "_service", "_iteration"]
"""The runtime's rooms, lowest first: a module imports only from its own room or a lower one
(inside functions too). `_processes` starts `_service.server` by its module name."""


def test_the_runtime_rooms_import_downward_only() -> None:
    def room(module: str) -> int | None:
        part = module.split(".")[1] if module.count(".") else ""
        return ROOMS.index(part) if part in ROOMS else None

    upward = [f"{module} -> {imported}" for module, imports in _imports().items()
              for imported in imports
              if (here := room(module)) is not None and (there := room(imported)) is not None
              and there > here]
    assert not upward, "\n".join(upward)
