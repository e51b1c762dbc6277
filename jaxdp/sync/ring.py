"""The ring: reduce-scatter then all-gather, each step moving 1/N of a buffer to the next neighbour.

Built from `jax.lax.ppermute` inside `shard_map`: flatten the tree into fused buffers, split each into N chunks,
N-1 reduce-scatter steps then N-1 all-gather steps. Bandwidth-optimal: each device sends 2(N-1)/N of the buffer.
The coded ring (`ring_coded_allreduce`) sends every hop through a codec's wire format (int8 / int4).
jaxdp/sync/collectives.py wraps these as the `RING` collective.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxdp.sync.fusion import fused_together

Tree = Any


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
# The coded ring: every hop sends through a codec's wire format (int8 / int4 in jaxdp/sync/compression.py).
# ---------------------------------------------------------------------------------------------


def ring_coded_allreduce(padded: jax.Array, axis_name: Any, wire: Any,
                         exact: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The ring all-reduce of a float32 buffer of N equal chunks whose every message is encoded:
    returns (sum, residual, exact sum), the sum identical on every device.

    `wire` is a codec's wire format for one chunk (`jaxdp.sync.compression.Wire`): `wire.encode(chunk)
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
