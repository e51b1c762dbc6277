"""Gradient compression codecs for the all-reduce: none, bf16, int8 / int4 and PowerSGD.

    comp = parse("powersgd:4")                  # "none" | "bf16" | "int8" | "int4" | "powersgd:RANK[:start=STEP][:min_rate=R][:seed=S]"
    cstate = comp.init(params)                  # ONE device's initial CompressionState (shapes/dtypes only matter)
    # inside jax.shard_map, on one device's gradient tree:
    mean, cstate, scalars = comp.mean(grads, cstate, allreduce_sum, num_devices, step)
    comp.payload_bytes(params), uncompressed_bytes(params), comp.collectives   # static, for reports and plan()

Interface (every kind is a frozen dataclass; build it with `parse`, `parse(c.name) == c`):

* `Compressor.name: str` ("none", "bf16", "int8", "int4", "powersgd:4", "powersgd:4:start=100").
* `Compressor.init(params) -> CompressionState`.
* `Compressor.mean(grads, state, allreduce_sum, num_devices, step) -> (mean_grads, state, scalars)`:
  runs on one device inside `shard_map`. `allreduce_sum(tree) -> tree` sums a whole tree over the
  data axis (`lambda t: jax.lax.psum(t, axis)` or `lambda t: jaxdp.sync.collectives.ring_allreduce(t, axis)`);
  it is called on whole trees, once per phase (one fused buffer per dtype per phase on the ring).
  Every mean is pre-scaled by 1/num_devices BEFORE the sum, so fp16/bf16 sums cannot overflow
  where the mean itself fits. `step` is the traced int32 step, identical on every device.
  A codec whose `needs` is "coded_sum" (int8, int4: `Quantized`) receives instead of `allreduce_sum`
  the collective's coded ring, `coded_sum(buffer, wire) -> (sum, residual)` (`Wire`,
  `ring_coded_allreduce`): it requantizes at every hop, which a whole-tree sum cannot do.
  `Compressor.needs` ("sum" or "coded_sum") is what the exchange checks the collective has.
  `mean_grads` has the structure and dtypes of `grads`; `scalars` is a dict of float32 scalars,
  identical on every device ({} for none and bf16).
* `Compressor.payload_bytes(params, num_devices=None) -> int`: bytes all-reduced per step once
  compressing (static); with `num_devices`, what that many devices' ring carries, padding and
  scales included (int8 / int4), so `bytes_sent(payload, N)` is what each device sends.
  `uncompressed_bytes(params)` is what plain averaging moves; their ratio is the compression ratio.
* `Compressor.collectives -> int`: all-reduce calls per step (PowerSGD: 2, P then Q).
* `Compressor.state_name -> str | None`: what its state in the train state is made for (None: it
  keeps none); two codecs with the same state_name share a state (PowerSGD's rank and min_rate
  fix its shapes; its start step and seed do not).

`CompressionState(error, q)` (a flax struct, dicts keyed by `jax.tree_util.keystr` of the leaf's path):

* `error`: per-device error feedback, float32 (float64 for float64 leaves), in each compressed leaf's
  own shape. It DIFFERS between devices: store it stacked on a leading device axis, sharded over the
  data axis (`P(axis)`), and checkpoint it per device; a checkpoint resumed on another device count
  gives every new device the mean of the old rows (jaxdp/checkpoint/checkpointer.py). Only the devices' mean is
  owed to the model; the rest drifts (a random walk of each device's gradient noise that cancels in
  the sum; scalars["error_ratio"]).
* `q`: PowerSGD's warm-start factors, (m, rank) per compressed leaf, IDENTICAL on every device after
  each step (the all-reduced Q): replicate it (`P()`).
* Both are `{}` for none and bf16; int8 / int4 keep `error` for every leaf and no `q`.

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

The train-state side (where the error feedback and Q live in `state.sync`, and the mean of the
devices' trees with the metrics riding along) is jaxdp/sync/exchange.py; the cost model that chooses a
codec from measured times is jaxdp/sync/costmodel.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.moved import forwarder

Tree = Any
AllReduce = Callable[[Tree], Tree]

# The epsilon the Gram-Schmidt `orthonormalize` added to each column norm (sqrt of float32's smallest
# normal), kept for code that reads it. The QR `orthonormalize` needs none: it divides by no column
# norm, and an all-zero column has R_jj = 0, so it is dropped rather than becoming NaN.
ORTHO_EPS = float(np.sqrt(np.finfo(np.float32).tiny))

# PyTorch's default min_compression_rate: compress a matrix only if its factors are at most half
# its size; below that the second round trip and the matmuls cost more than the bytes saved.
DEFAULT_MIN_RATE = 2.0



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
    state_name: str | None = None  # what its train-state slot is made for; None: it keeps no state
    needs = "sum"  # what of the collective `mean` receives: "sum", or "coded_sum" (int8, int4)

    def init(self, params: Tree) -> CompressionState:
        """One device's state: none, unless the kind keeps some between steps."""
        del params
        return CompressionState()

    def mean(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        raise NotImplementedError

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
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

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
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

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
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
    def state_name(self) -> str:
        return "powersgd:" + ":".join([str(self.rank)] + ([f"min_rate={self.min_rate:g}"]
                                                         if self.min_rate != DEFAULT_MIN_RATE else []))

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
# int8 / int4: a quantized ring, requantized at every hop, with error feedback.
# ---------------------------------------------------------------------------------------------

# The most values that share one float32 scale. Smaller blocks follow the values more closely (an
# outlier coarsens only its own block) but send more scales: 4 bytes per block is 0.8 % of an int8
# block of 512 and 1.6 % of an int4 one (256 bytes). 512 also keeps a small model's padding small:
# each ring chunk is cut into ceil(chunk / 512) equal blocks, so no chunk pads more than a few values.
QUANT_BLOCK = 512


class Wire(NamedTuple):
    """A codec's wire format for one ring chunk of a fixed length (float32), what
    `jaxdp.sync.collectives.ring_coded_allreduce` sends at every hop: `encode(chunk) -> (message, residual)`,
    the 1-D uint8 message and `chunk - decode(message)`; `decode(message) -> chunk`, what the
    receiver adds (or, for a finished chunk, every device keeps)."""

    encode: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
    decode: Callable[[jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Quantized(Compressor):
    """`int8` or `int4`: the whole tree as one float32 buffer through the collective's coded ring
    (jaxdp.sync.collectives.ring_coded_allreduce), every message `bits`-bit integers with one float32 scale per
    block of at most QUANT_BLOCK values (int4: two values per byte).

    Per device: x = (g + e) / N (e: this device's error feedback). In the reduce-scatter each
    device encodes its running sum of a chunk and sends it; the next device decodes it, adds its
    own x and encodes the new sum (requantizes) before sending on. The owner of a finished chunk
    encodes it once and the all-gather passes those bytes round; every device, the owner too,
    keeps their decoding, so every replica gets the same bits.

    Encoding a block: scale = max|v| / qmax (qmax = 127, or 7 for int4), v -> round(v / scale)
    (to nearest, ties to even), clipped to ±qmax. Its error is at most scale / 2 per value.

    Error feedback: each device encodes every chunk position exactly once (N - 1 partial sums in
    the reduce-scatter, then its finished chunk) and keeps what its encodings left out,
    e = N * residual (so the devices' MEAN error is what is owed to the mean, as with PowerSGD,
    and a checkpoint resumed on another device count keeps it). The residuals telescope:
    returned mean = mean(g) + mean(e_old) - mean(e_new) exactly (up to float32 rounding), so every
    hop's requantization, not only the quantization of a device's own input, is sent again at the
    next step, and the sum of applied means over T steps differs from the true one by
    mean(e_0) - mean(e_T) only.

    The bound of one step (before feedback): a value's sum meets N encodings (N - 1 hops, then the
    all-gather's one), each off by at most its block's scale / 2 = amax / (2 qmax). With A the
    largest sum over devices of |x| in the block (which bounds every true partial sum), each
    encoding's block max is at most A plus the errors before it, so the error after all N is at
    most ((1 + 1/(2 qmax))^N - 1) * A: for N = 8, 3.2 % of A for int8, 74 % for int4 (first order
    N / (2 qmax): 3.1 %, 57 %). It is bounded because scales follow the running sums, and it is
    not lost: error feedback carries it into the next step, where |e| <= N * scale / 2 again.

    Every leaf is quantized, biases too (no min-size rule): they share the fused buffer, so they
    cost no collective of their own; where a small leaf shares a block with larger values its
    rounding error is larger, and error feedback sends it later.
    """

    bits: int

    collectives = 1
    needs = "coded_sum"

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def state_name(self) -> str:
        return self.name

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def init(self, params: Tree) -> CompressionState:
        return CompressionState(error={jax.tree_util.keystr(p): jnp.zeros(x.shape, jnp.float32)
                                       for p, x in jax.tree_util.tree_flatten_with_path(params)[0]})

    def error_bound(self, num_devices: int) -> float:
        """The bound of one step before feedback, as a fraction of the block's largest sum over
        devices (the class docstring): (1 + 1 / (2 qmax)) ** N - 1."""
        return (1 + 1 / (2 * self.qmax)) ** max(int(num_devices), 1) - 1

    def chunking(self, size: int, num_devices: int) -> tuple[int, int]:
        """(chunk, block): the ring chunk of a `size`-value buffer over `num_devices`, cut into
        equal blocks of at most QUANT_BLOCK values (an even number, so int4 packs whole bytes)."""
        chunk = max(-(-size // num_devices), 1)
        blocks = -(-chunk // QUANT_BLOCK)
        block = 2 * -(-chunk // (2 * blocks))
        return blocks * block, block

    def message_bytes(self, chunk: int, block: int) -> int:
        return chunk // block * 4 + chunk * self.bits // 8

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
        size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        if num_devices is None:  # no padding: what a large device count converges to
            return -(-size * self.bits // 8) + -(-size // QUANT_BLOCK) * 4
        return num_devices * self.message_bytes(*self.chunking(size, num_devices))

    def wire(self, chunk: int, block: int) -> Any:
        """The Wire of one chunk: its float32 scales (as bytes), then the packed integers."""
        blocks, qmax = chunk // block, self.qmax

        def encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            v = x.reshape(blocks, block)
            scale = jnp.max(jnp.abs(v), axis=1) / jnp.float32(qmax)
            safe = jnp.where(scale > 0, scale, jnp.float32(1))
            q = jnp.clip(jnp.round(v / safe[:, None]), -qmax, qmax).astype(jnp.int8)
            q = jnp.where(scale[:, None] > 0, q, jnp.int8(0))
            left = x - _dequantize(q, scale).ravel()
            return jnp.concatenate([jax.lax.bitcast_convert_type(scale, jnp.uint8).ravel(), self._pack(q.ravel())]), left

        def decode(message: jax.Array) -> jax.Array:
            scale = jax.lax.bitcast_convert_type(message[:blocks * 4].reshape(blocks, 4), jnp.float32)
            return _dequantize(self._unpack(message[blocks * 4:]).reshape(blocks, block), scale).ravel()

        return Wire(encode, decode)

    def _pack(self, q: jax.Array) -> jax.Array:
        if self.bits == 8:
            return jax.lax.bitcast_convert_type(q, jnp.uint8)
        u = (q + 8).astype(jnp.uint8).reshape(-1, 2)  # 1 .. 15: two nibbles per byte
        return u[:, 0] | (u[:, 1] << 4)

    def _unpack(self, packed: jax.Array) -> jax.Array:
        if self.bits == 8:
            return jax.lax.bitcast_convert_type(packed, jnp.int8)
        return (jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(-1).astype(jnp.int8) - 8)

    def mean(self, grads: Tree, state: CompressionState, coded_sum: Callable, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        """`coded_sum(buffer, wire) -> (sum, residual)`: the collective's coded ring (jaxdp/sync/exchange.py)."""
        del step
        items, treedef = jax.tree_util.tree_flatten_with_path(grads)
        if not items:
            return grads, state, {}
        keys = [jax.tree_util.keystr(p) for p, _ in items]
        scale = jnp.float32(1.0 / num_devices)
        flat = jnp.concatenate([jnp.ravel((g.astype(jnp.float32) + state.error[k].astype(jnp.float32)) * scale)
                                for k, (_, g) in zip(keys, items)])
        size = flat.shape[0]
        chunk, block = self.chunking(size, num_devices)
        total, residual = coded_sum(jnp.pad(flat, (0, chunk * num_devices - size)), self.wire(chunk, block))
        out, error, offset = [], {}, 0
        for k, (_, g) in zip(keys, items):
            out.append(total[offset:offset + g.size].reshape(g.shape).astype(g.dtype))
            error[k] = residual[offset:offset + g.size].reshape(g.shape) * jnp.float32(num_devices)
            offset += g.size
        return jax.tree_util.tree_unflatten(treedef, out), CompressionState(error=error), {}


def _dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """Blocks of integers (blocks, block) times their scales: the one decoding every device uses."""
    return q.astype(jnp.float32) * scale[:, None]


# ---------------------------------------------------------------------------------------------
# parse
# ---------------------------------------------------------------------------------------------

SPEC_HELP = "none, bf16, int8, int4 or powersgd:RANK[:start=STEP][:min_rate=R][:seed=S]"


def parse(spec: str) -> Compressor:
    """"none" | "bf16" | "int8" | "int4" | "powersgd:RANK[:start=STEP][:min_rate=R][:seed=S]"; ValueError (one line) otherwise."""
    def bad(why: str) -> ValueError:
        return ValueError(f"compression {spec!r}: {why}; use {SPEC_HELP}")

    if not isinstance(spec, str):
        raise bad("not a string")
    text = spec.strip().lower()
    if text == "none":
        return NoCompression()
    if text == "bf16":
        return Bf16()
    if text in ("int8", "int4"):
        return Quantized(bits=int(text[3:]))
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


# Names that lived here before the cost model and the train-state adapter had modules of their own.
__getattr__ = forwarder(__name__, {**{name: "jaxdp.sync.costmodel" for name in (
    "CommModel", "fit_comm_model", "ladder", "plan", "relative_error", "weaker", "guard", "DEFAULT_RANKS",
    "TARGET_COMM_FRACTION", "MIN_STEP_GAIN", "GUARD_THRESHOLD", "GUARD_WINDOW")},
    "STATE_NAME": "jaxdp.sync.exchange", "AUTO": "jaxdp.sync.spec"})
