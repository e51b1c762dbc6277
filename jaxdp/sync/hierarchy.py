"""Hierarchical: any collective made two-level, exact inside each process (XLA's collective over
"local"), then the strategy across processes on 1/G of the buffer per device.

    mesh = make_mesh(axis_name=("hosts", "local"))      # one row of devices per process
    collective = hierarchical("ring")                   # a Collective; on a one-axis mesh the ring itself
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxdp.sync.collectives import Collective, Halves, Tree, as_collective, fused, psum_scatter


@functools.cache
def hierarchical(strategy: Any) -> Collective:
    """`strategy` (a name, Collective or function with a sum) made two-level for a mesh of two data
    axes (`make_mesh(axis_name=("hosts", "local"))`: one row of devices per process):

    1. reduce-scatter over "local" with XLA's own collective (`psum_scatter`, but see there): device l of a process
       holds the process's exact sum of block l, 1/G of the buffer (G devices per process);
    2. the strategy over "hosts" on that block only: each device's ring (or all-reduce) spans one
       device per process and carries 1/G of the buffer, so the link between processes carries
       each value once per process, where one flat ring over all N devices carries it about
       2 (N-1)/N × N/H times; a codec's hops (int8 / int4) quantize only there;
    3. all-gather over "local": every device gets the whole sum.

    The same sum as the flat collective, in another order (equal to float rounding). On a mesh of
    one axis it is the strategy itself. Its halves (ZeRO-1) give device (h, l) the chunk h G + l
    as the flat ones do, so a ZeRO-1 state is laid out the same either way.
    """
    base = as_collective(strategy)
    if base.on_host:
        raise ValueError(f"hierarchical: strategy {base.name!r} averages on the host, which sums inside each process "
                         "already; give an in-graph strategy (psum or ring)")
    if base.sum is None:
        raise ValueError(f"hierarchical: strategy {base.name!r} has no sum over devices (Collective.sum)")

    def mean(tree: Tree, outer: Any, inner: str) -> Tree:
        return fused(lambda flat: _across(flat, inner, lambda block: base(block, outer),
                                          1.0 / jax.lax.axis_size(inner)), tree)

    def total(tree: Tree, outer: Any, inner: str) -> Tree:
        return fused(lambda flat: _across(flat, inner, lambda block: base.sum(block, outer)), tree)

    def reduce_scatter(padded: jax.Array, outer: Any, inner: str) -> jax.Array:
        hosts, local = jax.lax.axis_size(outer), jax.lax.axis_size(inner)
        # chunk h G + l must end on device (h, l): order the chunks local-major, so that the
        # local reduce-scatter's block l holds chunks (0, l), (1, l), ... for the ring across hosts
        by_local = padded.reshape(hosts, local, -1).swapaxes(0, 1).reshape(-1)
        block = psum_scatter(by_local, inner) / local
        return base.halves.reduce_scatter(block, outer)

    def all_gather(owned: jax.Array, outer: Any, inner: str) -> jax.Array:
        hosts, local = jax.lax.axis_size(outer), jax.lax.axis_size(inner)
        by_local = jax.lax.all_gather(base.halves.all_gather(owned, outer), inner, tiled=True)
        return by_local.reshape(local, hosts, -1).swapaxes(0, 1).reshape(-1)

    def coded_sum(padded: jax.Array, outer: Any, inner: str, wire: Any,
                  exact: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        block = psum_scatter(padded, inner)  # exact, inside the process
        riding = None if exact is None else jax.lax.psum(exact, inner)
        got, left, riding = base.coded_sum(block, outer, wire, riding)
        # what this device's encodings left out sits at its block's place; over all devices the
        # residuals still add up to (exact sum - returned sum), so error feedback is unchanged
        residual = jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(padded), left,
                                                       jax.lax.axis_index(inner) * block.shape[0], 0)
        return jax.lax.all_gather(got, inner, tiled=True), residual, riding

    halves = None if base.halves is None else Halves(_two_level(base.halves.reduce_scatter, reduce_scatter),
                                                     _two_level(base.halves.all_gather, all_gather))
    return Collective(base.name, mean=_two_level(base, mean), sum=_two_level(base.sum, total), halves=halves,
                      coded_sum=None if base.coded_sum is None else _two_level(base.coded_sum, coded_sum),
                      hierarchical=True)


def _two_level(flat: Callable[..., Any], two: Callable[..., Any]) -> Callable[..., Any]:
    """`flat(x, axis, *rest)` on a mesh of one data axis; `two(x, outer, inner, *rest)` on a mesh of
    several (`_two_levels`)."""
    def call(x: Any, axis: Any, *rest: Any, **named: Any) -> Any:
        split = _two_levels(axis)
        return flat(x, axis, *rest, **named) if split is None else two(x, *split, *rest, **named)

    return call


def _two_levels(axis: Any) -> tuple[Any, str] | None:
    """(the axes across processes, the local axis) of a mesh's data axes, or None for one axis."""
    if isinstance(axis, str) or len(axis) < 2:
        return None
    return (axis[0] if len(axis) == 2 else tuple(axis[:-1])), axis[-1]


def _across(flat: jax.Array, inner: str, across: Callable[[jax.Array], jax.Array], scale: float = 1.0) -> jax.Array:
    """Reduce-scatter `flat` over `inner` (XLA, exact), `across` on this device's block, all-gather."""
    size, local = flat.shape[0], jax.lax.axis_size(inner)
    padded = jnp.pad(flat, (0, -(-size // local) * local - size))
    block = psum_scatter(padded, inner)
    if scale != 1.0:
        block = block * scale
    return jax.lax.all_gather(across(block), inner, tiled=True)[:size]
