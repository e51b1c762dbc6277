"""Gradient compression for the all-reduce (none, bf16, PowerSGD) and the adaptive controller's decisions.

    comp = parse("powersgd:4")                  # "none" | "bf16" | "powersgd:RANK[:start=STEP][:min_rate=R][:seed=S]"
    cstate = comp.init(params)                  # ONE device's initial CompressionState (shapes/dtypes only matter)
    # inside jax.shard_map, on one device's gradient tree:
    mean, cstate, scalars = comp.mean(grads, cstate, allreduce_sum, num_devices, step)
    comp.payload_bytes(params), uncompressed_bytes(params), comp.collectives   # static, for reports and plan()

Interface (every kind is a frozen dataclass; build it with `parse`, `parse(c.name) == c`):

* `Compressor.name: str` ("none", "bf16", "powersgd:4", "powersgd:4:start=100").
* `Compressor.init(params) -> CompressionState`.
* `Compressor.mean(grads, state, allreduce_sum, num_devices, step) -> (mean_grads, state, scalars)`:
  runs on one device inside `shard_map`. `allreduce_sum(tree) -> tree` sums a whole tree over the
  data axis (`lambda t: jax.lax.psum(t, axis)` or `lambda t: jaxdp.sync.ring_allreduce(t, axis)`);
  it is called on whole trees, once per phase (one fused buffer per dtype per phase on the ring).
  Every mean is pre-scaled by 1/num_devices BEFORE the sum, so fp16/bf16 sums cannot overflow
  where the mean itself fits. `step` is the traced int32 step, identical on every device.
  `mean_grads` has the structure and dtypes of `grads`; `scalars` is a dict of float32 scalars,
  identical on every device ({} for none and bf16).
* `Compressor.payload_bytes(params) -> int`: bytes all-reduced per step once compressing (static).
  `uncompressed_bytes(params)` is what plain averaging moves; their ratio is the compression ratio.
* `Compressor.collectives -> int`: all-reduce calls per step (PowerSGD: 2, P then Q).

`CompressionState(error, q)` (a flax struct, dicts keyed by `jax.tree_util.keystr` of the leaf's path):

* `error`: per-device error feedback, float32 (float64 for float64 leaves), in each compressed leaf's
  own shape. It DIFFERS between devices: store it stacked on a leading device axis, sharded over the
  data axis (`P(axis)`), and checkpoint it per device. `redistribute_error` maps it to another device count.
  Only the devices' mean is owed to the model; the rest drifts (a random walk of each device's
  gradient noise that cancels in the sum; scalars["error_ratio"]); `recenter_error` removes it.
* `q`: PowerSGD's warm-start factors, (m, rank) per compressed leaf, IDENTICAL on every device after
  each step (the all-reduced Q): replicate it (`P()`).
* Both are `{}` for none and bf16.

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
Orthonormalising a Q of rank r before use changes no span (so no result) and keeps P's scale that
of the gradient. Vectors, scalars and matrices too small to gain (n*m < min_rate*(n+m)*r, PyTorch's
`min_compression_rate`, default 2) are averaged uncompressed in call 1. The factors, the errors and
the matrix products are float32 (float64 leaves stay float64): the mean is cast back to the leaf's
dtype. Before `start` (default 0) the step is plain uncompressed averaging without error feedback,
chosen inside jit by `jax.lax.cond(step >= start, ...)`: both branches hold collectives, and every
device takes the same branch because `step` is replicated.

The controller is pure decision logic; the caller measures:

    model = fit_comm_model([1 << 20, 16 << 20], [t_small, t_large])   # latency + bytes / bandwidth
    choice, reasons = plan(compute_seconds, model, params)            # the weakest compression that fits
    choice = guard(choice, running_sum_error(applied_sum, e_start, e_end))  # e_*: recenter_error's mean
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Tree = Any
AllReduce = Callable[[Tree], Tree]

# The epsilon the Gram-Schmidt `orthonormalize` added to each column norm (sqrt of float32's smallest
# normal), kept for code that reads it. The QR `orthonormalize` needs none: it divides by no column
# norm, and an all-zero column has R_jj = 0, so it is dropped rather than becoming NaN.
ORTHO_EPS = float(np.sqrt(np.finfo(np.float32).tiny))

# PyTorch's default min_compression_rate: compress a matrix only if its factors are at most half
# its size; below that the second round trip and the matmuls cost more than the bytes saved.
DEFAULT_MIN_RATE = 2.0

# The ranks `ladder` offers, from least to most compression (Vogels et al. use 1 to 4 for
# ResNet/LSTM; 32 is already close to uncompressed for most layers of small models).
DEFAULT_RANKS = (32, 16, 8, 4, 2, 1)

# plan(): the largest predicted all-reduce time, as a fraction of the compute time, we accept
# without compressing more. jaxdp's step does not overlap the all-reduce with the backward pass,
# so a step takes compute + comm: 0.25 keeps scaling efficiency at or above 1 / 1.25 = 80 %, the
# usual bar for "scales well", while never compressing a run whose link already keeps up (every
# extra step of compression costs matmuls and some gradient quality).
TARGET_COMM_FRACTION = 0.25

# When plain averaging misses the target, compress only if the chosen candidate's predicted step
# (compute + all-reduce) is at least this much shorter than plain averaging's: the prediction
# leaves out compression's own work (casts, PowerSGD's matmuls) and its cost in gradient quality,
# and times measured on a shared machine vary by 10-20 %; a smaller predicted gain pays for none
# of that. A latency-bound link (simulated devices in one process, where an
# all-reduce costs about the same at any size) is exactly such a case: there, none.
MIN_STEP_GAIN = 0.20

# guard(): the threshold on the relative error of a window's summed compressed means against its
# summed true means, as jaxdp/controller.py measures it: GUARD_WINDOW batches at the current
# parameters, error feedback threaded through them (so the error is exactly the change of the
# devices' mean error over the window: the progress still owed). Measured on the GPT of
# `python -m jaxdp.bench compression` (4 layers x 256, SGD momentum 0.9, lr 0.3, 2 devices) after
# 100 steps: rank 32 0.019, 16 0.24, 8 0.38, 4 0.53, 2 0.74, 1 0.82; after 200 steps the held-out
# loss was 0.411 at rank 32 against 0.409 uncompressed, but 0.552 at rank 16 and 1.48 at rank 4.
# At the first step (random parameters) the same probe gave rank 4 0.24, 8 0.14, 16 0.090: a
# threshold of 0.1 took rank 16 there, and it ended 250 steps 18 % above uncompressed (bench
# compression, docs/perf). 0.05 stops rank 16 at both points and passes rank 32. (On the digits MLP,
# 100-step windows, every rank from 1 to 8 matched uncompressed accuracy:
# tests/scripts/compression_guard_window.py; a 4-step window errs on the side of more rank.) Never give guard the per-step error ||approx - mean|| / ||mean|| of
# one batch without error feedback: it is 0.5 or more at low rank by design.
GUARD_THRESHOLD = 0.05
GUARD_WINDOW = 4


@flax.struct.dataclass
class CompressionState:
    """error: per-device error feedback (differs between devices); q: shared warm-start factors."""

    error: Any = flax.struct.field(default_factory=dict)
    q: Any = flax.struct.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The kinds.
# ---------------------------------------------------------------------------------------------


class Compressor:
    """The interface every kind implements (module docstring); build one with `parse(spec)`."""

    name: str
    collectives: int  # all-reduce calls per step once compressing

    def init(self, params: Tree) -> CompressionState:
        """One device's state: none, unless the kind keeps some between steps."""
        del params
        return CompressionState()

    def mean(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        raise NotImplementedError

    def payload_bytes(self, params: Tree) -> int:
        raise NotImplementedError


def matrix_view(shape: Sequence[int]) -> tuple[int, int]:
    """The (n, m) a leaf is compressed as: its dimensions split in two at the point that makes the
    most nearly square matrix (the smallest n + m, so the most compression at a given rank; the
    first such split on a tie). A Dense kernel (in, out) is itself, a conv kernel (h, w, in, out)
    is (h*w*in, out), and an attention kernel (d_model, 3, heads, head_dim) is (d_model, 3*d_model)
    rather than (d_model*3*heads, head_dim), which a rank of 32 could hardly compress."""
    splits = [(int(np.prod(shape[:k])), int(np.prod(shape[k:]))) for k in range(1, len(shape))]
    return min(splits, key=lambda nm: nm[0] + nm[1])


def bytes_sent(payload_bytes: float, num_devices: int) -> float:
    """What each device sends to all-reduce `payload_bytes` with a bandwidth-optimal algorithm
    (the ring, and what psum's collectives do): 2 (N - 1) / N of it."""
    return payload_bytes * 2 * (num_devices - 1) / num_devices


def uncompressed_bytes(params: Tree) -> int:
    """Bytes plain averaging all-reduces per step: every leaf in its own dtype."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def _scaled(tree: Tree, num_devices: int) -> Tree:
    """Every leaf times 1/num_devices, in its own dtype (so fp16 sums cannot overflow)."""
    return jax.tree.map(lambda g: g * jnp.asarray(1.0 / num_devices, g.dtype), tree)


@dataclasses.dataclass(frozen=True)
class NoCompression(Compressor):
    """Plain averaging: `allreduce_sum(g / N)`."""

    name = "none"
    collectives = 1

    def mean(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        del step
        return allreduce_sum(_scaled(grads, num_devices)), state, {}

    def payload_bytes(self, params: Tree) -> int:
        return uncompressed_bytes(params)


@dataclasses.dataclass(frozen=True)
class Bf16(Compressor):
    """Pre-scale by 1/N, cast to bfloat16, all-reduce, cast back. Leaves of 2 bytes or fewer
    (bf16, fp16) stay in their own dtype."""

    name = "bf16"
    collectives = 1

    def mean(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        del step
        wire = jax.tree.map(lambda g: g.astype(_bf16_wire(g.dtype)), _scaled(grads, num_devices))
        summed = allreduce_sum(wire)
        return jax.tree.map(lambda s, g: s.astype(g.dtype), summed, grads), state, {}

    def payload_bytes(self, params: Tree) -> int:
        return sum(int(np.prod(x.shape)) * jnp.dtype(_bf16_wire(x.dtype)).itemsize for x in jax.tree.leaves(params))


def _bf16_wire(dtype: Any) -> Any:
    return dtype if jnp.dtype(dtype).itemsize <= 2 else jnp.bfloat16


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
    def name(self) -> str:
        options = [f"start={self.start}"] if self.start else []
        options += [f"min_rate={self.min_rate:g}"] if self.min_rate != DEFAULT_MIN_RATE else []
        options += [f"seed={self.seed}"] if self.seed else []
        return ":".join(["powersgd", str(self.rank), *options])

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

    def payload_bytes(self, params: Tree) -> int:
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
            return allreduce_sum(_scaled(grads, num_devices)), state, _scalars(0.0, 0.0)

        def compressed():
            return self._compressed(grads, state, allreduce_sum, num_devices, layout, step)

        def plain():
            return allreduce_sum(_scaled(grads, num_devices)), state, _scalars(0.0, 0.0)

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
        out, error, rest_iter = [], {}, iter(first["rest"])
        for path, g in items:
            k = jax.tree_util.keystr(path)
            if k not in layout:
                out.append(next(rest_iter))
                continue
            approx = p_hat[k] @ q[k].T
            error[k] = (ms[k] - approx).reshape(g.shape)
            out.append(approx.reshape(g.shape).astype(g.dtype))
        summed = first["norms"]
        error_ratio = jnp.sqrt(summed[0] / jnp.maximum(summed[1], jnp.finfo(jnp.float32).tiny))
        return jax.tree_util.tree_unflatten(treedef, out), CompressionState(error=error, q=q), _scalars(1.0, error_ratio)


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


# ---------------------------------------------------------------------------------------------
# parse and redistribute_error.
# ---------------------------------------------------------------------------------------------

SPEC_HELP = "none, bf16 or powersgd:RANK[:start=STEP][:min_rate=R][:seed=S]"


def parse(spec: str) -> Compressor:
    """"none" | "bf16" | "powersgd:RANK[:start=STEP][:min_rate=R][:seed=S]"; ValueError (one line) otherwise."""
    def bad(why: str) -> ValueError:
        return ValueError(f"compression {spec!r}: {why}; use {SPEC_HELP}")

    if not isinstance(spec, str):
        raise bad("not a string")
    text = spec.strip().lower()
    if text == "none":
        return NoCompression()
    if text == "bf16":
        return Bf16()
    kind, _, rest = text.partition(":")
    if kind != "powersgd":
        raise bad("unknown kind")
    rank_text, *options = rest.split(":")
    if not rank_text.isdigit() or int(rank_text) < 1:
        raise bad("RANK must be a positive integer")
    fields: dict[str, Any] = {}
    for option in options:
        key, eq, value = option.partition("=")
        try:
            if not eq or key not in ("start", "min_rate", "seed") or key in fields:
                raise ValueError
            fields[key] = float(value) if key == "min_rate" else int(value)
            if fields[key] < 0 or not math.isfinite(fields[key]):
                raise ValueError
        except ValueError:
            raise bad(f"bad option {option!r}") from None
    return PowerSGD(rank=int(rank_text), **fields)


def redistribute_error(error_stacked: Tree, new_num_devices: int) -> Tree:
    """Per-device errors stacked on a leading axis of the old device count -> the same for
    `new_num_devices`: every new device gets the mean of the old devices' errors.

    What error feedback owes the model is only the mean error: the next compressed step
    approximates mean(g) + mean(e), and the updates applied so far differ from the true gradient
    sum by exactly mean(e). Giving every new device that mean preserves it (so no owed update is
    lost or counted twice), for any old and new device count. Which device owed what is not
    needed. `q` is shared and carries over unchanged. Works on numpy or JAX arrays.
    """
    if not isinstance(new_num_devices, int) or new_num_devices < 1:
        raise ValueError(f"redistribute_error: new_num_devices must be a positive integer, got {new_num_devices!r}")

    def spread(e):
        mean = e.mean(axis=0, keepdims=True, dtype=e.dtype)
        return jnp.broadcast_to(mean, (new_num_devices, *e.shape[1:])) if isinstance(e, jax.Array) \
            else np.broadcast_to(mean, (new_num_devices, *e.shape[1:])).copy()

    return jax.tree.map(spread, error_stacked)


def recenter_error(error: Tree, allreduce_sum: AllReduce, num_devices: int) -> tuple[Tree, Tree]:
    """Inside `shard_map`: every device's error becomes the devices' mean error; returns
    (new error, mean error). One uncompressed all-reduce of the error buffers (pre-scaled).

    The mean is all that error feedback owes (see `redistribute_error`), so the updates are
    unchanged; what goes is the devices' drift apart (`_scalars`, error_ratio). The mean error is
    also what `running_sum_error` needs at each end of a window, so a caller measuring windows
    can recenter at every window boundary for free.
    """
    mean = allreduce_sum(_scaled(error, num_devices))
    return mean, mean


# ---------------------------------------------------------------------------------------------
# The adaptive controller: pure decisions from measured times.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommModel:
    """All-reduce time = calls * latency_s + bytes * seconds_per_byte."""

    latency_s: float
    seconds_per_byte: float

    def seconds(self, nbytes: int, calls: int = 1) -> float:
        return calls * self.latency_s + nbytes * self.seconds_per_byte


def fit_comm_model(sizes_bytes: Sequence[int], seconds: Sequence[float]) -> CommModel:
    """Least-squares line through measured (bytes, seconds) all-reduce times, two points or more.
    A negative intercept (noise) becomes 0 latency; times that do not grow with size raise."""
    x, y = np.asarray(sizes_bytes, np.float64), np.asarray(seconds, np.float64)
    if x.shape != y.shape or x.size < 2 or np.unique(x).size < 2:
        raise ValueError("fit_comm_model needs all-reduce times for at least two different sizes")
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        raise ValueError("fit_comm_model: the measured times do not grow with size; measure larger buffers")
    return CommModel(latency_s=max(float(intercept), 0.0), seconds_per_byte=float(slope))


def ladder(params: Tree, ranks: Sequence[int] = DEFAULT_RANKS, start: int = 0) -> list[Compressor]:
    """Candidates from least to most compression: none, bf16, then PowerSGD at decreasing ranks.
    A rank is left out when it is no smaller than the largest matrix's min(n, m) (it would be that
    matrix's full rank), or when it moves no fewer bytes than the previous PowerSGD candidate."""
    out: list[Compressor] = [NoCompression(), Bf16()]
    shapes = [x.shape for x in jax.tree.leaves(params) if len(x.shape) >= 2]
    largest = max((min(int(np.prod(s[:-1])), int(s[-1])) for s in shapes), default=0)
    last_bytes = None
    for r in sorted(set(ranks), reverse=True):
        candidate = PowerSGD(rank=r, start=start)
        if r >= largest or not candidate.layout(params):
            continue
        payload = candidate.payload_bytes(params)
        if last_bytes is not None and payload >= last_bytes:
            continue
        out.append(candidate)
        last_bytes = payload
    return out


def plan(compute_seconds: float, comm_model: CommModel, params: Tree, candidates: Sequence[Compressor] | None = None,
         target_fraction: float = TARGET_COMM_FRACTION) -> tuple[Compressor, dict]:
    """The first candidate (least compression first) whose predicted all-reduce time is at most
    `target_fraction * compute_seconds`, or if none is, the one with the shortest predicted step
    (compute + all-reduce); but the first candidate (plain averaging) unless the choice's step is
    at least MIN_STEP_GAIN shorter than its. Reasons say which and why.

    reasons: {"compute_s", "target_s", "predicted_s": {name: seconds}, "payload_bytes": {name: bytes},
    "uncompressed_bytes", "chosen", "fits": bool, "why": a sentence}.
    """
    candidates = list(ladder(params) if candidates is None else candidates)
    if not candidates:
        raise ValueError("plan needs at least one candidate")
    target = target_fraction * compute_seconds
    payload = {c.name: c.payload_bytes(params) for c in candidates}
    predicted = {c.name: comm_model.seconds(payload[c.name], c.collectives) for c in candidates}
    reasons = {"compute_s": compute_seconds, "target_s": target, "predicted_s": predicted, "payload_bytes": payload,
               "uncompressed_bytes": uncompressed_bytes(params)}
    step = {name: compute_seconds + t for name, t in predicted.items()}
    plain = candidates[0]
    fitting = [c for c in candidates if predicted[c.name] <= target]
    if plain in fitting:
        why = (f"{plain.name}: predicted all-reduce {predicted[plain.name] * 1e3:.3g} ms <= {target_fraction:g} x compute "
               f"{compute_seconds * 1e3:.3g} ms")
        return plain, {**reasons, "chosen": plain.name, "fits": True, "why": why}
    fastest = min(candidates, key=lambda c: step[c.name])  # the first of equals: the least compression
    choice = fitting[0] if fitting else fastest
    gain = 1 - step[choice.name] / step[plain.name]
    if gain < MIN_STEP_GAIN:
        why = (f"{plain.name}: the best candidate ({choice.name}) predicts a step only {gain:.0%} shorter (< "
               f"{MIN_STEP_GAIN:.0%}); the all-reduce costs latency more than bandwidth here")
        return plain, {**reasons, "chosen": plain.name, "fits": False, "why": why}
    if fitting:
        why = (f"{choice.name}: predicted all-reduce {predicted[choice.name] * 1e3:.3g} ms <= {target_fraction:g} x "
               f"compute {compute_seconds * 1e3:.3g} ms, the least compression that fits; a step {gain:.0%} shorter")
    else:
        why = (f"{choice.name}: no candidate fits {target_fraction:g} x compute {compute_seconds * 1e3:.3g} ms; it predicts "
               f"the shortest step, {gain:.0%} shorter than {plain.name} (communication still dominates: fewer "
               f"synchronisations, e.g. local steps, would be next)")
    return choice, {**reasons, "chosen": choice.name, "fits": bool(fitting), "why": why}


def relative_error(approx_mean: Tree, true_mean: Tree) -> jax.Array:
    """float32 ||approx - true|| / ||true|| over the whole tree (global norms); 0 when both are 0."""
    diff = sum(jnp.sum(jnp.square(jnp.asarray(a, jnp.float32) - jnp.asarray(t, jnp.float32)))
               for a, t in zip(jax.tree.leaves(approx_mean), jax.tree.leaves(true_mean)))
    true = sum(jnp.sum(jnp.square(jnp.asarray(t, jnp.float32))) for t in jax.tree.leaves(true_mean))
    return jnp.sqrt(jnp.asarray(diff, jnp.float32) / jnp.maximum(jnp.asarray(true, jnp.float32), jnp.finfo(jnp.float32).tiny))


def running_sum_error(applied_sum: Tree, mean_error_start: Tree, mean_error_end: Tree) -> jax.Array:
    """`relative_error(applied, true)` for the sums over a window of compressed steps, from what the
    caller can afford to measure: the applied (decompressed) means summed over the window, and the
    device-mean of the error buffer at its start and end (one uncompressed all-reduce of `error`
    each). Error feedback makes it exact: Σ true means = Σ applied + ē_end - ē_start (telescoping
    ē_{t+1} = ē_t + mean(g_t) - applied_t). This is what `guard` should be given for PowerSGD;
    for none and bf16 (no error feedback) the per-step `relative_error` is the right measure."""
    true_sum = jax.tree.map(lambda a, e1, e0: a + e1 - e0, applied_sum, mean_error_end, mean_error_start)
    return relative_error(applied_sum, true_sum)


def weaker(choice: Compressor, candidates: Sequence[Compressor] | None = None) -> Compressor:
    """The next candidate with less compression: the previous one in `candidates` when `choice` is
    in it; otherwise PowerSGD rank r -> 2r (up to the largest of DEFAULT_RANKS), then bf16, then none."""
    candidates = list(candidates or [])
    if choice in candidates:
        return candidates[max(candidates.index(choice) - 1, 0)]
    if isinstance(choice, PowerSGD):
        if choice.rank * 2 <= max(DEFAULT_RANKS):
            return dataclasses.replace(choice, rank=choice.rank * 2)
        return Bf16()
    return NoCompression()


def guard(choice: Compressor, rel_error: float, threshold: float = GUARD_THRESHOLD,
          candidates: Sequence[Compressor] | None = None) -> Compressor:
    """`choice` while `rel_error <= threshold`; above it, the next weaker candidate (`weaker`).
    Give it `running_sum_error` for PowerSGD (see GUARD_THRESHOLD); a NaN error steps back too."""
    if float(rel_error) <= threshold:
        return choice
    return weaker(choice, candidates)


# ---------------------------------------------------------------------------------------------
# In the TrainState: `state.sync` (jaxdp.state.SyncState) under the name "compression".
# ---------------------------------------------------------------------------------------------

STATE_NAME = "compression"
AUTO = "auto"


def resolve(spec: Any) -> Compressor | str | None:
    """None for no compression ("none" too), AUTO for "auto", else the Compressor (ValueError if bad)."""
    if spec is None or isinstance(spec, NoCompression):
        return None
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str) and spec.strip().lower() == AUTO:
        return AUTO
    compressor = parse(spec)
    return None if isinstance(compressor, NoCompression) else compressor


def _safe(key: str) -> str:
    """A leaf's keystr ("['Dense_0']['kernel']") as a checkpoint-safe name ("Dense_0.kernel")."""
    return re.sub(r"[^A-Za-z0-9_]+", ".", key).strip(".")


def state_for(spec: Any, params: Tree) -> CompressionState:
    """One device's state for `spec`; for AUTO, one state that serves every candidate of `ladder`:
    the error of every leaf any candidate compresses, and Q at the largest rank (a candidate of
    rank r uses its first r columns). Keys are checkpoint-safe names (`_safe`)."""
    compressor = resolve(spec)
    if compressor is None or isinstance(compressor, Bf16):
        return CompressionState()
    if compressor == AUTO:
        powersgd = [c for c in ladder(params) if isinstance(c, PowerSGD)]
        if not powersgd:
            return CompressionState()
        keys = set().union(*(c.layout(params) for c in powersgd))
        widest = PowerSGD(rank=max(c.rank for c in powersgd), min_rate=0.0).init(params)
        state = CompressionState(error={k: v for k, v in widest.error.items() if k in keys},
                                 q={k: v for k, v in widest.q.items() if k in keys})
    else:
        state = compressor.init(params)
    return CompressionState(error={_safe(k): v for k, v in state.error.items()},
                            q={_safe(k): v for k, v in state.q.items()})


def sync_state(spec: Any, params: Tree, mesh: Any) -> Any:
    """The `SyncState` of a new TrainState: the error stacked per device (sharded over the data
    axis), Q replicated. Empty without compression state."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxdp.mesh import axis_name, replicate
    from jaxdp.state import SyncState

    state = jax.device_get(state_for(spec, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)))
    if not state.error and not state.q:
        return SyncState()
    rows = NamedSharding(mesh, P(axis_name(mesh)))
    error = {k: jax.make_array_from_callback((mesh.size, *e.shape), rows, lambda index, e=e: np.broadcast_to(
        np.asarray(e), (mesh.size, *e.shape))[index]) for k, e in state.error.items()}
    return SyncState(per_device={STATE_NAME: error}, shared={STATE_NAME: replicate(state.q, mesh)})


def view(compressor: Compressor, stored: CompressionState, grads: Tree) -> CompressionState:
    """The part of a stored state (made by `state_for` for this compressor, or for AUTO) that
    `compressor.mean` reads, keyed as it expects. ValueError if the stored state lacks a leaf."""
    if not isinstance(compressor, PowerSGD):
        return CompressionState()
    layout = compressor.layout(grads)
    missing = [k for k in layout if _safe(k) not in stored.error]
    if missing:
        raise ValueError(f"the state has no compression state for {compressor.name} (leaf {missing[0]}); make it with "
                         f"init_state(..., compression={compressor.name!r}) or compression='auto'")
    return CompressionState(error={k: stored.error[_safe(k)] for k in layout},
                            q={k: stored.q[_safe(k)][:, :r] for k, (_, _, r) in layout.items()})


def merge(stored: CompressionState, new: CompressionState) -> CompressionState:
    """`view`'s inverse: the stored state with the compressor's new error and Q written back."""
    error, q = dict(stored.error), dict(stored.q)
    for k, e in new.error.items():
        error[_safe(k)] = e.astype(error[_safe(k)].dtype)
    for k, v in new.q.items():
        old = q[_safe(k)]
        q[_safe(k)] = v.astype(old.dtype) if v.shape == old.shape else old.at[:, :v.shape[1]].set(v.astype(old.dtype))
    return CompressionState(error=error, q=q)
