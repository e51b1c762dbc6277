"""fp8 matrix products for the GPT's dense layers (`--precision fp8`).

Each product of a block's dense layers (qkv, proj, fc, fc_out) runs on float8 operands: the
activations and weights in e4m3 (3 mantissa bits, the forward's range), the gradient in e5m2
(2 mantissa bits, the backward's wider range), each tensor scaled by its own current absolute
maximum (`current scaling`: scale = amax / the format's largest value), accumulated in float32 and
written in the compute dtype (bf16). The quantize and dequantize steps are flax's
(`flax.linen.fp8_ops.quantize` / `dequantize`); XLA's GEMM rewriter on Hopper (and Ada) turns the
dequantize-then-dot pattern into cuBLASLt's fp8 matrix product with the scales in its epilogue.

Why current scaling, not flax's `Fp8DotGeneralOp` (delayed scaling from an amax history): the
history is model state in a collection of its own (`_overwrite_with_gradient`) that every sync
strategy, layout, optimizer and checkpoint would have to treat as "replace, don't average". Current
scaling keeps the parameters, the optimizer state and checkpoints exactly as bf16 runs have them
(a run can switch between `--precision bf16` and `fp8` on resume), at the price of one
reduction over each operand, which XLA fuses into the kernel that produces it. Attention, the
embeddings, LayerNorms, the head and the loss stay in bf16 / float32.

Figures (an H200): docs/performance.md, "GPUs: GPT-2 small on one H200".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

FORWARD = jnp.float8_e4m3fn
BACKWARD = jnp.float8_e5m2


def unsupported(device: Any, model: str = "gpt") -> str | None:
    """Why `--precision fp8` cannot run `--model model` on `device` (one line), or None where it can:
    the built-in GPT on an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    if model != "gpt":
        return (f"--precision fp8 puts the gpt's dense layers on fp8; --model={model} has no such layers: "
                f"use --precision bf16")
    if device.platform == "gpu" and "nvidia" in device.device_kind.lower():
        capability = float(getattr(device, "compute_capability", "0"))
        if capability >= 8.9:
            return None
        where = f"an NVIDIA GPU of compute capability {capability:g} ({device.device_kind})"
    else:
        where = f"{device.platform} devices"
    return (f"--precision fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell) "
            f"for its fp8 matrix products; this run has {where}: use --precision bf16")


def scale_of(x: jax.Array, dtype: Any) -> jax.Array:
    """Current scaling: `max|x| / the largest value of dtype` (float32 scalar), 1 where `x` is all
    zero or not finite."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = amax / fp8_ops.get_fp8_max(dtype, jnp.float32)
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, jnp.float32(1.0))


def _cast(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    scale = scale_of(x, dtype)
    return fp8_ops.quantize(x, dtype, scale, jnp.float32), scale


def _product(a, a_scale, b, b_scale, dimension_numbers, out_dtype):
    return jax.lax.dot_general(fp8_ops.dequantize(a, out_dtype, a_scale), fp8_ops.dequantize(b, out_dtype, b_scale),
                               dimension_numbers, preferred_element_type=out_dtype)


_PLAIN = (((1,), (0,)), ((), ()))  # (m, k) @ (k, n)


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` for `x` (m, k) and `w` (k, n) of one dtype (flax's dense layers promote both to the
    compute dtype) on e4m3 operands; the gradients on an e5m2 gradient. The result is in that dtype."""
    return _forward(x, w)[0]


def _forward(x, w):
    xq, sx = _cast(x, FORWARD)
    wq, sw = _cast(w, FORWARD)
    return _product(xq, sx, wq, sw, _PLAIN, x.dtype), (xq, sx, wq, sw)


def _backward(residuals, g):
    xq, sx, wq, sw = residuals
    gq, sg = _cast(g, BACKWARD)
    dx = _product(gq, sg, wq, sw, (((1,), (1,)), ((), ())), g.dtype)  # g @ wᵀ
    dw = _product(xq, sx, gq, sg, (((0,), (0,)), ((), ())), g.dtype)  # xᵀ @ g
    return dx, dw


matmul.defvjp(_forward, _backward)
