"""An elastic run's update rule (`jaxdp.launch --elastic`, jaxdp/cluster/elastic.py): the host path, with the
sum across processes done by the launcher's hub, shard by shard, and the state a joining process receives.

    step = make_elastic_step(loss_fn, tx, mesh, member, shard_data)   # member: elastic.from_env()
    state = state_from_arrays(template, payload)                      # a joiner's state, from a live peer
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxdp.mesh import data_axes, replicate, shard_batch
from jaxdp.step.state import TrainState
from jaxdp.step.train_step import Batch, Metrics, TrainStep, _accumulated, _host_metrics, _host_programs, _local_grads_fn
from jaxdp.sync import host
from jaxdp.sync.spec import SyncSpec


def make_elastic_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, member: Any,
                      shard_data: Callable[[int, int], Batch], *, stateful: bool = False, grad_accum: int = 1,
                      grad_norm: bool = False) -> TrainStep:
    """The host path of an elastic run (jaxdp/cluster/elastic.py): `mesh` is this process's devices,
    `member` its link to the launcher, `shard_data(step, shard)` any shard's host rows of a step.

    Each call sums the gradients over this process's devices for every shard it computes (its
    own from `batch`, others' from `shard_data` while their processes are lost), sends the sums,
    gets the total over all `member.size` shards back, and applies the mean. When the launcher
    asks, it then sends the new state to a process that joins.
    """
    from jaxdp.cluster import elastic

    local_grads = _accumulated(_local_grads_fn(loss_fn, stateful, data_axes(mesh)), grad_accum)
    spec = SyncSpec(strategy="host").validate()
    grads_fn, update_fn, to_host = _host_programs(local_grads, tx, mesh)
    devices = member.size * mesh.size

    def shard_sum(state: TrainState, batch: Batch) -> tuple[Any, list[np.ndarray]]:
        return host.device_sum(to_host(state, batch))  # as host_mean adds them

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        at = int(jax.device_get(state.step))  # host sync point (the host path has one anyway)
        shard_batch_at = lambda shard: batch if shard == member.rank else shard_batch(shard_data(at, shard), mesh)  # noqa: E731
        partials = {shard: shard_sum(state, shard_batch_at(shard)) for shard in member.shards}
        treedef, like = next(iter(partials.values())) if partials else shard_sum(state, batch)
        try:
            payload, donate = member.reduce(at, {shard: sums for shard, (_, sums) in partials.items()},
                                            lambda shard: shard_sum(state, shard_batch_at(shard))[1])
        except (elastic.Lost, OSError) as err:  # the launcher is gone: the loop stops with `state` (rank 0 saves it)
            raise elastic.HubGone(f"rank {member.rank} lost the launcher at {member.address} at step {at} ({err})") from None
        totals = elastic.unpack(payload, like)
        means = [(t / devices).astype(t.dtype, copy=False) for t in totals]
        metrics, model_state, grads = jax.tree.unflatten(treedef, means)
        metrics = _host_metrics(dict(metrics), grads, grad_norm)
        grads, model_state = replicate((grads, model_state), mesh)
        state = update_fn(state, grads, model_state)
        if donate:
            try:
                member.send_state(at + 1, state_arrays(state))
            except (elastic.Lost, OSError):
                pass  # the launcher is gone: the next step finds out, and the loop stops with this state
        return state, metrics

    made = TrainStep(step, grads_fn, tx, spec, local_grads)
    made.warm_up = warm_up_fn(shard_sum, update_fn, mesh)
    return made


def warm_up_fn(shard_sum: Callable, update_fn: Callable, mesh: Mesh) -> Callable[[TrainState, Batch], None]:
    """`warm_up(state, batch)`: compile an elastic step's two programs (a shard's sums, the update) on a
    copy of `state`; a process that joins a run does this first (the hub's and torchft's steps alike)."""

    def warm_up(state: TrainState, batch: Batch) -> None:
        treedef, sums = shard_sum(state, batch)
        copy = jax.tree.map(jnp.copy, state)
        _, model_state, grads = jax.tree.unflatten(treedef, sums)
        jax.block_until_ready(update_fn(copy, *replicate((grads, model_state), mesh)))

    return warm_up


def state_arrays(state: TrainState) -> list[np.ndarray]:
    """Every array of `state` on the host, in `jax.tree.leaves` order (what a joining process gets)."""
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(state))]


def state_from_arrays(template: TrainState, payload: Any) -> TrainState:
    """`template` (a state of the same run) with the arrays of `state_arrays`'s bytes, placed as
    `template`'s are."""
    from jaxdp.cluster import elastic

    leaves, treedef = jax.tree.flatten(template)
    arrays = elastic.unpack(payload, leaves)
    return jax.tree.unflatten(treedef, [jax.device_put(a, x.sharding) for a, x in zip(arrays, leaves)])
