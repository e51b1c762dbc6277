"""The codecs that keep no state: `none` (plain averaging through the collective's sum) and `bf16`.

    NoCompression()   # allreduce_sum(g / N)
    Bf16()            # pre-scale by 1/N, cast to bfloat16, all-reduce, cast back

Both survive the sum (`needs = "sum"`), so psum and the ring carry them unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.sync.codecs.base import AllReduce, CompressionState, Compressor, Tree, scaled, uncompressed_bytes


class _NoOptions(Compressor):
    """A codec its name alone describes: `--compression NAME` has no options, `auto` one candidate."""

    @classmethod
    def from_spec(cls, text: str) -> Compressor:
        return cls()

    @classmethod
    def candidates(cls, name: str, params: Tree, **options: Any) -> list[Compressor]:
        return [cls()]


@dataclasses.dataclass(frozen=True)
class NoCompression(_NoOptions):
    """Plain averaging: `allreduce_sum(g / N)`."""

    name = "none"
    collectives = 1

    def mean(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        del step
        return allreduce_sum(scaled(grads, num_devices)), state, {}

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
        return uncompressed_bytes(params)


@dataclasses.dataclass(frozen=True)
class Bf16(_NoOptions):
    """Pre-scale by 1/N, cast to bfloat16, all-reduce, cast back. Leaves of 2 bytes or fewer
    (bf16, fp16) stay in their own dtype."""

    name = "bf16"
    collectives = 1

    def mean(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        del step
        wire = jax.tree.map(lambda g: g.astype(_bf16_wire(g.dtype)), scaled(grads, num_devices))
        summed = allreduce_sum(wire)
        return jax.tree.map(lambda s, g: s.astype(g.dtype), summed, grads), state, {}

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
        return sum(int(np.prod(x.shape)) * jnp.dtype(_bf16_wire(x.dtype)).itemsize for x in jax.tree.leaves(params))


def _bf16_wire(dtype: Any) -> Any:
    return dtype if jnp.dtype(dtype).itemsize <= 2 else jnp.bfloat16
