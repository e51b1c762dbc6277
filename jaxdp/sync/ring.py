"""The ring: reduce-scatter then all-gather, each step moving 1/N of a buffer to the next neighbour.

Built from `jax.lax.ppermute` inside `shard_map`: flatten the tree into fused buffers, split each into N chunks,
N-1 reduce-scatter steps then N-1 all-gather steps. Bandwidth-optimal: each device sends 2(N-1)/N of the buffer.
One loop (`ring`) moves every lane of a hop in one message: buffers of several dtypes together, and a coded
lane whose every hop goes through a codec's wire format (int8 / int4: `ring_coded_allreduce`).
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
    what the whole all-reduce does (docs/performance.md measures both).

    `mean=True` returns the mean instead: each device divides the one chunk it completes by N
    before the all-gather, 1/N of a pass over the buffer instead of a whole one.
    """
    if not jax.tree.leaves(tree):
        return tree
    n = jax.lax.axis_size(axis_name)
    if n == 1:
        return tree
    return fused_together(lambda flats: _ring_sum_together(flats, axis_name, n, mean), tree)


def _ring_sum_together(flats: list[jax.Array], axis_name: Any, n: int, mean: bool = False) -> list[jax.Array]:
    """Ring all-reduce (sum, or mean) of several 1-D buffers (one per dtype) in one ring: every hop sends one message
    with each buffer's chunk in it (`_hop`), and the receiver adds each in its own dtype. Mixed
    dtypes (bf16 gradients beside float32 metrics, a mixed-precision model) then cost one ring's
    round trips, not one ring per dtype: across processes on CPU every hop is a gloo exchange whose
    wake-up latency dominates a small model's buffers."""
    sizes = [f.shape[0] for f in flats]
    padded = [jnp.pad(f, (0, -(-size // n) * n - size)) for f, size in zip(flats, sizes)]
    outs, _ = ring(padded, axis_name, mean=mean)
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


def _hop(messages: list[jax.Array], axis_name: Any, to_next: list[tuple[int, int]]) -> list[jax.Array]:
    """One collective-permute to the next device carrying every lane's 1-D message: one alone as it is
    (`send`), several as bytes in one buffer, each read back in its own dtype. Bytes are not widened."""
    if len(messages) == 1:
        return [send(messages[0], axis_name, to_next)]
    got = jax.lax.ppermute(jnp.concatenate([jax.lax.bitcast_convert_type(m, jnp.uint8).ravel() for m in messages]),
                           axis_name, to_next)
    out, offset = [], 0
    for m in messages:
        width = jnp.dtype(m.dtype).itemsize
        raw = got[offset:offset + m.shape[0] * width]
        out.append(jax.lax.bitcast_convert_type(raw.reshape(-1, width) if width > 1 else raw, m.dtype))
        offset += m.shape[0] * width
    return out


def ring(buffers: list[jax.Array], axis_name: Any, wires: list[Any] | None = None, *, scatter: bool = True,
         gather: bool = True, mean: bool = False) -> tuple[list[jax.Array], list[jax.Array | None]]:
    """The one ring loop: (outputs, residuals) of several lanes moved together, one message a hop.

    Reduce-scatter (`scatter`): every buffer is 1-D, N equal chunks. In hop s device i sends its
    running sum of chunk (i - 1 - s) mod N to device i + 1, which adds it to its own copy of that
    chunk; after N - 1 hops device i holds the whole sum of chunk i (divided by N with `mean`: the
    one chunk it owns, not the whole buffer). All-gather (`gather`): the owned chunks go round N - 1
    more times, each landing in place in one fresh output buffer (`lax.empty`; writing into the
    input instead makes XLA copy it whenever the caller still owns it). With only `gather`, each
    buffer is the device's owned chunk.

    `wires[k]` (None: values sent as they are) is a codec's wire format for lane k's chunks
    (`jaxdp.sync.codecs.base.Wire`: `encode(chunk) -> (message, residual)`, `decode(message)`): every
    hop of that lane sends the encoded running sum, and the receiver adds its decoding; the owner of
    a finished chunk encodes it once, the all-gather passes that message on unchanged and every
    device, the owner too, keeps its decoding, so all replicas get bit-identical sums. Each device
    encodes each chunk position exactly once, so the lane's residual (what this device's encodings
    left out, at their positions) is a whole buffer, and the residuals telescope: the sum over
    devices of the residuals is the exact sum minus the returned one.
    """
    n, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    to_next = [(j, (j + 1) % n) for j in range(n)]
    wires = wires or [None] * len(buffers)
    chunks = [b.shape[0] // n if scatter else b.shape[0] for b in buffers]
    residuals = [jnp.zeros_like(b) if w is not None else None for b, w in zip(buffers, wires)]

    def chunk_of(k: int, c: jax.Array) -> jax.Array:  # my copy of lane k's chunk c mod n (fused into its consumer)
        return jax.lax.dynamic_slice_in_dim(buffers[k], (c % n) * chunks[k], chunks[k])

    def put(out: jax.Array, value: jax.Array, c: jax.Array, k: int) -> jax.Array:  # in place
        return jax.lax.dynamic_update_slice_in_dim(out, value, (c % n) * chunks[k], 0)

    def encoded(values: list[jax.Array], at: jax.Array) -> list[jax.Array]:
        """Each lane's message of `values` (a coded lane's residual recorded at chunk `at`)."""
        messages = []
        for k, (value, wire) in enumerate(zip(values, wires)):
            if wire is None:
                messages.append(value)
                continue
            message, left = wire.encode(value)
            residuals[k] = put(residuals[k], left, at, k)
            messages.append(message)
        return messages

    def decoded(messages: list[jax.Array]) -> list[jax.Array]:
        return [m if w is None else w.decode(m) for m, w in zip(messages, wires)]

    if n == 1:
        return list(buffers), residuals
    if scatter:
        for k, b in enumerate(buffers):
            if chunks[k] * n != b.shape[0]:
                raise ValueError(f"ring: a buffer of {b.shape[0]} values does not cut into {n} chunks")
        acc = [chunk_of(k, me - 1) for k in range(len(buffers))]
        for s in range(n - 1):
            got = decoded(_hop(encoded(acc, me - 1 - s), axis_name, to_next))
            acc = [chunk_of(k, me - s - 2) + g for k, g in enumerate(got)]
        if mean:
            acc = [a / n for a in acc]
    else:
        acc = list(buffers)
    if not gather:
        return acc, residuals
    messages = encoded(acc, me)  # my finished chunks (a coded lane's encoded once)
    outs = [put(jax.lax.empty((c * n,), v.dtype), v, me, k) for k, (v, c) in enumerate(zip(decoded(messages), chunks))]
    for s in range(n - 1):
        messages = _hop(messages, axis_name, to_next)  # the finished chunks (i - 1 - s), passed on unchanged
        outs = [put(o, v, me - s - 1, k) for k, (o, v) in enumerate(zip(outs, decoded(messages)))]
    return outs, residuals


def ring_reduce_scatter(padded: jax.Array, axis_name: Any, *, mean: bool = False) -> jax.Array:
    """The ring's first half: a 1-D buffer of N equal chunks in, on device i the sum (or mean)
    over devices of chunk i out. N - 1 hops, each moving one chunk to the next device."""
    return ring([padded], axis_name, scatter=True, gather=False, mean=mean)[0][0]


def ring_all_gather(owned: jax.Array, axis_name: Any) -> jax.Array:
    """The ring's second half: device i's chunk i in, every chunk (in order) out on every device.
    N - 1 hops; each received chunk lands in place in one fresh output buffer."""
    return ring([owned], axis_name, scatter=False, gather=True)[0][0]


def ring_mean(grads: Tree, axis_name: Any) -> Tree:
    return ring_allreduce(grads, axis_name, mean=True)


def ring_coded_allreduce(padded: jax.Array, axis_name: Any, wire: Any,
                         exact: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The ring all-reduce of a float32 buffer of N equal chunks whose every message is encoded by
    `wire` (a codec's wire format, int8 / int4: `ring`'s coded lane): returns (sum, residual, exact
    sum), the sum identical on every device. A codec with error feedback keeps the residual and adds
    it to the next step's input.

    `exact`: an optional float32 1-D buffer (the metrics riding along) summed in float32 in the
    same messages, appended to them as raw bytes: no collective of its own.
    """
    if jax.lax.axis_size(axis_name) == 1:
        return padded, jnp.zeros_like(padded), exact
    if exact is None:
        (out,), (residual,) = ring([padded], axis_name, [wire])
        return out, residual, None
    n = jax.lax.axis_size(axis_name)
    extra = jnp.pad(exact.astype(jnp.float32), (0, -(-exact.shape[0] // n) * n - exact.shape[0]))
    (out, out_extra), (residual, _) = ring([padded, extra], axis_name, [wire, None])
    return out, residual, out_extra[:exact.shape[0]]
