"""top-k: a fraction DENSITY of the gradient's values crosses, the rest waits in error feedback
(`TopK`, its class docstring has both forms).

    TopK(density=0.01)                 # "topk:0.01": 1 % of the values, float32, through psum or the ring
    TopK(density=0.01, bits=8)         # "topk:0.01:8": those values int8 through the ring's coded hops
    TopK(0.01, 2, form="gather")       # "topk:0.01:2:gather": SparseLoCo's, each device's own top-k
    TopK(0.01, 2, decay=0.9)           # "topk:0.01:2:decay=0.9": the error feedback decays each time

Two forms. The ring-summed one (ScaleCom's cyclic local top-k): every device sends its values at
ONE index set, the step's leader's local top-k, so the values add up position by position through
an all-reduce (psum, the ring), and what a device sends does not grow with the device count. The
all-gathered one (SparseLoCo's, DeMo's): every device its own top-k, (index, value) pairs gathered
by every device, which grows with the device count but keeps each device's largest values and
sends a 12-bit index once. A spec that names BITS takes the form that sends fewer bytes per device
at the run's device count (at 2 devices the all-gathered one, from 3 the ring-summed one); one
that names neither BITS nor a form (`topk:0.01`) spends the bytes of DENSITY float32 values on the
form and precision that carry the most values (`TopK.settled`: at 2 devices 2-bit values, several
times the density), since quality follows how many values cross, not their precision (measured on
the digits MLP, docs/slow-links.md, "topk: a fraction of the values"). The slot holds every leaf's
error feedback (float32), one row per device, as int8's does, for both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp.sync.codecs.base import CompressionState, Compressor, Tree, Wire, _checkpoint_safe, flat_with_feedback
from jaxdp.sync.codecs.quantized import QUANT_BLOCK, Quantized

# The values each top-k is chosen among: the fused float32 buffer is cut into chunks of this many
# values, and each keeps its round(DENSITY * CHUNK) largest, so a large leaf cannot crowd out a small
# one for the whole buffer, and an index fits 12 bits (sent as float32 here, exact below 2 ** 24).
# `:chunk=N` (a power of 2 up to MAX_CHUNK) sets another; indices above 12 bits are sent in 16.
CHUNK = 4096
MAX_CHUNK = 65536


FORMS = ("auto", "sum", "gather")

# The densities --compression auto offers, densest first (float32 values; the ladder keeps each only
# where it sends fewer bytes than the candidate before it, PowerSGD's lowest rank included).
DENSITIES = (0.1, 0.03, 0.01, 0.003, 0.001)

# The pseudo-gradient codecs `--sync-every auto --compression auto` may choose for local steps,
# densest first: SparseLoCo's form (each device's own top-k, 2-bit values, error feedback decayed at
# every exchange), in the configuration measured on the GPT testbed (docs/perf/calibration.md). Each must pass the
# quality guard (jaxdp/sync/controller.py, costmodel.PSEUDO_GUARD_THRESHOLD) before it is kept.
PSEUDO_DENSITIES = (0.03, 0.01, 0.006, 0.004, 0.002, 0.001)
PSEUDO_BITS = 2
PSEUDO_DECAY = 0.98


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
    """`topk:DENSITY[:BITS][:sum|:gather][:decay=B][:chunk=C]`. Per device x = (g + B e) / N (e: its
    error feedback, B: `decay`, 1 by default), fused into one float32 buffer cut into chunks of C
    values (CHUNK by default; the last padded with zeros); k = round(DENSITY * C) values of each
    chunk cross.

    The ring-summed form ("sum"):
    1. The leader, device `lead(step, N)` (every device in turn), takes the k largest |x| of each
       chunk (jax.lax.top_k); every other device sends zeros, and one all-reduce of those indices
       (two 12-bit indices per float32, one per float32 for chunks above 4096: exact) gives every
       device the same set.
    2. Every device sends its own x at those positions, a dense (chunks, k) buffer: through the
       collective's sum (BITS 32), or its coded ring with int8 / int4 / 2-bit values and one float32
       scale per block of at most QUANT_BLOCK (quantized.py's wire, requantized at every hop;
       needs the ring). The sum, scattered back to its positions, is the mean; zeros elsewhere.

    The all-gathered form ("gather", SparseLoCo's):
    1. Every device takes the k largest |x| of each of its own chunks and encodes them: the indices
       12 bits each (16 for chunks above 4096), the values float32 or BITS-bit integers with one
       float32 scale per block.
    2. One all-gather (the collective's) gives every device every device's message; each adds the
       N decoded sets into a buffer of zeros in device order, so every device holds the same bits.

    Error feedback, both forms: e = N * (x - what this device's values contributed): every value not
    selected, plus (BITS < 32) what the encodings left out at the selected ones. So with B = 1 the
    sum over devices of (g + e_old) / N = mean + sum of e_new / N (to float32 rounding): nothing is
    lost, only delayed, and a value left out grows until a top-k takes it. With B < 1 (SparseLoCo's
    decay, in place of outer momentum) what waits fades by B at every exchange.

    Bytes per step: the ring-summed form all-reduces k indices (2 bytes each) and k values (4, or
    BITS / 8 plus the scales) per chunk, 2 collectives (the index all-reduce carries the riders);
    the all-gathered form sends each device's own k (1.5 + BITS / 8 bytes, plus scales) to N - 1
    others, 1 collective (and the riders' own).
    """

    density: float
    bits: int = 0       # 0: float32 values, not named in the spec (with no form either, `settled` may choose)
    form: str = "auto"   # "sum" | "gather" | "auto": settled by the run's device count (`settled`)
    decay: float = 1.0
    chunk: int = CHUNK

    needs_device = True  # the exchange passes `device`, this device's index on the data axes

    @property
    def name(self) -> str:
        return (f"topk:{self.density!r}" + ("" if self.bits == 0 else f":{self.bits}")
                + ("" if self.form == "auto" else f":{self.form}") + ("" if self.decay == 1.0 else f":decay={self.decay!r}")
                + ("" if self.chunk == CHUNK else f":chunk={self.chunk}"))

    @property
    def collectives(self) -> int:  # type: ignore[override]
        return 1 if self.form == "gather" else 2

    @property
    def needs(self) -> str:  # type: ignore[override]
        if self.form == "gather":
            return "halves"
        return "sum" if self.bits in (0, 32) else "coded_sum"

    @property
    def state_name(self) -> str:
        return "topk"

    @classmethod
    def from_spec(cls, text: str) -> "TopK":
        parts = text.split(":")
        density = float(parts[1])
        if not 0 < density <= 1:
            raise ValueError(f"the density must be in (0, 1], not {density}")
        bits, form, decay, chunk = 0, "auto", 1.0, CHUNK
        for part in parts[2:]:
            if part in FORMS:
                form = part
            elif part.startswith("decay="):
                decay = float(part[6:])
                if not 0 < decay <= 1:
                    raise ValueError(f"the decay must be in (0, 1], not {decay}")
            elif part.startswith("chunk="):
                chunk = int(part[6:])
                if chunk < 2 or chunk > MAX_CHUNK or chunk & (chunk - 1):
                    raise ValueError(f"the chunk must be a power of 2 from 2 to {MAX_CHUNK}, not {chunk}")
            else:
                bits = int(part)
        return cls(density=density, bits=bits, form=form, decay=decay, chunk=chunk)

    @classmethod
    def candidates(cls, name: str, params: Tree, **options: Any) -> list[Compressor]:
        """The auto ladder's: each of DENSITIES, densest first, BITS unnamed (`settled` spends the
        bytes of its float32 values at the run's device count); none for a tree of fewer than
        1 / density values."""
        size = _size(params)
        return [cls(density=d) for d in DENSITIES if d * min(size, CHUNK) >= 1]

    @classmethod
    def pseudo_candidates(cls, params: Tree) -> list["TopK"]:
        """Local steps' top-k candidates under auto: PSEUDO_BITS-bit values, error feedback decayed
        by PSEUDO_DECAY, at each of PSEUDO_DENSITIES (densest first; the form settled by the run's
        device count); none for a tree of fewer than 1 / density values."""
        size = _size(params)
        return [cls(density=d, bits=PSEUDO_BITS, decay=PSEUDO_DECAY) for d in PSEUDO_DENSITIES
                if d * min(size, CHUNK) >= 1]

    def weaker(self, ranks: Sequence[int]) -> Compressor:
        """Outside a ladder: the next density of DENSITIES up (10x, 3x ...), then bf16."""
        denser = [d for d in DENSITIES if d > self.density]
        if denser:
            return dataclasses.replace(self, density=denser[-1])
        from jaxdp.sync.codecs import parse

        return parse("bf16")

    def settled(self, params: Tree, num_devices: int, pseudo_gradient: bool) -> "TopK":
        """"auto" settled by quality within the byte budget. A spec that names its BITS (or a form)
        keeps them, and its form is the one that sends fewer bytes per device (the all-gathered one
        at 2 devices, the ring-summed one, whose bytes do not grow with the device count, from 3).
        A spec that names neither (`topk:DENSITY`): the budget is what DENSITY float32 values send
        in that form, and the run takes, of the all-gathered form with float32, int8 or 2-bit values
        and the ring-summed one with float32 values (int8 and 2-bit sums need the ring's coded hops),
        the one that fits the most values per chunk into it (fewer bytes on a tie): measured on the
        digits MLP, quality follows how many values cross, not their precision (docs/slow-links.md)."""
        del pseudo_gradient
        if self.form != "auto":
            return self
        if num_devices < 2:
            return dataclasses.replace(self, form="sum")
        size = _size(params)
        fewest = self._fewest_bytes(size, num_devices)
        if self.bits:
            return fewest
        budget = fewest.sent_bytes(size, num_devices)
        fits = [self._densest(form, bits, size, num_devices, budget)
                for form, bits in (("gather", 0), ("gather", 8), ("gather", 2), ("sum", 0))]
        return max([fewest, *(c for c in fits if c is not None)],
                   key=lambda c: (c.shape(size)[2], -c.sent_bytes(size, num_devices)))

    def _fewest_bytes(self, size: int, n: int) -> "TopK":
        """This codec in the form that sends fewer bytes per device at `n` devices."""
        return min((dataclasses.replace(self, form=f) for f in ("sum", "gather")), key=lambda c: c.sent_bytes(size, n))

    def _densest(self, form: str, bits: int, size: int, n: int, budget: int) -> "TopK | None":
        """The densest `form` / `bits` version of this codec (density of 3 significant digits) that
        sends at most `budget` bytes per device at `n` devices, or None."""
        chunk, best = max(min(self.chunk, size), 1), None
        low, high = 1, chunk
        while low <= high:
            k = (low + high) // 2
            c = dataclasses.replace(self, form=form, bits=bits, density=min(1.0, float(f"{k / chunk:.3g}")))
            if c.sent_bytes(size, n) <= budget:
                best, low = c, k + 1
            else:
                high = k - 1
        return best

    def settled_note(self, params: Tree, num_devices: int, pseudo_gradient: bool) -> str | None:
        if self.form != "auto" or num_devices < 2:
            return None
        chosen = self.settled(params, num_devices, pseudo_gradient)
        words = {"sum": "ring-summed (one index set)", "gather": "all-gathered (each device's own top-k, SparseLoCo's)"}
        size = _size(params)
        what = "local steps' pseudo-gradients" if pseudo_gradient else "every step's gradients"
        sent = chosen.sent_bytes(size, num_devices)
        if self.bits:
            other = dataclasses.replace(self, form="sum" if chosen.form == "gather" else "gather")
            return (f"--compression {self.name}: {what} go {words[chosen.form]}: "
                    f"{sent:,} bytes sent per device per exchange at {num_devices} devices, "
                    f"against {other.sent_bytes(size, num_devices):,} {words[other.form].split(' (')[0]} "
                    f"(--compression {other.name})")
        plain = self._fewest_bytes(size, num_devices)
        ratio = chosen.shape(size)[2] / plain.shape(size)[2]
        why = (f"{ratio:.1f}x the values of {plain.name} in its bytes: quality follows how many values cross, "
               "not their precision" if ratio > 1 else "no other form or precision fits more values in those bytes")
        return (f"--compression {self.name}: {what} go {words[chosen.form]} as --compression {chosen.name}, "
                f"{sent:,} bytes sent per device per exchange at {num_devices} devices ({why}; "
                f"--compression {plain.name} keeps the density)")

    def init(self, params: Tree) -> CompressionState:
        return CompressionState(error={jax.tree_util.keystr(p): jnp.zeros(x.shape, jnp.float32)
                                       for p, x in jax.tree_util.tree_flatten_with_path(params)[0]})

    def read(self, slot: CompressionState, grads: Tree) -> CompressionState:
        keys = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        self._require(slot, keys)
        return CompressionState(error={k: slot.error[_checkpoint_safe(k)] for k in keys})

    def shape(self, size: int) -> tuple[int, int, int]:
        """(chunks, chunk, k) of a `size`-value buffer."""
        chunk = max(min(self.chunk, size), 1)
        return -(-size // chunk), chunk, max(1, min(chunk, round(self.density * chunk)))

    def _wire(self, values: int, num_devices: int) -> tuple[Quantized, int, int]:
        codec = Quantized(self.bits) if self.bits in (8, 4) else _TwoBits(2)
        return (codec, *codec.chunking(values, num_devices))

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
        """Bytes all-reduced per step (the ring-summed form); for the all-gathered form, the all-reduce
        payload that sends as many bytes per device: what a device sends, times N / 2."""
        return self._payload(_size(params), num_devices)

    def _payload(self, size: int, num_devices: int | None) -> int:
        """`payload_bytes` of a `size`-value buffer."""
        if self.form == "gather":
            return -(-self._message_bytes(size) * max(num_devices or 2, 2) // 2)
        chunks, _, k = self.shape(size)
        values = chunks * k
        indices = self._index_floats(values) * 4
        if self.bits in (0, 32):
            return indices + values * 4
        if num_devices is None:
            return indices + -(-values * self.bits // 8) + -(-values // QUANT_BLOCK) * 4
        codec, chunk, block = self._wire(values, num_devices)  # the indices: padded to the ring's chunks
        pairs = self._index_floats(values)
        return -(-pairs // num_devices) * num_devices * 4 + num_devices * codec.message_bytes(chunk, block)

    def sent_bytes(self, size: int, num_devices: int) -> int:
        """What one device sends per exchange of a `size`-value buffer over `num_devices`."""
        n = num_devices
        if n < 2:
            return 0
        if self.form == "gather":
            return (n - 1) * self._message_bytes(size)
        return self._payload(size, n) * 2 * (n - 1) // n

    def _message_bytes(self, size: int) -> int:
        """The all-gathered form's message of one device: packed indices, then the values' encoding."""
        chunks, _, k = self.shape(size)
        values = chunks * k
        return self._index_bytes(values) + self._values_wire(values)[2]

    def _wide(self) -> bool:
        """Indices above 12 bits: one per float32 in the index all-reduce, 16 bits in a message."""
        return self.chunk > 4096

    def _index_floats(self, count: int) -> int:
        """float32s of the ring-summed form's index all-reduce for `count` indices."""
        return count if self._wide() else -(-count // 2)

    def _index_bytes(self, count: int) -> int:
        """Bytes of `count` packed indices in an all-gathered message."""
        return 2 * count if self._wide() else -(-count // 2) * 3

    def _values_wire(self, values: int) -> tuple[Any, int, int]:
        """(wire, padded length, message bytes) of the all-gathered form's `values` selected values."""
        if self.bits in (0, 32):
            return _EXACT, values, values * 4
        codec, chunk, block = self._wire(values, 1)
        return codec.wire(chunk, block), chunk, codec.message_bytes(chunk, block)

    def mean(self, grads: Tree, state: CompressionState, reduce: Callable, num_devices: int, step: Any,
             device: Any = 0) -> tuple[Tree, CompressionState, dict]:
        """`reduce`: the collective's sum of a tree (BITS 32), its coded ring `(buffer, wire) ->
        (sum, residual)`, or (the all-gathered form) its all-gather of a 1-D buffer
        (jaxdp/sync/exchange.py); `device`: this device's index."""
        if not jax.tree.leaves(grads):
            return grads, state, {}
        n = num_devices
        flat, split = flat_with_feedback(grads, state, n, self.decay)
        size = flat.shape[0]
        chunks, chunk, k = self.shape(size)
        x = jnp.pad(flat, (0, chunks * chunk - size)).reshape(chunks, chunk)
        if self.form == "gather":
            return *split(*(v.ravel()[:size] for v in self._gathered(x, reduce, n))), {}
        rows = jnp.arange(chunks)[:, None]
        mine = jax.lax.top_k(jnp.abs(x), k)[1]
        leader = lead(jnp.asarray(step, jnp.int32), n) == jnp.asarray(device, jnp.int32)
        sent = jnp.where(leader, mine, 0).ravel()
        summed = self._sum(reduce, sent.astype(jnp.float32) if self._wide() else _pairs(sent), n, exact=True)[0]
        index = (summed.astype(jnp.int32)[:chunks * k] if self._wide() else _unpair(summed, chunks * k)).reshape(chunks, k)
        values = x[rows, index]
        total, left = self._sum(reduce, values.ravel(), n)
        mean = jnp.zeros_like(x).at[rows, index].set(total.reshape(chunks, k)).ravel()
        rest = x.at[rows, index].set(left.reshape(chunks, k)).ravel()
        return *split(mean[:size], rest[:size]), {}

    def _gathered(self, x: jax.Array, gather: Callable, n: int) -> tuple[jax.Array, jax.Array]:
        """The all-gathered form on this device's (chunks, chunk) x: (the mean, this device's residual)."""
        chunks, _, k = self.shape(x.size)
        rows = jnp.arange(chunks)[:, None]
        index = jax.lax.top_k(jnp.abs(x), k)[1]
        wire, padded, _ = self._values_wire(chunks * k)
        values = jnp.pad(x[rows, index].ravel(), (0, padded - chunks * k))
        pack, unpack = (_pack16, _unpack16) if self._wide() else (_pack12, _unpack12)
        message = jnp.concatenate([pack(index.ravel()), wire.encode(values)[0]])
        split_at = self._index_bytes(chunks * k)

        def decoded(m: jax.Array) -> tuple[jax.Array, jax.Array]:
            return (unpack(m[:split_at], chunks * k).reshape(chunks, k),
                    wire.decode(m[split_at:])[:chunks * k].reshape(chunks, k))

        total = jnp.zeros_like(x)
        for message_j in gather(message).reshape(n, -1) if n > 1 else message[None]:
            index_j, values_j = decoded(message_j)
            total = total.at[rows, index_j].add(values_j)
        sent = decoded(message)[1]
        return total, x.at[rows, index].add(-sent)

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


def _size(tree: Tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _pairs(index: jax.Array) -> jax.Array:
    """Indices below 4096, two per float32 (a * 4096 + b < 2 ** 24: exact in any float32 sum of one
    nonzero), padded with a zero to an even count."""
    i = jnp.pad(index.astype(jnp.int32), (0, index.shape[0] % 2)).reshape(-1, 2)
    return (i[:, 0] * 4096 + i[:, 1]).astype(jnp.float32)


def _unpair(pairs: jax.Array, count: int) -> jax.Array:
    p = pairs.astype(jnp.int32)
    return jnp.stack([p // 4096, p % 4096], axis=-1).ravel()[:count]


def _pack12(index: jax.Array) -> jax.Array:
    """Indices below 4096, 12 bits each: two in three bytes, padded with a zero to an even count."""
    i = jnp.pad(index.astype(jnp.uint32), (0, index.shape[0] % 2)).reshape(-1, 2)
    a, b = i[:, 0], i[:, 1]
    return jnp.stack([a & 255, (a >> 8) | ((b & 15) << 4), b >> 4], axis=-1).astype(jnp.uint8).ravel()


def _pack16(index: jax.Array) -> jax.Array:
    """Indices below 65536, 16 bits each: two bytes, low first."""
    i = index.astype(jnp.uint32)
    return jnp.stack([i & 255, i >> 8], axis=-1).astype(jnp.uint8).ravel()


def _unpack16(packed: jax.Array, count: int) -> jax.Array:
    u = packed.astype(jnp.int32).reshape(-1, 2)
    return (u[:, 0] | (u[:, 1] << 8))[:count]


def _unpack12(packed: jax.Array, count: int) -> jax.Array:
    u = packed.astype(jnp.int32).reshape(-1, 3)
    a = u[:, 0] | ((u[:, 1] & 15) << 8)
    b = (u[:, 1] >> 4) | (u[:, 2] << 4)
    return jnp.stack([a, b], axis=-1).ravel()[:count]


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
