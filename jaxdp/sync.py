"""Gradient synchronisation strategies, registered by name in `jaxdp.registry.STRATEGIES`.

A strategy turns each device's gradients into the mean over all devices. Two kinds exist:

* in-graph: `fn(grads, axis_name) -> mean_grads`, called inside `shard_map` on each device's own
  gradients. `psum` and `ring` (here) are of this kind. A new collective is one such function plus
  one line in `STRATEGIES`; the step, the CLI, the tests and the benchmarks pick it up from there.
  A strategy that can also be cut into a reduce-scatter and an all-gather carries them as
  `fn.halves` (a `Halves`); ZeRO-1 (`shard_optimizer=True`) needs them.
* on-host (marked with `@on_host`): `fn(local_trees, *, num_devices, process_sum) -> mean`, called
  outside jit on a list with one numpy pytree per local device. `host` (jaxdp/host.py) is the only
  one: it exists to show what a collective saves.

Every strategy returns a tree of the same structure and dtypes as its input. The train step
calls its strategy once per step, on the gradients together with the metrics and the float
leaves of the model state (one collective instead of three), so a strategy averages whatever
float tree it is given, not only gradients.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

Tree = Any


def on_host(fn: Callable) -> Callable:
    """Mark a strategy that averages numpy gradients on the host instead of inside the step."""
    fn.on_host = True
    return fn


def is_on_host(strategy: Callable) -> bool:
    """True for a strategy marked with `@on_host`."""
    return getattr(strategy, "on_host", False)


# ---------------------------------------------------------------------------------------------
# Fusion: one flat buffer per dtype, so a model with hundreds of leaves runs a handful of collectives.
# ---------------------------------------------------------------------------------------------


def fused(fn: Callable[[jax.Array], jax.Array], tree: Tree) -> Tree:
    """Apply `fn` (1-D buffer -> 1-D buffer of the same size) to the leaves of `tree`, concatenated
    into one buffer per dtype; split the results back into the tree's shapes. Inside the step,
    XLA fuses each slice back into the optimizer update that reads it.
    """
    leaves, treedef = jax.tree.flatten(tree)
    out: list[Any] = [None] * len(leaves)
    for indices in _group_by_dtype(leaves).values():
        flat = fn(jnp.concatenate([jnp.ravel(leaves[i]) for i in indices]))
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


def psum_mean(grads: Tree, axis_name: str) -> Tree:
    """`jax.lax.pmean`; across processes, of one fused buffer per dtype.

    Within a process, XLA's all-reduce of each leaf is the fastest (fusing costs a concatenation
    and gives nothing back). Across processes on CPU every leaf is one gloo call with its own
    latency, so there the leaves travel as one buffer per dtype (figures in README "Performance").
    On GPUs XLA combines all-reduces itself.
    """
    if jax.process_count() > 1:
        return fused(lambda flat: jax.lax.pmean(flat, axis_name), grads)
    return jax.lax.pmean(grads, axis_name)


# ---------------------------------------------------------------------------------------------
# ring: reduce-scatter then all-gather, each step moving 1/N of a buffer to the next neighbour.
# ---------------------------------------------------------------------------------------------


def ring_allreduce(tree: Tree, axis_name: str, *, mean: bool = False) -> Tree:
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
    return fused(lambda flat: _ring_sum(flat, axis_name, n, mean), tree)


def _ring_sum(flat: jax.Array, axis_name: str, n: int, mean: bool = False) -> jax.Array:
    """Ring all-reduce (sum, or mean) of a 1-D buffer over `n` devices: its two halves."""
    size = flat.shape[0]
    chunk = -(-size // n)  # ceil(size / n): the last chunk is zero-padded
    padded = jnp.pad(flat, (0, chunk * n - size))
    return ring_all_gather(ring_reduce_scatter(padded, axis_name, mean=mean), axis_name)[:size]


def ring_reduce_scatter(padded: jax.Array, axis_name: str, *, mean: bool = False) -> jax.Array:
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
        acc = chunk_of(me - s - 2) + jax.lax.ppermute(acc, axis_name, to_next)
    return acc / n if mean else acc  # a mean divides only the one chunk this device owns


def ring_all_gather(owned: jax.Array, axis_name: str) -> jax.Array:
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
        owned = jax.lax.ppermute(owned, axis_name, to_next)  # the full chunk (i - 1 - s)
        out = put(out, owned, me - s - 1)
    return out


def ring_mean(grads: Tree, axis_name: str) -> Tree:
    return ring_allreduce(grads, axis_name, mean=True)


# ---------------------------------------------------------------------------------------------
# Halves: what ZeRO-1 (jaxdp/zero.py) puts its optimizer update between.
# ---------------------------------------------------------------------------------------------


class Halves(NamedTuple):
    """A strategy's all-reduce cut in two, on 1-D buffers of N equal chunks (inside shard_map):
    `reduce_scatter(buffer, axis) -> the mean of chunk i` on device i, and
    `all_gather(chunk, axis) -> the whole buffer` on every device."""

    reduce_scatter: Callable[[jax.Array, str], jax.Array]
    all_gather: Callable[[jax.Array, str], jax.Array]


def _psum_scatter_mean(padded: jax.Array, axis_name: str) -> jax.Array:
    return jax.lax.psum_scatter(padded, axis_name, tiled=True) / jax.lax.axis_size(axis_name)


def _psum_all_gather(owned: jax.Array, axis_name: str) -> jax.Array:
    return jax.lax.all_gather(owned, axis_name, tiled=True)


psum_mean.halves = Halves(_psum_scatter_mean, _psum_all_gather)
# The plain sum over devices (compression pre-scales by 1/N itself, so narrow dtypes cannot overflow).
psum_mean.sum = lambda tree, axis_name: (fused(lambda flat: jax.lax.psum(flat, axis_name), tree)
                                         if jax.process_count() > 1 else jax.lax.psum(tree, axis_name))
ring_mean.sum = ring_allreduce
ring_mean.halves = Halves(functools.partial(ring_reduce_scatter, mean=True), ring_all_gather)


def summing(strategy: Callable) -> Callable[[Tree, str], Tree] | None:
    """The strategy's sum over devices `(tree, axis) -> tree`, or None if it has none."""
    return getattr(strategy, "sum", None)


def halves(strategy: Callable) -> Halves | None:
    """The strategy's reduce-scatter and all-gather, or None if it has none (`host`, a custom one)."""
    return getattr(strategy, "halves", None)
