"""Collectives as values: what turns each device's tree into the mean over the mesh.

A strategy is a `Collective`: a frozen value with its mean `(tree, axis) -> tree` (called inside
`shard_map` on each device's own tree), and where it has them its sum, its reduce-scatter and
all-gather halves (`Halves`, what ZeRO-1 puts its update between), a coded sum (the ring whose
every hop sends through a codec's wire format: the int8 / int4 codecs), or an on-host mean. `PSUM`
(XLA's all-reduce) and `RING` (the explicit ring of `jax.lax.ppermute` in jaxdp/sync/ring.py) are here; `HOST` (the
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
with several data axes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxdp.sync.fusion import _group_by_dtype, fused
from jaxdp.sync.ring import (  # noqa: F401 (send: importable from here too, as before the ring had a file)
    ring_all_gather, ring_allreduce, ring_coded_allreduce, ring_mean, ring_reduce_scatter, send,
)

Tree = Any

def on_host(fn: Callable) -> Callable:
    """Mark a strategy that averages numpy gradients on the host instead of inside the step."""
    fn.on_host = True
    return fn


def is_on_host(strategy: Any) -> bool:
    """True for an on-host strategy: a function marked with `@on_host`, or a Collective with a host mean."""
    return bool(getattr(strategy, "on_host", False))


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
    is a gloo round trip of its own, so bf16 gradients beside float32 metrics ran two, slower than
    one float32 buffer (docs/performance.md, "Behind the defaults")."""
    leaves = jax.tree.leaves(tree)
    if jax.default_backend() != "cpu" or len({jnp.result_type(x) for x in leaves}) < 2:
        return fused(reduce, tree)
    _group_by_dtype(leaves)  # floating point only, as everywhere
    wide = jnp.result_type(*leaves)
    return jax.tree.map(lambda out, x: out.astype(x.dtype), fused(reduce, jax.tree.map(lambda x: x.astype(wide), tree)), tree)


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


def psum_scatter(padded: jax.Array, axis_name: Any) -> jax.Array:
    """A 1-D buffer of N equal chunks in, on device i the sum over devices of chunk i out: XLA's
    `psum_scatter`, except on CPU under jax.distributed.

    There XLA runs every collective through gloo, even between the devices of one process, and
    gloo's reduce-scatter returns wrong values at the end of a chunk of a few MiB, now and then,
    with no error (https://github.com/jax-ml/jax/issues/40830); its all-reduce and send / receive
    are right. So on CPU with several processes this is the ring's own reduce-scatter, of
    ppermutes: faster there than gloo's own, and than an all-reduce and a slice (`python -m jaxdp.bench
    collectives --reduce-scatter`; docs/performance.md). Decided at trace time. An empty buffer is
    its own (empty) result: XLA's verifier refuses a reduce-scatter of zero length.
    """
    if not padded.size:
        return padded
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        return ring_reduce_scatter(padded, axis_name)
    return jax.lax.psum_scatter(padded, axis_name, tiled=True)


def _psum_scatter_mean(padded: jax.Array, axis_name: Any) -> jax.Array:
    return psum_scatter(padded, axis_name) / jax.lax.axis_size(axis_name)


def _psum_all_gather(owned: jax.Array, axis_name: Any) -> jax.Array:
    if not owned.size:  # an empty chunk of an empty buffer (XLA's verifier refuses an all-gather of zero length)
        return owned
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
