"""The train state (an immutable pytree, replicated over the mesh) and `init_state`.

`init_state` composes what each sync axis keeps (jaxdp/sync/spec.py): the codec's slot
(jaxdp/sync/exchange.py), local steps' replicas and outer state (jaxdp/step/local_sgd.py), ZeRO-1's sharded
optimizer state (jaxdp/step/zero.py). The state carries the `StateLayout` it was made for as a static
tag, which the step compares with its own. Optimizers and schedules: jaxdp/step/optim.py.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxdp.mesh import replicate, replicated_sharding
from jaxdp.moved import forwarder
from jaxdp.step import fsdp, hsdp, local_sgd, zero
from jaxdp.sync import exchange
from jaxdp.sync.spec import StateLayout, SyncSpec


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
    devices' rows (jaxdp/checkpoint/checkpointer.py).
    """

    per_device: dict = flax.struct.field(default_factory=dict)
    shared: dict = flax.struct.field(default_factory=dict)


@flax.struct.dataclass
class TrainState:
    """Everything a step reads and writes; update it with `.replace(...)`.

    step:        int32 scalar, number of updates applied so far.
    params:      the model parameters.
    opt_state:   the optax state for `params` (replicated), or with `shard_optimizer=True` a
                 `jaxdp.step.zero.ShardedOptState`: the state of the flat buffers, 1/N per device; with
                 local steps `()` (the inner states are per device, in `sync`).
    model_state: mutable model collections (e.g. {"batch_stats": ...}); {} when the model has none.
    rng:         a raw uint32[2] PRNG key; the step derives per-step, per-device keys from it and
                 `step`, so it never changes and a resumed run draws the same numbers.
    sync:        `SyncState`: what gradient compression keeps between steps, and with local steps
                 (jaxdp/step/local_sgd.py) every device's replica and inner optimizer state
                 (`per_device["local_sgd"]`) and the outer optimizer state (`shared["outer"]`);
                 empty without them. `params` stay the global parameters.
    optimizer:   (static) which optax transformation `opt_state` belongs to; not an array.
    layout:      (static) the `jaxdp.sync.spec.StateLayout` it was made for (replicated, local or
                 sharded; fragments; what its compression slot serves); `make_train_step`'s step
                 compares it with its own.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = flax.struct.field(default_factory=dict)
    rng: jax.Array | None = None
    sync: SyncState = flax.struct.field(default_factory=SyncState)
    optimizer: OptimizerTag = flax.struct.field(pytree_node=False, default=OptimizerTag(None))
    layout: StateLayout = flax.struct.field(pytree_node=False, default=StateLayout())


def init_state(params: Any, tx: optax.GradientTransformation, mesh: Mesh, *,
               model_state: Any = None, rng: Any = 0, shard_optimizer: bool = False,
               compression: Any = None, sync_every: int = 1,
               outer_tx: optax.GradientTransformation | None = None, sync_fragments: int = 1,
               shard_params: bool = False) -> TrainState:
    """A TrainState with `params` (and `model_state`) replicated over `mesh` and a fresh `tx` state.

    `params` may be host or device values; in a multi-process run every process must pass the
    same values (initialise from the same seed). `rng` is an int seed or a PRNG key. Pass the same
    `tx` object to `make_train_step`: it checks.

    `shard_optimizer=True` (ZeRO-1, jaxdp/step/zero.py): the optimizer state is cut into one 1/N slice
    per device instead of replicated; pass it to `make_train_step` too. InputError if `tx` looks at
    the parameter tree itself and so cannot run on the flat slices.

    `compression` ("bf16", "int8", "int4", "powersgd:RANK", "auto", or a `jaxdp.sync.codecs.base.Compressor`; None or
    "none": no state): the state gradient compression keeps between steps, in `state.sync`; pass
    the same to `make_train_step`. A state made for "auto" serves every candidate of the adaptive
    controller (jaxdp/sync/controller.py).

    `sync_every=H` (> 1) or an `outer_tx`: local steps (jaxdp/step/local_sgd.py, DiLoCo). Every device's
    replica of `params` and its own `tx` state go into `state.sync.per_device["local_sgd"]`, the
    `outer_tx` state (default `optax.sgd(1.0)`: plain averaging) into `state.sync.shared["outer"]`;
    `state.opt_state` is `()`. Pass the same `sync_every`, `outer_tx` and `sync_fragments` (Streaming
    DiLoCo: the outer state is one per fragment) to `make_train_step`.

    `shard_params=True` (ZeRO-3 / FSDP, jaxdp/step/fsdp.py): `params` and the optimizer state cut
    over the devices, each leaf along its largest dimension the device count divides (on the mesh
    ("hosts", "local"): over "local", a whole copy per process). With compression or local steps the
    rows of `state.sync` are one per worker (process), cut the same way (jaxdp/step/hsdp.py).
    """
    # The state does not depend on the strategy: check the other choices against the in-graph one
    # that can do everything (ring; int8 / int4 need its hops), make_train_step checks the strategy.
    spec = SyncSpec(strategy="ring", compression=compression, sync_every=sync_every,
                    sync_fragments=sync_fragments, outer_tx=outer_tx, shard_optimizer=shard_optimizer,
                    shard_params=shard_params)
    spec.validate()  # the one table (jaxdp/sync/rules.py): local steps and shard_optimizer do not combine, ...
    if isinstance(rng, (int, np.integer)):
        rng = jax.random.PRNGKey(int(rng))
    elif jnp.issubdtype(jnp.result_type(rng), jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)

    params = fsdp.place(params, mesh) if shard_params else replicate(params, mesh)
    per_device, shared = (hsdp.init_slot if shard_params else exchange.init_slot)(compression, params, mesh)
    if spec.local and shard_params:  # one replica per worker, cut over its devices (jaxdp/step/hsdp.py)
        rows, outer = hsdp.init_local(params, tx, mesh, outer_tx, sync_fragments)
        per_device, shared = {**per_device, **rows}, {**shared, **outer}
        opt_state = ()
    elif spec.local:
        rows, outer = local_sgd.init_sync(params, tx, mesh, outer_tx, sync_fragments)
        per_device, shared = {**per_device, **rows}, {**shared, **outer}
        opt_state = ()
    elif shard_params:
        opt_state = fsdp.init_opt_state(params, tx, mesh)
    elif shard_optimizer:
        opt_state = zero.init(params, tx, mesh)
    else:
        opt_state = jax.jit(tx.init, out_shardings=replicated_sharding(mesh))(params)
    return TrainState(
        step=replicate(np.int32(0), mesh),
        sync=SyncState(per_device=per_device, shared=shared),
        params=params,
        opt_state=opt_state,
        model_state=replicate({} if model_state is None else model_state, mesh),
        rng=replicate(np.asarray(rng, dtype=np.uint32), mesh),
        optimizer=OptimizerTag(tx),
        layout=spec.layout(),
    )


# The optimizer builders lived here before jaxdp/step/optim.py.
__getattr__ = forwarder(__name__, dict.fromkeys(
    ("adam", "adamw", "sgd", "momentum", "make_optimizer", "nesterov_outer", "sgd_outer", "make_outer_optimizer",
     "constant_schedule", "cosine_schedule", "warmup_cosine_schedule", "make_schedule"), "jaxdp.step.optim"))
