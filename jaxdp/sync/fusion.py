"""Fusion: one flat buffer per dtype, so a model with hundreds of leaves runs a handful of collectives.

Every collective of jaxdp/sync/ (psum across processes, the ring, the coded ring) fuses the leaves of the tree
it is given with these before it sends anything.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

Tree = Any


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
