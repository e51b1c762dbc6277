"""The two programs of an every-step elastic exchange (jaxdp/elastic/every_step.py), each row
made and every row read on the devices: a step crosses to the host once each way, as bytes.

    rows = RowPrograms(local_grads, mesh, spec, coder_of, grad_norm, workers, update)
    payload, finite, feedback = rows.send(state, batch, owed)   # one shard's row: its sums' bytes
    state, metrics = rows.apply(state, all_rows, counted_mask, count)   # their mean, and the update

`send`: the shard's (metrics, model state, gradients), summed over this worker's devices (in device
order with --strategy host, as jaxdp.sync.host.device_sum adds them; in-graph by psum or the ring
otherwise), as one uint8 row: every leaf's bytes, the gradient's as the codec's message (RowCoder,
with `owed`, the shard's error feedback, and the new feedback beside it), and whether every sum is
finite. `apply`: the rows decoded and added in shard order (the counted ones), each leaf divided by
`count`: without a codec what the host path computed with numpy, the same operations in the same
order, so the same bits (float32 additions and one division, no multiplication for a contraction to
join; a codec's dequantizing multiply may fuse with the addition: within float32 rounding of the host
path, and the same on every worker). Then `update(state, grads, model_state)`, a program of its own:
inside the same one, XLA fused the mean into the optimizer's arithmetic and the parameters no longer
matched a one-process run's bit for bit.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from jaxdp.mesh import data_axes, replicated_sharding
from jaxdp.sync.rules import HOST_CODED
from jaxdp.sync.spec import SyncSpec


def to_bytes(x: jax.Array) -> jax.Array:
    """`x`'s bytes in C order (numpy's `tobytes`), traced."""
    x = x.ravel()
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).ravel()


def from_bytes(raw: jax.Array, shape: tuple, dtype: Any) -> jax.Array:
    """The array of `shape` and `dtype` whose bytes `raw` (uint8) holds, traced."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return (raw != 0).reshape(shape)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(raw, dtype).reshape(shape)
    return jax.lax.bitcast_convert_type(raw.reshape(-1, dtype.itemsize), dtype).reshape(shape)


def worker_sum_fn(local_grads: Callable, mesh: Mesh, spec: SyncSpec) -> Callable:
    """(state, batch) -> (metrics, model state, grads) summed over this worker's devices, traced."""
    axis = data_axes(mesh)
    if "host" in spec.abilities:  # each device's, added in device order (the hub's sum, host.device_sum)
        def per_device(state: Any, batch: Any) -> Any:
            return jax.tree.map(lambda x: x[None], local_grads(state, batch))

        stacked = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(axis), check_vma=False)
        return lambda state, batch: jax.tree.map(
            lambda x: functools.reduce(operator.add, [x[d] for d in range(x.shape[0])]), stacked(state, batch))
    total = spec.collective.sum
    return jax.shard_map(lambda state, batch: total(local_grads(state, batch), axis), mesh=mesh,
                         in_specs=(P(), P(axis)), out_specs=P(), check_vma=False)


class RowPrograms:
    """`send` and `apply` (module docstring); `coder_of(size)`: the RowCoder of a gradient of
    `size` values, or None to send float32 bytes; `size`: the workers (rows); `update(state, grads,
    model_state) -> state`; `worker_sum`: the worker's sums if not `worker_sum_fn`'s (the parameters
    cut over its devices: jaxdp.step.fsdp.worker_sums). Built on the first call's shapes (`layout`)."""

    def __init__(self, local_grads: Callable, mesh: Mesh, spec: SyncSpec, coder_of: Callable[[int], Any],
                 grad_norm: bool, size: int, update: Callable, worker_sum: Callable | None = None):
        self.mesh, self.size, self.grad_norm, self.update = mesh, size, grad_norm, update
        self.worker_sum = worker_sum or worker_sum_fn(local_grads, mesh, spec)
        self.coder_of = coder_of
        self.coder = None
        self._send = self._mean = None

    def layout(self, state: Any, batch: Any) -> None:
        """The row's layout from the sums' shapes (no computation), and the two programs."""
        if self._send is not None:
            return
        shapes = jax.eval_shape(self.worker_sum, state, batch)
        leaves, self.treedef = jax.tree.flatten(shapes)
        self.like = [(tuple(x.shape), np.dtype(x.dtype), int(np.prod(x.shape, dtype=np.int64))) for x in leaves]
        self.exact = len(leaves) - self.treedef.children()[2].num_leaves  # (metrics, model state) | grads
        values = sum(count for _, _, count in self.like[self.exact:])
        self.coder = self.coder_of(values)
        self.head = sum(count * dtype.itemsize for _, dtype, count in self.like[:self.exact])
        self.nbytes = self.head + (self.coder.nbytes if self.coder else
                                   sum(count * dtype.itemsize for _, dtype, count in self.like[self.exact:]))
        # (placed as `send` returns the feedback: one program for a shard's first row and every later one; an
        # uncommitted zeros compiled a second program at a joiner's second step, with the others waiting on it)
        self.zeros = jax.device_put(np.zeros(values, np.float32), replicated_sharding(self.mesh)) \
            if self.coder and self.coder.keeps_feedback else None
        self._send = jax.jit(self._send_fn)
        self._mean = jax.jit(self._mean_fn, out_shardings=replicated_sharding(self.mesh))

    def _send_fn(self, state: Any, batch: Any, owed: Any) -> tuple[jax.Array, jax.Array, Any]:
        leaves = jax.tree.leaves(self.worker_sum(state, batch))
        finite = functools.reduce(jnp.logical_and, [jnp.isfinite(x).all() for x in leaves
                                                    if jnp.issubdtype(x.dtype, jnp.inexact)], jnp.bool_(True))
        head = [to_bytes(x) for x in leaves[:self.exact]]
        if self.coder is None:
            return jnp.concatenate(head + [to_bytes(x) for x in leaves[self.exact:]]), finite, owed
        flat = jnp.concatenate([x.ravel().astype(jnp.float32) for x in leaves[self.exact:]])
        message, left = self.coder.encode_traced(flat, owed if owed is not None else jnp.zeros_like(flat))
        return jnp.concatenate(head + [message]), finite, left

    def send(self, state: Any, batch: Any, owed: Any = None) -> tuple[np.ndarray, bool, Any]:
        """(this shard's row as uint8 host bytes, whether its sums are finite, the new error feedback
        or None). `owed`: the shard's feedback so far (None: none yet)."""
        self.layout(state, batch)
        if self.zeros is not None and owed is None:
            owed = self.zeros
        payload, finite, left = self._send(state, batch, owed)
        payload, finite = jax.device_get((payload, finite))
        return payload, bool(finite), left if self.zeros is not None else None

    def _parts(self, row: jax.Array) -> list[jax.Array]:
        """One row's leaves: the exact ones from their bytes, the gradient's from the codec's message."""
        parts, offset = [], 0
        for shape, dtype, count in self.like[:self.exact] + (self.like[self.exact:] if self.coder is None else []):
            parts.append(from_bytes(row[offset:offset + count * dtype.itemsize], shape, dtype))
            offset += count * dtype.itemsize
        if self.coder is not None:
            flat, at = self.coder.decode_traced(row[self.head:]), 0
            for shape, dtype, count in self.like[self.exact:]:
                parts.append(flat[at:at + count].reshape(shape).astype(dtype))
                at += count
        return parts

    def _mean_fn(self, rows: jax.Array, counted: jax.Array, count: jax.Array) -> tuple[Any, Any, dict]:
        totals = [jnp.zeros(shape, dtype) for shape, dtype, _ in self.like]
        for shard in range(self.size):  # in shard order, the counted ones: the host path's additions
            totals = [jnp.where(counted[shard], t + p, t) for t, p in zip(totals, self._parts(rows[shard]))]
        means = []
        for t in totals:
            if jnp.issubdtype(t.dtype, jnp.inexact):  # (none counted: NaN, which stops the run as ever)
                # A true division, as numpy's host path: XLA turns `t / count` into `t * (1 / count)`, which
                # rounds differently where count is not a power of two (3 workers did not match one process).
                divisor = jax.lax.optimization_barrier(jnp.broadcast_to(count.astype(t.dtype), t.shape))
                means.append(jnp.where(count > 0, t / divisor, jnp.nan).astype(t.dtype))
            else:
                means.append(jnp.where(count > 0, (t / jnp.maximum(count, 1)).astype(t.dtype), t))
        metrics, model_state, grads = jax.tree.unflatten(self.treedef, means)
        metrics = dict(metrics)
        if self.grad_norm:
            metrics["grad_norm"] = optax.tree.norm(grads)
        return grads, model_state, {k: v.astype(jnp.float32) for k, v in metrics.items()}

    def apply(self, state: Any, rows: np.ndarray, counted: np.ndarray, count: int) -> tuple[Any, dict]:
        """(`state` updated by the mean of `rows`' sums over the `counted` shards (a bool per row),
        divided by `count` (the devices counted); the metrics). Nothing waits for the devices: the
        metrics stay there, as a compiled step's do, so the update runs while the host goes on to the
        next step. `update` may donate `state`."""
        grads, model_state, metrics = self._mean(rows, counted, np.int32(count))
        return self.update(state, grads, model_state), metrics

    def warm_up(self, state: Any, batch: Any) -> None:
        """Compile both programs and the update (on a copy of `state`)."""
        payload, _, _ = self.send(state, batch)
        rows = np.zeros((self.size, self.nbytes), np.uint8)
        rows[0] = payload  # (the other rows' zeros decode to zeros: only the shapes matter here)
        jax.block_until_ready(self.apply(jax.tree.map(jnp.copy, state), rows, np.arange(self.size) == 0, 1))


class RowCoder:
    """One worker's sum, a flat float32 vector of `size` values, as the bytes of a codec's message
    (bf16, int8, int4: `HOST_CODED`), and back. int8 / int4 keep error feedback per key (the data
    shard the sum is of): what a message leaves out is added to that key's next vector, as the ring's
    coded sum does per device; bf16 keeps none, as its in-graph codec. `encode` returns the new
    feedback beside the message; `keep` makes it the key's (once the exchange went through), and
    `settle` makes an exchange's feedback the only feedback kept.
    `encode_traced(values, owed)` and `decode_traced(message)` are the same inside a caller's jit
    (owed: the key's feedback, zeros for none; bf16 returns it unchanged)."""

    def __init__(self, codec: Any, size: int) -> None:
        import jax.numpy as jnp

        if codec.name not in HOST_CODED:
            raise ValueError(f"a host exchange codes only {', '.join(HOST_CODED)}, not {codec.name!r}")
        self.codec, self.size, self.feedback = codec, size, {}
        self.keeps_feedback = codec.name != "bf16"
        if codec.name == "bf16":
            self.nbytes = 2 * size
            self.encode_traced = lambda values, owed: (
                jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint8).ravel(), owed)
            self.decode_traced = lambda message: jax.lax.bitcast_convert_type(
                message.reshape(-1, 2), jnp.bfloat16).astype(jnp.float32)
            return
        chunk, block = codec.chunking(size, 1)
        wire = codec.wire(chunk, block)
        pad = chunk - size

        def encode(values: jax.Array, owed: jax.Array) -> tuple[jax.Array, jax.Array]:
            message, left = wire.encode(jnp.pad(values + owed, (0, pad)))
            return message, left[:size]

        # (traced: for RowPrograms' programs below, made and read on the devices)
        self.encode_traced, self.decode_traced = encode, lambda message: wire.decode(message)[:size]
        self._encode = jax.jit(encode)  # (one program a message: a worker's step waits on it)
        self._decode = jax.jit(jax.vmap(self.decode_traced))
        self._zeros = np.zeros(size, np.float32)
        self.nbytes = codec.message_bytes(chunk, block)

    def encode(self, values: np.ndarray, key: int) -> tuple[bytes, np.ndarray | None]:
        """(the message of `values` plus `key`'s feedback, the new feedback or None)."""
        values = np.asarray(values, np.float32)
        if self.codec.name == "bf16":
            return values.astype(jax.numpy.bfloat16).tobytes(), None
        owed = self.feedback.get(key)
        message, left = self._encode(values, self._zeros if owed is None else owed)
        return np.asarray(message).tobytes(), np.asarray(left)

    def keep(self, key: int, feedback: np.ndarray | None) -> None:
        if feedback is not None:
            self.feedback[key] = feedback

    def settle(self, kept: dict, left_out: Any = ()) -> None:
        """After an exchange went through: the feedback owed is that of the keys coded in it (`kept`:
        key -> new feedback), less those whose values were not finite (`left_out`: their feedback
        would carry the NaN into every later message of the key). Every other key's is dropped, so a
        key coded again later (an elastic run's lost worker's shard once more, a worker's own shard
        after it healed) starts at zero, not from what it left out steps ago."""
        left_out = set(left_out)
        self.feedback = {key: f for key, f in kept.items() if f is not None and key not in left_out}

    def decode(self, message: bytes) -> np.ndarray:
        return self.decode_rows(np.frombuffer(message, np.uint8)[None])[0]

    def decode_rows(self, messages: np.ndarray) -> np.ndarray:
        """Each row of `messages` (uint8, one message a row) decoded: (rows, size) float32, in one program."""
        if self.codec.name == "bf16":
            return np.ascontiguousarray(messages).view(jax.numpy.bfloat16).astype(np.float32)
        return np.asarray(self._decode(messages), np.float32)
