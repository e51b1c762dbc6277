"""The low-rank arithmetic PowerSGD runs on (jaxdp/sync/codecs/powersgd.py): how a leaf is seen as a
matrix, and orthonormal bases that stay orthonormal however ill-conditioned their input.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The epsilon the Gram-Schmidt `orthonormalize` added to each column norm (sqrt of float32's smallest
# normal), kept for code that reads it. The QR `orthonormalize` needs none.
ORTHO_EPS = float(np.sqrt(np.finfo(np.float32).tiny))

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


def compute_dtype(dtype: Any) -> Any:
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
    return (q * jnp.where(used, signs(rr), 0))[:k]


def signs(r: jax.Array) -> jax.Array:
    """+1 or -1 per column of QR's Q, making R's diagonal non-negative (R_jj = 0: +1)."""
    return jnp.where(jnp.diagonal(r) < 0, -1, 1).astype(r.dtype)


def basis(a: jax.Array, fresh: jax.Array) -> jax.Array:
    """r orthonormal columns (k >= r): `orthonormalize(a)`, its zero columns replaced by the columns of
    `fresh` (random, shaped like `a`) made orthogonal to the others (jaxdp/sync/codecs/powersgd.py's docstring)."""
    kept = orthonormalize(a)
    dropped = jnp.all(kept == 0, axis=0)
    order = jnp.argsort(dropped, stable=True)  # the kept columns first, in order: QR leaves them as they are
    q, rr = jnp.linalg.qr(jnp.where(dropped, fresh.astype(a.dtype), kept)[:, order])
    return (q * signs(rr))[:, jnp.argsort(order)]
