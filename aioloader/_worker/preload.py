"""Which installed packages decode processes need, so the zygote imports them once, before it
forks, rather than every decode process on its own."""

from __future__ import annotations

import contextlib
import importlib
import os
import pickletools
import sys
import sysconfig
from types import ModuleType


def installed_packages(modules: set[str]) -> list[str]:
    """The top-level packages among `modules` that come from the Python installation
    (standard library, site-packages), not from the user's own folders."""
    roots = _installation_roots()
    return sorted({name.partition(".")[0] for name in modules
                   if _installed(name.partition(".")[0], roots)})


def packages_behind(pickles: list[bytes]) -> list[str]:
    """The installed packages that unpickling `pickles` imports: those it names, and those the
    user's own modules it names import (followed through their globals, as importing them
    runs their imports)."""
    roots = _installation_roots()
    todo = [arg for pickled in pickles for _, arg, _ in pickletools.genops(pickled)
            if isinstance(arg, str) and arg in sys.modules and not arg.startswith("__")]
    seen: set[str] = set()
    found: set[str] = set()
    while todo:
        name = todo.pop()
        top = name.partition(".")[0]
        if name in seen or top == "aioloader":
            continue
        seen.add(name)
        if _installed(top, roots):
            found.add(top)
            continue
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            named = value.__name__ if isinstance(value, ModuleType) else getattr(
                value, "__module__", None)
            if isinstance(named, str) and named in sys.modules and not named.startswith("__"):
                todo.append(named)
    return sorted(found)


def preload(packages: list[str]) -> None:
    """Import installed packages so forked decode processes have them; one that fails to
    import is left to the decode process, as before."""
    for name in packages:
        if name not in sys.modules and not name.startswith("_"):
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _installation_roots() -> set[str]:
    return {os.path.realpath(p) for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(key))}


def _installed(top: str, roots: set[str]) -> bool:
    """Whether `top` is a public package of the installation. Private modules (`_asyncio`,
    `_socket`) come with their package: imported on their own, first, some break it
    (`_asyncio` imported before `asyncio` leaves `asyncio.current_task()` always None)."""
    module = sys.modules.get(top)
    where = getattr(module, "__file__", None)
    if top.startswith("_") or where is None:
        return False
    where = os.path.realpath(where)
    return any(where.startswith(root + os.sep) for root in roots)
