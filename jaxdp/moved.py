"""Old import paths of names that moved to another module: they still resolve, with a
DeprecationWarning that names the release that removes them (REMOVED_IN). Nothing here runs at
import: each old path is a module-level `__getattr__` (PEP 562) of the module that held the name.

    __getattr__ = moved.forwarder(__name__, {"plan": "jaxdp.sync.costmodel"})   # at the end of the old module
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

REMOVED_IN = "0.2.0"  # the release that removes every old path below


def forwarder(module: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` (PEP 562) for `module` that finds each name of `homes` in its
    new module, warning once per lookup; any other name is an AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} moved to {homes[name]}.{name}; the old path is removed in jaxdp {REMOVED_IN}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__


def package(name: str, former: str | tuple[str, ...] | None = None, warn: bool = True) -> Callable[[str], Any]:
    """A subpackage's lazy `__getattr__` (PEP 562): its submodules load on first use, so importing
    the package imports nothing. `former` is the module that held the package's name before the
    wave-4 layout (jaxdp/sync.py -> jaxdp.sync.collectives): its names still resolve from the package,
    with a DeprecationWarning, until REMOVED_IN (`warn=False`: for good, where the names are the
    package's own, as jaxdp.models.GPT)."""

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        try:
            return importlib.import_module(f"{name}.{attr}")
        except ModuleNotFoundError as e:
            if e.name != f"{name}.{attr}":
                raise
        for home in (former,) if isinstance(former, str) else former or ():
            module = importlib.import_module(home)
            if hasattr(module, attr):
                if warn:
                    warnings.warn(f"{name}.{attr} moved to {home}.{attr}; the old path is removed in jaxdp {REMOVED_IN}",
                                  DeprecationWarning, stacklevel=2)
                return getattr(module, attr)
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    return __getattr__
