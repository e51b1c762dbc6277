"""Gradient synchronisation strategies, registered by name in `STRATEGIES`.

A strategy turns each device's gradients into the mean over all devices. Two kinds exist:

* in-graph: `fn(grads, axis_name) -> mean_grads`, called inside `shard_map` on each device's own
  gradients. `psum` and `ring` are of this kind. A new collective is one such function plus one
  line in `STRATEGIES`; the step, the CLI, the tests and the benchmarks pick it up from there.
* on-host (marked with `@on_host`): `fn(local_grads) -> mean_grads`, called outside jit on a list
  with one numpy gradient pytree per local device. `host` is the only one: it exists to show what
  a collective saves.

Every strategy returns a tree of the same structure and dtypes as its input.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Tree = Any


def on_host(fn: Callable) -> Callable:
    """Mark a strategy that averages numpy gradients on the host instead of inside the step."""
    fn.on_host = True
    return fn


def runs_on_host(strategy: Callable) -> bool:
    return getattr(strategy, "on_host", False)


# ---------------------------------------------------------------------------------------------
# psum: XLA's all-reduce (NCCL on GPUs).
# ---------------------------------------------------------------------------------------------


def psum_mean(grads: Tree, axis_name: str) -> Tree:
    return jax.lax.pmean(grads, axis_name)


# ---------------------------------------------------------------------------------------------
# ring: reduce-scatter then all-gather, each step moving 1/N of a buffer to the next neighbour.
# ---------------------------------------------------------------------------------------------


def ring_allreduce(tree: Tree, axis_name: str, *, mean: bool = False) -> Tree:
    """Sum `tree` over `axis_name` with an explicit ring; same result as `jax.lax.psum(tree, axis_name)`.

    Call it inside `shard_map` (with `check_vma=False`) or `pmap`. Leaves are fused into one
    buffer per dtype, so a model with hundreds of parameters runs a handful of rings, not hundreds.

    The buffer is cut into N chunks. In reduce-scatter step s (s = 0 .. N-2) device i sends its
    running sum of chunk (i - s) mod N to device i + 1, which adds it to its own copy of that
    chunk. After N-1 steps device i holds the complete sum of chunk (i + 1) mod N. The all-gather
    phase then passes the complete chunks around the ring N-1 more times. Each device sends
    2 (N-1) / N of the buffer in total, the bandwidth-optimal amount.

    Device i's chunk indices are (i - s) mod N, so the chunks are addressed with dynamic slices
    of the padded (N, chunk) buffer; XLA fuses each slice into the add that reads it and writes
    each received all-gather chunk in place into that same buffer. There is no rotation, stack or
    gather: per hop, one collective-permute copy plus (reduce-scatter only) one fused add.
    On one process with simulated CPU devices the 2 (N-1) collective-permute copies alone cost
    about as much as XLA's one-pass in-process all-reduce (measurements in README "Performance").

    `mean=True` returns the mean instead: each device divides the one chunk it completes by N
    before the all-gather, 1/N of a pass over the buffer instead of a whole one.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    n = jax.lax.axis_size(axis_name)
    if n == 1:
        return tree
    out: list[Any] = [None] * len(leaves)
    for dtype, indices in _group_by_dtype(leaves).items():
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in indices])
        summed = _ring_sum(flat, axis_name, n, mean)
        offset = 0
        for i in indices:
            size = leaves[i].size
            out[i] = summed[offset:offset + size].reshape(leaves[i].shape)
            offset += size
    return jax.tree.unflatten(treedef, out)


def _group_by_dtype(leaves: Sequence[jax.Array]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise TypeError(f"ring_allreduce sums floating-point arrays only, got {dtype}")
        groups.setdefault(dtype, []).append(i)
    return groups


def _ring_sum(flat: jax.Array, axis_name: str, n: int, mean: bool = False) -> jax.Array:
    """Ring all-reduce (sum, or mean) of a 1-D buffer over `n` devices."""
    size = flat.shape[0]
    chunk = -(-size // n)  # ceil(size / n): the last chunk is zero-padded
    padded = jnp.pad(flat, (0, chunk * n - size)).reshape(n, chunk)
    me = jax.lax.axis_index(axis_name)
    to_next = [(j, (j + 1) % n) for j in range(n)]

    def chunk_of(c: jax.Array) -> jax.Array:  # my copy of chunk c mod n (fused into its consumer)
        return jax.lax.dynamic_index_in_dim(padded, c % n, 0, keepdims=False)

    # Reduce-scatter: in step s send my running sum of chunk (i - s), add the received running sum
    # of chunk (i - s - 1) to my own copy of it. After n - 1 steps `acc` is the full sum of chunk i + 1.
    acc = chunk_of(me)
    for s in range(n - 1):
        acc = chunk_of(me - s - 1) + jax.lax.ppermute(acc, axis_name, to_next)
    if mean:
        acc = acc / n  # the same division psum-then-divide does, on the one chunk this device owns
    # All-gather: pass complete chunks on; each lands in place in the (dead) padded input buffer.
    out = jax.lax.dynamic_update_index_in_dim(padded, acc, (me + 1) % n, 0)
    for s in range(n - 1):
        acc = jax.lax.ppermute(acc, axis_name, to_next)  # the full sum of chunk (i - s)
        out = jax.lax.dynamic_update_index_in_dim(out, acc, (me - s) % n, 0)
    return out.reshape(-1)[:size]


def ring_mean(grads: Tree, axis_name: str) -> Tree:
    return ring_allreduce(grads, axis_name, mean=True)


# ---------------------------------------------------------------------------------------------
# host: the naive baseline. Device -> host numpy average -> device, outside the compiled step.
# ---------------------------------------------------------------------------------------------

# Sums the per-process host partial sums across processes (through host memory). Single-process
# runs leave it as the identity; `jaxdp.distributed` installs a cross-process one.
_cross_process_sum: Callable[[list[np.ndarray]], list[np.ndarray]] = lambda arrays: arrays


def set_cross_process_sum(fn: Callable[[list[np.ndarray]], list[np.ndarray]]) -> None:
    """Install how `host` sums its per-process partial sums across processes."""
    global _cross_process_sum
    _cross_process_sum = fn


@on_host
def host_mean(local_grads: Sequence[Tree], num_devices: int | None = None) -> Tree:
    """Average per-device gradients in host memory.

    `local_grads` holds one numpy pytree per device of this process; `num_devices` is the global
    device count (default: len(local_grads), the single-process case).
    """
    num_devices = len(local_grads) if num_devices is None else num_devices
    first, *rest = local_grads
    leaves, treedef = jax.tree.flatten(first)
    sums = [np.array(leaf, copy=True) for leaf in leaves]
    for tree in rest:  # accumulate in place: no N-times-larger stack
        for acc, leaf in zip(sums, jax.tree.leaves(tree)):
            acc += leaf
    sums = _cross_process_sum(sums)
    means = [(s / num_devices).astype(s.dtype, copy=False) for s in sums]
    return jax.tree.unflatten(treedef, means)


STRATEGIES: dict[str, Callable] = {
    "psum": psum_mean,
    "ring": ring_mean,
    "host": host_mean,
}
