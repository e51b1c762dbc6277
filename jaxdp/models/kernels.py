"""The GPT's memory-bound work as Pallas kernels: LayerNorm, and the cross-entropy over the vocabulary.

Each has an XLA path written in `jax.numpy` (every platform; the tests' reference) and a Pallas
path, lowered through Triton on an NVIDIA GPU and run by Pallas's interpreter on a CPU, which is
how the tests check it. `implementation(requested, dtype)` says which path a run takes.

* `layer_norm`: statistics in float32 over the last axis, one row per program; the mean and the
  reciprocal deviation kept in float32 for the gradient. Forward: one read of `x`, one write.
  Backward: `dx` in one kernel; the scale's and bias's gradients are column sums XLA fuses.
* `cross_entropy` (Pallas only; XLA's path is `jaxdp.models.tasks.token_cross_entropy`) over
  16-bit logits: the forward reads each row once with a running maximum and sum (the log-sum-exp
  in one pass), the backward reads it once and writes `softmax - one_hot`, scaled by the incoming
  gradient.

On an H200 at GPT-2 small the two together were no faster than what XLA fuses, so "auto" takes
XLA's (docs/performance.md, "GPUs: GPT-2 small on one H200").
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("auto", "xla", "pallas")


def implementation(requested: str, dtype: Any) -> str:
    """Which path the GPT's LayerNorms and loss take: "xla" or "pallas". "auto" takes XLA's; a
    float32 run takes XLA's either way (the kernels are written for 16-bit activations)."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"kernels must be one of {', '.join(IMPLEMENTATIONS)}, got {requested!r}")
    if requested == "auto" or jnp.dtype(dtype) == jnp.dtype(jnp.float32):
        return "xla"
    return requested


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _block(n: int, most: int = 4096) -> int:
    """Columns a program reads at once: Triton's blocks are powers of 2; the tail is masked."""
    return min(max(1 << max(n - 1, 1).bit_length(), 128), most)


# --- LayerNorm --------------------------------------------------------------------------------


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float, path: str = "xla") -> jax.Array:
    """`(x - mean) / sqrt(var + epsilon) * scale + bias` over the last axis, statistics in float32,
    the result in `x`'s dtype: flax's `nn.LayerNorm(dtype=x.dtype)` to rounding (its variance is
    `E[x²] - E[x]²`, this one `E[(x - mean)²]`)."""
    if path == "xla":
        return _layer_norm_xla(x, scale, bias, epsilon)
    return _layer_norm_pallas(x, scale, bias, epsilon)


def _layer_norm_xla(x, scale, bias, epsilon):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centred = x32 - mean
    rstd = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + epsilon)
    return (centred * rstd * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm_pallas(x, scale, bias, epsilon):
    return _ln_forward(x, scale, bias, epsilon)[0]


def _ln_forward(x, scale, bias, epsilon):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    n = x.shape[-1]
    block = _block(n)

    def kernel(x_ref, scale_ref, bias_ref, y_ref, mean_ref, rstd_ref):
        cols = jnp.arange(block)
        inside = cols < n
        row = plgpu.load(x_ref.at[cols], mask=inside, other=0.0).astype(jnp.float32)
        mean = jnp.sum(row) / n
        centred = jnp.where(inside, row - mean, 0.0)
        rstd = jax.lax.rsqrt(jnp.sum(centred * centred) / n + epsilon)
        w = plgpu.load(scale_ref.at[cols], mask=inside, other=0.0).astype(jnp.float32)
        b = plgpu.load(bias_ref.at[cols], mask=inside, other=0.0).astype(jnp.float32)
        plgpu.store(y_ref.at[cols], (centred * rstd * w + b).astype(y_ref.dtype), mask=inside)
        mean_ref[...] = mean
        rstd_ref[...] = rstd

    call = pl.pallas_call(
        kernel, grid=(), interpret=_interpret(), name="jaxdp_layer_norm",
        compiler_params=plgpu.CompilerParams(num_warps=min(max(block // 256, 1), 8)),
        out_shape=[jax.ShapeDtypeStruct((n,), x.dtype), jax.ShapeDtypeStruct((), jnp.float32),
                   jax.ShapeDtypeStruct((), jnp.float32)])
    rows = x.reshape(-1, n)
    y, mean, rstd = jax.vmap(call, in_axes=(0, None, None))(rows, scale, bias)
    return y.reshape(x.shape), (rows, scale, bias, mean, rstd)


def _ln_backward(epsilon, residuals, g):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    del epsilon
    rows, scale, bias, mean, rstd = residuals
    n = rows.shape[-1]
    block = _block(n)
    g_rows = g.reshape(-1, n)

    def kernel(x_ref, g_ref, scale_ref, mean_ref, rstd_ref, dx_ref):
        cols = jnp.arange(block)
        inside = cols < n
        x = plgpu.load(x_ref.at[cols], mask=inside, other=0.0).astype(jnp.float32)
        dy = plgpu.load(g_ref.at[cols], mask=inside, other=0.0).astype(jnp.float32)
        w = plgpu.load(scale_ref.at[cols], mask=inside, other=0.0).astype(jnp.float32)
        rstd = rstd_ref[...]
        normed = jnp.where(inside, (x - mean_ref[...]) * rstd, 0.0)
        wdy = w * dy
        dx = (wdy - normed * (jnp.sum(normed * wdy) / n) - jnp.sum(wdy) / n) * rstd
        plgpu.store(dx_ref.at[cols], dx.astype(dx_ref.dtype), mask=inside)

    call = pl.pallas_call(
        kernel, grid=(), interpret=_interpret(), name="jaxdp_layer_norm_dx",
        compiler_params=plgpu.CompilerParams(num_warps=min(max(block // 256, 1), 8)),
        out_shape=jax.ShapeDtypeStruct((n,), rows.dtype))
    dx = jax.vmap(call, in_axes=(0, 0, None, 0, 0))(rows, g_rows, scale, mean, rstd)
    dy = g_rows.astype(jnp.float32)
    normed = (rows.astype(jnp.float32) - mean[:, None]) * rstd[:, None]
    dscale = jnp.sum(dy * normed, axis=0).astype(scale.dtype)
    dbias = jnp.sum(dy, axis=0).astype(bias.dtype)
    return dx.reshape(g.shape), dscale, dbias


_layer_norm_pallas.defvjp(_ln_forward, _ln_backward)


class LayerNorm(nn.Module):
    """`nn.LayerNorm(epsilon, dtype)` on the Pallas path: the same parameters (`scale` ones, `bias`
    zeros, float32, over the last axis), so a checkpoint moves between the paths."""

    epsilon: float
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (features,), jnp.float32)
        return layer_norm(x.astype(self.dtype), scale, bias, self.epsilon, "pallas")


# --- cross-entropy ----------------------------------------------------------------------------


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Softmax cross-entropy of integer `labels` (...,) under 16-bit `logits` (..., V), in float32:
    `jaxdp.models.tasks.token_cross_entropy` (the XLA path) to rounding, in one Pallas kernel per pass."""
    vocab = logits.shape[-1]
    losses = _cross_entropy_pallas(logits.reshape(-1, vocab), labels.reshape(-1).astype(jnp.int32))
    return losses.reshape(labels.shape)


@jax.custom_vjp
def _cross_entropy_pallas(logits, labels):
    return _ce_forward(logits, labels)[0]


_NEGATIVE = -1e30  # a masked logit: exp of it less any real maximum is 0


def _ce_forward(logits, labels):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    vocab = logits.shape[-1]
    block = _block(vocab)

    def kernel(logits_ref, label_ref, loss_ref, lse_ref):
        label = label_ref[...]

        def body(i, carry):
            top, total, picked = carry
            cols = i * block + jnp.arange(block)
            inside = cols < vocab
            x = plgpu.load(logits_ref.at[cols], mask=inside, other=_NEGATIVE).astype(jnp.float32)
            new_top = jnp.maximum(top, x)
            total = total * jnp.exp(top - new_top) + jnp.where(inside, jnp.exp(x - new_top), 0.0)
            picked = picked + jnp.where(cols == label, x, 0.0)
            return new_top, total, picked

        start = (jnp.full((block,), _NEGATIVE, jnp.float32), jnp.zeros((block,), jnp.float32),
                 jnp.zeros((block,), jnp.float32))
        top, total, picked = jax.lax.fori_loop(0, pl.cdiv(vocab, block), body, start)
        row_top = jnp.max(top)
        lse = row_top + jnp.log(jnp.sum(total * jnp.exp(top - row_top)))
        loss_ref[...] = lse - jnp.sum(picked)
        lse_ref[...] = lse

    call = pl.pallas_call(
        kernel, grid=(), interpret=_interpret(), name="jaxdp_cross_entropy",
        compiler_params=plgpu.CompilerParams(num_warps=8),
        out_shape=[jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((), jnp.float32)])
    losses, lse = jax.vmap(call)(logits, labels)
    return losses, (logits, labels, lse)


def _ce_backward(residuals, g):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    logits, labels, lse = residuals
    vocab = logits.shape[-1]
    block = _block(vocab)

    def kernel(logits_ref, label_ref, lse_ref, g_ref, grad_ref):
        label, lse, scale = label_ref[...], lse_ref[...], g_ref[...]

        def body(i, carry):
            cols = i * block + jnp.arange(block)
            inside = cols < vocab
            x = plgpu.load(logits_ref.at[cols], mask=inside, other=0.0).astype(jnp.float32)
            grad = jnp.exp(x - lse) * scale
            grad = jnp.where(cols == label, grad - scale, grad)
            plgpu.store(grad_ref.at[cols], grad.astype(grad_ref.dtype), mask=inside)
            return carry

        jax.lax.fori_loop(0, pl.cdiv(vocab, block), body, 0)

    call = pl.pallas_call(
        kernel, grid=(), interpret=_interpret(), name="jaxdp_cross_entropy_grad",
        compiler_params=plgpu.CompilerParams(num_warps=8),
        out_shape=jax.ShapeDtypeStruct((vocab,), logits.dtype))
    return jax.vmap(call)(logits, labels, lse, g.astype(jnp.float32)), None


_cross_entropy_pallas.defvjp(_ce_forward, _ce_backward)
