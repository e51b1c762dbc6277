"""Built-in Flax models. Modules only: nothing here knows about meshes or devices.

The CNN's BatchNorm takes an optional `axis_name`: inside a jaxdp step it is `DATA_AXIS`, so batch
statistics are computed over the whole global batch (synchronised BatchNorm) and the model trains
exactly as it would on one device; outside a mapped context (evaluation, a single-device
reference) it is None.
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax.numpy as jnp


class MLP(nn.Module):
    """Flatten, then Dense + ReLU (+ dropout) per hidden layer, then a linear classifier."""

    hidden: Sequence[int] = (256, 256)
    num_classes: int = 10
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
            if self.dropout_rate:
                x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
    """Two conv blocks with BatchNorm, global average pooling, a linear classifier."""

    features: Sequence[int] = (32, 64)
    num_classes: int = 10
    axis_name: str | None = None  # set to DATA_AXIS for synchronised BatchNorm

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
        for width in self.features:
            x = nn.Conv(width, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=self.axis_name)(x)
            x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


def build_model(name: str, num_classes: int, axis_name: str | None = None) -> nn.Module:
    """The built-in model called `name` (see `MODELS`)."""
    if name == "mlp":
        return MLP(num_classes=num_classes)
    if name == "cnn":
        return CNN(num_classes=num_classes, axis_name=axis_name)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


MODELS = ("mlp", "cnn")
