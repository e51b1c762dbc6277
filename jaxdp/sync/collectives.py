"""Collectives as values: what turns each device's tree into the mean over the mesh.

A strategy is a `Collective`: a frozen value with its mean `(tree, axis) -> tree` (called inside
`shard_map` on each device's own tree), and where it has them its sum, its reduce-scatter and
all-gather halves (`Halves`, what ZeRO-1 puts its update between), a coded sum (the ring whose
every hop sends through a codec's wire format: the int8 / int4 codecs), or an on-host mean. `PSUM`
(XLA's all-reduce) and `RING` (an explicit ring of `jax.lax.ppermute`) are here; `HOST` (the
device -> host -> device baseline) is in jaxdp/sync/host.py. They are registered by name in
`jaxdp.registry.STRATEGIES`.

A user's own strategy stays a bare function `fn(tree, axis) -> mean`:
`STRATEGIES.register("mine", fn)`; `as_collective` wraps it (and reads the `fn.sum` / `fn.halves`
attributes older code set on such functions). A function marked `@on_host` is an on-host mean
`fn(local_trees, *, num_devices, process_sum) -> mean`.

Every collective returns a tree of the same structure and dtypes as its input, and averages
whatever float tree it is given: the train step hands it the gradients together with the
metrics and the model state's float leaves (jaxdp/sync/exchange.py), one collective instead of three.
`axis` is the mesh's data axis (`jaxdp.mesh.data_axes`): a name, or a tuple of names on a mesh
with several data axes; `hierarchical` (jaxdp/sync/hierarchy.py) makes any of them two-level.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

Tree = Any


def on_host(fn: Callable) -> Callable:
    """Mark a strategy that averages numpy gradients on the host instead of inside the step."""
    fn.on_host = True
    return fn


def is_on_host(strategy: Any) -> bool:
    """True for an on-host strategy: a function marked with `@on_host`, or a Collective with a host mean."""
    return bool(getattr(strategy, "on_host", False))


# ---------------------------------------------------------------------------------------------
# Fusion: one flat buffer per dtype, so a model with hundreds of leaves runs a handful of collectives.
# ---------------------------------------------------------------------------------------------


def fused(fn: Callable[[jax.Array], jax.Array], tree: Tree) -> Tree:
    """Apply `fn` (1-D buffer -> 1-D buffer of the same size) to the leaves of `tree`, concatenated
    into one buffer per dtype; split the results back into the tree's shapes. Inside the step,
    XLA fuses each slice back into the optimizer update that reads it.
    """
    return fused_together(lambda flats: [fn(flat) for flat in flats], tree)


def fused_together(fn: Callable[[list[jax.Array]], list[jax.Array]], tree: Tree) -> Tree:
    """`fused`, with `fn` given every dtype's buffer at once (a list, one per dtype) so that one
    collective can carry them all."""
    leaves, treedef = jax.tree.flatten(tree)
    out: list[Any] = [None] * len(leaves)
    groups = list(_group_by_dtype(leaves).values())
    results = fn([jnp.concatenate([jnp.ravel(leaves[i]) for i in indices]) for indices in groups])
    for indices, flat in zip(groups, results):
        offset = 0
        for i in indices:
            size = leaves[i].size
            out[i] = flat[offset:offset + size].reshape(leaves[i].shape)
            offset += size
    return jax.tree.unflatten(treedef, out)


def _group_by_dtype(leaves: Sequence[jax.Array]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(f"gradient sync averages floating-point arrays only, got {dtype}")
        groups.setdefault(dtype, []).append(i)
    return groups


# ---------------------------------------------------------------------------------------------
# psum: XLA's all-reduce (NCCL on GPUs).
# ---------------------------------------------------------------------------------------------


def psum_mean(grads: Tree, axis_name: Any) -> Tree:
    """`jax.lax.pmean`; across processes, of one fused buffer per dtype.

    Within a process, XLA's all-reduce of each leaf is the fastest (fusing costs a concatenation
    and gives nothing back). Across processes on CPU every leaf is one gloo call with its own
    latency, so there the leaves travel as one buffer per dtype (figures in README "Performance").
    On GPUs XLA combines all-reduces itself.
    """
    if jax.process_count() > 1:
        return _across_processes(lambda flat: jax.lax.pmean(flat, axis_name), grads)
    return jax.lax.pmean(grads, axis_name)


def _across_processes(reduce: Callable[[jax.Array], jax.Array], tree: Tree) -> Tree:
    """`reduce` (an all-reduce of a 1-D buffer) of `tree` across processes, fused. On GPUs one
    buffer per dtype (NCCL reduces bf16 as bf16). On CPUs one buffer of the widest dtype for all
    the leaves: XLA's CPU all-reduce widens 16-bit floats to float32 anyway, and each collective
    is a gloo round trip of its own, so bf16 gradients beside float32 metrics ran two (with
    `--compression bf16`, 130-136 steps/s against 204-210 for float32 on two local processes)."""
    leaves = jax.tree.leaves(tree)
    if jax.default_backend() != "cpu" or len({jnp.result_type(x) for x in leaves}) < 2:
        return fused(reduce, tree)
    _group_by_dtype(leaves)  # floating point only, as everywhere
    wide = jnp.result_type(*leaves)
    return jax.tree.map(lambda out, x: out.astype(x.dtype), fused(reduce, jax.tree.map(lambda x: x.astype(wide), tree)), tree)


# ---------------------------------------------------------------------------------------------
# ring: reduce-scatter then all-gather, each step moving 1/N of a buffer to the next neighbour.
# ---------------------------------------------------------------------------------------------


def ring_allreduce(tree: Tree, axis_name: Any, *, mean: bool = False) -> Tree:
    """Sum `tree` over `axis_name` with an explicit ring; same result as `jax.lax.psum(tree, axis_name)`.

    Call it inside `shard_map` (with `check_vma=False`) or `pmap`. Leaves are fused into one
    buffer per dtype, so a model with hundreds of parameters runs a handful of rings, not hundreds.

    The buffer is cut into N chunks. In reduce-scatter step s (s = 0 .. N-2) device i sends its
    running sum of chunk (i - 1 - s) mod N to device i + 1, which adds it to its own copy of that
    chunk. After N-1 steps device i holds the complete sum of chunk i (`ring_reduce_scatter`, the
    layout ZeRO-1 shards its optimizer state by). The all-gather (`ring_all_gather`)
    phase then passes the complete chunks around the ring N-1 more times. Each device sends
    2 (N-1) / N of the buffer in total, the bandwidth-optimal amount.

    Device i's chunk indices depend on i, so chunks are addressed with dynamic slices of
    the flat buffer: XLA fuses each slice into the add that reads it, and each all-gather chunk
    lands in place in one fresh output buffer (`lax.empty`: uninitialised on GPU, zeroed on CPU).
    Per hop that is one collective-permute copy plus, in reduce-scatter, one fused add; there is
    no rotation, stack, gather or copy of the input. On one process with simulated CPU devices,
    where XLA's all-reduce reads each input once, the ring's 2 (N-1) copies alone cost about
    what the whole all-reduce does (figures in README "Performance").

    `mean=True` returns the mean instead: each device divides the one chunk it completes by N
    before the all-gather, 1/N of a pass over the buffer instead of a whole one.
    """
    if not jax.tree.leaves(tree):
        return tree
    n = jax.lax.axis_size(axis_name)
    if n == 1:
        return tree
    return fused_together(lambda flats: _ring_sum_together(flats, axis_name, n, mean), tree)


def _ring_sum(flat: jax.Array, axis_name: Any, n: int, mean: bool = False) -> jax.Array:
    """Ring all-reduce (sum, or mean) of a 1-D buffer over `n` devices: its two halves."""
    size = flat.shape[0]
    chunk = -(-size // n)  # ceil(size / n): the last chunk is zero-padded
    padded = jnp.pad(flat, (0, chunk * n - size))
    return ring_all_gather(ring_reduce_scatter(padded, axis_name, mean=mean), axis_name)[:size]


def _ring_sum_together(flats: list[jax.Array], axis_name: Any, n: int, mean: bool = False) -> list[jax.Array]:
    """`_ring_sum` of several 1-D buffers (one per dtype) in one ring: every hop sends one message,
    each buffer's chunk in it as bytes, and the receiver adds each in its own dtype. Mixed dtypes
    (bf16 gradients beside float32 metrics, a mixed-precision model) then cost one ring's round
    trips, not one ring per dtype: across processes on CPU every hop is a gloo exchange whose
    wake-up latency dominates a small model's buffers (with two rings, `--compression bf16`
    trained 120.7 steps/s against 249.4 for float32 on two local processes; with one, 246.1). Bytes are not widened:
    a uint8 message is what the 16-bit floats' `send` also guards against."""
    if len(flats) == 1:
        return [_ring_sum(flats[0], axis_name, n, mean)]
    sizes = [f.shape[0] for f in flats]
    chunks = [-(-size // n) for size in sizes]
    padded = [jnp.pad(f, (0, c * n - size)) for f, c, size in zip(flats, chunks, sizes)]
    widths = [jnp.dtype(f.dtype).itemsize for f in flats]
    me = jax.lax.axis_index(axis_name)
    to_next = [(j, (j + 1) % n) for j in range(n)]

    def chunk_of(k: int, c: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(padded[k], (c % n) * chunks[k], chunks[k])

    def hop(parts: list[jax.Array]) -> list[jax.Array]:  # one collective-permute for every buffer's chunk
        message = jnp.concatenate([jax.lax.bitcast_convert_type(p, jnp.uint8).ravel() for p in parts])
        got, out, offset = jax.lax.ppermute(message, axis_name, to_next), [], 0
        for k, p in enumerate(parts):
            nbytes = chunks[k] * widths[k]
            raw = got[offset:offset + nbytes]
            out.append(jax.lax.bitcast_convert_type(raw.reshape(-1, widths[k]) if widths[k] > 1 else raw, p.dtype))
            offset += nbytes
        return out

    acc = [chunk_of(k, me - 1) for k in range(len(flats))]
    for s in range(n - 1):  # reduce-scatter, as ring_reduce_scatter
        acc = [chunk_of(k, me - s - 2) + got for k, got in enumerate(hop(acc))]
    if mean:
        acc = [a / n for a in acc]
    outs = [jax.lax.dynamic_update_slice_in_dim(jax.lax.empty((c * n,), a.dtype), a, (me % n) * c, 0)
            for a, c in zip(acc, chunks)]
    for s in range(n - 1):  # all-gather, as ring_all_gather
        acc = hop(acc)
        outs = [jax.lax.dynamic_update_slice_in_dim(o, a, ((me - s - 1) % n) * c, 0) for o, a, c in zip(outs, acc, chunks)]
    return [o[:size] for o, size in zip(outs, sizes)]


def send(x: jax.Array, axis_name: Any, pairs: list[tuple[int, int]]) -> jax.Array:
    """`jax.lax.ppermute` that keeps 16-bit floats 16 bits on the wire.

    XLA's CPU compiler rewrites a bf16 / fp16 collective-permute into an f32 one (its float
    normalization: the CPU backend computes in f32), so a bf16 ring would send as many bytes as an
    f32 one. The bits go as uint16 instead, which no pass widens; a free bitcast on every backend.
    (An all-reduce cannot do this: it adds on the way, so `psum` of bf16 moves f32 on CPU.)"""
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = jax.lax.ppermute(jax.lax.bitcast_convert_type(x, jnp.uint16), axis_name, pairs)
        return jax.lax.bitcast_convert_type(bits, x.dtype)
    return jax.lax.ppermute(x, axis_name, pairs)


def ring_reduce_scatter(padded: jax.Array, axis_name: Any, *, mean: bool = False) -> jax.Array:
    """The ring's first half: a 1-D buffer of N equal chunks in, on device i the sum (or mean)
    over devices of chunk i out. N - 1 hops, each moving one chunk to the next device."""
    n = jax.lax.axis_size(axis_name)
    chunk = padded.shape[0] // n
    if chunk * n != padded.shape[0]:
        raise ValueError(f"ring_reduce_scatter: a buffer of {padded.shape[0]} values does not cut into {n} chunks")
    if n == 1:
        return padded
    me = jax.lax.axis_index(axis_name)
    to_next = [(j, (j + 1) % n) for j in range(n)]

    def chunk_of(c: jax.Array) -> jax.Array:  # my copy of chunk c mod n (fused into its consumer)
        return jax.lax.dynamic_slice_in_dim(padded, (c % n) * chunk, chunk)

    # In step s send my running sum of chunk (i - 1 - s), add the received running sum of chunk
    # (i - 2 - s) to my own copy of it. After n - 1 steps `acc` is the full sum of chunk i.
    acc = chunk_of(me - 1)
    for s in range(n - 1):
        acc = chunk_of(me - s - 2) + send(acc, axis_name, to_next)
    return acc / n if mean else acc  # a mean divides only the one chunk this device owns


def ring_all_gather(owned: jax.Array, axis_name: Any) -> jax.Array:
    """The ring's second half: device i's chunk i in, every chunk (in order) out on every device.
    N - 1 hops; each received chunk lands in place in one fresh output buffer."""
    n = jax.lax.axis_size(axis_name)
    if n == 1:
        return owned
    chunk = owned.shape[0]
    me = jax.lax.axis_index(axis_name)
    to_next = [(j, (j + 1) % n) for j in range(n)]

    def put(out: jax.Array, value: jax.Array, c: jax.Array) -> jax.Array:  # in place
        return jax.lax.dynamic_update_slice_in_dim(out, value, (c % n) * chunk, 0)

    # (Writing into the input instead makes XLA copy it first whenever the caller still owns it.)
    out = put(jax.lax.empty((chunk * n,), owned.dtype), owned, me)
    for s in range(n - 1):
        owned = send(owned, axis_name, to_next)  # the full chunk (i - 1 - s)
        out = put(out, owned, me - s - 1)
    return out


def ring_mean(grads: Tree, axis_name: Any) -> Tree:
    return ring_allreduce(grads, axis_name, mean=True)


# ---------------------------------------------------------------------------------------------
# The coded ring: every hop sends through a codec's wire format (int8 / int4 in jaxdp/sync/codecs/quantized.py).
# ---------------------------------------------------------------------------------------------


def ring_coded_allreduce(padded: jax.Array, axis_name: Any, wire: Any,
                         exact: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The ring all-reduce of a float32 buffer of N equal chunks whose every message is encoded:
    returns (sum, residual, exact sum), the sum identical on every device.

    `wire` is a codec's wire format for one chunk (`jaxdp.sync.codecs.base.Wire`): `wire.encode(chunk)
    -> (message, residual)`, a 1-D uint8 message and `chunk - wire.decode(message)`.

    Reduce-scatter: in hop s device i encodes its running sum of chunk (i - 1 - s) (at s = 0 its
    own value), sends the message, and the next device adds the decoded message to its own copy.
    The owner of a finished chunk encodes it once; the all-gather passes that message on unchanged
    and every device, the owner too, keeps its decoding: the same bytes decoded the same way, so
    all replicas get bit-identical sums.

    Every device encodes each chunk position exactly once (N - 1 partial sums, then its finished
    chunk), so `residual` (what this device's encodings left out, at their positions) is a whole
    buffer, and the residuals telescope: sum over devices of residual = exact sum - returned sum.
    A codec with error feedback keeps it and adds it to the next step's input.

    `exact`: an optional float32 1-D buffer (the metrics riding along) summed in float32 in the
    same messages, appended to them as raw bytes: no collective of its own.
    """
    n = jax.lax.axis_size(axis_name)
    if n == 1:
        return padded, jnp.zeros_like(padded), exact
    chunk = padded.shape[0] // n
    if chunk * n != padded.shape[0]:
        raise ValueError(f"ring_coded_allreduce: a buffer of {padded.shape[0]} values does not cut into {n} chunks")
    me = jax.lax.axis_index(axis_name)
    to_next = [(j, (j + 1) % n) for j in range(n)]
    extra = None if exact is None else jnp.pad(exact.astype(jnp.float32), (0, -(-exact.shape[0] // n) * n - exact.shape[0]))
    per = 0 if extra is None else extra.shape[0] // n

    def chunk_of(buffer: jax.Array, c: jax.Array, size: int) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(buffer, (c % n) * size, size)

    def put(out: jax.Array, value: jax.Array, c: jax.Array, size: int) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(out, value, (c % n) * size, 0)

    def send(message: jax.Array, riding: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """One collective-permute: the message, then the riding float32 values as bytes."""
        if riding is None:
            return jax.lax.ppermute(message, axis_name, to_next), None
        got = jax.lax.ppermute(jnp.concatenate([message, jax.lax.bitcast_convert_type(riding, jnp.uint8).ravel()]),
                               axis_name, to_next)
        return got[:message.shape[0]], jax.lax.bitcast_convert_type(got[message.shape[0]:].reshape(-1, 4), jnp.float32)

    residual = jnp.zeros_like(padded)
    acc, acc_extra = chunk_of(padded, me - 1, chunk), None if extra is None else chunk_of(extra, me - 1, per)
    for s in range(n - 1):
        message, left = wire.encode(acc)
        residual = put(residual, left, me - 1 - s, chunk)
        message, got_extra = send(message, acc_extra)
        acc = chunk_of(padded, me - s - 2, chunk) + wire.decode(message)
        if extra is not None:
            acc_extra = chunk_of(extra, me - s - 2, per) + got_extra
    message, left = wire.encode(acc)  # my finished chunk, encoded once
    residual = put(residual, left, me, chunk)
    out = put(jax.lax.empty((chunk * n,), jnp.float32), wire.decode(message), me, chunk)
    out_extra = None if extra is None else put(jnp.zeros((per * n,), jnp.float32), acc_extra, me, per)
    for s in range(n - 1):
        message, acc_extra = send(message, acc_extra)
        out = put(out, wire.decode(message), me - s - 1, chunk)
        if extra is not None:
            out_extra = put(out_extra, acc_extra, me - s - 1, per)
    return out, residual, None if exact is None else out_extra[:exact.shape[0]]


# ---------------------------------------------------------------------------------------------
# Collectives as values.
# ---------------------------------------------------------------------------------------------


class Halves(NamedTuple):
    """An all-reduce cut in two, on 1-D buffers of N equal chunks (inside shard_map):
    `reduce_scatter(buffer, axis) -> the mean of chunk i` on device i, and
    `all_gather(chunk, axis) -> the whole buffer` on every device."""

    reduce_scatter: Callable[[jax.Array, Any], jax.Array]
    all_gather: Callable[[jax.Array, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class Collective:
    """A gradient-sync strategy as a value.

    name:         its name in STRATEGIES (or the function's name).
    mean:         `(tree, axis) -> mean over devices`, in-graph; None for an on-host collective.
    sum:          `(tree, axis) -> sum over devices`, in-graph; compression and local steps need it
                  (they pre-scale by 1/N themselves, so narrow dtypes cannot overflow).
    halves:       its reduce-scatter and all-gather; ZeRO-1 needs them.
    host:         an on-host mean `(local_trees, *, num_devices, process_sum) -> mean` (jaxdp/sync/host.py).
    coded_sum:    `(buffer, axis, wire, exact=None) -> (sum, residual, exact sum)`: a sum whose every hop
                  sends through a codec's wire format (`ring_coded_allreduce`); int8 / int4 need it.
    xla_combines: XLA combines this collective's per-leaf calls by itself (XLA's own all-reduce in
                  one process), so ZeRO-1 need not interleave its buffers into one.
    hierarchical: made by `hierarchical`: on a mesh of two data axes it sums inside each process
                  first, then across processes.

    Calling it is calling its mean, so a Collective is also a strategy function: `fn(tree, axis)`
    in-graph, or the on-host `fn(local_trees, *, num_devices, process_sum)`.
    """

    name: str
    mean: Callable[[Tree, Any], Tree] | None = None
    sum: Callable[[Tree, Any], Tree] | None = None
    halves: Halves | None = None
    host: Callable[..., Tree] | None = None
    xla_combines: bool = False
    coded_sum: Callable[..., tuple[jax.Array, jax.Array, jax.Array | None]] | None = None
    hierarchical: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Tree:
        return (self.mean or self.host)(*args, **kwargs)

    @property
    def on_host(self) -> bool:
        return self.host is not None


def _psum_sum(tree: Tree, axis_name: Any) -> Tree:
    """`jax.lax.psum`; across processes, of one fused buffer per dtype (as `psum_mean`)."""
    if jax.process_count() > 1:
        return _across_processes(lambda flat: jax.lax.psum(flat, axis_name), tree)
    return jax.lax.psum(tree, axis_name)


def _psum_scatter_mean(padded: jax.Array, axis_name: Any) -> jax.Array:
    return jax.lax.psum_scatter(padded, axis_name, tiled=True) / jax.lax.axis_size(axis_name)


def _psum_all_gather(owned: jax.Array, axis_name: Any) -> jax.Array:
    return jax.lax.all_gather(owned, axis_name, tiled=True)


PSUM = Collective("psum", mean=psum_mean, sum=_psum_sum, halves=Halves(_psum_scatter_mean, _psum_all_gather),
                  xla_combines=True)
RING = Collective("ring", mean=ring_mean, sum=ring_allreduce,
                  halves=Halves(functools.partial(ring_reduce_scatter, mean=True), ring_all_gather),
                  coded_sum=ring_coded_allreduce)


def as_collective(strategy: Any) -> Collective:
    """A Collective for a strategy given as a Collective, a registered name, an `@on_host`
    function, or a bare in-graph `fn(tree, axis)` (with the optional `fn.sum` / `fn.halves` that
    older code attached)."""
    if isinstance(strategy, Collective):
        return strategy
    if isinstance(strategy, str):
        from jaxdp.registry import STRATEGIES

        return as_collective(STRATEGIES[strategy])
    if not callable(strategy):
        raise TypeError(f"a strategy is a name in STRATEGIES, a Collective or a function fn(tree, axis), got {strategy!r}")
    name = getattr(strategy, "__name__", "this strategy")
    if is_on_host(strategy):
        return Collective(name, host=strategy)
    if strategy is psum_mean:
        return PSUM
    if strategy is ring_mean:
        return RING
    return Collective(name, mean=strategy, sum=getattr(strategy, "sum", None), halves=getattr(strategy, "halves", None))


def __getattr__(name: str) -> Any:
    """`hierarchical` lives in jaxdp/sync/hierarchy.py (it builds on this module); found here too."""
    if name == "hierarchical":
        from jaxdp.sync.hierarchy import hierarchical

        return hierarchical
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
