"""jaxdp: data-parallel training for JAX/Flax models over a device mesh.

    import jaxdp
    mesh  = jaxdp.make_mesh()
    state = jaxdp.init_state(params, tx, mesh)
    step  = jaxdp.make_train_step(loss_fn, tx, mesh, strategy="ring")
    state, metrics = step(state, jaxdp.shard_batch(host_batch, mesh))
    with jaxdp.Checkpointer("/tmp/run") as ckpt:   # orbax: ckpt.save(state), ckpt.restore(state)
        state = ckpt.restore(state)
"""

from jaxdp import malloc_env

malloc_env.reexec_if_needed()  # `python -m jaxdp.train|bench` only, before JAX loads: see malloc_env.py

from jaxdp.checkpoint import Checkpointer  # noqa: E402
from jaxdp.mesh import DATA_AXIS, batch_sharding, make_mesh, replicate, replicated, shard_batch
from jaxdp.state import TrainState, init_state, make_optimizer
from jaxdp.step import make_eval_step, make_train_step
from jaxdp.sync import STRATEGIES, host_mean, on_host, psum_mean, ring_allreduce, ring_mean

__version__ = "0.1.0"

__all__ = [
    "Checkpointer", "DATA_AXIS", "STRATEGIES", "TrainState", "__version__", "batch_sharding", "host_mean", "init_state",
    "make_eval_step", "make_mesh", "make_optimizer", "make_train_step", "on_host", "psum_mean",
    "replicate", "replicated", "ring_allreduce", "ring_mean", "shard_batch",
]
