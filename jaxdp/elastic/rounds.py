"""Local steps across the workers of an elastic run (`--sync-every H`): DiLoCo rounds whose
membership may change at every round's end (jaxdp/elastic/ft.py has the engine, every_step.py the
every-step exchange whose pieces this reuses).

Inside a worker nothing changes from a plain run of local steps (jaxdp/step/local_sgd.py): every device
of the worker is a replica with its own inner optimizer state, training on its slice of the worker's
batch with no collective but the scalars' mean over the worker's devices. Across workers there is no
traffic at all between round ends. At the end of each round of H steps:

1. A quorum (the engine's: the hub or torchft's Lighthouse): who takes part. A worker that is behind (a new, restarted or
   stalled one) receives a live peer's state here, as it stands at that peer's round end before the
   exchange, and then takes part in that exchange as a listener (its row carries no pseudo-gradient).
2. One all-gather of one row per worker: the sum over its devices of the pseudo-gradient (global
   parameters - replica), as float32 bytes or a codec's message (bf16, int8, int4: rows.RowCoder,
   its error feedback per worker in the worker's memory).
3. The engine's commit. A failed one (a worker died or stalled in the round or in the exchange) does the
   exchange again over a new quorum: the round completes with the others. Each worker's row counts
   the replicas that did all of the round's steps, so the mean is weighted by the examples actually
   done; a lost worker's steps of that round are lost with it (they are not computed by another
   worker, unlike an every-step run's lost shard: the replicas' states are not transferable), and a
   row whose values are not finite is left out and named.
4. Every worker adds the rows in rank order on the host (the same bits everywhere), divides by the
   replicas counted, and applies the outer optimizer to the global parameters; every replica restarts
   from them. The inner optimizer states stay per replica (a healed worker's are its peer's).

A worker joins only at a round's end; a worker lost in a round misses the rest of it. At the run's
start every worker waits, as in an every-step run, for rank 0, which restored the checkpoint, and
for every launched worker, up to --quorum-timeout (every_step.py, `wait_at_start`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.elastic.hub import HubGone
from jaxdp.elastic.rows import RowCoder
from jaxdp.mesh import data_axes, replicate, state_specs
from jaxdp.elastic.every_step import (
    ASKS_STOP, HEADER, TAKES_PART, cut, flags_of, lead_of, live_of, present_of, say_live, step_number,
    take_quorum, wait_at_start,
)
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME, default_outer, replica_step
from jaxdp.step.rounds import make_inner, outer_step
from jaxdp.step.state import TrainState
from jaxdp.step.train_step import TrainStep, _accumulated, _local_grads_fn
from jaxdp.sync.codecs.base import bytes_sent
from jaxdp.sync.spec import SyncSpec

Batch = Any
Metrics = dict


class Ended(NamedTuple):
    """What a round's end left: the state (a live peer's, where this worker was behind), whether it was
    healed, whether this was the run's start (only who takes part was exchanged), the rows' weighted
    mean (None where nothing was counted), the weight counted, the scalars' weighted mean (NaN where
    nothing was counted), and each counted rank's (weight, scalars)."""

    state: Any
    healed: bool
    start: bool
    mean: np.ndarray | None
    counted: float
    shared: np.ndarray
    by_rank: dict


class RoundEnd:
    """Steps 1-3 above and step 4's sum, for any rounds across elastic workers (these, and the timed
    rounds of jaxdp/elastic/timed.py). Each worker's row: a header (rank + 1 where it takes part,
    negated for values that are not finite; its flags), then float64 `[weight, *scalars]` (`keys`
    names the scalars), then `values` float32 values (or a codec's message). Every worker adds the
    counted rows' values in rank order (the same bits everywhere) and divides by their weights' sum:
    a row's values must already be its weight times what it averages. `at_of(state)` is the number
    the quorum compares (a worker behind it is healed): the step, or the round."""

    def __init__(self, member: Any, codec: Any, values: int, keys: list[str], at_of: Callable[[TrainState], int]):
        self.member, self.values, self.keys, self.at_of = member, values, list(keys), at_of
        self.coder = RowCoder(codec, values) if codec is not None else None
        self.head = 8 * (1 + len(self.keys))
        self.nbytes = self.head + (self.coder.nbytes if self.coder else 4 * values)
        self.bad: list[int] = []  # the ranks named last as not finite
        self.present: list[int] = list(range(member.size))  # the ranks whose rows came in the last exchange
        self.where: Callable[[TrainState, int], str] = lambda state, at: f"step {at}"  # (the console's words)

    def wire(self) -> float:
        """The bytes each worker sends per round end (an all-gather of one row each)."""
        size = self.member.size
        return float(bytes_sent(self.nbytes * size // 2, size)) if size > 1 else 0.0

    def row(self, delta: np.ndarray | None, head: np.ndarray | None, flags: int, kept: dict) -> np.ndarray:
        """This worker's row. No `delta` (the run's start, or a listener), or a weight of 0 (no step taken):
        zeros, which count nothing; a weight of 0 still takes part."""
        rank = self.member.rank
        piece = np.zeros((1, HEADER + self.nbytes), np.uint8)
        piece[0, 8:16] = np.frombuffer(np.int64(flags).tobytes(), np.uint8)
        finite = delta is None or bool(np.isfinite(delta).all() and np.isfinite(head).all())
        if flags & TAKES_PART:
            piece[0, :8] = np.frombuffer(np.int64(rank + 1 if finite else -rank - 1).tobytes(), np.uint8)
        if delta is not None and finite and flags & TAKES_PART and head[0]:  # (a weight of 0 counts nothing)
            if self.coder is None:
                body = delta.tobytes()
            else:
                body, kept[rank] = self.coder.encode(delta, rank)
            piece[0, HEADER:] = np.frombuffer(np.asarray(head, np.float64).tobytes() + body, np.uint8)
        return piece

    def values_of(self, payload: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """(weight, scalars, values) of a row's payload."""
        head = np.frombuffer(payload[:self.head].tobytes(), np.float64)
        if not head[0]:
            return 0.0, head[1:], np.zeros(self.values, np.float32)
        body = payload[self.head:].tobytes()
        return head[0], head[1:], (np.frombuffer(body, np.float32) if self.coder is None else self.coder.decode(body))

    def exchange(self, state: TrainState, at: int, delta: np.ndarray | None, head: np.ndarray | None = None) -> Ended:
        """One round's end (no `delta`: the run's start, where only who takes part is exchanged, or a
        listener's), done again over a new quorum until it commits."""
        try:
            return self._exchange(state, at, delta, head)
        except HubGone as gone:  # the quorum is lost: the state this worker holds now goes with it
            gone.state = getattr(gone, "state", state)
            raise

    def _exchange(self, state: TrainState, at: int, delta: np.ndarray | None, head: np.ndarray | None) -> Ended:
        member = self.member
        healed_any, start = False, delta is None
        while True:
            kept: dict = {}
            if member.fresh_quorum:  # settle's quorum is this exchange's
                member.fresh_quorum = False
                if member.pending_round:  # healed at a peer's round end: its exchange, as a listener
                    member.pending_round, start = False, False
            else:
                try:
                    healed, pending, _ = take_quorum(member, state, at, pending=not start)
                except BaseException as err:
                    err.state = state  # (a peer's, where this worker had healed: not the one it was given)
                    raise
                if healed is not None:  # behind: the peer's state, and its exchange as a listener
                    state, at, healed_any, delta, start = healed, self.at_of(healed), True, None, not pending
            takes_part = member.engine.participating() and (start or delta is not None)
            own = flags_of(member, takes_part)
            rows = cut(member.engine.allgather(self.row(delta, head, own, kept)))
            if not member.engine.commit() or not rows:
                continue  # someone failed in the round or the exchange: again, over the new quorum
            heads = [(tag, flags) for tag, flags, _ in rows]
            live = live_of(heads)
            if start and wait_at_start(member, heads, self.where(state, at)):
                continue  # at the start, for rank 0 (it restored the checkpoint) and every launched worker
            break
        self.present = present_of(heads)
        member.stop = member.stop or any(flags & ASKS_STOP for _, flags in heads)
        member.fresh, member.leader = False, lead_of(heads, member.leader)
        nothing = np.full(len(self.keys), np.nan)
        if start:
            self.report(self.where(state, at), live, [], present_of(heads))
            return Ended(state, healed_any, True, None, 0.0, nothing, {})
        if self.coder is not None:  # the exchange went through: this round's feedback is owed (none
            self.coder.settle(kept)  # when this worker only listened: what it owed before is stale)
        acc, counted, bad, by_rank = np.zeros(self.values, np.float32), 0.0, [], {}
        shared = np.zeros(len(self.keys), np.float64)
        for tag, _, payload in sorted(rows, key=lambda r: abs(r[0])):  # in rank order: the same bits everywhere
            if tag > 0:
                weight, scalars, values = self.values_of(payload)
                if weight:
                    acc += values
                    counted += weight
                    shared += weight * scalars
                    by_rank[tag - 1] = (weight, scalars)
            elif tag < 0:
                bad.append(-tag - 1)
        self.report(self.where(state, at), live, sorted(bad), present_of(heads))
        if not counted:
            return Ended(state, healed_any, False, None, 0.0, nothing, by_rank)
        return Ended(state, healed_any, False, acc / np.float32(counted), counted, shared / counted, by_rank)

    def loss(self, end: Ended) -> float:
        """A round's loss, the rows' weighted one; no row counted: NaN where some row was not finite (the
        guard stops the run only if every row was), else 0, as one program's timed rounds report a round
        without steps."""
        return float(end.shared[0]) if end.counted or self.bad else 0.0

    def report(self, where: str, live: list[int], bad: list[int], present: list[int]) -> None:
        say_live(self.member, where, live, present=present)
        if bad != self.bad:
            self.member.say(f"{where}: the pseudo-gradient of rank(s) {bad} is not finite: left out of the round, "
                            f"the mean taken over the others" if bad else
                            f"{where}: every rank's pseudo-gradient is finite again")
            self.bad = bad


def flat_of(tree: Any) -> np.ndarray:
    """A tree of device values as one flat float32 vector on the host (what a row carries; `tree_of` undoes it)."""
    return np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(jax.device_get(tree))])


def tree_of(flat: np.ndarray, treedef: Any, shapes: list[tuple]) -> Any:
    """A flat vector of values as the parameters' tree."""
    leaves = np.split(flat, np.cumsum([int(np.prod(s)) for s in shapes])[:-1])
    return jax.tree.unflatten(treedef, [x.reshape(s) for x, s in zip(leaves, shapes)])


class Replicas:
    """What the host-driven rounds of one elastic worker share (the timed rounds of
    jaxdp/elastic/timed.py, the overlapped ones of jaxdp/elastic/overlap.py): the run's pieces, the
    inner step over the worker's replicas (`layout["inner"]`: rounds.make_inner), the round end
    (`layout["ends"]`), per-device rows of a value, the view of the state the inner step reads, and
    the round loop's settings (jaxdp/loop/rounds.py sets `steps`, `stopping`, `local_rows`)."""

    def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, member: Any,
                 shard_data: Callable[[int, int], Any], *, spec: SyncSpec, stateful: bool = False,
                 grad_accum: int = 1):
        self.mesh, self.member, self.shard_data, self.tx, self.spec = mesh, member, shard_data, tx, spec
        self.axis, self.n = data_axes(mesh), mesh.size
        self.local_grads = _accumulated(_local_grads_fn(loss_fn, stateful, self.axis), grad_accum)
        self.outer = default_outer(spec.outer_tx)
        self.steps: int | None = None  # --steps: no stream is read past it
        self.stopping: Callable[[], bool] = lambda: False  # a stop signal arrived
        self.on_stop: Callable[[], Any] = member.ask_stop
        self.local_rows: int | None = None  # each worker's rows of a global batch
        self.absent: set[int] = set()  # the ranks the last round's end did not count (the loop names no one idle)
        self.layout: dict[str, Any] = {}

    def _build(self, state: TrainState, keys: list[str], at_of: Callable[[TrainState], int], apply: Callable,
               **programs: Any) -> None:
        """The layout every round reads: the inner step, `apply` compiled (donating the state), the
        parameters' shapes and zeros, the round end over rows of `keys`; and `programs`."""
        leaves = jax.tree.leaves(state.params)
        self.layout.update(
            inner=make_inner(self.local_grads, self.tx, self.mesh),
            apply=jax.jit(apply, out_shardings=jax.tree.map(lambda x: x.sharding, state), donate_argnums=0),
            treedef=jax.tree.structure(state.params), shapes=[x.shape for x in leaves],
            zeros=replicate(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state.params), self.mesh),
            rows=NamedSharding(self.mesh, P(self.axis)),
            ends=RoundEnd(self.member, self.spec.codec, sum(int(np.prod(x.shape)) for x in leaves), keys, at_of),
            **programs)
        self.wire = self.layout["ends"].wire()

    def _mean(self, mean: np.ndarray | None) -> Any:
        """A round's mean (flat, on the host) as the parameters' tree on the devices; None: zeros."""
        layout = self.layout
        return layout["zeros"] if mean is None else replicate(tree_of(mean, layout["treedef"], layout["shapes"]),
                                                              self.mesh)

    def _inner(self, rows: Any, view: TrainState, position: jax.Array, loss_sum: jax.Array, batch: Any) -> Any:
        return self.layout["inner"](rows, view, position, loss_sum, batch)

    def by_process(self, values: Any) -> list[int]:
        """A round's per-rank figures (steps, positions) as the round loop reads them: one per worker."""
        return [int(v) for v in values]

    def _rows(self, value: Any) -> jax.Array:
        """`value` on each of this worker's devices, as per-device rows."""
        host = np.full(self.n, value, np.int32 if isinstance(value, int) else np.float32)
        return jax.make_array_from_callback(host.shape, self.layout["rows"], lambda index: host[index])

    def _view(self, state: TrainState) -> TrainState:
        """What the inner step reads besides the rows (model state, rng: this worker's own dropout keys)."""
        view = state.replace(params=(), opt_state=(), sync=state.sync.replace(per_device={}, shared={}))
        return view.replace(rng=jax.random.fold_in(view.rng, self.member.rank))

    def close(self) -> None:
        pass

    @classmethod
    def make(cls, loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, member: Any,
             shard_data: Callable[[int, int], Any], *, spec: SyncSpec, grad_norm: bool = False, **options: Any
             ) -> TrainStep:
        """The run's step object: not called step by step (the round loop, jaxdp/loop/rounds.py, runs
        `made.rounds`), it carries the rounds, their warm-up (compiled before the worker joins) and their
        close. `grad_norm` is not read: the inner step's metrics are the loss alone, as in
        jaxdp/step/rounds.py."""
        del grad_norm
        rounds = cls(loss_fn, tx, mesh, member, shard_data, spec=spec, **options)

        def step(state: TrainState, batch: Any) -> Any:
            raise TypeError("rounds across elastic workers run in rounds (jaxdp/loop/rounds.py), not step by step")

        made = TrainStep(step, None, tx, spec, rounds.local_grads)
        made.rounds, made.warm_up, made.close = rounds, rounds.warm_up, rounds.close
        return made


def make_round_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, member: Any,
                    shard_data: Callable[[int, int], Batch], *, spec: SyncSpec, stateful: bool = False,
                    grad_accum: int = 1, grad_norm: bool = False) -> TrainStep:
    """The step of local steps across elastic workers: `sync_every` inner steps on each of this
    worker's devices, then the pseudo-gradients' exchange described above. `strategy` sums the
    pseudo-gradient over this worker's devices (psum or the ring); `compression` codes each worker's
    row (bf16, int8, int4). `shard_data` is not read: a lost worker's steps are not redone."""

    del shard_data
    axis, n, rank = data_axes(mesh), mesh.size, member.rank
    local_grads = _accumulated(_local_grads_fn(loss_fn, stateful, axis), grad_accum)
    sync_every = spec.sync_every
    codec, total, outer = spec.codec, spec.collective.sum, default_outer(spec.outer_tx)
    layout: dict[str, Any] = {}

    def device_inner(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        mine = jax.tree.map(lambda x: x[0], state.sync.per_device[STATE_NAME])  # this device's replica and inner state
        new, metrics, model_state = replica_step(local_grads, tx, state, mine, batch, grad_norm)
        sync = state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: jax.tree.map(lambda x: x[None], new)})
        metrics = jax.tree.map(lambda x: jax.lax.pmean(x, axis), metrics)  # the worker's devices' mean
        return state.replace(step=state.step + 1, model_state=model_state, sync=sync), metrics

    def device_delta(state: TrainState) -> Any:
        replica = jax.tree.map(lambda x: x[0], state.sync.per_device[STATE_NAME]["params"])
        return total(jax.tree.map(lambda g, r: g - r, state.params, replica), axis)  # summed over the devices

    def apply(state: TrainState, mean: Any) -> TrainState:
        params, kept = outer_step(outer, state, mean, jnp.bool_(True))
        rows = state.sync.per_device[STATE_NAME]
        rows = {"params": jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), params), "opt_state": rows["opt_state"]}
        sync = state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: rows},
                                  shared={**state.sync.shared, OUTER_NAME: (kept,)})
        return state.replace(params=params, sync=sync)

    def build(state: TrainState, batch: Batch) -> None:
        specs = state_specs(state, axis)
        shardings = jax.tree.map(lambda x: x.sharding, state)
        layout["inner"] = jax.jit(jax.shard_map(device_inner, mesh=mesh, in_specs=(specs, P(axis)),
                                                out_specs=(specs, P()), check_vma=False), donate_argnums=0)
        layout["delta"] = jax.jit(jax.shard_map(device_delta, mesh=mesh, in_specs=(specs,), out_specs=P(),
                                                check_vma=False))
        layout["apply"] = jax.jit(apply, out_shardings=shardings, donate_argnums=0)
        leaves = jax.tree.leaves(state.params)
        keys = sorted(jax.eval_shape(layout["inner"], state, batch)[1])  # the metrics, shared at rounds' ends
        ends = RoundEnd(member, codec, sum(int(np.prod(x.shape)) for x in leaves), keys, lambda s: int(jax.device_get(s.step)))
        layout.update(treedef=jax.tree.structure(state.params), shapes=[x.shape for x in leaves], ends=ends, keys=keys)
        layout["wire"] = ends.wire()
        # the metrics of a step between rounds' ends beside the inner step's own (made once, not each step)
        layout["between"] = {"synced": jnp.float32(0), "comm_bytes_per_step": jnp.float32(layout["wire"] / sync_every)}

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        if layout.get("skip"):  # healed past these steps: the state already holds them
            layout["skip"] -= 1
            return state, layout["metrics"]
        if "inner" not in layout:
            build(state, batch)
        at = step_number(state, layout)
        if member.fresh_quorum:  # the first call after settle: the run's start, or a round's end it healed at
            state = layout["ends"].exchange(state, at, None).state
            further = int(jax.device_get(state.step))
            if further > at and "metrics" in layout:
                layout["skip"] = further - at - 1
                return state, layout["metrics"]
            at = further
        state, metrics = layout["inner"](state, batch)
        metrics, done = {**metrics, **layout["between"]}, at + 1
        if done % sync_every == 0:
            delta = flat_of(layout["delta"](state))
            own = np.array([float(metrics[k]) for k in layout["keys"]], np.float64)
            try:
                end = layout["ends"].exchange(state, at + 1, delta, np.concatenate([[float(n)], own]))
            except HubGone as gone:  # the quorum is lost: the round ends with this worker alone, to be saved
                if gone.state is state and np.isfinite(delta).all():  # (the inner step gave up the loop's state)
                    gone.state = layout["apply"](state, replicate(tree_of(delta / np.float32(n), layout["treedef"],
                                                                          layout["shapes"]), mesh))
                raise
            state, healed, shared = end.state, end.healed, end.shared
            if end.mean is not None:  # the outer step with the rows' mean; every replica restarts from it
                state = layout["apply"](state, replicate(tree_of(end.mean, layout["treedef"], layout["shapes"]), mesh))
            # the round's metrics, every worker the same (what the loop's NaN guard reads: --metrics-at-sync)
            metrics = {**metrics, **{k: jnp.asarray(v, metrics[k].dtype) for k, v in zip(layout["keys"], shared)},
                       "synced": jnp.float32(1)}
            done = int(jax.device_get(state.step))
            if healed and done > at + 1:
                layout["skip"] = done - at - 1
                print(f"jaxdp: rank {rank} healed from step {at + 1} to {done} with a live worker's state",
                      file=sys.stderr, flush=True)
        layout["metrics"], layout["known"] = metrics, (state.step, done)  # (the skipped calls return this state)
        return state, metrics

    made = TrainStep(step, None, tx, spec, local_grads)

    def warm_up(state: TrainState, batch: Batch) -> None:
        build(state, batch)
        copy = jax.tree.map(jnp.copy, state)
        copy, _ = layout["inner"](copy, batch)
        jax.device_get(layout["delta"](copy))
        jax.block_until_ready(layout["apply"](copy, state.params))

    made.warm_up = warm_up
    return made
