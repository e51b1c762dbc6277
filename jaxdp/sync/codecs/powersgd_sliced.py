"""PowerSGD on slices of the leaves (`Sliced`): `shard_params` across workers (jaxdp/step/hsdp.py),
where each device holds a slice of every matrix and no device a whole one.

    PowerSGD(rank=4).on_slices(cuts, "local", 4)      # what hsdp.Workers.exchange_of asks for

The rule, and why it is PowerSGD's on whole leaves, are in `Sliced`'s docstring; the rest of
PowerSGD (the basis, the new directions, the slot) is jaxdp/sync/codecs/powersgd.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.sync.codecs.base import AllReduce, CompressionState, Compressor, Tree
from jaxdp.sync.codecs.powersgd import PowerSGD, _basis, _compute_dtype, finish, split_at


@dataclasses.dataclass(frozen=True)
class Sliced(Compressor):
    """PowerSGD on slices (`shard_params` across workers, jaxdp/step/hsdp.py): each device holds a
    slice of every leaf, cut along one dimension into `pieces` over the mesh axis `axis` (its
    worker's devices), and averages it with the devices holding the same slice in the other
    workers. The result is `base`'s on the whole leaves, up to the order of float sums:

    A leaf cut on the rows of its matrix view (n, m) (a dimension before the split) holds rows M_l:
    P_l = M_l Q is its own rows of P, summed across workers as it is, then gathered over `axis`
    (n r floats inside the worker) into the whole P, which every device orthonormalises (its rows in
    their natural order, so the new directions are the same draw); Q = Σ_l M_lᵀ P̂_l is summed over
    `axis` and across workers at once: scattered over `axis`, each device sends its 1/pieces across,
    then gathered. A leaf cut on the columns: the same with the roles of P and Q swapped (its rows
    of Q, the shared factor, taken from the whole Q every device keeps). A leaf every device holds
    whole (no dimension divides): each device sends 1/pieces of P and of Q across, then they are
    gathered. So what crosses between workers is 1/pieces of `base`'s payload per device, what
    crosses inside a worker is the factors, and no device ever holds a whole gradient. Error
    feedback is per slice, the warm-start Q whole (replicated), as `base` keeps them.

    `cuts`: ((leaf key, whole shape, cut dimension or None), ...), keyed like `base.layout`.
    """

    base: PowerSGD
    cuts: tuple
    axis: Any
    pieces: int

    collectives = 2

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def state_name(self) -> str:
        return self.base.state_name

    @property
    def start(self) -> int:  # type: ignore[override]
        return self.base.start

    def _whole(self, tree: Tree) -> Tree:
        """`tree` (slices) as ShapeDtypeStructs of the whole leaves."""
        shapes = {k: shape for k, shape, _ in self.cuts}
        return jax.tree_util.tree_map_with_path(
            lambda path, x: jax.ShapeDtypeStruct(shapes[jax.tree_util.keystr(path)], x.dtype), tree)

    def layout(self, params: Tree) -> dict[str, tuple[int, int, int]]:
        return self.base.layout(self._whole(params))

    def read(self, slot: CompressionState, grads: Tree) -> CompressionState:
        return self.base.read(slot, self._whole(grads))

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
        """What one device sends across workers (its slice's share)."""
        layout, parts = self.layout(params), self.pieces
        shapes, cut = {k: shape for k, shape, _ in self.cuts}, {k: c for k, _, c in self.cuts}
        total = 8
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            k = jax.tree_util.keystr(path)
            if k not in layout:
                total += int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                continue
            n, m, r = layout[k]
            split, c = split_at(shapes[k]), cut[k]
            rows, cols = -(-n * r // parts), -(-m * r // parts)  # scattered or spread: 1/pieces each
            if c is not None:
                rows, cols = (n // parts * r, cols) if c < split else (rows, m // parts * r)
            total += (rows + cols) * jnp.dtype(_compute_dtype(x.dtype)).itemsize
        return total

    mean = PowerSGD.mean  # (plain averaging before `start`, then `_compressed` below)

    def _compressed(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
                    layout: dict, step: Any) -> tuple[Tree, CompressionState, dict]:
        axis, parts = self.axis, self.pieces
        me = jax.lax.axis_index(axis)
        whole_shape = {k: shape for k, shape, _ in self.cuts}
        cut = {k: c for k, _, c in self.cuts}
        items, treedef = jax.tree_util.tree_flatten_with_path(grads)
        scale = 1.0 / num_devices
        fresh = self.base._fresh(layout, step)

        def own(x: jax.Array, dim: int) -> jax.Array:
            """This device's piece of a whole `x` along `dim`."""
            size = x.shape[dim] // parts
            return jax.lax.dynamic_slice_in_dim(x, me * size, size, axis=dim)

        def gathered(x: jax.Array, dim: int) -> jax.Array:
            """Every device's piece `x` along `dim`, in order: the whole."""
            g = jnp.moveaxis(jax.lax.all_gather(x, axis), 0, dim)
            return g.reshape(*g.shape[:dim], g.shape[dim] * g.shape[dim + 1], *g.shape[dim + 2:])

        def scatter(x: jax.Array, summed: bool) -> jax.Array:
            """1/pieces of `x` (flattened, padded): summed over `axis` (partial sums) or this
            device's part of an `x` every device holds."""
            flat = jnp.pad(jnp.ravel(x), (0, -x.size % parts)).reshape(parts, -1)
            return jax.lax.psum_scatter(flat, axis, scatter_dimension=0) if summed else flat[me]

        def unscatter(piece: jax.Array, shape: tuple) -> jax.Array:
            return jax.lax.all_gather(piece, axis, tiled=True)[:int(np.prod(shape))].reshape(shape)

        ms, first, plans, rest = {}, {}, {}, []
        sq_cut, sq_whole = jnp.zeros(2, jnp.float32), jnp.zeros(2, jnp.float32)
        for path, g in items:
            k = jax.tree_util.keystr(path)
            if k not in layout:
                rest.append(g * jnp.asarray(scale, g.dtype))
                continue
            n, m, r = layout[k]
            shape, c = whole_shape[k], cut[k]
            split = split_at(shape)
            dtype = _compute_dtype(g.dtype)
            e = state.error[k].astype(dtype)
            ms[k] = (g.astype(dtype) + e).reshape(int(np.prod(g.shape[:split])), -1)  # this device's M
            mk = ms[k] * jnp.asarray(scale, dtype)
            norms = jnp.stack([jnp.sum(jnp.square(e)), jnp.sum(jnp.square(g.astype(dtype)))]).astype(jnp.float32)
            q = _basis(state.q[k].astype(dtype), fresh[k][0])
            if c is None:  # whole on every device of the worker
                sq_whole += norms
                plans[k] = "whole"
                first[k] = scatter(mk @ q, summed=False)
            elif c < split:  # rows: this device's rows of P
                sq_cut += norms
                plans[k] = "rows"
                first[k] = mk @ q
            else:  # columns: this device's rows of Q, a partial P
                sq_cut += norms
                plans[k] = "cols"
                mine = own(q.reshape(*shape[split:], r), c - split).reshape(-1, r)
                first[k] = scatter(mk @ mine, summed=True)
        norms = (jax.lax.psum(sq_cut, axis) + sq_whole) * jnp.float32(scale)
        # Call 1: P (or this device's part of it), the uncompressed slices, two norms.
        summed = allreduce_sum({"p": first, "rest": rest, "norms": norms})
        p_hat, second = {}, {}
        for k, plan in plans.items():
            n, m, r = layout[k]
            shape, c = whole_shape[k], cut[k]
            split = split_at(shape)
            mk = ms[k] * jnp.asarray(scale, ms[k].dtype)
            if plan == "rows":
                piece_shape = (*shape[:split], r)
                piece_shape = tuple(s // parts if i == c else s for i, s in enumerate(piece_shape))
                p = gathered(summed["p"][k].reshape(piece_shape), c).reshape(n, r)
                p_hat[k] = own(_basis(p, fresh[k][1]).reshape(*shape[:split], r), c).reshape(-1, r)
                second[k] = scatter(mk.T @ p_hat[k], summed=True)
            else:
                p_hat[k] = _basis(unscatter(summed["p"][k], (n, r)), fresh[k][1])
                second[k] = mk.T @ p_hat[k] if plan == "cols" else scatter(mk.T @ p_hat[k], summed=False)
        # Call 2: Q (or this device's part of it).
        summed_q = allreduce_sum(second)
        q_whole, q_mine = {}, {}
        for k, plan in plans.items():
            n, m, r = layout[k]
            shape, c = whole_shape[k], cut[k]
            split = split_at(shape)
            if plan == "cols":
                q_mine[k] = summed_q[k]
                piece_shape = tuple(s // parts if i + split == c else s for i, s in enumerate(shape[split:]))
                q_whole[k] = gathered(summed_q[k].reshape(*piece_shape, r), c - split).reshape(m, r)
            else:
                q_whole[k] = q_mine[k] = unscatter(summed_q[k], (m, r))
        return finish(items, treedef, layout, summed["rest"], ms, p_hat, q_mine, q_whole, summed["norms"])
