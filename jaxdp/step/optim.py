"""Optimizers, outer optimizers and learning-rate schedules, by their names in jaxdp.registry.

    tx = make_optimizer("adamw", make_schedule("cosine", 3e-4, steps=1000), weight_decay=0.1, clip_norm=1.0)
    outer = make_outer_optimizer("nesterov", lr=0.7, momentum=0.9)      # local steps (DiLoCo)

Each builder is a small function registered in `OPTIMIZERS`, `OUTER_OPTIMIZERS` or `SCHEDULES`
(jaxdp/registry.py), so the command line's choices, its help and these factories read one list.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections import defaultdict
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers as Dims

# ---------------------------------------------------------------------------------------------
# The optimizers behind --optimizer (jaxdp.registry.OPTIMIZERS): (lr, momentum, weight_decay) -> tx
# ---------------------------------------------------------------------------------------------


def adam(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.adam(lr)


def adamw(lr: Any, momentum: float, weight_decay: float, mask: Any = None) -> optax.GradientTransformation:
    return optax.adamw(lr, weight_decay=weight_decay, mask=mask)


def matrices(params: Any) -> Any:
    """True for the parameters weight decay applies to, nanoGPT's rule: two or more dimensions
    (kernels, embeddings), not biases or LayerNorm scales."""
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def sgd(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.sgd(lr)


def momentum(lr: Any, momentum: float, weight_decay: float) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=momentum)


def muon(lr: Any, momentum: float, weight_decay: float, *, muon_lr: Any = None, on: str = "all"
         ) -> optax.GradientTransformation:
    """Muon (optax.contrib.muon's update and state, its Newton-Schulz batched by matrix shape:
    `batched_muon` below): momentum orthogonalised by Newton-Schulz for weight matrices, Adam (its
    usual fallback, at `lr`) for every other leaf. `muon_lr`: the matrices' learning rate (None:
    `lr`). `on`: which leaves are Muon's: "hidden" (`hidden_matrices`: the hidden layers' kernels,
    the GPT's attention kernels as matrices too; embeddings, the head, biases and norms Adam's, as
    Muon's authors and MuLoCo use it) or "all" (optax's default: every 2-D leaf)."""
    return batched_muon(lr if muon_lr is None else muon_lr, adam_learning_rate=None if muon_lr is None else lr,
                        dimension_numbers=hidden_matrices if on == "hidden" else None)


def hidden_matrices(params: Any) -> Any:
    """Muon's dimension numbers for `on="hidden"`: every 2-D `kernel` (a Dense layer's) but the head's
    (a module named "head"), and jaxdp's GPT's attention kernels, `qkv_i` [d, 3, heads, head_dim]
    (q, k and v each a [d, d] matrix) and `proj_i` [heads, head_dim, d]; None (Adam) elsewhere:
    embeddings, biases, norms, convolutions."""
    def dims(path: Any, x: Any) -> Any:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        module = keys[-2] if len(keys) > 1 else ""
        if keys[-1] != "kernel" or module == "head":
            return None
        if x.ndim == 2:
            return Dims()
        if module.startswith("qkv_") and x.ndim == 4:
            return Dims(reduction_axis=0, output_axis=(2, 3))
        if module.startswith("proj_") and x.ndim == 3:
            return Dims(reduction_axis=(0, 1), output_axis=2)
        return None

    return jax.tree_util.tree_map_with_path(dims, params)


def make_optimizer(name: str, lr: Any, momentum: float = 0.9, weight_decay: float = 1e-4, *,
                   clip_norm: float = 0.0, decay_matrices_only: bool = False, muon_lr: Any = None,
                   muon_on: str = "all") -> optax.GradientTransformation:
    """The optax optimizer called `name` in `jaxdp.registry.OPTIMIZERS`; `lr` may be a schedule.
    `clip_norm` > 0 clips the global gradient norm first (optax.clip_by_global_norm).
    `decay_matrices_only`: adamw's weight decay on parameters of two or more dimensions only
    (`matrices`); the optimizer state has the same arrays either way. `muon_lr`, `muon_on`: muon's
    (`muon`)."""
    from jaxdp.registry import OPTIMIZERS

    if decay_matrices_only and name in OPTIMIZERS and OPTIMIZERS[name] is adamw:
        tx = adamw(lr, momentum, weight_decay, mask=matrices)
    elif name in OPTIMIZERS and OPTIMIZERS[name] is muon:
        tx = muon(lr, momentum, weight_decay, muon_lr=muon_lr, on=muon_on)
    else:
        tx = OPTIMIZERS[name](lr, momentum, weight_decay)
    return optax.chain(optax.clip_by_global_norm(clip_norm), tx) if clip_norm else tx


# The outer optimizers behind --outer-optimizer (jaxdp.registry.OUTER_OPTIMIZERS; local steps,
# jaxdp/step/local_sgd.py): (lr, momentum) -> tx, applied to the averaged pseudo-gradient every sync.


def nesterov_outer(lr: float, momentum: float) -> optax.GradientTransformation:
    if not momentum:
        raise ValueError("the nesterov outer optimizer needs a momentum > 0; use sgd for none")
    return optax.sgd(lr, momentum=momentum, nesterov=True)


def sgd_outer(lr: float, momentum: float) -> optax.GradientTransformation:
    return optax.sgd(lr, momentum=momentum or None)


def make_outer_optimizer(name: str, lr: float, momentum: float) -> optax.GradientTransformation:
    """The optimizer that applies the averaged pseudo-gradient to the global parameters every sync,
    by its name in `jaxdp.registry.OUTER_OPTIMIZERS`: "nesterov" (DiLoCo: lr 0.7, momentum 0.9) or
    "sgd" (heavy-ball momentum if `momentum` > 0; lr 1 and momentum 0 is plain model averaging,
    Local SGD)."""
    from jaxdp.registry import OUTER_OPTIMIZERS

    return OUTER_OPTIMIZERS[name](lr, momentum)


# ---------------------------------------------------------------------------------------------
# The schedules behind --schedule (jaxdp.registry.SCHEDULES): (lr, steps, warmup, final) -> schedule
# ---------------------------------------------------------------------------------------------


def constant_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    del steps, final_fraction
    if warmup_steps:
        return optax.linear_schedule(0.0, lr, warmup_steps)
    return optax.constant_schedule(lr)


def cosine_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    del warmup_steps
    return optax.cosine_decay_schedule(lr, max(steps, 1), alpha=final_fraction)


def warmup_cosine_schedule(lr: float, steps: int, warmup_steps: int, final_fraction: float) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(steps, warmup_steps + 1),
                                              end_value=lr * final_fraction)


def make_schedule(name: str, lr: float, steps: int, warmup_steps: int = 0, final_fraction: float = 0.1) -> optax.Schedule:
    """The learning rate as a function of the step, by its name in `jaxdp.registry.SCHEDULES`."""
    from jaxdp.registry import SCHEDULES

    return SCHEDULES[name](lr, steps, warmup_steps, final_fraction)


# ---------------------------------------------------------------------------------------------
# Muon whose Newton-Schulz products run once per matrix shape, not once per matrix (`batched_muon`)
# ---------------------------------------------------------------------------------------------
#
#     tx = batched_muon(0.02, adam_learning_rate=3e-3, dimension_numbers=hidden_matrices)   # --optimizer muon
#
# `optax.contrib.muon` orthogonalises each parameter's momentum on its own: a GPT-2 small runs five
# Newton-Schulz iterations of three matrix products for each of its 48 hidden kernels, 720 products
# a step, each too small to fill a GPU (docs/performance.md has the profile).
# The twelve layers' kernels have four shapes between them, so `batched_muon` stacks every matrix of one
# shape (after optax's own reshape to batch x reduction x output, and its transpose of tall matrices)
# into one batch, runs the iterations on the batch, and splits the result back.
#
# Everything else is optax.contrib.muon's, at its defaults: the same partition into Muon's matrices
# and an Adam fallback, the same Nesterov momentum and bias correction, the same width scaling, and
# the same optimizer state, leaf for leaf, so checkpoints written with either resume with the other
# (tests/test_muon.py compares the two, update for update). Each matrix's iterations are the same
# arithmetic in the same order as optax's, but XLA compiles a batch of 48 matrices differently from a
# batch of one (which products it fuses with the normalisation, which kernels it picks), so the two
# agree to float32 rounding (about 1e-6 relative), not bit for bit.

# Muon's defaults, as optax.contrib.muon has them (optax 0.2.x): the quintic's coefficients, its
# iterations, the momentum and the normalisation's epsilon.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
BETA = 0.95
EPS = 1e-8

DimsRule = Callable[[Any], Any] | None  # params -> a tree of Dims (Muon's) or None (Adam's); None: every 2-D leaf


def _is_dims(x: Any) -> bool:
    return x is None or isinstance(x, Dims)


def _axes(x: jax.Array, dims: Dims) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The batch, reduction and output axes of `x` under `dims`, each a sorted tuple of axes."""
    as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
    reduction = tuple(a % x.ndim for a in as_tuple(dims.reduction_axis))
    output = tuple(a % x.ndim for a in as_tuple(dims.output_axis))
    if x.ndim < 2 or set(reduction) & set(output):
        raise ValueError(f"Muon needs a matrix: an array of rank >= 2 with disjoint reduction and output axes; "
                         f"got shape {x.shape} with {dims}")
    batch = tuple(a for a in range(x.ndim) if a not in reduction and a not in output)
    return batch, reduction, output


def _as_matrices(x: jax.Array, dims: Dims) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """`x` as a batch of wide matrices [b, m, n] with m <= n (a tall one transposed, as optax does),
    and the function that puts a batch of that shape back into `x`'s."""
    batch, reduction, output = _axes(x, dims)
    order = batch + reduction + output
    size = lambda axes: math.prod(x.shape[a] for a in axes)  # noqa: E731
    flat = x.transpose(order).reshape(size(batch), size(reduction), size(output))
    tall = flat.shape[1] > flat.shape[2]
    unflat = tuple(x.shape[a] for a in order)
    back = tuple(sorted(range(x.ndim), key=order.__getitem__))

    def restore(m: jax.Array) -> jax.Array:
        return (m.swapaxes(1, 2) if tall else m).reshape(unflat).transpose(back)

    return (flat.swapaxes(1, 2) if tall else flat), restore


def newton_schulz(x: jax.Array, coeffs: jax.Array, steps: int = NS_STEPS, eps: float = EPS) -> jax.Array:
    """Each matrix of the batch `x` [b, m, n] (m <= n), divided by its Frobenius norm, through `steps`
    iterations of the quintic X <- c0 X + (c1 A + c2 A A) X, A = X X^T (Muon's orthogonalisation,
    in optax's order of operations)."""
    x = x / (jnp.linalg.norm(x, axis=(1, 2), keepdims=True) + eps)
    c = coeffs.astype(x.dtype)
    for _ in range(steps):
        a = x @ x.swapaxes(1, 2)
        b = c[1] * a + c[2] * a @ a
        x = c[0] * x + b @ x
    return x


# Inside a step whose devices all hold the same update (the replicated every-step rule), each device
# need not orthogonalise every matrix: under `split_over(axis, count)` device i of the `count` along
# `axis` (an axis inside one process: no link crossed) takes the i-th 1/count of each shape's batch
# and an all-gather gives every device all of them, as distributed Muon implementations do. On 8
# simulated CPU devices every device repeating the whole batch made a GPT step far slower than AdamW's
# (docs/performance.md, "Behind the defaults").
_SPLIT: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("jaxdp_muon_split", default=None)


@contextlib.contextmanager
def split_over(axis: Any, count: int) -> Iterator[None]:
    """While tracing a shard_map body over `axis` (`count` devices, all with the same updates): Muon's
    Newton-Schulz batches are cut over those devices and all-gathered (`orthogonalize`)."""
    token = _SPLIT.set((axis, count) if count > 1 else None)
    try:
        yield
    finally:
        _SPLIT.reset(token)


def _newton_schulz_split(x: jax.Array, coeffs: jax.Array, steps: int, eps: float) -> jax.Array:
    """`newton_schulz(x)` with the batch cut over `split_over`'s devices (zero matrices pad it: their
    iterations stay zero), each device's part all-gathered."""
    axis, count = _SPLIT.get()
    per = -(-x.shape[0] // count)
    padded = jnp.pad(x, ((0, per * count - x.shape[0]), (0, 0), (0, 0)))
    mine = jax.lax.dynamic_slice_in_dim(padded, jax.lax.axis_index(axis) * per, per)
    return jax.lax.all_gather(newton_schulz(mine, coeffs, steps, eps), axis, tiled=True)[:x.shape[0]]


def orthogonalize(tree: Any, dims: Any, coeffs: jax.Array, steps: int = NS_STEPS, eps: float = EPS) -> Any:
    """`tree`'s matrices (its leaves, each reshaped by its `Dims` in `dims`), orthogonalised with
    one batched Newton-Schulz per shape and dtype (cut over the devices under `split_over`)."""
    leaves, treedef = jax.tree.flatten(tree)
    specs = jax.tree.leaves(dims, is_leaf=lambda d: isinstance(d, Dims))
    if len(specs) != len(leaves):
        raise ValueError(f"Muon's dimension numbers name {len(specs)} matrices for {len(leaves)} updates")
    pieces = [_as_matrices(x, d) for x, d in zip(leaves, specs)]
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (m, _) in enumerate(pieces):
        groups[(m.shape[1:], m.dtype)].append(i)
    out: list[Any] = [None] * len(leaves)
    for members in groups.values():
        stacked = jnp.concatenate([pieces[i][0] for i in members]) if len(members) > 1 else pieces[members[0]][0]
        split = _SPLIT.get() is not None and stacked.shape[0] > 1
        done = (_newton_schulz_split if split else newton_schulz)(stacked, coeffs, steps, eps)
        start = 0
        for i in members:
            count = pieces[i][0].shape[0]
            out[i] = pieces[i][1](done[start:start + count])
            start += count
    return jax.tree.unflatten(treedef, out)


def _dims_of(rule: DimsRule, updates: Any) -> Any:
    """The Dims of each of `updates`' leaves (the Muon part of a partition: the Adam leaves are
    optax.MaskedNode, which hold no leaves)."""
    if rule is None:
        return jax.tree.map(lambda _: Dims(), updates)
    return rule(updates)


def scale_by_muon(rule: DimsRule = None) -> optax.GradientTransformation:
    """optax.contrib.scale_by_muon's transformation at its defaults (Nesterov momentum 0.95, five
    iterations, Frobenius normalisation), with the orthogonalisation batched by shape; its state is
    optax's `MuonState`."""
    reference = optax.contrib.scale_by_muon(ns_coeffs=NS_COEFFS, ns_steps=NS_STEPS, beta=BETA, eps=EPS)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        mu = optax.tree.update_moment(updates, state.mu, BETA, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(lambda m, g: BETA * m + (1 - BETA) * g,
                              optax.tree.bias_correction(mu, BETA, optax.safe_increment(count)),
                              optax.tree.bias_correction(updates, BETA, count))
        ortho = orthogonalize(mu_hat, _dims_of(rule, updates), state.ns_coeffs)
        return ortho, state._replace(count=count, mu=mu)

    return optax.GradientTransformation(reference.init, update)


def scale_by_width(rule: DimsRule = None) -> optax.GradientTransformation:
    """Each orthogonalised update times sqrt(max(1, fan_out / fan_in)) (Keller Jordan's width
    scaling, optax's `scale_by_shape` without `consistent_rms`)."""

    def scale(updates: Any, params: Any) -> Any:
        del params
        leaves, treedef = jax.tree.flatten(updates)
        specs = jax.tree.leaves(_dims_of(rule, updates), is_leaf=lambda d: isinstance(d, Dims))
        scaled = []
        for x, d in zip(leaves, specs):
            _, reduction, output = _axes(x, d)
            fan_in, fan_out = (math.prod(x.shape[a] for a in axes) for axes in (reduction, output))
            scaled.append(jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * x)
        return jax.tree.unflatten(treedef, scaled)

    return optax.stateless(scale)


def labels(rule: DimsRule, params: Any) -> Any:
    """"muon" for the leaves Muon updates, "adam" for the rest."""
    if rule is None:
        return jax.tree.map(lambda x: "muon" if jnp.ndim(x) == 2 else "adam", params)
    return jax.tree.map(lambda d, sub: jax.tree.map(lambda _: "adam" if d is None else "muon", sub),
                        rule(params), params, is_leaf=_is_dims)


def batched_muon(learning_rate: Any, *, adam_learning_rate: Any = None, dimension_numbers: DimsRule = None
         ) -> optax.GradientTransformation:
    """optax.contrib.muon(learning_rate, adam_learning_rate=..., muon_weight_dimension_numbers=...)
    at its other defaults, with its Newton-Schulz iterations batched by shape. `dimension_numbers`:
    a function of the parameters giving each leaf's `MuonDimensionNumbers` (Muon) or None (Adam);
    None: Muon for every 2-D leaf."""
    return optax.partition(
        {"muon": optax.chain(scale_by_muon(dimension_numbers), scale_by_width(dimension_numbers),
                             optax.add_decayed_weights(0.0),  # no decay; kept so the state is optax's, link for link
                             optax.scale_by_learning_rate(learning_rate)),
         "adam": optax.adamw(learning_rate if adam_learning_rate is None else adam_learning_rate,
                             eps=EPS, weight_decay=0.0, nesterov=True)},
        lambda params: labels(dimension_numbers, params))
