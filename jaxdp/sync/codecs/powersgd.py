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

# The epsilon the Gram-Schmidt `orthonormalize` added to each column norm (sqrt of float32's smallest
# normal), kept for code that reads it. The QR `orthonormalize` needs none.
ORTHO_EPS = float(np.sqrt(np.finfo(np.float32).tiny))

# PyTorch's default min_compression_rate: compress a matrix only if its factors are at most half
# its size; below that the second round trip and the matmuls cost more than the bytes saved.
DEFAULT_MIN_RATE = 2.0


def matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """The (n, m) a leaf is compressed as: its dimensions split in two at the point that makes the
    most nearly square matrix (the smallest n + m, so the most compression at a given rank; the
    first such split on a tie). A Dense kernel (in, out) is itself, a conv kernel (h, w, in, out)
    is (h*w*in, out), and an attention kernel (d_model, 3, heads, head_dim) is (d_model, 3*d_model)
    rather than (d_model*3*heads, head_dim), which a rank of 32 could hardly compress."""
    k = split_at(shape)
    return int(np.prod(shape[:k])), int(np.prod(shape[k:]))


def split_at(shape: Sequence[int]) -> int:
    """The k of `matrix_view`: its rows are the dimensions before k, its columns the rest."""
    sums = [int(np.prod(shape[:k])) + int(np.prod(shape[k:])) for k in range(1, len(shape))]
    return 1 + sums.index(min(sums))


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
        """The same PowerSGD on slices of the leaves (jaxdp/sync/codecs/powersgd_sliced.py)."""
        from jaxdp.sync.codecs.powersgd_sliced import Sliced

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
            dtype = _compute_dtype(flat[k].dtype)
            error[k] = jnp.zeros(flat[k].shape, dtype)
            q[k] = jax.random.normal(jax.random.fold_in(key, i), (m, r), dtype)
        return CompressionState(error=error, q=q)

    def _fresh(self, layout: dict, step: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
        """{leaf key: (m, r) and (n, r) standard normals}, the new directions `_basis` may give Q and
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
                total += (n + m) * r * jnp.dtype(_compute_dtype(x.dtype)).itemsize
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
            dtype = _compute_dtype(g.dtype)
            e = state.error[k].astype(dtype)
            ms[k] = (g.astype(dtype) + e).reshape(n, m)
            ps[k] = (ms[k] * scale) @ _basis(state.q[k].astype(dtype), fresh[k][0])
            err_sq += jnp.sum(jnp.square(e)).astype(jnp.float32)
            grad_sq += jnp.sum(jnp.square(g.astype(dtype))).astype(jnp.float32)
        # Call 1: P of every compressed leaf, the uncompressed leaves, and two norms for the metrics.
        norms = jnp.stack([err_sq, grad_sq]) * jnp.float32(scale)
        first = allreduce_sum({"p": ps, "rest": rest, "norms": norms})
        p_hat = {k: _basis(p, fresh[k][1]) for k, p in first["p"].items()}
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


def _compute_dtype(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def orthonormalize(a: jax.Array) -> jax.Array:
    """Orthonormal (or zero) columns whose span contains the columns of `a` (k, r): the Q of a
    Householder QR (`jnp.linalg.qr`), orthonormal to working precision however ill-conditioned `a`
    is, each column's sign chosen so that R's diagonal is not negative. Where `a` has full column
    rank this is Gram-Schmidt's result (column j: the part of a's column j outside the previous
    ones), deterministic and unique.

    A column of Q that `a` does not use, |row j of R| = |q_jᵀ a| at rounding level (sqrt(k) eps
    times a's largest column norm), becomes 0: where the rank of `a` is below r, and every column
    of an all-zero `a` (no NaN). So P̂ P̂ᵀ is always an orthogonal projection that keeps `a`: it
    never enlarges the gradient, even when the gradient's rank is below r (a constant matrix, or a
    Dense kernel's gradient from fewer rows than r).
    """
    k, r = a.shape
    largest = jnp.max(jnp.abs(a))
    a = a / jnp.where(largest > 0, largest, 1)  # Q is the same; the norms below neither under- nor overflow
    q, rr = jnp.linalg.qr(jnp.pad(a, ((0, max(r - k, 0)), (0, 0))))  # r rows at least: Q is (., r)
    used = jnp.linalg.norm(rr, axis=1) > np.sqrt(k) * jnp.finfo(a.dtype).eps * jnp.max(jnp.linalg.norm(a, axis=0))
    return (q * jnp.where(used, _signs(rr), 0))[:k]


def _signs(r: jax.Array) -> jax.Array:
    """+1 or -1 per column of QR's Q, making R's diagonal non-negative (R_jj = 0: +1)."""
    return jnp.where(jnp.diagonal(r) < 0, -1, 1).astype(r.dtype)


def _basis(a: jax.Array, fresh: jax.Array) -> jax.Array:
    """r orthonormal columns (k >= r): `orthonormalize(a)`, its zero columns replaced by the columns of
    `fresh` (random, shaped like `a`) made orthogonal to the others (module docstring)."""
    kept = orthonormalize(a)
    dropped = jnp.all(kept == 0, axis=0)
    order = jnp.argsort(dropped, stable=True)  # the kept columns first, in order: QR leaves them as they are
    q, rr = jnp.linalg.qr(jnp.where(dropped, fresh.astype(a.dtype), kept)[:, order])
    return (q * _signs(rr))[:, jnp.argsort(order)]
