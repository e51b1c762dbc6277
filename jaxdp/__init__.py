"""jaxdp: data-parallel training for JAX/Flax models over a device mesh.

    import jaxdp
    mesh  = jaxdp.make_mesh()
    state = jaxdp.init_state(params, tx, mesh)
    step  = jaxdp.make_train_step(loss_fn, tx, mesh, strategy="ring")
    state, metrics = step(state, jaxdp.shard_batch(host_batch, mesh))
    result = jaxdp.fit(loss_fn, params, tx, batch_at, steps=1000, checkpoint_dir="/tmp/run")  # the whole loop
    params = jaxdp.load_params("/tmp/run")                  # numpy, no template
    with jaxdp.Checkpointer("/tmp/run") as ckpt:   # orbax: ckpt.save(state), ckpt.restore(state)
        state = ckpt.restore(state)

The names below are the public API. They load on first use (PEP 562), so importing the package,
or `jaxdp.config` for `--help`, does not import JAX; importing has no other side effect.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "Checkpointer": "jaxdp.checkpoint",
    "Collective": "jaxdp.sync",
    "SyncSpec": "jaxdp.syncspec",
    "DATA_AXIS": "jaxdp.mesh",
    "Diverged": "jaxdp.metrics",
    "MetricsWriter": "jaxdp.metrics",
    "Periodic": "jaxdp.metrics",
    "check_finite": "jaxdp.metrics",
    "EXIT_CODES": "jaxdp.errors",
    "InputError": "jaxdp.errors",
    "MODELS": "jaxdp.registry",
    "OPTIMIZERS": "jaxdp.registry",
    "Preemption": "jaxdp.preemption",
    "Prefetcher": "jaxdp.prefetch",
    "Result": "jaxdp.loop",
    "fit": "jaxdp.loop",
    "load_model": "jaxdp.artifacts",
    "load_params": "jaxdp.artifacts",
    "load_variables": "jaxdp.artifacts",
    "pad_batch": "jaxdp.mesh",
    "STRATEGIES": "jaxdp.registry",
    "TrainState": "jaxdp.state",
    "TrainStep": "jaxdp.step",
    "batch_sharding": "jaxdp.mesh",
    "hierarchical": "jaxdp.sync",
    "host_mean": "jaxdp.host",
    "init_state": "jaxdp.state",
    "initialize": "jaxdp.distributed",
    "is_on_host": "jaxdp.sync",
    "make_eval_step": "jaxdp.step",
    "make_mesh": "jaxdp.mesh",
    "make_optimizer": "jaxdp.optim",
    "make_train_step": "jaxdp.step",
    "on_host": "jaxdp.sync",
    "psum_mean": "jaxdp.sync",
    "replicate": "jaxdp.mesh",
    "replicated_sharding": "jaxdp.mesh",
    "ring_allreduce": "jaxdp.sync",
    "ring_mean": "jaxdp.sync",
    "shard_batch": "jaxdp.mesh",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
