"""The exchange: the mean of per-device trees over the mesh, a collective and (maybe) a codec.

    exchange = make_exchange(RING, PowerSGD(rank=4))      # or make_exchange(PSUM) for plain averaging
    # inside shard_map, on one device:
    mean, metrics, model_state, sync, extra = exchange.mean(grads, metrics, model_state, state.sync, state.step)

Every update rule averages through an exchange: the replicated step its gradients, local steps
their pseudo-gradients (jaxdp/step/local_sgd.py). The scalar metrics and the float leaves of the model
state (BatchNorm statistics) ride along in the same collective (`riders`), so they cost no
latency of their own. `extra` holds the metrics the exchange adds ("comm_bytes",
"compression_ratio" and the codec's scalars; {} for plain averaging).

A codec's state (error feedback, PowerSGD's warm-start Q) lives in the train state's `state.sync`,
in the slot the codec owns (jaxdp/sync/codecs/base.py): the exchange asks the codec to read and
write it (`codec.read`, `codec.write`) and never asks what class a codec is. `init_slot` places a
new slot on the mesh, for one codec or for "auto" (one slot serving every candidate of the
controller's ladder: jaxdp.sync.costmodel.auto_slot).

A new way to average (a delayed all-reduce, a hierarchical exchange) is a new class here with the
same `mean`, plus its field in jaxdp/sync/spec.py, its rows in jaxdp/sync/rules.py and its flag; a new
codec is a file in jaxdp/sync/codecs/ and a line in its table, and needs nothing here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.mesh import data_axes, replicate
from jaxdp.registry import AUTO
from jaxdp.sync import codecs, rules
from jaxdp.sync.codecs.base import SLOT, CompressionState, Compressor, bytes_sent, entries, leaf_key, store, stored, \
    uncompressed_bytes
from jaxdp.sync.collectives import Collective

Tree = Any
STATE_NAME = SLOT  # the codec's slot in state.sync (older code reads the name here; the codec owns it)


def leaf_names(tree: Tree) -> list[str]:
    """`leaf_key` of every leaf, in flatten order."""
    return [leaf_key(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def float_leaves(tree: Tree) -> tuple[list[Any], Callable[[list[Any]], Tree]]:
    """The tree's float leaves (what is averaged over devices), and the function that puts averaged
    ones back in their places beside the untouched integer leaves (e.g. counters)."""
    leaves, treedef = jax.tree.flatten(tree)
    is_float = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]

    def rejoin(floats: list[Any]) -> Tree:
        floats = iter(floats)
        return jax.tree.unflatten(treedef, [next(floats) if f else x for x, f in zip(leaves, is_float)])

    return [x for x, f in zip(leaves, is_float) if f], rejoin


def codec(compression: Any) -> Compressor | None:
    """None for no compression (None, "none", the none codec), else the codec (ValueError if bad).
    "auto" is not a codec: the controller decides one (jaxdp/sync/controller.py)."""
    if isinstance(compression, str) and compression.strip().lower() == AUTO:
        raise ValueError("compression='auto' is decided while training (jaxdp.train's controller); give the step one "
                         f"choice: {codecs.SPEC_HELP} (a state made for 'auto' serves each)")
    found = codecs.parse(compression) if isinstance(compression, str) else compression
    return None if found is None or found.name == "none" else found


# ---------------------------------------------------------------------------------------------
# The exchanges.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plain:
    """Plain averaging: one call of the collective's mean on (tree, riders)."""

    collective: Collective
    axis: Any
    n: int
    collectives: int = 1

    def mean(self, tree: Tree, metrics: dict, model_state: Tree, sync: Any, step: Any) -> tuple[Tree, dict, Tree, Any, dict]:
        if self.n == 1:  # the mean is the value; XLA would still run a 1-device all-reduce
            return tree, metrics, model_state, sync, {}
        floats, rejoin = float_leaves(model_state)
        tree, metrics, floats = self.collective.mean((tree, metrics, floats), self.axis)
        return tree, metrics, rejoin(floats), sync, {}

    def riders(self, metrics: dict, model_state: Tree) -> tuple[dict, Tree]:
        """The riders alone, averaged in one small call (local steps between syncs, ZeRO-1)."""
        return _riders(self.collective, self.axis, self.n, metrics, model_state)

    def payload_bytes(self, params: Tree) -> int:
        return uncompressed_bytes(params)


@dataclasses.dataclass(frozen=True)
class Coded:
    """Averaging through a codec over the collective's sum (or, for a codec that needs it, the
    collective's coded ring: int8 / int4); its state in the slot the codec owns."""

    collective: Collective
    codec: Compressor
    axis: Any
    n: int
    pseudo_gradient: bool = False  # local steps' (the codec may settle a choice by it: top-k's form)

    @property
    def collectives(self) -> int:
        return self.codec.collectives

    def riders(self, metrics: dict, model_state: Tree) -> tuple[dict, Tree]:
        return _riders(self.collective, self.axis, self.n, metrics, model_state)

    def settled(self, tree: Tree) -> Compressor:
        """The codec that averages `tree` here (`Compressor.settled`)."""
        return self.codec.settled(tree, self.n, self.pseudo_gradient)

    def payload_bytes(self, params: Tree) -> int:
        """What one average all-reduces here (the codec's count on this exchange's device count)."""
        return self.settled(params).payload_bytes(params, self.n)

    def mean(self, tree: Tree, metrics: dict, model_state: Tree, sync: Any, step: Any) -> tuple[Tree, dict, Tree, Any, dict]:
        """The riders go in the codec's first collective (before a PowerSGD start step, in their
        own): summed with it, in the coded ring's messages, or appended to an all-gathered buffer."""
        codec, axis, n, total = self.settled(tree), self.axis, self.n, self.collective.sum
        slot = stored(sync)
        floats, rejoin = float_leaves(model_state)
        riders = (metrics, floats)
        riding: list[Any] = []

        def sum_with_riders(t: Tree) -> Tree:  # the first call also carries the scaled riders
            if riding:
                return total(t, axis)
            summed, riders_sum = total((t, jax.tree.map(lambda x: x / n, riders)), axis)
            riding.append(riders_sum)
            return summed

        def coded_with_riders(buffer: jax.Array, wire: Any) -> tuple[jax.Array, jax.Array]:
            """The coded ring; its first call carries the scaled riders exactly, in its own messages."""
            if riding or separate:
                summed, residual, _ = coded(buffer, axis, wire)
                return summed, residual
            flat, back = _flat_riders(riders, n)
            summed, residual, flat = coded(buffer, axis, wire, flat)
            riding.append(back(flat))
            return summed, residual

        def gather_with_riders(buffer: jax.Array) -> jax.Array:
            """The all-gather of a 1-D buffer; the first one also carries the scaled riders' bytes
            (a uint8 buffer: top-k's message) and sums them in device order, so they cost no
            collective of their own."""
            gather = self.collective.halves.all_gather
            if riding or separate:
                return gather(buffer, axis)
            flat, back = _flat_riders(riders, n)
            if flat is None:  # (nothing rides)
                riding.append(riders)
                return gather(buffer, axis)
            if buffer.dtype != jnp.uint8:  # (no codec sends another dtype here; averaged on their own)
                riding.append(self.collective.mean(riders, axis))
                return gather(buffer, axis)
            rows = gather(jnp.concatenate([buffer, jax.lax.bitcast_convert_type(flat, jnp.uint8).ravel()]),
                          axis).reshape(n, -1)
            sums = jax.lax.bitcast_convert_type(rows[:, buffer.size:].reshape(n, -1, 4), jnp.float32)
            total = sums[0]
            for row in sums[1:]:  # in device order: the same bits on every device
                total = total + row
            riding.append(back(total))
            return rows[:, :buffer.size].ravel()

        start = codec.start
        separate = n == 1 or start > 0  # (lax.cond branches cannot hand values out)
        coded = self.collective.coded_sum
        if codec.needs == "halves":  # an all-gather of one 1-D buffer (top-k's all-gathered form)
            reduce = gather_with_riders
        elif codec.needs == "coded_sum":
            reduce = coded_with_riders
        else:
            reduce = (lambda t: total(t, axis)) if separate else sum_with_riders
        where = {"device": jax.lax.axis_index(axis)} if getattr(codec, "needs_device", False) else {}  # top-k's leader
        mean, new, scalars = codec.mean(tree, codec.read(slot, tree), reduce, n, step, **where)
        metrics, floats = self.collective.mean(riders, axis) if separate and n > 1 else (
            riding[0] if riding else riders)
        sync = store(sync, codec.write(slot, new))
        payload, plain = codec.payload_bytes(tree, n), uncompressed_bytes(tree)
        if start > 0:  # before its start step the codec sends the whole tree
            payload = jnp.where(jnp.asarray(step) >= start, jnp.float32(payload), jnp.float32(plain))
        extra = {**scalars, "comm_bytes": jnp.float32(bytes_sent(payload, n)),
                 "compression_ratio": jnp.float32(plain) / jnp.float32(payload)}
        return mean, metrics, rejoin(floats), sync, extra


def _flat_riders(riders: Tree, n: int) -> tuple[jax.Array | None, Callable[[jax.Array], Tree]]:
    """The riders scaled by 1/n as one float32 buffer (None: there are none), and the function that
    turns such a buffer (their sum, after the collective) back into their tree, each leaf in its own
    shape and dtype."""
    leaves, treedef = jax.tree.flatten(riders)
    offsets = np.cumsum([0] + [x.size for x in leaves])
    flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) / n for x in leaves]) if leaves else None

    def back(buffer: jax.Array) -> Tree:
        return jax.tree.unflatten(treedef, [buffer[a:b].reshape(x.shape).astype(x.dtype)
                                            for x, a, b in zip(leaves, offsets, offsets[1:])])

    return flat, back


def _riders(collective: Collective, axis: Any, n: int, metrics: dict, model_state: Tree) -> tuple[dict, Tree]:
    if n == 1:
        return metrics, model_state
    floats, rejoin = float_leaves(model_state)
    metrics, floats = collective.mean((metrics, floats), axis)
    return metrics, rejoin(floats)


def make_exchange(collective: Collective, axis: Any, n: int, codec: Compressor | None = None,
                  pseudo_gradient: bool = False) -> Plain | Coded:
    """The exchange of `collective` over the data axis `axis` of `n` devices, through `codec`
    (None: plain averaging with the collective's mean; `NoCompression()`: the same through its sum,
    pre-scaled by 1/n, which is how local steps average their pseudo-gradients, `pseudo_gradient`)."""
    if codec is None:
        return Plain(collective, axis, n)
    rules.check(rules.Choices(collective.name, rules.abilities(collective), compression=codec.name, needs=codec.needs))
    return Coded(collective, codec, axis, n, pseudo_gradient)


# ---------------------------------------------------------------------------------------------
# The codec's slot in state.sync.
# ---------------------------------------------------------------------------------------------


def slot_state(compression: Any, params: Tree) -> CompressionState:
    """One device's slot for `compression` (a codec, its name, or "auto"), keyed by `leaf_key`:
    the codec's own (`Compressor.slot`), or for "auto" one that serves every candidate of the cost
    model's ladder (jaxdp.sync.costmodel.auto_slot)."""
    if isinstance(compression, str) and compression.strip().lower() == AUTO:
        from jaxdp.sync.costmodel import auto_slot

        return auto_slot(params)
    found = codec(compression)
    return CompressionState() if found is None else found.slot(params)


def init_slot(compression: Any, params: Tree, mesh: Any) -> tuple[dict, dict]:
    """(per_device, shared) entries of a new state's `sync` for `compression`: the error stacked one
    row per device (sharded over the data axes), Q replicated; ({}, {}) when the codec keeps none."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = jax.device_get(slot_state(compression, abstract))
    if not state.error and not state.q:
        return {}, {}
    rows = NamedSharding(mesh, P(data_axes(mesh)))
    error = {k: jax.make_array_from_callback((mesh.size, *e.shape), rows, lambda index, e=e: np.broadcast_to(
        np.asarray(e), (mesh.size, *e.shape))[index]) for k, e in state.error.items()}
    return entries(error, replicate(state.q, mesh))


@jax.jit
def non_finite(tree: Any) -> jax.Array:
    """NaN if any value of `tree` is NaN, else inf if any is infinite, else 0 (one program, one scalar)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    nan = jnp.any(jnp.stack([jnp.any(jnp.isnan(x)) for x in leaves]))
    inf = jnp.any(jnp.stack([jnp.any(jnp.isinf(x)) for x in leaves]))
    return jnp.where(nan, jnp.nan, jnp.where(inf, jnp.inf, 0.0))
