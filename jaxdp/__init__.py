"""jaxdp: data-parallel training for JAX/Flax models over a device mesh.

    import jaxdp
    mesh  = jaxdp.make_mesh()
    state = jaxdp.init_state(params, tx, mesh)
    step  = jaxdp.make_train_step(loss_fn, tx, mesh, strategy="ring")
    state, metrics = step(state, jaxdp.shard_batch(host_batch, mesh))
    result = jaxdp.fit(loss_fn, params, tx, batch_at, steps=1000,     # the whole loop
                       checkpoint=jaxdp.CheckpointOptions(directory="/tmp/run"))
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
    "Checkpointer": "jaxdp.checkpoint.checkpointer",
    "CheckpointOptions": "jaxdp.loop.options",
    "EvalOptions": "jaxdp.loop.options",
    "LogOptions": "jaxdp.loop.options",
    "RunOptions": "jaxdp.loop.options",
    "SyncOptions": "jaxdp.loop.options",
    "Collective": "jaxdp.sync.collectives",
    "SyncSpec": "jaxdp.sync.spec",
    "DATA_AXIS": "jaxdp.mesh",
    "Diverged": "jaxdp.metrics",
    "MetricsWriter": "jaxdp.metrics",
    "Periodic": "jaxdp.metrics",
    "check_finite": "jaxdp.metrics",
    "EXIT_CODES": "jaxdp.errors",
    "InputError": "jaxdp.errors",
    "MODELS": "jaxdp.registry",
    "OPTIMIZERS": "jaxdp.registry",
    "Preemption": "jaxdp.cluster.preemption",
    "Prefetcher": "jaxdp.data.prefetch",
    "Result": "jaxdp.loop.trainer",
    "fit": "jaxdp.loop.trainer",
    "load_model": "jaxdp.checkpoint.artifacts",
    "load_params": "jaxdp.checkpoint.artifacts",
    "load_variables": "jaxdp.checkpoint.artifacts",
    "pad_batch": "jaxdp.mesh",
    "STRATEGIES": "jaxdp.registry",
    "TrainState": "jaxdp.step.state",
    "TrainStep": "jaxdp.step.train_step",
    "batch_sharding": "jaxdp.mesh",
    "hierarchical": "jaxdp.sync.hierarchy",
    "host_mean": "jaxdp.sync.host",
    "init_state": "jaxdp.step.state",
    "initialize": "jaxdp.cluster.distributed",
    "is_on_host": "jaxdp.sync.collectives",
    "make_eval_step": "jaxdp.step.train_step",
    "make_mesh": "jaxdp.mesh",
    "make_optimizer": "jaxdp.step.optim",
    "make_train_step": "jaxdp.step.train_step",
    "on_host": "jaxdp.sync.collectives",
    "psum_mean": "jaxdp.sync.collectives",
    "replicate": "jaxdp.mesh",
    "replicated_sharding": "jaxdp.mesh",
    "ring_allreduce": "jaxdp.sync.ring",
    "ring_mean": "jaxdp.sync.ring",
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
