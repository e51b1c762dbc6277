"""top-k: a fraction DENSITY of the gradient's values crosses, the same positions on every device,
the rest waits in error feedback (`TopK`, its class docstring has the scheme).

    TopK(density=0.01)            # "topk:0.01": 1 % of the values, float32, through psum or the ring
    TopK(density=0.01, bits=8)    # "topk:0.01:8": those values int8 through the ring's coded hops

Reduce-compatible (ScaleCom's cyclic local top-k): every device sends its values at ONE index set,
the step's leader's local top-k, so the values add up position by position through an all-reduce
(psum, the ring) and never need an all-gather whose bytes grow with the device count. Its slot
holds every leaf's error feedback (float32), one row per device, as int8's does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.sync.codecs.base import CompressionState, Compressor, Tree, Wire, _checkpoint_safe, flat_with_feedback
from jaxdp.sync.codecs.quantized import QUANT_BLOCK, Quantized

# The values each top-k is chosen among: the fused float32 buffer is cut into chunks of this many
# values, and each keeps its round(DENSITY * CHUNK) largest, so a large leaf cannot crowd out a small
# one for the whole buffer, and an index fits 12 bits (sent as float32 here, exact below 2 ** 24).
CHUNK = 4096


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
    """`topk:DENSITY[:BITS]`. Per device x = (g + e) / N (e: its error feedback), fused into one
    float32 buffer cut into chunks of CHUNK values (the last padded with zeros).

    1. The leader, device `lead(step, N)` (every device in turn), takes the k = round(DENSITY *
       chunk) largest |x| of each chunk (jax.lax.top_k); every other device sends zeros, and one
       all-reduce of those (chunks, k) indices (as float32: exact) gives every device the same set.
    2. Every device sends its own x at those positions, a dense (chunks, k) buffer: through the
       collective's sum (BITS 32), or its coded ring with int8 / int4 / 2-bit values and one float32
       scale per block of at most QUANT_BLOCK (quantized.py's wire, requantized at every hop;
       needs the ring). The sum, scattered back to its positions, is the mean; zeros elsewhere.
    3. Error feedback: e = N * (x - what this device's values contributed), i.e. every value not
       selected, plus (BITS < 32) what the coded ring's encodings left out at the selected ones. So
       sum over devices of (g + e_old) / N = mean + sum of e_new / N (to float32 rounding): nothing
       is lost, only delayed, and a value left out grows until some leader's top-k takes it.

    Bytes per step: the indices (4 bytes each) and the values (4, or BITS / 8 plus the scales), each
    k per chunk; 2 collectives (the index all-reduce is tiny and carries the riders).
    """

    density: float
    bits: int = 32

    collectives = 2
    needs_device = True  # the exchange passes `device`, this device's index on the data axes

    @property
    def name(self) -> str:
        return f"topk:{self.density!r}" + ("" if self.bits == 32 else f":{self.bits}")

    @property
    def needs(self) -> str:  # type: ignore[override]
        return "sum" if self.bits == 32 else "coded_sum"

    @property
    def state_name(self) -> str:
        return "topk"

    @classmethod
    def from_spec(cls, text: str) -> "TopK":
        parts = text.split(":")
        density = float(parts[1])
        if not 0 < density <= 1:
            raise ValueError(f"the density must be in (0, 1], not {density}")
        return cls(density=density, bits=int(parts[2]) if len(parts) > 2 else 32)

    def init(self, params: Tree) -> CompressionState:
        return CompressionState(error={jax.tree_util.keystr(p): jnp.zeros(x.shape, jnp.float32)
                                       for p, x in jax.tree_util.tree_flatten_with_path(params)[0]})

    def read(self, slot: CompressionState, grads: Tree) -> CompressionState:
        keys = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        self._require(slot, keys)
        return CompressionState(error={k: slot.error[_checkpoint_safe(k)] for k in keys})

    def shape(self, size: int) -> tuple[int, int, int]:
        """(chunks, chunk, k) of a `size`-value buffer."""
        chunk = max(min(CHUNK, size), 1)
        return -(-size // chunk), chunk, max(1, min(chunk, round(self.density * chunk)))

    def _wire(self, values: int, num_devices: int) -> tuple[Quantized, int, int]:
        codec = Quantized(self.bits) if self.bits in (8, 4) else _TwoBits(2)
        return (codec, *codec.chunking(values, num_devices))

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
        size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        chunks, _, k = self.shape(size)
        values = chunks * k
        if self.bits == 32:
            return values * 8
        if num_devices is None:
            return values * 4 + -(-values * self.bits // 8) + -(-values // QUANT_BLOCK) * 4
        codec, chunk, block = self._wire(values, num_devices)  # the indices: float32, padded to the ring's chunks
        return -(-values // num_devices) * num_devices * 4 + num_devices * codec.message_bytes(chunk, block)

    def mean(self, grads: Tree, state: CompressionState, reduce: Callable, num_devices: int, step: Any,
             device: Any = 0) -> tuple[Tree, CompressionState, dict]:
        """`reduce`: the collective's sum of a tree (BITS 32), or its coded ring `(buffer, wire) ->
        (sum, residual)` (jaxdp/sync/exchange.py); `device`: this device's index."""
        if not jax.tree.leaves(grads):
            return grads, state, {}
        n = num_devices
        flat, split = flat_with_feedback(grads, state, n)
        size = flat.shape[0]
        chunks, chunk, k = self.shape(size)
        x = jnp.pad(flat, (0, chunks * chunk - size)).reshape(chunks, chunk)
        mine = jax.lax.top_k(jnp.abs(x), k)[1]
        leader = lead(jnp.asarray(step, jnp.int32), n) == jnp.asarray(device, jnp.int32)
        proposal = jnp.where(leader, mine, 0).astype(jnp.float32).ravel()
        index = self._sum(reduce, proposal, n, exact=True)[0].astype(jnp.int32).reshape(chunks, k)
        rows = jnp.arange(chunks)[:, None]
        values = x[rows, index]
        total, left = self._sum(reduce, values.ravel(), n)
        mean = jnp.zeros_like(x).at[rows, index].set(total.reshape(chunks, k)).ravel()
        rest = x.at[rows, index].set(left.reshape(chunks, k)).ravel()
        return *split(mean, rest), {}

    def _sum(self, reduce: Callable, buffer: jax.Array, n: int, exact: bool = False) -> tuple[jax.Array, jax.Array]:
        """(sum over devices of `buffer`, what this device's encodings left out): the collective's
        sum, or its coded ring with the values' wire (`exact`: a float32 wire that leaves nothing out)."""
        if self.needs == "sum":
            return reduce(buffer), jnp.zeros_like(buffer)
        size = buffer.shape[0]
        if exact:
            chunk, wire = -(-size // n), _EXACT
        else:
            codec, chunk, block = self._wire(size, n)
            wire = codec.wire(chunk, block)
        total, left = reduce(jnp.pad(buffer, (0, chunk * n - size)), wire)
        return total[:size], left[:size]


def lead(step: Any, n: int) -> Any:
    """The leader of `step` among `n` devices: the sum of step's base-n digits, mod n. Over any n
    consecutive steps every device leads once (as step mod n), and it still reaches every device
    when the codec runs every H steps only (local steps sync at steps H - 1, 2H - 1, ...), where
    step mod n would return to the same n / gcd(H, n) devices."""
    total, place = step * 0, 1
    while n > 1 and place < 2 ** 31:  # every digit of an int32
        total, place = total + step // place % n, place * n
    return total % n


def _exact_encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax.lax.bitcast_convert_type(x, jnp.uint8).ravel(), jnp.zeros_like(x)


_EXACT = Wire(_exact_encode, lambda m: jax.lax.bitcast_convert_type(m.reshape(-1, 4), jnp.float32))


@dataclasses.dataclass(frozen=True)
class _TwoBits(Quantized):
    """quantized.py's blockwise wire with 2-bit values (-1, 0, 1 times the block's max |v|), four a byte."""

    def chunking(self, size: int, num_devices: int) -> tuple[int, int]:
        chunk = max(-(-size // num_devices), 1)
        blocks = -(-chunk // QUANT_BLOCK)
        block = 4 * -(-chunk // (4 * blocks))
        return blocks * block, block

    def _pack(self, q: jax.Array) -> jax.Array:
        u = (q + 1).astype(jnp.uint8).reshape(-1, 4)
        return u[:, 0] | (u[:, 1] << 2) | (u[:, 2] << 4) | (u[:, 3] << 6)

    def _unpack(self, packed: jax.Array) -> jax.Array:
        return (jnp.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=-1).reshape(-1).astype(jnp.int8) - 1)
