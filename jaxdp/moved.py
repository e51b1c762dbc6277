"""Old import paths of names that moved to another module: they still resolve, with a
DeprecationWarning, for one release.

    __getattr__ = moved.forwarder(__name__, {"plan": "jaxdp.sync.costmodel"})   # at the end of the old module
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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


# Modules that moved into a subpackage (the wave-4 layout): old path -> new path. `import jaxdp.state`
# and `from jaxdp.state import TrainState` keep working for one release, with a DeprecationWarning.
MODULES = {
    "jaxdp.host": "jaxdp.sync.host", "jaxdp.compression": "jaxdp.sync.compression",
    "jaxdp.exchange": "jaxdp.sync.exchange", "jaxdp.syncspec": "jaxdp.sync.spec",
    "jaxdp.costmodel": "jaxdp.sync.costmodel", "jaxdp.controller": "jaxdp.sync.controller",
    "jaxdp.state": "jaxdp.step.state", "jaxdp.optim": "jaxdp.step.optim", "jaxdp.local_sgd": "jaxdp.step.local_sgd",
    "jaxdp.zero": "jaxdp.step.zero", "jaxdp.delayed": "jaxdp.step.delayed", "jaxdp.paced": "jaxdp.step.rounds",
    "jaxdp.artifacts": "jaxdp.checkpoint.artifacts", "jaxdp.portable": "jaxdp.checkpoint.portable",
    "jaxdp.resume": "jaxdp.checkpoint.resume", "jaxdp.saveplan": "jaxdp.checkpoint.saveplan",
    "jaxdp.dirlock": "jaxdp.checkpoint.dirlock",
    "jaxdp.order": "jaxdp.data.order", "jaxdp.tokens": "jaxdp.data.tokens", "jaxdp.tokenizer": "jaxdp.data.tokenizer",
    "jaxdp.prefetch": "jaxdp.data.prefetch", "jaxdp.digest": "jaxdp.data.digest",
    "jaxdp.usermodel": "jaxdp.models.usermodel", "jaxdp.hf": "jaxdp.models.hf", "jaxdp.generate": "jaxdp.models.generate",
    "jaxdp.tasks": "jaxdp.models.tasks",
    "jaxdp.distributed": "jaxdp.cluster.distributed", "jaxdp.gloo": "jaxdp.cluster.gloo",
    "jaxdp.handshake": "jaxdp.cluster.handshake", "jaxdp.agreement": "jaxdp.cluster.agreement",
    "jaxdp.coordination": "jaxdp.cluster.coordination", "jaxdp.peer_watch": "jaxdp.cluster.peer_watch",
    "jaxdp.heartbeat": "jaxdp.cluster.heartbeat", "jaxdp.preemption": "jaxdp.cluster.preemption",
    "jaxdp.runtime": "jaxdp.cluster.runtime", "jaxdp.quiet": "jaxdp.cluster.quiet",
    "jaxdp.malloc_env": "jaxdp.cluster.malloc_env", "jaxdp.elastic": "jaxdp.cluster.elastic",
    "jaxdp.workers": "jaxdp.launcher.workers", "jaxdp.rendezvous": "jaxdp.launcher.rendezvous",
    "jaxdp.zygote": "jaxdp.launcher.zygote",
}


class _OldModulePaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `jaxdp.state` (and the others of MODULES) as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MODULES[spec.name]}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MODULES[spec.name])
        self._own_spec = module.__spec__  # the import system sets the alias's spec on it next
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_spec  # already executed at its new path; give it back its own spec


def install_old_module_paths() -> None:
    """Let the old flat module paths resolve (called once by jaxdp/__init__.py)."""
    if not any(isinstance(f, _OldModulePaths) for f in sys.meta_path):
        sys.meta_path.append(_OldModulePaths())


def package(name: str, former: str | tuple[str, ...] | None = None, warn: bool = True) -> Callable[[str], Any]:
    """A subpackage's lazy `__getattr__` (PEP 562): its submodules load on first use, so importing
    the package imports nothing. `former` is the module that held the package's name before the
    wave-4 layout (jaxdp/sync.py -> jaxdp.sync.collectives): its names still resolve from the package,
    with a DeprecationWarning, for one release (`warn=False`: for good, where the names are the
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
                    warnings.warn(f"{name}.{attr} moved to {home}.{attr}; the old path goes in the next release",
                                  DeprecationWarning, stacklevel=2)
                return getattr(module, attr)
        raise AttributeError(f"module {name!r} has no attribute {attr!r}")

    return __getattr__
