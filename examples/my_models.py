"""Your own Flax models for `python -m jaxdp.train --model MODULE:ATTR` (docs/models.md).

    python -m jaxdp.train --model examples.my_models:Classifier --steps 100
    python -m jaxdp.train --model examples.my_models:TinyLM --dataset book.txt --seq-len 64

jaxdp fills in the fields it knows (`num_classes` or `vocab_size`, `seq_len`, `axis_name`) and
passes `train=True` / `False` to a `__call__` that takes it; everything else is yours.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


class Classifier(nn.Module):
    """A residual MLP with BatchNorm (synchronised over the devices through `axis_name`) and dropout."""

    num_classes: int = 10
    width: int = 128
    blocks: int = 2
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        x = nn.Dense(self.width)(x.reshape((x.shape[0], -1)))
        for _ in range(self.blocks):
            h = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
            h = nn.Dropout(0.1, deterministic=not train)(nn.relu(nn.Dense(self.width)(h)))
            x = x + h
        return nn.Dense(self.num_classes)(x)


class TinyLM(nn.Module):
    """A one-block causal transformer: `tokens [B, T] -> logits [B, T, vocab_size]`."""

    vocab_size: int = 256
    seq_len: int = 128
    width: int = 128
    heads: int = 4

    @nn.compact
    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        length = tokens.shape[1]
        x = nn.Embed(self.vocab_size, self.width)(tokens) + nn.Embed(self.seq_len, self.width)(jnp.arange(length))
        mask = nn.make_causal_mask(tokens)
        x = x + nn.SelfAttention(self.heads)(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x))))
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))
