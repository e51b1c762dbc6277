"""The registries of built-in choices: strategies, models, datasets, optimizers.

Each entry is a name and the import path of what it names. Entries resolve lazily, on first
access, so the command line can list the choices (`--help`, flag errors) without importing JAX,
and each name is written exactly once: adding a strategy is its own function plus one line here.

    from jaxdp.registry import STRATEGIES
    list(STRATEGIES)            # ["psum", "ring", "host"]: names only, nothing imported
    STRATEGIES["ring"]          # jaxdp.sync.collectives.RING (a Collective), imported now
    STRATEGIES.register("mine", my_strategy)   # a user's own, then usable by name everywhere
"""

from __future__ import annotations

import importlib
from typing import Any, Iterator, Mapping


# The word for "decide it while training" (--compression auto, --sync-every auto, --save-every auto): the
# controllers resolve it (jaxdp/sync/controller.py, jaxdp/checkpoint/saveplan.py); written once, here.
AUTO = "auto"


class Registry(Mapping[str, Any]):
    """A name -> object mapping whose entries are "module:attribute" paths imported on access."""

    def __init__(self, kind: str, entries: Mapping[str, str]):
        self.kind = kind
        self._paths: dict[str, str] = dict(entries)
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._paths:
            raise KeyError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self._paths)}")
        if name not in self._loaded:
            module, _, attribute = self._paths[name].partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:  # by name: Mapping's own would import the entry
        return name in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self._paths!r})"

    def register(self, name: str, obj: Any) -> Any:
        """Add a user's own entry (an object, not a path); returns it, so it can decorate."""
        if name in self._paths:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._paths[name] = f"<registered {obj!r}>"
        self._loaded[name] = obj
        return obj


# Gradient synchronisation: `jaxdp.sync.collectives.Collective` values; a user's own is a bare `fn(tree, axis)`
# (jaxdp/sync/collectives.py).
STRATEGIES = Registry("strategy", {"psum": "jaxdp.sync.collectives:PSUM", "ring": "jaxdp.sync.collectives:RING",
                                   "host": "jaxdp.sync.host:HOST"})

# What each built-in strategy can do, known without importing it (jaxdp.sync.spec checks the
# command line's combinations before JAX starts): "sum" an in-graph sum (compression, local
# steps), "halves" a reduce-scatter and an all-gather (ZeRO-1), "coded_sum" a ring whose hops a codec
# encodes (int8 / int4 compression), "host" an on-host mean.
STRATEGY_ABILITIES = {"psum": frozenset({"sum", "halves"}), "ring": frozenset({"sum", "halves", "coded_sum"}),
                      "host": frozenset({"host"})}

# Built-in models: `build(config, num_outputs, axis_name) -> flax.linen.Module`; num_outputs is the
# number of classes, or the vocabulary size for gpt (whose builder also knows --init-from: jaxdp/models/hf.py).
MODELS = Registry("model", {"mlp": "jaxdp.models.builtin:build_mlp", "cnn": "jaxdp.models.builtin:build_cnn",
                            "gpt": "jaxdp.models.hf:build_gpt"})

# Built-in datasets: `load() -> jaxdp.data.datasets.Dataset`. A path to an .npz file is the other choice.
DATASETS = Registry("dataset", {"digits": "jaxdp.data.datasets:digits", "synthetic": "jaxdp.data.datasets:synthetic"})

# Learning-rate schedules: `build(lr, steps, warmup_steps, final_fraction) -> optax.Schedule`.
SCHEDULES = Registry("schedule", {"constant": "jaxdp.step.optim:constant_schedule", "cosine": "jaxdp.step.optim:cosine_schedule",
                                  "warmup-cosine": "jaxdp.step.optim:warmup_cosine_schedule"})

# optax optimizers: `build(learning_rate, momentum, weight_decay) -> optax.GradientTransformation`.
OPTIMIZERS = Registry("optimizer", {"adam": "jaxdp.step.optim:adam", "adamw": "jaxdp.step.optim:adamw", "sgd": "jaxdp.step.optim:sgd",
                                    "momentum": "jaxdp.step.optim:momentum", "muon": "jaxdp.step.optim:muon"})

# Outer optimizers of local steps (--sync-every, jaxdp/step/local_sgd.py): `build(lr, momentum) -> optax.GradientTransformation`.
OUTER_OPTIMIZERS = Registry("outer optimizer", {"nesterov": "jaxdp.step.optim:nesterov_outer", "sgd": "jaxdp.step.optim:sgd_outer"})
