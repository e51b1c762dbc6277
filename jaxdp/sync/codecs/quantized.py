"""int8 / int4: the whole gradient as one float32 buffer through the collective's coded ring,
requantized at every hop, with error feedback (`Quantized`, its class docstring has the bound).

    Quantized(bits=8)    # "int8"; Quantized(4) is "int4"

It needs the ring's hops (`needs = "coded_sum"`): psum's all-reduce sums in full precision inside,
with no hop to requantize. Its slot holds every leaf's error feedback (float32), one row per device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.sync.codecs.base import CompressionState, Compressor, Tree, Wire, _checkpoint_safe, flat_with_feedback

# The most values that share one float32 scale. Smaller blocks follow the values more closely (an
# outlier coarsens only its own block) but send more scales: 4 bytes per block is 0.8 % of an int8
# block of 512 and 1.6 % of an int4 one (256 bytes). 512 also keeps a small model's padding small:
# each ring chunk is cut into ceil(chunk / 512) equal blocks, so no chunk pads more than a few values.
QUANT_BLOCK = 512


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

    @classmethod
    def from_spec(cls, text: str) -> "Quantized":
        return cls(bits=int(text[3:]))

    @classmethod
    def candidates(cls, name: str, params: Tree, *, ranks: Sequence[int], start: int, ring_devices: int | None,
                   bound: float) -> list[Compressor]:
        """The auto ladder's `name` (int8, int4) on a ring of `ring_devices` (None: no coded ring, none),
        where its one-step error bound is at most `bound`."""
        codec = cls.from_spec(name)
        return [codec] if ring_devices and codec.error_bound(ring_devices) <= bound else []

    @property
    def state_name(self) -> str:
        return self.name

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def init(self, params: Tree) -> CompressionState:
        return CompressionState(error={jax.tree_util.keystr(p): jnp.zeros(x.shape, jnp.float32)
                                       for p, x in jax.tree_util.tree_flatten_with_path(params)[0]})

    @classmethod
    def serving(cls, members: Sequence[Compressor], params: Tree) -> CompressionState:
        """Every leaf's error row (float32): what int8 and int4 read, and what any codec may owe."""
        return cls(8).slot(params)

    def weaker(self, ranks: Sequence[int]) -> Compressor:
        """int4 -> int8 -> bf16."""
        from jaxdp.sync.codecs import parse

        return parse("int8" if self.bits < 8 else "bf16")

    def read(self, slot: CompressionState, grads: Tree) -> CompressionState:
        keys = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        self._require(slot, keys)
        return CompressionState(error={k: slot.error[_checkpoint_safe(k)] for k in keys})

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
        if not jax.tree.leaves(grads):
            return grads, state, {}
        flat, split = flat_with_feedback(grads, state, num_devices)
        size = flat.shape[0]
        chunk, block = self.chunking(size, num_devices)
        total, residual = coded_sum(jnp.pad(flat, (0, chunk * num_devices - size)), self.wire(chunk, block))
        return *split(total, residual), {}


def _dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """Blocks of integers (blocks, block) times their scales: the one decoding every device uses."""
    return q.astype(jnp.float32) * scale[:, None]
