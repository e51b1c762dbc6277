"""Local steps with infrequent averaging: Local SGD and DiLoCo (Douillard et al., 2023).

    state = jaxdp.init_state(params, tx, mesh, sync_every=16, outer_tx=optax.sgd(0.7, momentum=0.9, nesterov=True))
    step  = jaxdp.make_train_step(loss_fn, tx, mesh, sync_every=16, outer_tx=<the same outer_tx>)
    state, metrics = step(state, batch)          # metrics["synced"]: 1.0 on a sync step, else 0.0

The replica is the DEVICE: every device of the mesh, in every process, keeps its own copy of the
parameters and of the inner optimizer state (`tx`, e.g. AdamW) and trains it on its own slice of
each global batch with no gradient all-reduce. After every `sync_every` (H) steps, i.e. on the step
with (step + 1) % H == 0, each device computes its pseudo-gradient (global params - its params),
the devices average it through the strategy's sum (psum or ring, pre-scaled by 1/N) and the
compression if any (jaxdp/compression.py: the pseudo-gradient is what gets compressed, its state in
`state.sync` as for gradients), and the outer optimizer (`outer_tx`, any optax transformation;
DiLoCo: SGD with Nesterov momentum 0.9, lr 0.7) applies that mean to the shared global
parameters. Every replica then restarts from the new global parameters; the inner optimizer state
stays per device (DiLoCo keeps each worker's AdamW moments).

With H = 1, `outer_tx=optax.sgd(1.0)` and a plain SGD inner optimizer this is exactly synchronous
training (tests/test_local_sgd.py checks it). With Adam as the inner optimizer H = 1 is NOT the
same as synchronous Adam: every device keeps moment estimates of its own gradients, not of the
averaged gradient. `outer_tx=None` with H > 1 means plain model averaging, `optax.sgd(1.0)`
(Local SGD).

Where it lives in the TrainState:

* `state.params`: the global (outer) parameters, replicated; eval and checkpoints read them as
  before. Between syncs they are the parameters of the last sync.
* `state.sync.per_device["local_sgd"]`: {"params", "opt_state"}: each device's replica and inner
  optimizer state, one row per device (leading axis = mesh size, sharded over the data axis).
* `state.sync.shared["outer"]`: the outer optimizer's state, replicated.
* `state.opt_state`: `()`; the inner optimizer states are the per-device rows.

What is communicated between syncs: the scalar metrics (loss, aux, the gradient norm) and the float
leaves of the model state (BatchNorm statistics, none for the MLP and GPT) are averaged over the
devices in one tiny all-reduce every step, so the logged loss is the mean of the replicas' losses
on their own slices and every process sees the same values (the NaN guard agrees). `grad_norm` is
the mean over devices of each replica's own gradient norm. `comm_bytes` is what a device sent for
the pseudo-gradient on this step (0 between syncs) and `comm_bytes_per_step` its average over a
period.

How the step decides: one compiled program with `jax.lax.cond((step + 1) % H == 0, sync, local)`
on the replicated step counter. Every device of every process reads the same counter, so all take
the same branch and the sync branch's collectives run on all devices or none; the decision is a
pure function of `state.step`, which checkpoints hold, so a run resumed in the middle of a period
syncs at the same steps as one that never stopped; and the caller (the CLI loop, a notebook) passes
nothing extra and compiles once. (Two programs chosen on the host would need the step number on the
host: a device read per step for a notebook caller.) Preemption stops every process after the same
step as before (jaxdp/preemption.py), whichever branch that step took.

A checkpoint restored on another device count gives every new device the mean of the old rows
(jaxdp/checkpoint.py). For the replicas that is a sync without the outer step: the mean replica
is exactly what the next sync would average (uncompressed), so the pseudo-gradient of the next
sync, global - mean(replicas), is unchanged; the inner optimizer states become their mean too.

For an adaptive controller: `comm_seconds_per_step(comm_model, payload_bytes, H)` predicts the
per-step communication time of local steps, and `choose_sync_every` the smallest H that fits a
budget.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

STATE_NAME = "local_sgd"   # state.sync.per_device[STATE_NAME] = {"params": rows, "opt_state": rows}
OUTER_NAME = "outer"       # state.sync.shared[OUTER_NAME] = the outer optimizer's state


def is_local(state: Any) -> bool:
    """True for a TrainState made with `init_state(..., sync_every=H > 1 or outer_tx=...)`."""
    return STATE_NAME in state.sync.per_device


def optimizer_states(state: Any) -> Any:
    """The inner (per-device rows) and outer optimizer states of a local state; () otherwise."""
    if not is_local(state):
        return ()
    return state.sync.per_device[STATE_NAME]["opt_state"], state.sync.shared[OUTER_NAME]


def check_sync_every(sync_every: Any) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, (int, np.integer)) or sync_every < 1:
        raise ValueError(f"sync_every must be a positive integer (1: synchronise every step), got {sync_every!r}")
    return int(sync_every)


def default_outer(outer_tx: optax.GradientTransformation | None) -> optax.GradientTransformation:
    """`outer_tx`, or plain model averaging (Local SGD): SGD with lr 1, no momentum."""
    return optax.sgd(1.0) if outer_tx is None else outer_tx


def init_sync(params: Any, tx: optax.GradientTransformation, mesh: Mesh,
              outer_tx: optax.GradientTransformation | None) -> tuple[dict, dict]:
    """(per_device, shared) entries of a new TrainState's SyncState: every device's replica = `params`
    with a fresh `tx` state, stacked one row per device and sharded over the data axis; the outer
    optimizer's state replicated. `params` are the replicated global parameters."""
    from jaxdp.mesh import axis_name, replicated_sharding

    rows = NamedSharding(mesh, P(axis_name(mesh)))
    inner = jax.jit(tx.init, out_shardings=replicated_sharding(mesh))(params)
    stack = jax.jit(lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (mesh.size, *jnp.shape(x))), tree),
                    out_shardings=rows)
    outer = jax.jit(default_outer(outer_tx).init, out_shardings=replicated_sharding(mesh))(params)
    return {STATE_NAME: stack({"params": params, "opt_state": inner})}, {OUTER_NAME: outer}


# ---------------------------------------------------------------------------------------------
# The step (built by jaxdp.step.make_train_step when the state is local)
# ---------------------------------------------------------------------------------------------


def make_device_step(local_grads: Callable, tx: optax.GradientTransformation, outer_tx: optax.GradientTransformation,
                     sync: Callable, compressor: Any, axis: str, n: int, sync_every: int, grad_norm: bool) -> Callable:
    """`(state, local batch) -> (state, metrics)` on one device, inside `shard_map`."""
    from jaxdp import compression as compression_lib
    from jaxdp.step import _compress_together, _sync_together

    compressor = compression_lib.NoCompression() if compressor is None else compressor

    def device_step(state: Any, batch: Any) -> tuple[Any, dict]:
        mine = jax.tree.map(lambda x: x[0], state.sync.per_device[STATE_NAME])  # this device's replica
        metrics, model_state, grads = local_grads(state.replace(params=mine["params"]), batch)
        if grad_norm:
            metrics = {**metrics, "grad_norm": optax.global_norm(grads)}  # this replica's own gradient
        updates, inner = tx.update(grads, mine["opt_state"], mine["params"])
        replica = optax.apply_updates(mine["params"], updates)
        step = state.step + 1

        def rows(params: Any, sync_state: Any) -> Any:
            local = {"params": params, "opt_state": inner}
            return sync_state.replace(per_device={**sync_state.per_device, STATE_NAME: jax.tree.map(lambda x: x[None], local)})

        def synced() -> tuple[Any, dict]:
            # The pseudo-gradient: how far this replica moved from the global parameters.
            delta = jax.tree.map(lambda g, r: g - r, state.params, replica)
            mean, out, new_model_state, sync_state = _compress_together(
                compressor, sync, axis, n, delta, metrics, model_state, state)
            updates, outer = outer_tx.update(mean, state.sync.shared[OUTER_NAME], state.params)
            params = optax.apply_updates(state.params, updates)
            sync_state = rows(params, sync_state)  # every replica restarts from the new global parameters
            sync_state = sync_state.replace(shared={**sync_state.shared, OUTER_NAME: outer})
            out = {**out, "synced": jnp.float32(1), "comm_bytes_per_step": out["comm_bytes"] / sync_every}
            return state.replace(step=step, params=params, model_state=new_model_state, sync=sync_state), out

        if sync_every == 1:
            return synced()
        shapes = jax.eval_shape(synced)[1]

        def local() -> tuple[Any, dict]:
            out, new_model_state = metrics, model_state
            if n > 1:  # a few scalars (and BatchNorm statistics), so every process logs the same values
                _, out, new_model_state = _sync_together(sync, axis, {}, metrics, model_state)
            out = {**{k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}, **out,
                   "comm_bytes_per_step": shapes_bytes / sync_every}
            return state.replace(step=step, model_state=new_model_state, sync=rows(replica, state.sync)), out

        shapes_bytes = jnp.float32(compressor.payload_bytes(grads) * 2 * (n - 1) / n)
        return jax.lax.cond(step % sync_every == 0, synced, local)

    return device_step


# ---------------------------------------------------------------------------------------------
# For an adaptive controller: the per-step communication time of local steps
# ---------------------------------------------------------------------------------------------


def comm_seconds_per_step(comm_model: Any, payload_bytes: int, sync_every: int, collectives: int = 1) -> float:
    """Predicted all-reduce seconds per step, averaged over a period of `sync_every` steps: one
    all-reduce of the pseudo-gradient (`payload_bytes`, in `collectives` calls) per period.
    `comm_model` is a `jaxdp.compression.CommModel` (latency + bytes / bandwidth). The per-step
    scalar metrics (a few floats) are left out: one latency each step, `comm_model.latency_s`."""
    return comm_model.seconds(payload_bytes, collectives) / check_sync_every(sync_every)


def choose_sync_every(compute_seconds: float, comm_model: Any, payload_bytes: int, collectives: int = 1,
                      target_fraction: float | None = None, max_sync_every: int = 1024) -> int:
    """The smallest H whose predicted per-step communication is at most `target_fraction` (default:
    jaxdp.compression.TARGET_COMM_FRACTION) of the compute time, capped at `max_sync_every`."""
    from jaxdp.compression import TARGET_COMM_FRACTION

    target = (TARGET_COMM_FRACTION if target_fraction is None else target_fraction) * compute_seconds
    per_sync = comm_model.seconds(payload_bytes, collectives)
    if target <= 0:
        return max_sync_every
    return int(min(max(1, math.ceil(per_sync / target)), max_sync_every))
