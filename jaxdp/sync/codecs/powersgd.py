"""PowerSGD: rank-r compression with error feedback and warm start (`PowerSGD`).

    PowerSGD(rank=4)    # "powersgd:4"; parse("powersgd:4:start=100:min_rate=2:seed=0")

PowerSGD (Vogels et al., NeurIPS 2019; behaviour of PyTorch's powerSGD_hook) on each compressible
leaf g seen as a matrix of shape (n, m) = `matrix_view(g.shape)`, its dimensions split where the
matrix is most nearly square (a Dense kernel (in, out) is itself, a conv kernel (h, w, in, out) is
(h*w*in, out), an attention kernel (d, 3, heads, head_dim) is (d, 3*heads*head_dim));
r = min(RANK, n, m):

    M = g + e                                   (error feedback, per device)
    P = (M / N) @ basis(Q)                      all-reduced with the uncompressed leaves (call 1)
    P̂ = basis(P)
    Q = (M / N)ᵀ @ P̂                            all-reduced (call 2); kept in the state (warm start)
    mean ≈ P̂ Qᵀ,  e = M - P̂ Qᵀ                  (per device)

basis(A) is r orthonormal columns whose span contains A's columns: `orthonormalize(A)` (a
Householder QR with R's diagonal made non-negative: Gram-Schmidt's result wherever A has full column
rank), with each column that A does not use (A's rank is below r) replaced by a new random
direction orthogonal to the others. The new directions come from one draw per step, keyed by (seed,
step), each leaf's at its place in the draw: the same on every device (A, the all-reduced P or the
shared Q, is too) and in a resumed run. So a step whose gradient has rank below r (zero, for a
layer behind a zero-initialised one; constant; sparse) lowers the rank of that step only. Without
them its Q would keep zero columns for good: a leaf whose first compressed gradient is zero would
never train.

Because the sums are linear, P̂ Qᵀ = P̂ P̂ᵀ mean(M): the projection of the mean EF-corrected gradient
onto span(P̂) ⊇ span(mean(M) @ basis(Q)), the same as compressing the mean gradient on one device
with the same Q. The columns of P̂ are orthonormal, so the projection never enlarges the gradient,
a zero gradient gives exactly 0, and at full rank (r = min(n, m)) the mean is exact. The mean of
the devices' new errors is exactly what that projection left out, so the next step adds it back.
Vectors, scalars and matrices too small to gain (n*m < min_rate*(n+m)*r, PyTorch's
`min_compression_rate`, default 2) are averaged uncompressed in call 1. The factors, the errors and
the matrix products are float32 (float64 leaves stay float64): the mean is cast back to the leaf's
dtype. Before `start` (default 0) the step is plain uncompressed averaging without error feedback,
chosen inside jit by `jax.lax.cond(step >= start, ...)`: both branches hold collectives, and every
device takes the same branch because `step` is replicated.

The slot: `error` per device for each compressed leaf (it DIFFERS between devices; a checkpoint
resumed on another device count gives every new device the mean of the old rows), `q` the (m, r)
warm-start factors, IDENTICAL on every device after each step, replicated. A slot made for a
higher rank (or for "auto": the largest rank of the ladder) serves a lower one: it reads Q's first
r columns.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.sync.codecs.base import AllReduce, CompressionState, Compressor, Tree, _checkpoint_safe, scaled
from jaxdp.sync.codecs.lowrank import (  # noqa: F401 (ORTHO_EPS, orthonormalize, matrix_view: importable from here too)
    ORTHO_EPS, basis, compute_dtype, matrix_view, orthonormalize, split_at,
)

# PyTorch's default min_compression_rate: compress a matrix only if its factors are at most half
# its size; below that the second round trip and the matmuls cost more than the bytes saved.
DEFAULT_MIN_RATE = 2.0


# PowerSGD's random streams: the initial Q of leaf i is drawn from fold_in(PRNGKey(seed), i); the new
# directions of a step from fold_in(fold_in(PRNGKey(seed), _FRESH_STREAM), step), which no leaf
# index reaches.
_FRESH_STREAM = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-`rank` PowerSGD with error feedback and warm start (module docstring)."""

    rank: int
    start: int = 0                       # plain averaging (no error feedback) while step < start
    min_rate: float = DEFAULT_MIN_RATE   # compress only if n*m >= min_rate * (n+m) * r
    seed: int = 0                        # the initial Q, identical on every device

    collectives = 2

    @property
    def state_name(self) -> str:
        return "powersgd:" + ":".join([str(self.rank)] + ([f"min_rate={self.min_rate:g}"]
                                                         if self.min_rate != DEFAULT_MIN_RATE else []))

    @property
    def name(self) -> str:
        options = [f"start={self.start}"] if self.start else []
        options += [f"min_rate={self.min_rate:g}"] if self.min_rate != DEFAULT_MIN_RATE else []
        options += [f"seed={self.seed}"] if self.seed else []
        return ":".join(["powersgd", str(self.rank), *options])

    @classmethod
    def from_spec(cls, text: str) -> "PowerSGD":
        """"powersgd:RANK[:start=STEP][:min_rate=R][:seed=S]" (the table's grammar has checked it)."""
        rank_text, *options = text.split(":")[1:]
        fields: dict[str, Any] = {}
        for option in options:
            key, _, value = option.partition("=")
            if key in fields:
                raise ValueError(f"option {key!r} given twice")
            fields[key] = float(value) if key == "min_rate" else int(value)
            if not math.isfinite(fields[key]):
                raise ValueError(f"bad option {option!r}")
        return cls(rank=int(rank_text), **fields)

    @classmethod
    def candidates(cls, name: str, params: Tree, *, ranks: Sequence[int], start: int, ring_devices: int | None,
                   bound: float) -> list[Compressor]:
        """The auto ladder's: one per rank of `ranks`, largest first, less those no smaller than the
        largest matrix's min(n, m) (its full rank) or with nothing to compress."""
        shapes = [x.shape for x in jax.tree.leaves(params) if len(x.shape) >= 2]
        largest = max((min(int(np.prod(s[:-1])), int(s[-1])) for s in shapes), default=0)
        return [c for c in (cls(rank=r, start=start) for r in sorted(set(ranks), reverse=True))
                if c.rank < largest and c.layout(params)]

    @classmethod
    def serving(cls, members: Sequence[Compressor], params: Tree) -> CompressionState:
        """Q at the largest rank of `members`, for the leaves any of them compresses (a candidate of
        rank r reads the first r columns), and their error rows."""
        if not members:
            return CompressionState()
        keys = {_checkpoint_safe(k) for c in members for k in c.layout(params)}
        widest = cls(rank=max(c.rank for c in members), min_rate=0.0).slot(params)
        return CompressionState(error={k: v for k, v in widest.error.items() if k in keys},
                                q={k: v for k, v in widest.q.items() if k in keys})

    def on_slices(self, cuts: tuple, axis: Any, pieces: int) -> Compressor:
        """The same PowerSGD on slices of the leaves (`Sliced`, below)."""
        return Sliced(self, cuts, axis, pieces)

    def weaker(self, ranks: Sequence[int]) -> Compressor:
        """Rank r -> 2r, up to the largest of `ranks`, then bf16."""
        if self.rank * 2 <= max(ranks):
            return dataclasses.replace(self, rank=self.rank * 2)
        from jaxdp.sync.codecs import parse

        return parse("bf16")

    def read(self, slot: CompressionState, grads: Tree) -> CompressionState:
        layout = self.layout(grads)
        self._require(slot, list(layout), " or compression='auto'")
        return CompressionState(error={k: slot.error[_checkpoint_safe(k)] for k in layout},
                                q={k: slot.q[_checkpoint_safe(k)][:, :r] for k, (_, _, r) in layout.items()})

    def layout(self, params: Tree) -> dict[str, tuple[int, int, int]]:
        """{leaf key: (n, m, r)} for the leaves this compressor compresses, in flatten order."""
        out = {}
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            if len(x.shape) < 2:
                continue
            n, m = matrix_view(x.shape)
            r = min(self.rank, n, m)
            if n * m >= self.min_rate * (n + m) * r:
                out[jax.tree_util.keystr(path)] = (n, m, r)
        return out

    def init(self, params: Tree) -> CompressionState:
        layout = self.layout(params)
        flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        key = jax.random.PRNGKey(self.seed)
        error, q = {}, {}
        for i, (k, (n, m, r)) in enumerate(layout.items()):
            dtype = compute_dtype(flat[k].dtype)
            error[k] = jnp.zeros(flat[k].shape, dtype)
            q[k] = jax.random.normal(jax.random.fold_in(key, i), (m, r), dtype)
        return CompressionState(error=error, q=q)

    def _fresh(self, layout: dict, step: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
        """{leaf key: (m, r) and (n, r) standard normals}, the new directions `lowrank.basis` may give Q and
        P at `step`: one draw for all leaves (one generator in the program, which compiles in a
        fraction of the time of one per leaf), each leaf's slice at its index in `layout`. The same
        on every device and in a resumed run, different at every step."""
        sizes = [size for n, m, r in layout.values() for size in (m * r, n * r)]
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.seed), _FRESH_STREAM), step)
        pieces = iter(jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32), np.cumsum(sizes)[:-1]))
        return {k: (next(pieces).reshape(m, r), next(pieces).reshape(n, r)) for k, (n, m, r) in layout.items()}

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
        layout = self.layout(params)
        total = 8  # the two float32 norms riding in call 1 (scalars["error_ratio"])
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            k = jax.tree_util.keystr(path)
            if k in layout:
                n, m, r = layout[k]
                total += (n + m) * r * jnp.dtype(compute_dtype(x.dtype)).itemsize
            else:
                total += int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
        return total

    def mean(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        layout = self.layout(grads)
        if not layout:  # nothing worth compressing: plain averaging, one call
            return allreduce_sum(scaled(grads, num_devices)), state, _scalars(0.0, 0.0)

        def compressed():
            return self._compressed(grads, state, allreduce_sum, num_devices, layout, step)

        def plain():
            return allreduce_sum(scaled(grads, num_devices)), state, _scalars(0.0, 0.0)

        if self.start <= 0:
            return compressed()
        # Collectives in both branches: every device takes the same one, since `step` is replicated.
        return jax.lax.cond(jnp.asarray(step) >= self.start, compressed, plain)

    def _compressed(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
                    layout: dict, step: Any) -> tuple[Tree, CompressionState, dict]:
        items, treedef = jax.tree_util.tree_flatten_with_path(grads)
        scale = 1.0 / num_devices
        fresh = self._fresh(layout, step)
        ms, ps, rest = {}, {}, []
        err_sq, grad_sq = jnp.float32(0), jnp.float32(0)
        for path, g in items:
            k = jax.tree_util.keystr(path)
            if k not in layout:
                rest.append(g * jnp.asarray(scale, g.dtype))
                continue
            n, m, _ = layout[k]
            dtype = compute_dtype(g.dtype)
            e = state.error[k].astype(dtype)
            ms[k] = (g.astype(dtype) + e).reshape(n, m)
            ps[k] = (ms[k] * scale) @ basis(state.q[k].astype(dtype), fresh[k][0])
            err_sq += jnp.sum(jnp.square(e)).astype(jnp.float32)
            grad_sq += jnp.sum(jnp.square(g.astype(dtype))).astype(jnp.float32)
        # Call 1: P of every compressed leaf, the uncompressed leaves, and two norms for the metrics.
        norms = jnp.stack([err_sq, grad_sq]) * jnp.float32(scale)
        first = allreduce_sum({"p": ps, "rest": rest, "norms": norms})
        p_hat = {k: basis(p, fresh[k][1]) for k, p in first["p"].items()}
        # Call 2: Q of every compressed leaf.
        q = allreduce_sum({k: (ms[k] * scale).T @ p_hat[k] for k in ms})
        return finish(items, treedef, layout, first["rest"], ms, p_hat, q, q, first["norms"])


def finish(items: list, treedef: Any, layout: dict, rest: list, ms: dict, p_hat: dict, q: dict, kept: dict,
           norms: jax.Array) -> tuple[Tree, CompressionState, dict]:
    """The end of a compressed step: each compressed leaf's mean P̂ Qᵀ (`q` this device's rows of
    Q, whole on a whole leaf) and its new error M - P̂ Qᵀ, the averaged `rest` elsewhere, the state
    with the warm start `kept`, and the scalars from the summed `norms`."""
    out, error, rest_iter = [], {}, iter(rest)
    for path, g in items:
        k = jax.tree_util.keystr(path)
        if k not in layout:
            out.append(next(rest_iter))
            continue
        approx = p_hat[k] @ q[k].T
        error[k] = (ms[k] - approx).reshape(g.shape)
        out.append(approx.reshape(g.shape).astype(g.dtype))
    error_ratio = jnp.sqrt(norms[0] / jnp.maximum(norms[1], jnp.finfo(jnp.float32).tiny))
    return jax.tree_util.tree_unflatten(treedef, out), CompressionState(error=error, q=kept), _scalars(1.0, error_ratio)


def _scalars(compressed: Any, error_ratio: Any) -> dict:
    """compressed: 1 on a compressed step, 0 before `start`.

    error_ratio: sqrt(Σ_devices ||e||² / Σ_devices ||g||²) over the compressed leaves at the start
    of the step. It is NOT the error feedback still owed (that is the devices' MEAN error, which
    needs an all-reduce: `recenter_error`). Each device keeps e_i = M_i - mean approximation, so
    the part of e_i that differs between devices adds up each step's g_i - mean(g): a random walk
    of the gradient noise that cancels exactly in the sum but grows like sqrt(steps) (on the MLP /
    digits at rank 4: 13 at step 100, ~300 at step 600). Read it as a precision gauge: the float32
    sum of P loses about error_ratio x 6e-8 relative; `recenter_error` resets it.
    """
    return {"compressed": jnp.asarray(compressed, jnp.float32), "error_ratio": jnp.asarray(error_ratio, jnp.float32)}


# ---------------------------------------------------------------------------------------------
# PowerSGD on slices of the leaves: shard_params across workers (jaxdp/step/hsdp.py), where each device
# holds a slice of every matrix and no device a whole one. `PowerSGD.on_slices` makes it.
# ---------------------------------------------------------------------------------------------


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
            total += (rows + cols) * jnp.dtype(compute_dtype(x.dtype)).itemsize
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
            dtype = compute_dtype(g.dtype)
            e = state.error[k].astype(dtype)
            ms[k] = (g.astype(dtype) + e).reshape(int(np.prod(g.shape[:split])), -1)  # this device's M
            mk = ms[k] * jnp.asarray(scale, dtype)
            norms = jnp.stack([jnp.sum(jnp.square(e)), jnp.sum(jnp.square(g.astype(dtype)))]).astype(jnp.float32)
            q = basis(state.q[k].astype(dtype), fresh[k][0])
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
                p_hat[k] = own(basis(p, fresh[k][1]).reshape(*shape[:split], r), c).reshape(-1, r)
                second[k] = scatter(mk.T @ p_hat[k], summed=True)
            else:
                p_hat[k] = basis(unscatter(summed["p"][k], (n, r)), fresh[k][1])
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
