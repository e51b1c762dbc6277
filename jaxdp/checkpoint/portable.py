"""A TrainState as checkpoints hold it, and back: whole, on the host, for any device count.

    saved = to_portable(state)                   # ZeRO-1 state in its tree form, per-device rows gathered
    state = from_portable(restored, like=state)  # cut and placed like `like`; rows on another device count
    shapes = flat_shapes(tree)                   # {"params/Dense_0/kernel": (shape, dtype)}
    digests = checksums(jax.device_get(state))   # sha256 of every array's bytes

So a checkpoint written on 8 devices restores on 2, sharded or not (jaxdp/checkpoint/checkpointer.py).

Zero-size arrays (a parameter of shape (0, 4), and its optimizer state) are not written by orbax,
which refuses them ("Cannot save arrays with zero size"): their shape and dtype are all they hold.
So orbax gets the state `without_zero_size` (None in their place), the step's meta records them
(`zero_size_meta`: {ZERO_SIZE: {path: [shape, dtype]}}), and a restore puts them back
(`with_zero_size`, from the restore's target; `load_params` from the record).
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from jaxdp.step import zero
from jaxdp.step.state import TrainState

PER_DEVICE = "sync/per_device/"  # paths of per-device rows (jaxdp.step.state.SyncState): any device count
ZERO_SIZE = "zero_size"  # meta: {path: [shape, dtype]} of the state's zero-size arrays (not in orbax's files)


def to_portable(state: TrainState, abstract: bool = False, stored: dict | None = None) -> TrainState:
    """`state` as checkpoints hold it, whole and on the host: a ZeRO-1 optimizer state
    (jaxdp/step/zero.py) in its tree form, and the per-device rows of `state.sync` gathered from every
    process, so that a checkpoint restores onto any device count, sharded or not.

    `abstract`: shapes only, placed on this process's CPU (a restore reads into host memory, not
    device memory); per-device rows then have the row count `stored` records, if given.
    """
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    if abstract:
        shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host)  # noqa: E731
        opt_state = state.opt_state
        if zero.is_sharded(opt_state):
            opt_state = jax.tree.map(shape, zero.abstract_tree(opt_state))
        per_device = jax.tree_util.tree_map_with_path(
            lambda path, x: jax.ShapeDtypeStruct(_stored_rows(path, x, stored), x.dtype, sharding=host),
            state.sync.per_device)
        return state.replace(opt_state=opt_state, sync=state.sync.replace(per_device=per_device))
    if zero.is_sharded(state.opt_state):
        state = state.replace(opt_state=zero.to_host_tree(state.opt_state))
    return state.replace(sync=state.sync.replace(per_device=jax.tree.map(_gather, state.sync.per_device)))


def _stored_rows(path: Any, x: Any, stored: dict | None) -> tuple[int, ...]:
    name = PER_DEVICE + "/".join(key_name(k) for k in path)
    saved = (stored or {}).get(name)
    return (saved[0][0], *x.shape[1:]) if saved else tuple(x.shape)


def _gather(x: jax.Array) -> np.ndarray:
    """A global array, whole, as numpy on every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)


def from_portable(restored: TrainState, like: TrainState) -> TrainState:
    """`to_portable`'s inverse: the restored state placed like `like`. A sharded optimizer state is
    cut into `like`'s shards; per-device rows saved on another device count become, on every new
    device, the mean of the old rows (what compression's error feedback owes is that mean, and for
    local steps' replicas it is exactly what the next sync would average)."""
    if zero.is_sharded(like.opt_state):
        mesh = jax.tree.leaves(like.params)[0].sharding.mesh
        restored = restored.replace(opt_state=zero.from_host_tree(jax.device_get(restored.opt_state), like.opt_state, mesh))

    def place(saved: Any, want: jax.Array) -> jax.Array:
        rows = np.asarray(saved)
        if rows.shape[0] != want.shape[0]:
            rows = np.broadcast_to(rows.mean(axis=0, dtype=rows.dtype), want.shape)
        return jax.make_array_from_callback(want.shape, want.sharding, lambda index: rows[index])

    per_device = jax.tree.map(place, restored.sync.per_device, like.sync.per_device)
    return restored.replace(sync=restored.sync.replace(per_device=per_device))


def flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{"params/Dense_0/kernel": (shape, dtype)} for a state, or for orbax's metadata of one."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {"/".join(key_name(k) for k in path): (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
            for path, leaf in leaves}


def key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def describe(shape_dtype: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = shape_dtype
    return f"{dtype}{list(shape)}"


def named_leaves(tree: Any) -> dict[str, Any]:
    """{"params/Dense_0/kernel": array} for a state."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(key_name(k) for k in path): leaf for path, leaf in leaves}


def checksums(tree: Any) -> dict[str, str]:
    """{"params/Dense_0/kernel": sha256 of its bytes} for a host (numpy) copy of a state."""
    return {name: hashlib.sha256(np.ascontiguousarray(leaf).tobytes()).hexdigest()
            for name, leaf in named_leaves(tree).items()}


def _is_zero_size(x: Any) -> bool:
    return hasattr(x, "shape") and 0 in tuple(x.shape)


def without_zero_size(tree: Any) -> Any:
    """`tree` with None for each zero-size array: what orbax is given (it cannot save them)."""
    return jax.tree.map(lambda x: None if _is_zero_size(x) else x, tree)


def zero_size_meta(tree: Any) -> dict:
    """{ZERO_SIZE: {path: [shape, dtype]}} of `tree`'s zero-size arrays for a checkpoint's meta; {}
    when it has none (so the meta of every other checkpoint stays as it was)."""
    shapes = {path: [list(shape), dtype] for path, (shape, dtype) in flat_shapes(tree).items() if 0 in shape}
    return {ZERO_SIZE: shapes} if shapes else {}


def recorded_zero_size(meta: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """`zero_size_meta`'s record, as `flat_shapes` gives shapes: {path: (shape, dtype)}."""
    recorded = meta.get(ZERO_SIZE) if isinstance(meta, dict) else None
    return {path: (tuple(int(n) for n in shape), str(np.dtype(dtype)))
            for path, (shape, dtype) in (recorded or {}).items()}


def with_zero_size(restored: Any, target: Any) -> Any:
    """`without_zero_size`'s inverse after a restore into `target` (arrays or ShapeDtypeStructs):
    each zero-size array of `target` made anew, with its shape, dtype and sharding (numpy without
    one), the rest from `restored`."""
    def zeros(want: Any) -> Any:
        empty = np.zeros(want.shape, want.dtype)
        sharding = getattr(want, "sharding", None)
        return empty if sharding is None else jax.make_array_from_callback(want.shape, sharding, lambda i: empty[i])
    return jax.tree.map(lambda want, got: zeros(want) if _is_zero_size(want) else got, target, restored)


def without_unsaved_feedback(state: Any, shapes: dict) -> tuple[Any, list[str]]:
    """(`state` less what of its codec's slot checkpoint `shapes` lacks, those names): the codec
    that owns the slot migrates an older checkpoint's layout (jaxdp.sync.codecs.base.Compressor.restorable)."""
    from jaxdp.sync.codecs.base import SLOT, migration

    owner = migration(state.layout.compression)
    slot, missing = owner.restorable(state.sync.per_device.get(SLOT), lambda k: f"sync/per_device/{SLOT}/{k}" in shapes)
    if not missing:
        return state, []
    return state.replace(sync=state.sync.replace(per_device={**state.sync.per_device, SLOT: slot})), missing


def with_feedback(restored: Any, fresh: Any, owed: list[str]) -> Any:
    """`without_unsaved_feedback`'s inverse: the slot's rows it left out, from `fresh` (a new slot)."""
    if not owed:
        return restored
    from jaxdp.sync.codecs.base import SLOT, migration

    slot = migration(fresh.layout.compression).refill(restored.sync.per_device[SLOT], fresh.sync.per_device[SLOT], owed)
    return restored.replace(sync=restored.sync.replace(per_device={**restored.sync.per_device, SLOT: slot}))
