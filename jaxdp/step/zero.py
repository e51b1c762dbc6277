"""ZeRO-1: the optimizer state sharded over the data axis, one 1/N slice per device.

    state = init_state(params, tx, mesh, shard_optimizer=True)
    step = make_train_step(loss_fn, tx, mesh, strategy="ring", shard_optimizer=True)

A replicated data-parallel step all-reduces the gradients and then every device runs the same
optimizer update on all of them. ZeRO stage 1 splits the all-reduce into its two halves and puts
the update in between:

    reduce-scatter the gradients  ->  each device updates its own 1/N of the parameters, with
    its own 1/N of the optimizer state  ->  all-gather the updated parameters

The same bytes cross the wire as in one all-reduce (a reduce-scatter plus an all-gather is what
a ring all-reduce is), but each device keeps 1/N of the optimizer state and does 1/N of the
update's work. With `strategy="ring"` the halves are the explicit ring's own
(`jaxdp.sync.collectives.ring_reduce_scatter`, `ring_all_gather`); with `psum` they are XLA's
`psum_scatter` and `all_gather` (on CPU across processes the ring's reduce-scatter instead:
`jaxdp.sync.collectives.psum_scatter` says why).

Layout (`FlatLayout`): every parameter leaf is raveled into a flat buffer, zero-padded to a
multiple of N and cut into N equal chunks; device i owns chunk i of every buffer. The optimizer
sees those buffers (a `FlatBuffers`) as its parameters. How the buffers travel is the strategy's
business (`scatter` / `gather`): XLA's collectives take them one by one (XLA combines them, and a
buffer whose leaf divides evenly needs no copy), while the ring, and any strategy across
processes (where every collective is a round trip), interleaves them into one buffer per dtype,
each device's chunks side by side, so one collective carries them all. Zeros in the padding stay zero: a zero
gradient and a zero parameter give a zero update under every elementwise optimizer.

The update runs on global arrays sharded over the data axis, outside `shard_map`: elementwise
work stays on each device's chunk, and XLA inserts the all-reduce a reduction needs. So
`optax.clip_by_global_norm` (a norm over all chunks) is exact, and so is a statistic per leaf
such as LAMB's trust ratio (each leaf is its own buffer). What cannot work on flat buffers is an
optimizer that looks at the parameter tree's structure or shapes: per-leaf masks (`optax.masked`,
`multi_transform`), factored moments of 2-D leaves (`adafactor`).
`init_state` therefore runs every optimizer twice on a probe, once on the parameter tree and once
on the flat buffers, and refuses one whose updates differ, with a message saying so.

Checkpoints store the optimizer state in its ordinary, tree-shaped form (what `tx.init(params)`
would make), gathered to host memory. So a sharded run resumes on another device count (the
buffers are cut again) and a run may switch `--shard-optimizer` on or off when it resumes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.errors import InputError
from jaxdp.mesh import data_axes


@flax.struct.dataclass
class FlatBuffers:
    """One flat buffer per dtype group of a `FlatLayout`: the optimizer's view of the parameters."""

    buffers: tuple


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each leaf of a parameter tree lives in the flat buffers, and their padded size.

    `groups[g]` = (dtype name, indices of the leaves in that buffer, in tree order). Each buffer
    holds `size(g)` values followed by zeros up to `shards * chunk(g)`.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[str, tuple[int, ...]], ...]
    shards: int

    @classmethod
    def of(cls, params: Any, shards: int) -> "FlatLayout":
        """One buffer per leaf, each padded to a multiple of `shards` (so a leaf whose size
        divides evenly is its own buffer, reshaped without a copy)."""
        leaves, treedef = jax.tree.flatten(params)
        return cls(treedef, tuple(tuple(np.shape(x)) for x in leaves),
                   tuple((str(jnp.result_type(x)), (i,)) for i, x in enumerate(leaves)), shards)

    def size(self, g: int) -> int:
        return sum(math.prod(self.shapes[i]) for i in self.groups[g][1])

    def chunk(self, g: int) -> int:
        return -(-self.size(g) // self.shards)

    def flatten(self, tree: Any) -> FlatBuffers:
        """Tree with this layout's structure -> padded buffers (jnp inside jit, numpy outside)."""
        leaves = self.treedef.flatten_up_to(tree)
        xp = jnp if any(isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) for x in leaves) else np
        buffers = []
        for g, (_, indices) in enumerate(self.groups):
            flat = xp.concatenate([xp.ravel(leaves[i]) for i in indices])
            buffers.append(xp.pad(flat, (0, self.shards * self.chunk(g) - self.size(g))))
        return FlatBuffers(tuple(buffers))

    def unflatten(self, flat: FlatBuffers) -> Any:
        """Padded (or unpadded) buffers -> the tree; each leaf is a slice of its buffer."""
        leaves: list[Any] = [None] * len(self.shapes)
        for (_, indices), buffer in zip(self.groups, flat.buffers):
            offset = 0
            for i in indices:
                size = math.prod(self.shapes[i])
                leaves[i] = buffer[offset:offset + size].reshape(self.shapes[i])
                offset += size
        return self.treedef.unflatten(leaves)

    def abstract_tree(self, flat: FlatBuffers) -> Any:
        """ShapeDtypeStructs of the tree that `unflatten(flat)` would give."""
        leaves: list[Any] = [None] * len(self.shapes)
        for (_, indices), buffer in zip(self.groups, flat.buffers):
            for i in indices:
                leaves[i] = jax.ShapeDtypeStruct(self.shapes[i], buffer.dtype)
        return self.treedef.unflatten(leaves)

    def resharded(self, shards: int) -> "FlatLayout":
        return dataclasses.replace(self, shards=shards)


@flax.struct.dataclass
class ShardedOptState:
    """`TrainState.opt_state` of a ZeRO-1 state: the optax state of the flat buffers (`inner`),
    each buffer sharded over the data axis; scalars such as Adam's count are replicated."""

    inner: Any
    layout: FlatLayout = flax.struct.field(pytree_node=False)


def scatter(flat: FlatBuffers, reduce_scatter: Callable, axis: str, shards: int, fuse: bool) -> FlatBuffers:
    """Inside shard_map: every buffer's chunk i, averaged over devices, on device i. An empty buffer
    (a zero-size leaf: nothing to average) is its own chunk and takes part in no collective."""
    if not fuse:
        return FlatBuffers(tuple(reduce_scatter(b, axis) if b.size else b for b in flat.buffers))
    owned: list[Any] = [None if b.size else b for b in flat.buffers]
    for indices in _by_dtype(flat.buffers).values():
        rows = jnp.concatenate([flat.buffers[i].reshape(shards, -1) for i in indices], axis=1)  # device i: row i
        for i, part in zip(indices, _split(reduce_scatter(rows.reshape(-1), axis), [flat.buffers[i].shape[0] // shards
                                                                                  for i in indices])):
            owned[i] = part
    return FlatBuffers(tuple(owned))


def gather(owned: FlatBuffers, all_gather: Callable, axis: str, shards: int, fuse: bool) -> FlatBuffers:
    """Inside shard_map: `scatter`'s inverse for complete chunks: every buffer, whole, everywhere."""
    if not fuse:
        return FlatBuffers(tuple(all_gather(b, axis) if b.size else b for b in owned.buffers))
    whole: list[Any] = [None if b.size else b for b in owned.buffers]
    for indices in _by_dtype(owned.buffers).values():
        widths = [owned.buffers[i].shape[0] for i in indices]
        rows = all_gather(jnp.concatenate([owned.buffers[i] for i in indices]), axis).reshape(shards, -1)
        offsets = np.cumsum([0, *widths])
        for k, i in enumerate(indices):
            whole[i] = rows[:, offsets[k]:offsets[k + 1]].reshape(-1)
    return FlatBuffers(tuple(whole))


def _by_dtype(buffers: tuple) -> dict[Any, list[int]]:
    """The non-empty buffers' indices by dtype (an empty one travels nowhere)."""
    groups: dict[Any, list[int]] = {}
    for i, b in enumerate(buffers):
        if b.size:
            groups.setdefault(b.dtype, []).append(i)
    return groups


def _split(flat: jax.Array, sizes: list[int]) -> list[jax.Array]:
    offsets = np.cumsum([0, *sizes])
    return [flat[offsets[k]:offsets[k + 1]] for k in range(len(sizes))]


# ---------------------------------------------------------------------------------------------
# The step: reduce-scatter -> each device's update of its 1/N -> all-gather.
# ---------------------------------------------------------------------------------------------


def make_step(local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, collective: Any, exchange: Any,
              grad_norm: bool) -> Callable:
    """The jitted ZeRO-1 step `(state, batch) -> (state, metrics)` (the old state donated).

    Two `shard_map`s hold the collective's halves; between them the update runs on global arrays
    sharded over the data axes, so each device updates its own chunk, and XLA adds the all-reduce
    that a global reduction (clip_by_global_norm, the grad_norm metric) needs. The metrics and the
    model state are averaged by `exchange` (jaxdp/sync/exchange.py) as in the replicated step.
    """
    axis = data_axes(mesh)
    reduce_scatter, all_gather = collective.halves
    split = NamedSharding(mesh, P(axis))
    # One collective per buffer where XLA combines them itself (its own collectives, one process);
    # one interleaved buffer per dtype for the ring, and across processes (`scatter`).
    fuse = not collective.xla_combines or jax.process_count() > 1

    def scatter_grads(state: Any, batch: Any, layout: FlatLayout) -> tuple[Any, dict, Any]:
        metrics, model_state, grads = local_grads(state, batch)
        owned = scatter(layout.flatten(grads), reduce_scatter, axis, mesh.size, fuse)
        metrics, model_state = exchange.riders(metrics, model_state)
        return owned, metrics, model_state

    def gather_params(owned: FlatBuffers, layout: FlatLayout) -> Any:
        return layout.unflatten(gather(owned, all_gather, axis, mesh.size, fuse))

    def step(state: Any, batch: Any) -> tuple[Any, dict]:
        layout = state.opt_state.layout
        if layout.shards != mesh.size:
            raise ValueError(f"the optimizer state is cut into {layout.shards} slices but the mesh has {mesh.size} "
                             f"devices; make the state with init_state on this mesh")
        grads, metrics, model_state = jax.shard_map(
            functools.partial(scatter_grads, layout=layout), mesh=mesh, in_specs=(P(), P(axis)),
            out_specs=(P(axis), P(), P()), check_vma=False)(state.replace(opt_state=None), batch)
        owned = jax.lax.with_sharding_constraint(layout.flatten(state.params), split)
        updates, inner = tx.update(grads, state.opt_state.inner, owned)
        owned = jax.lax.with_sharding_constraint(optax.apply_updates(owned, updates), split)
        params = jax.shard_map(functools.partial(gather_params, layout=layout), mesh=mesh, in_specs=P(axis),
                               out_specs=P(), check_vma=False)(owned)
        if grad_norm:
            metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        state = state.replace(step=state.step + 1, params=params, model_state=model_state,
                              opt_state=ShardedOptState(inner, layout))
        return state, metrics

    return jax.jit(step, donate_argnums=0)


def is_sharded(opt_state: Any) -> bool:
    return isinstance(opt_state, ShardedOptState)


def _is_flat(x: Any) -> bool:
    return isinstance(x, FlatBuffers)


def shardings(abstract_inner: Any, mesh: Mesh) -> Any:
    """Sharded over the data axis for every flat buffer of an optax state, replicated otherwise."""
    split, whole = NamedSharding(mesh, P(data_axes(mesh))), NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.tree.map(lambda _: split, x) if _is_flat(x) else whole,
                        abstract_inner, is_leaf=_is_flat)


def init(params: Any, tx: optax.GradientTransformation, mesh: Mesh) -> ShardedOptState:
    """`tx`'s state for `params`, flat and sharded over `mesh` (InputError if `tx` cannot be)."""
    layout = FlatLayout.of(params, mesh.size)
    check_elementwise(tx, params, layout)
    make = lambda p: tx.init(layout.flatten(p))  # noqa: E731
    inner = jax.jit(make, out_shardings=shardings(jax.eval_shape(make, params), mesh))(params)
    return ShardedOptState(inner, layout)


def check_elementwise(tx: optax.GradientTransformation, params: Any, layout: FlatLayout) -> None:
    """InputError unless `tx` gives the same updates on the flat, padded buffers as on the tree.

    Two updates of random gradients (so that state such as momentum and Adam's moments takes
    part), on one device, before training starts.
    """
    leaves = jax.tree.leaves(params)
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * len(leaves))
    draws = [[jax.random.normal(k, np.shape(x), jnp.result_type(x)) for k, x in zip(keys[j::2], leaves)]
             for j in range(2)]
    grads = [layout.treedef.unflatten(d) for d in draws]

    def two_updates(params: Any, grads: list[Any], view: Callable) -> Any:
        params, grads = view(params), [view(g) for g in grads]
        opt_state = tx.init(params)
        for g in grads:
            updates, opt_state = tx.update(g, opt_state, params)
            params = optax.apply_updates(params, updates)
        return updates

    device = jax.local_devices()[0]
    params = jax.device_put(jax.device_get(params), device)
    expected = jax.jit(two_updates, static_argnums=2)(params, grads, lambda t: t)
    try:
        flat = jax.jit(two_updates, static_argnums=2)(params, grads, layout.flatten)
        got = layout.unflatten(flat)
        same = jax.tree.structure(got) == jax.tree.structure(expected) and all(
            _close(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)))
        why = "its updates of the flat buffers differ from its updates of the parameter tree"
    except Exception as err:  # noqa: BLE001 - the optimizer expects the parameter tree itself
        same, why = False, f"it fails on them ({str(err).strip().splitlines()[0][:160]})"
    if not same:
        raise InputError("shard_optimizer: this optax optimizer cannot run on the flat, sharded parameter buffers: "
                         f"{why}; it looks at the parameter tree itself (per-leaf masks, multi_transform, "
                         "or factored statistics of 2-D leaves such as adafactor); train it without "
                         "shard_optimizer", argument="tx")


def _close(a: Any, b: Any) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-30)
    return a.shape == b.shape and float(np.max(np.abs(a - b), initial=0.0)) <= 1e-5 * scale


# ---------------------------------------------------------------------------------------------
# Checkpoints: the optimizer state in its tree form, on the host
# ---------------------------------------------------------------------------------------------


def to_host_tree(opt_state: ShardedOptState) -> Any:
    """The optimizer state as `tx.init(params)` would shape it, as numpy arrays (every process
    gathers the whole of it: host memory, not device memory)."""
    from jax.experimental import multihost_utils

    def gather(x: jax.Array) -> np.ndarray:
        return np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True)

    host = jax.tree.map(gather, opt_state.inner)
    layout = opt_state.layout
    return jax.tree.map(lambda x: layout.unflatten(x) if _is_flat(x) else x, host, is_leaf=_is_flat)


def abstract_tree(opt_state: ShardedOptState) -> Any:
    """ShapeDtypeStructs of `to_host_tree(opt_state)`, without reading any array."""
    layout = opt_state.layout
    return jax.tree.map(lambda x: layout.abstract_tree(x) if _is_flat(x) else jax.ShapeDtypeStruct(x.shape, x.dtype),
                        opt_state.inner, is_leaf=_is_flat)


def from_host_tree(tree: Any, like: ShardedOptState, mesh: Mesh) -> ShardedOptState:
    """`to_host_tree`'s inverse, cut for `mesh` (which may have another device count than the
    run that saved it): flat buffers sharded over the data axis, the rest replicated."""
    layout = like.layout.resharded(mesh.size)
    params_treedef = layout.treedef

    def is_params_shaped(x: Any) -> bool:
        return jax.tree.structure(x) == params_treedef

    inner_host = jax.tree.map(lambda x: layout.flatten(x) if is_params_shaped(x) else np.asarray(x),
                              tree, is_leaf=is_params_shaped)
    placed = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
                          inner_host, shardings(inner_host, mesh))
    return ShardedOptState(placed, layout)


def bytes_per_device(tree: Any) -> int:
    """Bytes of `tree`'s arrays held by one device (the first local one), from their shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.addressable_shards[0]
        total += math.prod(shard.data.shape) * shard.data.dtype.itemsize
    return total
