"""Muon whose Newton-Schulz products run once per matrix shape, not once per matrix.

    tx = muon(0.02, adam_learning_rate=3e-3, dimension_numbers=hidden_matrices)   # --optimizer muon

`optax.contrib.muon` orthogonalises each parameter's momentum on its own: a GPT-2 small runs five
Newton-Schulz iterations of three matrix products for each of its 48 hidden kernels, 720 products
a step, each too small to fill a GPU (docs/performance.md, "A sixth lease": 20 ms of a 48 ms step).
The twelve layers' kernels have four shapes between them, so this module stacks every matrix of one
shape (after optax's own reshape to batch x reduction x output, and its transpose of tall matrices)
into one batch, runs the iterations on the batch, and splits the result back.

Everything else is optax.contrib.muon's, at its defaults: the same partition into Muon's matrices
and an Adam fallback, the same Nesterov momentum and bias correction, the same width scaling, and
the same optimizer state, leaf for leaf, so checkpoints written with either resume with the other
(tests/test_muon.py compares the two, update for update). Each matrix's iterations are the same
arithmetic in the same order as optax's, but XLA compiles a batch of 48 matrices differently from a
batch of one (which products it fuses with the normalisation, which kernels it picks), so the two
agree to float32 rounding (about 1e-6 relative), not bit for bit.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers as Dims

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


def orthogonalize(tree: Any, dims: Any, coeffs: jax.Array, steps: int = NS_STEPS, eps: float = EPS) -> Any:
    """`tree`'s matrices (its leaves, each reshaped by its `Dims` in `dims`), orthogonalised with
    one batched Newton-Schulz per shape and dtype."""
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
        done = newton_schulz(stacked, coeffs, steps, eps)
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


def muon(learning_rate: Any, *, adam_learning_rate: Any = None, dimension_numbers: DimsRule = None
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
