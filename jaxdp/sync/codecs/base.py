"""What every codec shares: the `Compressor` interface, its state, and the slot it owns in `state.sync`.

    comp = jaxdp.sync.codecs.parse("powersgd:4")   # a Compressor (the table in codecs/__init__.py)
    cstate = comp.init(params)                     # ONE device's CompressionState (shapes/dtypes only matter)
    # inside jax.shard_map, on one device's gradient tree:
    mean, cstate, scalars = comp.mean(grads, cstate, allreduce_sum, num_devices, step)

Interface (every codec is a frozen dataclass; `parse(c.name) == c`):

* `name`, `collectives` (all-reduce calls per step once compressing), `needs` ("sum", or
  "coded_sum": the collective's coded ring, `coded_sum(buffer, wire) -> (sum, residual)`, which
  requantizes at every hop: int8 / int4), `start` (the step it starts compressing at; 0: at once).
* `init(params) -> CompressionState`; `mean(grads, state, allreduce_sum, num_devices, step)`: runs
  on one device inside `shard_map`; every mean is pre-scaled by 1/num_devices BEFORE the sum, so
  fp16/bf16 sums cannot overflow where the mean itself fits; `scalars` are float32 scalars,
  identical on every device.
* `on_slices(cuts, axis, pieces)`: the codec for slices of the leaves (`shard_params`): itself
  unless it needs whole matrices (PowerSGD's sliced form).
* `payload_bytes(params, num_devices=None)`: bytes all-reduced per step once compressing (static);
  `bytes_sent(payload, N)` is what each device sends, `uncompressed_bytes(params)` plain averaging's.

The slot (optax's rule: a feature owns its state; nothing outside the codec reads it). A codec's
state lives in `state.sync` under `SLOT`: the error feedback one row per device
(`per_device[SLOT]`, sharded over the data axes), shared factors replicated (`shared[SLOT]`), keyed
by checkpoint-safe leaf names (`leaf_key`). The codec's methods are the only readers and writers:

* `state_name`: what its slot is made for (None: it keeps none); two codecs with the same
  state_name share a slot (PowerSGD's start step and seed do not change its shapes).
* `slot(params) -> CompressionState`: one device's new slot (checkpoint-safe keys);
  `serving(members, params)` (a classmethod): one slot that serves each of `members`, codecs of
  this family (`auto_slot` merges the families' for `--compression auto`).
* `read(slot, grads) -> CompressionState`: the part `mean` reads, keyed as it expects (ValueError,
  naming what to pass to init_state, if the slot lacks a leaf); `write(slot, new)`: the inverse.
* `restorable(slot, saved)` / `refill(restored, fresh, owed)`: checkpoint migration, an older
  checkpoint's slot to the current layout (the checkpointer calls them through `migration`).
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

Tree = Any
AllReduce = Callable[[Tree], Tree]
SLOT = "compression"  # the codec's slot in state.sync.per_device / state.sync.shared


@flax.struct.dataclass
class CompressionState:
    """error: per-device error feedback (differs between devices); q: shared warm-start factors."""

    error: Any = flax.struct.field(default_factory=dict)
    q: Any = flax.struct.field(default_factory=dict)


class Wire(NamedTuple):
    """A codec's wire format for one ring chunk of a fixed length (float32), what
    `jaxdp.sync.collectives.ring_coded_allreduce` sends at every hop: `encode(chunk) -> (message, residual)`,
    the 1-D uint8 message and `chunk - decode(message)`; `decode(message) -> chunk`, what the
    receiver adds (or, for a finished chunk, every device keeps)."""

    encode: Callable[[jax.Array], tuple[jax.Array, jax.Array]]
    decode: Callable[[jax.Array], jax.Array]


class Compressor:
    """The interface every codec implements (module docstring); build one with `codecs.parse(spec)`."""

    name: str
    collectives: int  # all-reduce calls per step once compressing
    state_name: str | None = None  # what its train-state slot is made for; None: it keeps no state
    needs = "sum"  # what of the collective `mean` receives: "sum", or "coded_sum" (int8, int4)
    start = 0  # the step it starts compressing at (before it: plain averaging)

    def init(self, params: Tree) -> CompressionState:
        """One device's state: none, unless the kind keeps some between steps."""
        del params
        return CompressionState()

    def mean(self, grads: Tree, state: CompressionState, allreduce_sum: AllReduce, num_devices: int,
             step: Any) -> tuple[Tree, CompressionState, dict]:
        raise NotImplementedError

    def payload_bytes(self, params: Tree, num_devices: int | None = None) -> int:
        raise NotImplementedError

    def settled(self, params: Tree, num_devices: int, pseudo_gradient: bool) -> "Compressor":
        """The codec that averages trees like `params` on `num_devices` devices, every step's
        gradients or (`pseudo_gradient`) local steps' pseudo-gradients: itself, unless its spec
        leaves a choice to them (top-k's form, jaxdp/sync/codecs/topk.py). The exchange asks."""
        del params, num_devices, pseudo_gradient
        return self

    def settled_note(self, params: Tree, num_devices: int, pseudo_gradient: bool) -> str | None:
        """The console line that says what `settled` chose and why (None: it chose nothing)."""
        del params, num_devices, pseudo_gradient
        return None

    def on_slices(self, cuts: tuple, axis: Any, pieces: int) -> "Compressor":
        """The codec that averages each device's SLICE of the leaves the way this one averages
        whole leaves (`shard_params` across workers, jaxdp/step/hsdp.py): `cuts` holds, per leaf,
        (key, whole shape, the dimension cut into `pieces` over the mesh axis `axis`, or None for a
        leaf every device holds whole). Default: itself, right for a codec that acts on each value
        (bf16) or on blocks of values (int8, int4): a slice is averaged as a whole leaf is."""
        del cuts, axis, pieces
        return self

    def weaker(self, ranks: Sequence[int]) -> "Compressor":
        """The next codec with less compression, outside a ladder (costmodel.weaker): default none."""
        from jaxdp.sync.codecs import parse

        return parse("none")

    # -- the slot --------------------------------------------------------------------------------

    def slot(self, params: Tree) -> CompressionState:
        """One device's new slot for this codec, keyed by `leaf_key` ({} and {}: it keeps none)."""
        return safe_keys(self.init(params))

    @classmethod
    def serving(cls, members: Sequence["Compressor"], params: Tree) -> CompressionState:
        """One slot that serves each of `members` (codecs of this family). Default: the first's."""
        return members[0].slot(params) if members else CompressionState()

    def read(self, slot: CompressionState, grads: Tree) -> CompressionState:
        """What `mean` reads of the slot (default: nothing)."""
        del slot, grads
        return CompressionState()

    def write(self, slot: CompressionState, new: CompressionState) -> CompressionState:
        """`read`'s inverse: the slot with `new` (keyed as `mean` returns it) written back; a
        shared factor narrower than the slot's (a lower rank read from a wider slot) fills its
        first columns."""
        error, q = dict(slot.error), dict(slot.q)
        for k, e in new.error.items():
            error[_checkpoint_safe(k)] = e.astype(error[_checkpoint_safe(k)].dtype)
        for k, v in new.q.items():
            old = q[_checkpoint_safe(k)]
            q[_checkpoint_safe(k)] = v.astype(old.dtype) if v.shape == old.shape else old.at[:, :v.shape[1]].set(v.astype(old.dtype))
        return CompressionState(error=error, q=q)

    def _require(self, slot: CompressionState, keys: Sequence[str], alternative: str = "") -> None:
        missing = [k for k in keys if _checkpoint_safe(k) not in slot.error]
        if missing:
            raise ValueError(f"the state has no compression state for {self.name} (leaf {missing[0]}); make it with "
                             f"init_state(..., compression={self.name!r}){alternative}")

    # -- checkpoint migration --------------------------------------------------------------------

    @staticmethod
    def restorable(slot: Any, saved: Callable[[str], bool]) -> tuple[Any, list[str]]:
        """(the slot's error rows to restore, the names a checkpoint lacks). A checkpoint may hold
        error feedback for fewer leaves than the slot now keeps (a `--compression auto` checkpoint
        from before int8 and int4 joined the ladder holds PowerSGD's matrices only): what it lacks
        starts at zero, as in a new slot, since nothing was owed for those leaves. A slot the
        checkpoint lacks entirely is not this (the compatibility check names it): ([], all kept).
        `saved(name)` says whether the checkpoint holds the slot's row `name`."""
        if not isinstance(slot, dict):
            return slot, []
        missing = [k for k in slot if not saved(k)]
        if not missing or len(missing) == len(slot):
            return slot, []
        return {k: v for k, v in slot.items() if k not in missing}, missing

    @staticmethod
    def refill(restored: dict, fresh: dict, owed: list[str]) -> dict:
        """`restorable`'s inverse: the rows it left out, from a new slot `fresh` (zeros)."""
        return {**restored, **{k: fresh[k] for k in owed}}


def stored(sync: Any) -> CompressionState:
    """This device's slot inside `shard_map` (its error row, the shared factors), from a SyncState."""
    return CompressionState(error=jax.tree.map(lambda x: x[0], sync.per_device.get(SLOT, {})), q=sync.shared.get(SLOT, {}))


def store(sync: Any, slot: CompressionState) -> Any:
    """`stored`'s inverse: the SyncState with this device's slot written back (unchanged if empty)."""
    if not slot.error and not slot.q:
        return sync
    return sync.replace(per_device={**sync.per_device, SLOT: jax.tree.map(lambda x: x[None], slot.error)},
                        shared={**sync.shared, SLOT: slot.q})


def only(sync: Any) -> Any:
    """The SyncState holding the slot alone (what an exchange reads and writes), nothing else."""
    return sync.replace(per_device={k: v for k, v in sync.per_device.items() if k == SLOT},
                        shared={k: v for k, v in sync.shared.items() if k == SLOT})


def rows(sync: Any) -> tuple[dict, dict]:
    """(every device's error rows, the shared factors) of a whole state's slot ({} where none)."""
    return sync.per_device.get(SLOT, {}), sync.shared.get(SLOT, {})


def entries(slot_rows: dict, shared: dict) -> tuple[dict, dict]:
    """(per_device, shared) entries of a new SyncState holding the slot ({}, {} when empty)."""
    if not slot_rows and not shared:
        return {}, {}
    return {SLOT: slot_rows}, {SLOT: shared}


def migration(state_name: str | None) -> type[Compressor]:
    """Who migrates a slot made for `state_name` (a codec's, or "auto") from an older checkpoint:
    every codec's slot keeps error rows by leaf name, so the base rule serves them all today; a codec
    whose layout changes overrides `restorable` / `refill`, and this returns its class."""
    del state_name
    return Compressor


def auto_slot(params: Tree, families: Sequence[tuple[type[Compressor], Sequence[Compressor]]]) -> CompressionState:
    """One slot serving every candidate of the auto ladder: each family's `serving` slot, merged
    in the order given (the first family to name a leaf's error row keeps it). The error is what
    is still owed to the mean, whichever codec left it, so a switch of codec carries it over."""
    error, q = {}, {}
    for cls, members in families:
        part = cls.serving(members, params)
        error = {**part.error, **error}
        q = {**part.q, **q}
    return CompressionState(error=error, q=q)


def safe_keys(state: CompressionState) -> CompressionState:
    """A CompressionState keyed by `jax.tree_util.keystr` -> keyed by checkpoint-safe names."""
    return CompressionState(error={_checkpoint_safe(k): v for k, v in state.error.items()},
                            q={_checkpoint_safe(k): v for k, v in state.q.items()})


def leaf_key(path: Any) -> str:
    """A leaf's path as a checkpoint-safe name: ("Dense_0", "kernel") -> "Dense_0.kernel"."""
    return _checkpoint_safe(jax.tree_util.keystr(path))


def _checkpoint_safe(key: str) -> str:
    """A `jax.tree_util.keystr` ("['Dense_0']['kernel']") as a checkpoint-safe name ("Dense_0.kernel")."""
    return re.sub(r"[^A-Za-z0-9_]+", ".", key).strip(".")


def bytes_sent(payload_bytes: float, num_devices: int) -> float:
    """What each device sends to all-reduce `payload_bytes` with a bandwidth-optimal algorithm
    (the ring, and what psum's collectives do): 2 (N - 1) / N of it."""
    return payload_bytes * 2 * (num_devices - 1) / num_devices


def uncompressed_bytes(params: Tree) -> int:
    """Bytes plain averaging all-reduces per step: every leaf in its own dtype."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def scaled(tree: Tree, num_devices: int) -> Tree:
    """Every leaf times 1/num_devices, in its own dtype (so fp16 sums cannot overflow)."""
    return jax.tree.map(lambda g: g * jnp.asarray(1.0 / num_devices, g.dtype), tree)


def flat_with_feedback(grads: Tree, state: CompressionState, num_devices: int,
                       decay: float = 1.0) -> tuple[jax.Array, Callable]:
    """What an error-feedback codec of one flat buffer sends: every leaf's (g + decay * its error)
    / N, float32, concatenated in leaf order; and `split(mean, residual)`, which cuts the buffer's
    mean and this device's residual back into leaves: (the mean tree in the leaves' dtypes, the new
    CompressionState, the residual times N). `grads` has at least one leaf."""
    items, treedef = jax.tree_util.tree_flatten_with_path(grads)
    keys = [jax.tree_util.keystr(p) for p, _ in items]
    scale = jnp.float32(1.0 / num_devices)

    def owed(k: str) -> jax.Array:
        e = state.error[k].astype(jnp.float32)
        return e if decay == 1.0 else e * jnp.float32(decay)

    flat = jnp.concatenate([jnp.ravel((g.astype(jnp.float32) + owed(k)) * scale) for k, (_, g) in zip(keys, items)])

    def split(mean: jax.Array, residual: jax.Array) -> tuple[Tree, CompressionState]:
        out, error, offset = [], {}, 0
        for key, (_, g) in zip(keys, items):
            out.append(mean[offset:offset + g.size].reshape(g.shape).astype(g.dtype))
            error[key] = residual[offset:offset + g.size].reshape(g.shape) * jnp.float32(num_devices)
            offset += g.size
        return jax.tree_util.tree_unflatten(treedef, out), CompressionState(error=error)

    return flat, split
