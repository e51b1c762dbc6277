"""Old import paths of names that moved to another module: they still resolve, with a
DeprecationWarning, for one release.

    __getattr__ = moved.forwarder(__name__, {"plan": "jaxdp.costmodel"})   # at the end of the old module
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable


def forwarder(module: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` (PEP 562) for `module` that finds each name of `homes` in its
    new module, warning once per lookup; any other name is an AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} moved to {homes[name]}.{name}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(homes[name]), name)

    return __getattr__
