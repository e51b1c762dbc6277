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


def ring_allreduce(tree: Tree, axis_name: str) -> Tree:
    """Sum `tree` over `axis_name` with an explicit ring; same result as `jax.lax.psum(tree, axis_name)`.

    Call it inside `shard_map` (with `check_vma=False`) or `pmap`. Leaves are fused into one
    buffer per dtype, so a model with hundreds of parameters runs a handful of rings, not hundreds.

    The buffer is cut into N chunks. In reduce-scatter step s (s = 0 .. N-2) device i sends its
    running sum of chunk (i - s) mod N to device i + 1, which adds it to its own copy of that
    chunk. After N-1 steps device i holds the complete sum of chunk (i + 1) mod N. The all-gather
    phase then passes the complete chunks around the ring N-1 more times. Each device sends
    2 (N-1) / N of the buffer in total, the bandwidth-optimal amount.

    To keep every slice static, each device first rotates its chunk list so that "my chunk" is
    always index 0: after the rotation the chunk a device works on in step s is the same index on
    every device, and XLA sees only static slices and concatenations.
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
        summed = _ring_sum(flat, axis_name, n)
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


def _ring_sum(flat: jax.Array, axis_name: str, n: int) -> jax.Array:
    """Ring all-reduce of a 1-D buffer over `n` devices."""
    size = flat.shape[0]
    chunk = -(-size // n)  # ceil(size / n): the last chunk is zero-padded
    padded = jnp.pad(flat, (0, chunk * n - size)).reshape(n, chunk)
    me = jax.lax.axis_index(axis_name)
    # Rotate so that row 0 is "my" chunk (i), row 1 is chunk i+1, ...: from here on every index is static.
    rotated = jnp.take(padded, (jnp.arange(n) + me) % n, axis=0)
    chunks = [rotated[k] for k in range(n)]
    to_next = [(j, (j + 1) % n) for j in range(n)]

    # Reduce-scatter: in step s send my running sum of chunk (i - s), add the received one into
    # chunk (i - s - 1). In rotated coordinates those are rows (-s) % n and (-s - 1) % n.
    for s in range(n - 1):
        received = jax.lax.ppermute(chunks[(-s) % n], axis_name, to_next)
        k = (-s - 1) % n
        chunks[k] = chunks[k] + received
    # Now row (1 - n) % n == 1 holds the full sum of chunk i + 1. All-gather: pass complete chunks on.
    for s in range(n - 1):
        received = jax.lax.ppermute(chunks[(1 - s) % n], axis_name, to_next)
        chunks[(-s) % n] = received

    # Undo the rotation: original chunk c sits in row (c - i) % n.
    stacked = jnp.stack(chunks)
    unrotated = jnp.take(stacked, (jnp.arange(n) - me) % n, axis=0)
    return unrotated.reshape(-1)[:size]


def ring_mean(grads: Tree, axis_name: str) -> Tree:
    n = jax.lax.axis_size(axis_name)
    return jax.tree.map(lambda g: g / n, ring_allreduce(grads, axis_name))


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
