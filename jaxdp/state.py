"""The train state (an immutable pytree, replicated over the mesh) and optimizer construction."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxdp.mesh import replicate, replicated_sharding


class OptimizerTag:
    """The optax transformation a state was made for, carried in the TrainState's static part.

    It only lets `make_train_step` check that it was given the same optimizer as `init_state`.
    Two tags always compare equal, so states made with different optimizer objects still have the
    same tree structure (they can be compared leaf by leaf, restored into each other, and share
    a compiled step).
    """

    def __init__(self, tx: optax.GradientTransformation | None):
        self.tx = tx

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OptimizerTag)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "OptimizerTag(...)"


@flax.struct.dataclass
class SyncState:
    """State of the gradient-synchronisation layer, by the name of the feature that owns it (e.g.
    "compression": error feedback per device, PowerSGD's warm start shared; "local_sgd": each
    device's replica and inner optimizer state, "outer": the outer optimizer's state).

    per_device: {name: tree}; every leaf has a leading axis as long as the mesh, sharded over the
                data axis: row i belongs to device i.
    shared:     {name: tree}; replicated, identical on every device.

    A checkpoint resumed on another device count gives every new device the mean of the old
    devices' rows (jaxdp/checkpoint.py).
    """

    per_device: dict = flax.struct.field(default_factory=dict)
    shared: dict = flax.struct.field(default_factory=dict)


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; update it with `.replace(...)`.

    step:        int32 scalar, number of updates applied so far.
    params:      the model parameters.
    opt_state:   the optax state for `params` (replicated), or with `shard_optimizer=True` a
                 `jaxdp.zero.ShardedOptState`: the state of the flat buffers, 1/N per device; with
                 local steps `()` (the inner states are per device, in `sync`).
    model_state: mutable model collections (e.g. {"batch_stats": ...}); {} when the model has none.
    rng:         a raw uint32[2] PRNG key; the step derives per-step, per-device keys from it and
                 `step`, so it never changes and a resumed run draws the same numbers.
    sync:        `SyncState`: what gradient compression keeps between steps, and with local steps
                 (jaxdp/local_sgd.py) every device's replica and inner optimizer state
                 (`per_device["local_sgd"]`) and the outer optimizer state (`shared["outer"]`);
                 empty without them. `params` stay the global parameters.
    optimizer:   (static) which optax transformation `opt_state` belongs to; not an array.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = flax.struct.field(default_factory=dict)
    rng: jax.Array | None = None
    sync: SyncState = flax.struct.field(default_factory=SyncState)
    optimizer: OptimizerTag = flax.struct.field(pytree_node=False, default=OptimizerTag(None))


def init_state(params: Any, tx: optax.GradientTransformation, mesh: Mesh, *,
               model_state: Any = None, rng: Any = 0, shard_optimizer: bool = False,
               compression: Any = None, sync_every: int = 1,
               outer_tx: optax.GradientTransformation | None = None, sync_fragments: int = 1) -> TrainState:
    """A TrainState with `params` (and `model_state`) replicated over `mesh` and a fresh `tx` state.

    `params` may be host or device values; in a multi-process run every process must pass the
    same values (initialise from the same seed). `rng` is an int seed or a PRNG key. Pass the same
    `tx` object to `make_train_step`: it checks.

    `shard_optimizer=True` (ZeRO-1, jaxdp/zero.py): the optimizer state is cut into one 1/N slice
    per device instead of replicated; pass it to `make_train_step` too. InputError if `tx` looks at
    the parameter tree itself and so cannot run on the flat slices.

    `compression` ("bf16", "powersgd:RANK", "auto", or a `jaxdp.compression.Compressor`; None or
    "none": no state): the state gradient compression keeps between steps, in `state.sync`; pass
    the same to `make_train_step`. A state made for "auto" serves every candidate of the adaptive
    controller (jaxdp/compression.py).

    `sync_every=H` (> 1) or an `outer_tx`: local steps (jaxdp/local_sgd.py, DiLoCo). Every device's
    replica of `params` and its own `tx` state go into `state.sync.per_device["local_sgd"]`, the
    `outer_tx` state (default `optax.sgd(1.0)`: plain averaging) into `state.sync.shared["outer"]`;
    `state.opt_state` is `()`. Pass the same `sync_every`, `outer_tx` and `sync_fragments` (Streaming
    DiLoCo: the outer state is one per fragment) to `make_train_step`.
    """
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.PRNGKey(int(rng))
    elif jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    from jaxdp import compression as compression_lib, local_sgd

    params = replicate(params, mesh)
    sync = compression_lib.sync_state(compression, params, mesh)
    local = local_sgd.check_sync_every(sync_every, sync_fragments) > 1 or outer_tx is not None
    if local and shard_optimizer:
        raise ValueError("init_state: local steps (sync_every > 1 or an outer_tx) and shard_optimizer do not combine")
    if local:
        per_device, shared = local_sgd.init_sync(params, tx, mesh, outer_tx, sync_fragments)
        sync = sync.replace(per_device={**sync.per_device, **per_device}, shared={**sync.shared, **shared})
        opt_state = ()
    elif shard_optimizer:
        from jaxdp import zero

        opt_state = zero.init(params, tx, mesh)
    else:
        opt_state = jax.jit(tx.init, out_shardings=replicated_sharding(mesh))(params)
    return TrainState(
        step=replicate(np.int32(0), mesh),
        sync=sync,
        params=params,
        opt_state=opt_state,
        model_state=replicate({} if model_state is None else model_state, mesh),
        rng=replicate(np.asarray(rng, dtype=np.uint32), mesh),
        optimizer=OptimizerTag(tx),
    )


# ---------------------------------------------------------------------------------------------
# The optimizers behind --optimizer (jaxdp.registry.OPTIMIZERS): (lr, momentum, weight_decay) -> tx
# ---------------------------------------------------------------------------------------------


def adam(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.adam(lr)


def adamw(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.adamw(lr, weight_decay=weight_decay)


def sgd(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.sgd(lr)


def momentum(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=momentum)


def make_optimizer(name: str, lr: Any, momentum: float = 0.9, weight_decay: float = 1e-4, *,
                   clip_norm: float = 0.0) -> optax.GradientTransformation:
    """The optax optimizer called `name` in `jaxdp.registry.OPTIMIZERS`; `lr` may be a schedule.
    `clip_norm` > 0 clips the global gradient norm first (optax.clip_by_global_norm)."""
    from jaxdp.registry import OPTIMIZERS

    tx = OPTIMIZERS[name](lr, momentum, weight_decay)
    return optax.chain(optax.clip_by_global_norm(clip_norm), tx) if clip_norm else tx


# The outer optimizers behind --outer-optimizer (jaxdp.registry.OUTER_OPTIMIZERS; local steps,
# jaxdp/local_sgd.py): (lr, momentum) -> tx, applied to the averaged pseudo-gradient every sync.


def nesterov_outer(lr: float, momentum: float) -> optax.GradientTransformation:
    if not momentum:
        raise ValueError("the nesterov outer optimizer needs a momentum > 0; use sgd for none")
    return optax.sgd(lr, momentum=momentum, nesterov=True)


def sgd_outer(lr: float, momentum: float) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=momentum or None)


def make_outer_optimizer(name: str, lr: float, momentum: float) -> optax.GradientTransformation:
    """The optimizer that applies the averaged pseudo-gradient to the global parameters every sync,
    by its name in `jaxdp.registry.OUTER_OPTIMIZERS`: "nesterov" (DiLoCo: lr 0.7, momentum 0.9) or
    "sgd" (heavy-ball momentum if `momentum` > 0; lr 1 and momentum 0 is plain model averaging,
    Local SGD)."""
    from jaxdp.registry import OUTER_OPTIMIZERS

    return OUTER_OPTIMIZERS[name](lr, momentum)


# ---------------------------------------------------------------------------------------------
# The schedules behind --schedule (jaxdp.registry.SCHEDULES): (lr, steps, warmup, final) -> schedule
# ---------------------------------------------------------------------------------------------


def constant_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    del steps, final_fraction
    if warmup_steps:
        return optax.linear_schedule(0.0, lr, warmup_steps)
    return optax.constant_schedule(lr)


def cosine_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    del warmup_steps
    return optax.cosine_decay_schedule(lr, max(steps, 1), alpha=final_fraction)


def warmup_cosine_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(steps, warmup_steps + 1),
                                              end_value=lr * final_fraction)


def make_schedule(name: str, lr: float, steps: int, warmup_steps: int = 0, final_fraction: float = 0.1) -> optax.Schedule:
    """The learning rate as a function of the step, by its name in `jaxdp.registry.SCHEDULES`."""
    from jaxdp.registry import SCHEDULES

    return SCHEDULES[name](lr, steps, warmup_steps, final_fraction)
