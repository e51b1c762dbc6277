"""The exchange: the mean of per-device trees over the mesh, a collective and (maybe) a codec.

    exchange = make_exchange(RING, PowerSGD(rank=4))      # or make_exchange(PSUM) for plain averaging
    # inside shard_map, on one device:
    mean, metrics, model_state, sync, extra = exchange.mean(grads, metrics, model_state, state.sync, state.step)

Every update rule averages through an exchange: the replicated step its gradients, local steps
their pseudo-gradients (jaxdp/step/local_sgd.py). The scalar metrics and the float leaves of the model
state (BatchNorm statistics) ride along in the same collective (`riders`), so they cost no
latency of their own. `extra` holds the metrics the exchange adds ("comm_bytes",
"compression_ratio" and the codec's scalars; {} for plain averaging).

A codec's state (PowerSGD's error feedback and warm-start Q) lives in the train state's
`state.sync` under the slot `STATE_NAME` ("compression"): the error one row per device
(`per_device`, sharded over the data axes), Q replicated (`shared`). `init_slot` makes it, for one
codec or for "auto" (one slot serving every candidate of the controller's ladder); `read_slot` and
`write_slot` convert between the slot (keyed by checkpoint-safe leaf names, `leaf_key`) and the
codec's own `CompressionState`.

A new way to average (a delayed all-reduce, a hierarchical exchange) is a new class here with the
same `mean`, plus its field in jaxdp/sync/spec.py and its flag.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp.sync.compression import Bf16, CompressionState, Compressor, NoCompression, PowerSGD, Quantized, bytes_sent, \
    parse, uncompressed_bytes
from jaxdp.mesh import data_axes, replicate
from jaxdp.sync.collectives import Collective
from jaxdp.sync.spec import AUTO

Tree = Any
STATE_NAME = "compression"  # the codec's slot in state.sync.per_device / state.sync.shared


def leaf_key(path: Any) -> str:
    """A leaf's path as a checkpoint-safe name: ("Dense_0", "kernel") -> "Dense_0.kernel"."""
    return _checkpoint_safe(jax.tree_util.keystr(path))


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
    """None for no compression (None, "none", NoCompression), else the Compressor (ValueError if bad).
    "auto" is not a codec: the controller decides one (jaxdp/sync/controller.py)."""
    if compression is None or isinstance(compression, NoCompression):
        return None
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, str) and compression.strip().lower() == AUTO:
        raise ValueError("compression='auto' is decided while training (jaxdp.train's controller); give the step one "
                         "choice: none, bf16, int8, int4 or powersgd:RANK (a state made for 'auto' serves each)")
    found = parse(compression)
    return None if isinstance(found, NoCompression) else found


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
    collective's coded ring: int8 / int4); its state in the slot STATE_NAME."""

    collective: Collective
    codec: Compressor
    axis: Any
    n: int

    @property
    def collectives(self) -> int:
        return self.codec.collectives

    def riders(self, metrics: dict, model_state: Tree) -> tuple[dict, Tree]:
        return _riders(self.collective, self.axis, self.n, metrics, model_state)

    def payload_bytes(self, params: Tree) -> int:
        return self.codec.payload_bytes(params)

    def mean(self, tree: Tree, metrics: dict, model_state: Tree, sync: Any, step: Any) -> tuple[Tree, dict, Tree, Any, dict]:
        """The riders go in the codec's first collective (before a PowerSGD start step, in their own)."""
        codec, axis, n, total = self.codec, self.axis, self.n, self.collective.sum
        stored = CompressionState(error=jax.tree.map(lambda x: x[0], sync.per_device.get(STATE_NAME, {})),
                                  q=sync.shared.get(STATE_NAME, {}))
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
            leaves, treedef = jax.tree.flatten(riders)
            flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) / n for x in leaves]) if leaves else None
            summed, residual, flat = coded(buffer, axis, wire, flat)
            offsets = np.cumsum([0] + [x.size for x in leaves])
            riding.append(jax.tree.unflatten(treedef, [flat[a:b].reshape(x.shape).astype(x.dtype)
                                                       for x, a, b in zip(leaves, offsets, offsets[1:])]))
            return summed, residual

        start = getattr(codec, "start", 0)
        separate = n == 1 or start > 0  # lax.cond branches cannot hand values out
        coded = self.collective.coded_sum
        if codec.needs == "coded_sum":
            reduce = coded_with_riders
        else:
            reduce = (lambda t: total(t, axis)) if separate else sum_with_riders
        mean, new, scalars = codec.mean(tree, read_slot(codec, stored, tree), reduce, n, step)
        metrics, floats = self.collective.mean(riders, axis) if separate and n > 1 else (
            riding[0] if riding else riders)
        merged = write_slot(stored, new)
        if merged.error or merged.q:
            sync = sync.replace(per_device={**sync.per_device, STATE_NAME: jax.tree.map(lambda x: x[None], merged.error)},
                                shared={**sync.shared, STATE_NAME: merged.q})
        payload, plain = codec.payload_bytes(tree, n), uncompressed_bytes(tree)
        if start > 0:  # before its start step the codec sends the whole tree
            payload = jnp.where(jnp.asarray(step) >= start, jnp.float32(payload), jnp.float32(plain))
        extra = {**scalars, "comm_bytes": jnp.float32(bytes_sent(payload, n)),
                 "compression_ratio": jnp.float32(plain) / jnp.float32(payload)}
        return mean, metrics, rejoin(floats), sync, extra


def _riders(collective: Collective, axis: Any, n: int, metrics: dict, model_state: Tree) -> tuple[dict, Tree]:
    if n == 1:
        return metrics, model_state
    floats, rejoin = float_leaves(model_state)
    metrics, floats = collective.mean((metrics, floats), axis)
    return metrics, rejoin(floats)


def make_exchange(collective: Collective, axis: Any, n: int, codec: Compressor | None = None) -> Plain | Coded:
    """The exchange of `collective` over the data axis `axis` of `n` devices, through `codec`
    (None: plain averaging with the collective's mean; `NoCompression()`: the same through its sum,
    pre-scaled by 1/n, which is how local steps average their pseudo-gradients)."""
    if codec is None:
        return Plain(collective, axis, n)
    if collective.sum is None:
        raise ValueError(f"compression needs an in-graph sum over devices; strategy {collective.name!r} has none")
    if codec.needs == "coded_sum" and collective.coded_sum is None:
        raise ValueError(f"compression {codec.name} requantizes at every hop of a ring; strategy {collective.name!r} "
                         f"has no such hops (jaxdp.sync.collectives.Collective.coded_sum); use ring")
    return Coded(collective, codec, axis, n)


# ---------------------------------------------------------------------------------------------
# The codec's slot in state.sync.
# ---------------------------------------------------------------------------------------------


def slot_state(compression: Any, params: Tree) -> CompressionState:
    """One device's slot for `compression` (a codec, its name, or "auto"), keyed by `leaf_key`.
    For "auto", one slot that serves every candidate of the cost model's ladder: the error of every
    leaf (int8 and int4 quantize them all; PowerSGD reads its matrices'), and Q at the largest rank
    (a candidate of rank r reads its first r columns). The error is what is still owed to the mean,
    whichever codec left it, so a switch of codec carries it over."""
    if isinstance(compression, str) and compression.strip().lower() == AUTO:
        from jaxdp.sync.costmodel import ladder

        powersgd = [c for c in ladder(params) if isinstance(c, PowerSGD)]
        error = Quantized(8).init(params).error
        if not powersgd:
            state = CompressionState(error=error)
        else:
            keys = set().union(*(c.layout(params) for c in powersgd))
            widest = PowerSGD(rank=max(c.rank for c in powersgd), min_rate=0.0).init(params)
            state = CompressionState(error=error, q={k: v for k, v in widest.q.items() if k in keys})
    else:
        found = codec(compression)
        if found is None or isinstance(found, Bf16):
            return CompressionState()
        state = found.init(params)
    return CompressionState(error={_checkpoint_safe(k): v for k, v in state.error.items()},
                            q={_checkpoint_safe(k): v for k, v in state.q.items()})


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
    return {STATE_NAME: error}, {STATE_NAME: replicate(state.q, mesh)}


def read_slot(codec: Compressor, stored: CompressionState, grads: Tree) -> CompressionState:
    """The part of a slot (made by `slot_state` for this codec, or for "auto") that `codec.mean`
    reads, keyed as it expects. ValueError if the slot lacks a leaf."""
    if isinstance(codec, Quantized):  # error feedback for every leaf
        keys = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        missing = [k for k in keys if _checkpoint_safe(k) not in stored.error]
        if missing:
            raise ValueError(f"the state has no compression state for {codec.name} (leaf {missing[0]}); make it with "
                             f"init_state(..., compression={codec.name!r})")
        return CompressionState(error={k: stored.error[_checkpoint_safe(k)] for k in keys})
    if not isinstance(codec, PowerSGD):
        return CompressionState()
    layout = codec.layout(grads)
    missing = [k for k in layout if _checkpoint_safe(k) not in stored.error]
    if missing:
        raise ValueError(f"the state has no compression state for {codec.name} (leaf {missing[0]}); make it with "
                         f"init_state(..., compression={codec.name!r}) or compression='auto'")
    return CompressionState(error={k: stored.error[_checkpoint_safe(k)] for k in layout},
                            q={k: stored.q[_checkpoint_safe(k)][:, :r] for k, (_, _, r) in layout.items()})


def write_slot(stored: CompressionState, new: CompressionState) -> CompressionState:
    """`read_slot`'s inverse: the slot with the codec's new error and Q written back."""
    error, q = dict(stored.error), dict(stored.q)
    for k, e in new.error.items():
        error[_checkpoint_safe(k)] = e.astype(error[_checkpoint_safe(k)].dtype)
    for k, v in new.q.items():
        old = q[_checkpoint_safe(k)]
        q[_checkpoint_safe(k)] = v.astype(old.dtype) if v.shape == old.shape else old.at[:, :v.shape[1]].set(v.astype(old.dtype))
    return CompressionState(error=error, q=q)


def _checkpoint_safe(key: str) -> str:
    """A `jax.tree_util.keystr` ("['Dense_0']['kernel']") as a checkpoint-safe name ("Dense_0.kernel")."""
    return re.sub(r"[^A-Za-z0-9_]+", ".", key).strip(".")
