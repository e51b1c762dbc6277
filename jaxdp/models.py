"""Built-in Flax models. Modules only: nothing here knows about meshes or devices.

The CNN's BatchNorm takes an optional `axis_name`: inside a jaxdp step it is the mesh's axis, so batch
statistics are computed over the whole global batch (synchronised BatchNorm) and the model trains
exactly as it would on one device; outside a mapped context (evaluation, a single-device
reference) it is None.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
    """Flatten, then Dense + ReLU (+ dropout) per hidden layer, then a linear classifier."""

    hidden: Sequence[int] = (256, 256)
    num_classes: int = 10
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32  # compute dtype; parameters stay float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width, dtype=self.dtype)(x))
            if self.dropout_rate:
                x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


class CNN(nn.Module):
    """Two conv blocks with BatchNorm, global average pooling, a linear classifier."""

    features: Sequence[int] = (32, 64)
    num_classes: int = 10
    axis_name: str | None = None  # the mesh's axis name for synchronised BatchNorm
    dtype: Any = jnp.float32  # compute dtype; parameters and batch statistics stay float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        for width in self.features:
            x = nn.Conv(width, (3, 3), dtype=self.dtype)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name, dtype=self.dtype)(x)
            x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


class GPT(nn.Module):
    """A decoder-only transformer (GPT-2 layout: pre-LayerNorm blocks, causal attention, GELU MLP).

    Parameters are float32; `dtype` is the compute dtype (bfloat16 for mixed precision: matmuls
    and attention in bf16, LayerNorm statistics and the loss in float32). Used by
    `python -m jaxdp.bench gpt` for throughput and MFU; `flops_per_token` is the model-FLOPs count
    that MFU divides by.
    """

    vocab_size: int = 50304
    seq_len: int = 1024
    layers: int = 12
    d_model: int = 768
    heads: int = 12
    dtype: Any = jnp.float32
    attention: str = "auto"  # "auto", "xla" or "cudnn": see attention_implementation

    @nn.compact
    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        length = tokens.shape[1]
        embed = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype, name="embed")
        x = embed(tokens) + nn.Embed(self.seq_len, self.d_model, dtype=self.dtype, name="pos")(jnp.arange(length))
        head_dim = self.d_model // self.heads
        implementation = attention_implementation(self.attention, self.dtype, head_dim)
        for i in range(self.layers):
            h = nn.LayerNorm(dtype=self.dtype, name=f"ln_attn_{i}")(x)
            qkv = nn.DenseGeneral((3, self.heads, head_dim), dtype=self.dtype, name=f"qkv_{i}")(h)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            attn = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
            x = x + nn.DenseGeneral(self.d_model, axis=(-2, -1), dtype=self.dtype, name=f"proj_{i}")(attn)
            h = nn.LayerNorm(dtype=self.dtype, name=f"ln_mlp_{i}")(x)
            h = nn.gelu(nn.Dense(4 * self.d_model, dtype=self.dtype, name=f"fc_{i}")(h))
            x = x + nn.Dense(self.d_model, dtype=self.dtype, name=f"fc_out_{i}")(h)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
        return nn.Dense(self.vocab_size, dtype=self.dtype, name="head")(x).astype(jnp.float32)

    def flops_per_token(self, params: Any) -> float:
        """Training FLOPs per token, the count MFU is defined with (PaLM paper, appendix B): 6 per
        weight (2 forward, 4 backward) for every parameter but the embedding tables (lookups, not
        matmuls), plus 12 * layers * d_model * seq_len for attention scores and weighted values
        (the full matrix, not halved for the causal mask)."""
        n = sum(x.size for x in jax.tree.leaves(params))
        n -= params["embed"]["embedding"].size + params["pos"]["embedding"].size
        return 6 * n + 12 * self.layers * self.d_model * self.seq_len


def attention_implementation(requested: str, dtype: Any, head_dim: int, device: Any = None) -> str:
    """Which `jax.nn.dot_product_attention` implementation the GPT uses: "xla" or "cudnn".

    "auto" picks cuDNN's fused flash attention where it runs: an NVIDIA GPU of compute capability
    8.0 or newer (Ampere, Hopper, Blackwell), a 16-bit compute dtype (bf16 or fp16) and a head
    size that is a multiple of 8 up to 128. Everywhere else (CPUs, float32, other GPUs) it picks
    XLA's own attention. `jax.nn.dot_product_attention` with no implementation chose the XLA
    path even on an H100, at half cuDNN's speed for GPT-2-small (README "Performance").
    """
    if requested not in ("auto", "xla", "cudnn"):
        raise ValueError(f"attention must be auto, xla or cudnn, got {requested!r}")
    if requested != "auto":
        return requested
    device = jax.devices()[0] if device is None else device
    capability = getattr(device, "compute_capability", "0")
    on_nvidia = device.platform == "gpu" and "nvidia" in device.device_kind.lower()
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fits = head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if on_nvidia and float(capability) >= 8.0 and sixteen_bit and fits else "xla"


def build_mlp(config: Any, num_outputs: int, axis_name: str | None = None) -> nn.Module:
    del axis_name  # no cross-device statistics
    return MLP(num_classes=num_outputs, dtype=compute_dtype(config.precision))


def build_cnn(config: Any, num_outputs: int, axis_name: str | None = None) -> nn.Module:
    return CNN(num_classes=num_outputs, axis_name=axis_name, dtype=compute_dtype(config.precision))


def build_gpt(config: Any, num_outputs: int, axis_name: str | None = None) -> nn.Module:
    del axis_name
    return GPT(vocab_size=num_outputs, seq_len=config.seq_len, layers=config.layers, d_model=config.d_model,
               heads=config.heads, dtype=compute_dtype(config.precision), attention=config.attention)


def compute_dtype(precision: str) -> Any:
    """--precision to a dtype: "fp32" or "bf16" (parameters stay float32 either way)."""
    return {"fp32": jnp.float32, "bf16": jnp.bfloat16}[precision]


def build_model(name: str, config: Any, num_outputs: int, axis_name: str | None = None) -> nn.Module:
    """The built-in model called `name` in `jaxdp.registry.MODELS`, sized by `config`'s fields."""
    from jaxdp.registry import MODELS

    return MODELS[name](config, num_outputs, axis_name)
