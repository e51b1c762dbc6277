"""Host-driven rounds of local steps: workers at their own pace (`--sync-seconds S`), and rounds of
H steps whose average overlaps the next round (`--overlap`, `Overlapped`, at the end).

    result = jaxdp.fit(loss_fn, params, tx, batch_at, steps=2000, sync=jaxdp.SyncOptions(
                       sync_seconds=2.0, outer_tx=optax.sgd(0.7, momentum=0.9, nesterov=True)))

With lockstep local steps (`--sync-every H`, jaxdp/step/local_sgd.py) every process takes H inner steps
per round, so a process with half the compute keeps the others idle for half of every round: the
run goes at the slowest process's pace. With `sync_seconds=S` every process takes as many inner
steps as it manages in S seconds of wall clock, on its own devices with no collective, then every
process joins one outer sync. A fast process does more steps per round instead of waiting.

The outer sync (one program over the whole mesh) averages the pseudo-gradients (global params -
replica) weighted by the examples each device processed in the round, n_d (every device of a
process has the same n, the process's steps, and every device holds the same rows per step):

    mean = sum_d n_d * (global - replica_d) / sum_d n_d

then the outer optimizer applies `mean` to the global parameters and every replica restarts from
them. Why by examples: each pseudo-gradient summarises the gradients of the examples its device
saw, so weighting by examples counts every example once, as the synchronous mean of a global batch
does (FedAvg weights its clients by their example counts for the same reason); an equal-weight mean
would let a slow process's few examples count as much as a fast one's many. Limits: a process that
takes more steps also moves further, so its pseudo-gradient is both longer and more heavily
weighted; with data that differ between processes (not the case with jaxdp's shards of one shuffled
dataset) the average leans toward the fast processes' data. FedNova's normalised averaging (divide
each pseudo-gradient by its step count first) removes that lean at the price of a different
effective learning rate; it is not what this module does. Time-bounded rounds also make the number
of steps, and so the result, depend on timing: two runs of the same command differ. The steps
each process took are recorded (the metrics file's "round_steps_by_process", and the positions in
every checkpoint), and `sync_seconds` may be a schedule `(round, process) -> steps` that replays
them exactly.

State (`state.sync`, checkpointed with the rest): the replicas and inner optimizer states as for
local steps (`per_device["local_sgd"]`), the outer optimizer's state (`shared["outer"]`, one
fragment), and `per_device["paced"]["position"]`: the inner steps each device's process has taken
so far, its data position. Process p's k-th inner step reads `data(k)`, this process's rows of
global batch k, a pure function of (seed, process, k): a resumed run continues every process from
its recorded position, so resume is exact given the positions (and, with a time bound, as exact as
the timing allows). `shared["paced"]["round"]` counts the outer syncs. `state.step` is the training
done so far in global batches: floor(sum of the positions / processes), so `steps`, `save_every`,
`eval_every` and the logs count examples as a lockstep run does; a run ends at the first sync where
it reaches `steps` and every process's position has. No round takes a process's position past
`steps` (`Rounds.steps`), so neither does `state.step`, except where a run resumes with a `steps` that
a position had passed before the save: that process then takes no steps while the others read on to
`steps` (jaxdp/loop/rounds.py), and `state.step` ends past it. A time-bound round takes at least one
step per process, however short, and ends early, after the step in flight, at a stop signal (`Rounds.stopping`): SIGTERM's save comes within
a step, not at the end of the round.

A process that takes no inner step in a round (a schedule's 0) has weight 0 and is named on the
console and in the metrics file ("no_progress") unless it has reached `steps`; the others do not
wait for its steps, only for it to reach the sync. A schedule round that gives no process a step
is refused (InputError): it would train nothing. Before every save the replicas (and, with
overlap, the delta in flight) are checked for NaN / Inf (`check_in_flight`): the guard's loss is
a round late, and a checkpoint holds them. One that never reaches the sync is named by the
heartbeat (jaxdp/cluster/heartbeat.py, which counts rounds here, not steps) after `--stall-timeout`.

Scope: an in-graph strategy (psum, ring) and its compression (not "auto"), one fragment, no ZeRO-1,
a flat mesh (`--hierarchy flat`), and models without float model state (BatchNorm statistics would
differ per process between syncs; dropout's keys are fine): the rules of jaxdp/sync/rules.py, which
fit asks.

Overlap (`overlap=True` with `sync_every=H`, `Overlapped`): every process takes H inner steps per
round, and round k's average (`make_reduce`, the only collective) runs on a thread of its own while
round k + 1 trains; then `make_apply` (no collective) takes the outer step with it and restarts
every replica from the new global parameters minus its own delta of round k + 1, which is the next
delta in flight (`per_device["overlap"]`, checkpointed, so a resume with an average in flight is
exact). The same scope as above, one round of delay, and the end of the run applies the last
average. Why a thread works, and what it needs of the CPU backend: docs/slow-links.md, "Overlap".
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.errors import InputError
from jaxdp.step.round_programs import (  # noqa: F401 (PACE_NAME, rows_to, make_sync: importable from here too)
    PACE_NAME, local_mesh, make_inner, make_sync, outer_step, replicated_to, rows_to, slot_specs,
)
from jaxdp.mesh import data_axes
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME, default_outer
from jaxdp.step.state import TrainState
from jaxdp.sync.collectives import as_collective
from jaxdp.sync.codecs.base import only as codec_slot
from jaxdp.sync.codecs.plain import NoCompression
from jaxdp.sync.exchange import codec as codec_of, make_exchange

OVERLAP_NAME = "overlap"  # --overlap: per_device[OVERLAP_NAME] = {"delta": params rows, "steps", "loss_sum": rows}

Pace = float | Callable[[int, int], int]


def check(pace: Any, mesh: Mesh | None) -> None:
    """InputError unless `pace` is a positive number of seconds or a schedule, on a flat mesh (None:
    any mesh)."""
    if callable(pace):
        pass
    elif isinstance(pace, bool) or not isinstance(pace, (int, float)) or not math.isfinite(pace) or pace <= 0:
        raise InputError(f"sync_seconds must be a positive number of seconds (or a schedule (round, process) -> "
                         f"steps), got {pace!r}", setting="sync_seconds")
    if mesh is not None and not isinstance(data_axes(mesh), str):
        raise InputError(f"sync_seconds needs a mesh with one data axis, got axes {tuple(mesh.axis_names)}; "
                         f"with several devices per process use --hierarchy flat", setting="sync_seconds")


def init_sync(mesh: Mesh) -> tuple[dict, dict]:
    """(per_device, shared) entries of a new state: every position 0, round 0."""
    rows = NamedSharding(mesh, P(data_axes(mesh)))
    zeros = np.zeros(mesh.size, np.int32)
    position = jax.make_array_from_callback(zeros.shape, rows, lambda index: zeros[index])
    round_ = jax.device_put(np.int32(0), NamedSharding(mesh, P()))
    return {PACE_NAME: {"position": position}}, {PACE_NAME: {"round": round_}}


def is_paced(state: Any) -> bool:
    return PACE_NAME in state.sync.per_device


# ---------------------------------------------------------------------------------------------
# The rounds (what jaxdp.fit's round loop, jaxdp/loop/rounds.py, runs with sync_seconds)
# ---------------------------------------------------------------------------------------------


def process_rows(mesh: Mesh, rows_per_step: int | None) -> tuple[dict[int, int], int | None]:
    """({process: the index of its first device in the mesh's order}, each process's rows of a
    global batch of `rows_per_step`, None if that is not known)."""
    owners = [d.process_index for d in mesh.devices.flat]
    first_row = {p: owners.index(p) for p in sorted(set(owners))}
    return first_row, rows_per_step // len(first_row) if rows_per_step else None


def timed_inner(inner: Callable, carry: tuple, batch_at: Callable[[int], Any], *, budget: float | None,
                planned: int | None, room: int | None, warm: bool, stopping: Callable[[], bool],
                started: float | None = None) -> tuple[tuple, int, float]:
    """A round's inner steps, `carry = inner(*carry, batch_at(k))` for k = 0, 1, ..., until `room` or the
    schedule (`planned` steps) or, with neither, the time (`budget` seconds, at least one step) or a stop
    signal (`stopping`) says stop. Returns (the carry, the steps taken, when the round's clock started:
    after the first step's compilation when not `warm`). The carry's last element is what the host waits
    on (one step in flight: it waits for the one before, then reads the clock)."""
    started, taken, previous = time.perf_counter() if started is None else started, 0, None
    while True:
        if (room is not None and taken >= room) or (planned is not None and taken >= planned):
            break
        if planned is None and taken and (time.perf_counter() - started >= budget or stopping()):
            break
        carry = inner(*carry, batch_at(taken))
        taken += 1
        if budget is not None:
            if previous is not None or not warm:
                jax.block_until_ready(previous if previous is not None else carry[-1])
            if not warm and taken == 1:
                started, warm = time.perf_counter(), True  # compiled: the round's time starts now
            previous = carry[-1]
    return carry, taken, started


class Rounds:
    """The inner and sync programs of one run, and one round of them (`round`); the loop that
    runs them round after round is jaxdp/loop/rounds.py."""

    def __init__(self, local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, strategy: Any,
                 compression: Any, outer_tx: Any, pace: Pace, data: Callable[[int], Any], rows_per_step: int | None):
        check(pace, mesh)
        self.mesh, self.pace, self.data = mesh, pace, data
        self.local = local_mesh(mesh)
        self.inner = make_inner(local_grads, tx, self.local)
        self.sync = make_sync(mesh, strategy, compression, outer_tx)
        self.process = jax.process_index()
        self.first_row, self.local_rows = process_rows(mesh, rows_per_step)
        self.steps: int | None = None  # --steps: no process's position goes past it (`train` sets it)
        self.stopping: Callable[[], bool] = lambda: False  # a stop signal arrived: end a time-bound round now

    def _batch(self, position: int) -> Any:
        sharding = NamedSharding(self.local, P(data_axes(self.local)))
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), self.data(position))

    def round(self, state: TrainState, round_index: int, warm: bool, limit: int | None = None
              ) -> tuple[TrainState, dict, int, float]:
        """One round: inner steps until the time (or the schedule, or `limit`) says stop, then the
        sync. Returns (state, metrics on device, this process's steps, the round's seconds). With
        `warm` False, the first step's compilation is left out of the time bound."""
        local = self.local
        rows = rows_to(state.sync.per_device[STATE_NAME], local)
        position = rows_to(state.sync.per_device[PACE_NAME]["position"], local)
        view = replicated_to(state.replace(params=(), opt_state=(), sync=state.sync.replace(per_device={}, shared={})),
                             local)
        view = view.replace(rng=jax.random.fold_in(view.rng, self.process))  # each process's own dropout keys
        at = int(np.asarray(position.addressable_shards[0].data)[0])
        loss_sum = jnp.zeros(local.size, jnp.float32, device=NamedSharding(local, P(data_axes(local))))
        started = time.perf_counter()
        budget = None if callable(self.pace) else float(self.pace)
        planned = int(self.pace(round_index, self.process)) if callable(self.pace) else None
        if planned is not None and not any(self.pace(round_index, p) for p in self.first_row):
            raise InputError(f"the sync_seconds schedule gives no process a step in round {round_index}: such a "
                             f"round trains nothing, and a run of them never ends; give some process a step",
                             setting="sync_seconds")
        if limit is not None and planned is None:  # (a schedule is followed as it is: it replays a run)
            planned, budget = limit, None
        room = None if self.steps is None else max(self.steps - at, 0)  # never past --steps
        (rows, position, loss_sum), taken, started = timed_inner(
            lambda rows, position, loss_sum, batch: self.inner(rows, view, position, loss_sum, batch), (rows, position, loss_sum),
            lambda k: self._batch(at + k), budget=budget, planned=planned, room=room, warm=warm,
            stopping=self.stopping, started=started)
        steps = jnp.full(local.size, taken, jnp.int32, device=NamedSharding(local, P(data_axes(local))))
        sync = state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: rows_to(rows, self.mesh),
                                              PACE_NAME: {"position": rows_to(position, self.mesh)}})
        state, metrics = self.sync(state.replace(sync=sync), rows_to(steps, self.mesh), rows_to(loss_sum, self.mesh))
        return state, metrics, taken, time.perf_counter() - started

    def last_round_limit(self, last: list[int] | None, remaining: int) -> int | None:
        return last_round_share(last, remaining, self.process)

    def by_process(self, steps_by_device: Any) -> list[int]:
        values = np.asarray(steps_by_device)
        return [int(values[row]) for row in self.first_row.values()]


def last_round_share(last: list[int] | None, remaining: int, index: int) -> int | None:
    """Process (or worker) `index`'s steps in what will be the last round, so the run ends near
    `steps` rather than up to a round past it: if they took `last` steps in the previous round and
    that many would finish the run, each takes its share of what remains. Every process computes the
    same plan from the same numbers. None: not the last round (or no previous round to go by)."""
    if not last or sum(last) == 0 or sum(last) < remaining * len(last):
        return None
    return math.ceil(last[index] * remaining * len(last) / sum(last))


def check_in_flight(state: TrainState, step: int) -> None:
    """Raise jaxdp.metrics.Diverged if the replicas, or (--overlap) the delta in flight, hold NaN or
    infinite values. The guard checks the loss of a round that landed; a checkpoint also holds what
    has not landed yet, and a resume would average it at once. So before every save."""
    from jaxdp.metrics import Diverged
    from jaxdp.step.delayed import non_finite

    held = {k: v for k, v in state.sync.per_device.items() if k in (STATE_NAME, OVERLAP_NAME)}
    value = float(jax.device_get(non_finite(held)))  # host sync point
    if value:
        raise Diverged(step, "the parameters in flight (the replicas of the round)", value)


# ---------------------------------------------------------------------------------------------
# Overlap (--overlap with --sync-every H): round k's average runs while round k + 1 trains
# ---------------------------------------------------------------------------------------------


class FixedSteps:
    """The pace of an overlapped `--sync-every H` run: H inner steps per round, every process (the
    last round: what is left of `steps`)."""

    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, round_index: int, process: int) -> int:
        return self.steps


def init_overlap(params: Any, mesh: Mesh) -> dict:
    """per_device[OVERLAP_NAME] of a new state: nothing in flight (no delta, 0 steps, 0 loss)."""
    rows = NamedSharding(mesh, P(data_axes(mesh)))

    def zeros(shape: tuple, dtype: Any) -> jax.Array:
        host = np.zeros((mesh.size, *shape), dtype)
        return jax.make_array_from_callback(host.shape, rows, lambda index: host[index])

    return {OVERLAP_NAME: {"delta": jax.tree.map(lambda x: zeros(x.shape, x.dtype), params),
                           "steps": zeros((), np.int32), "loss_sum": zeros((), np.float32)}}


def is_overlapped(state: Any) -> bool:
    return OVERLAP_NAME in state.sync.per_device


def make_reduce(mesh: Mesh, strategy: Any, compression: Any) -> Callable:
    """`(coded, delta, steps, loss_sum, step) -> (mean, total, coded, metrics)` over the whole mesh:
    the mean of the round's pseudo-gradients through the strategy (and codec), the loss riding in
    the same collective, and nothing else: the overlapped run's only collective. Every device took
    the same H steps, so unlike `make_sync` no weights need summing first. `coded` is the codec's
    slot of `state.sync` (a SyncState holding only it), returned updated."""
    axis, n = data_axes(mesh), mesh.size
    exchange = make_exchange(as_collective(strategy), axis, n, codec_of(compression) or NoCompression(), pseudo_gradient=True)

    def device_reduce(coded: Any, delta: Any, steps: jax.Array, loss_sum: jax.Array, step: jax.Array):
        total = steps[0].astype(jnp.float32) * n  # every device took the same steps: all weights are 1
        mean, out, _, coded, extra = exchange.mean(jax.tree.map(lambda d: d[0], delta), {"loss_sum": loss_sum[0]}, {},
                                                   coded, step)
        by_device = jnp.full(n, steps[0])
        metrics = {"loss": out["loss_sum"] * n / jnp.maximum(total, 1.0), "steps_by_device": by_device, **extra}
        return mean, total, coded, metrics

    def mapped(coded: Any, delta: Any, steps: jax.Array, loss_sum: jax.Array, step: jax.Array):
        coded_specs = slot_specs(coded, axis)
        return jax.shard_map(device_reduce, mesh=mesh, in_specs=(coded_specs, P(axis), P(axis), P(axis), P()),
                             out_specs=(P(), P(), coded_specs, P()), check_vma=False)(coded, delta, steps, loss_sum, step)

    return jax.jit(mapped)


def make_apply(mesh: Mesh, outer_tx: optax.GradientTransformation | None) -> Callable:
    """`(state, mean, total, coded, anchor, steps, loss_sum) -> state` over the whole mesh, with no
    collective: the outer step with the mean of the round before (skipped when `total` is 0: nothing
    was in flight), then every replica (the state's rows, as the round left them) restarts from the
    new global parameters plus its own progress of the round (replica - `anchor`, not averaged yet),
    which becomes the delta in flight. The step is the data position (every process takes the same
    steps)."""
    from jaxdp.step.train_step import state_specs

    axis = data_axes(mesh)
    outer_tx = default_outer(outer_tx)

    def device_apply(state: TrainState, mean: Any, total: jax.Array, coded: Any, anchor: Any,
                     steps: jax.Array, loss_sum: jax.Array) -> TrainState:
        rows = state.sync.per_device[STATE_NAME]  # the replicas as the round left them
        params, outer = outer_step(outer_tx, state, mean, total > 0)
        mine, start = jax.tree.map(lambda x: x[0], rows["params"]), jax.tree.map(lambda x: x[0], anchor)
        delta = jax.tree.map(lambda a, r: a - r, start, mine)  # this round's pseudo-gradient, in flight
        replica = jax.tree.map(lambda g, d: g - d, params, delta)
        position = state.sync.per_device[PACE_NAME]["position"]
        sync = state.sync.replace(
            per_device={**state.sync.per_device, **coded.per_device,
                        STATE_NAME: {"params": jax.tree.map(lambda x: x[None], replica), "opt_state": rows["opt_state"]},
                        OVERLAP_NAME: {"delta": jax.tree.map(lambda x: x[None], delta), "steps": steps,
                                       "loss_sum": loss_sum}},
            shared={**state.sync.shared, **coded.shared, OUTER_NAME: (outer,),
                    PACE_NAME: {"round": state.sync.shared[PACE_NAME]["round"] + 1}})
        return state.replace(step=position[0], params=params, sync=sync)

    def mapped(state: TrainState, mean: Any, total: jax.Array, coded: Any, anchor: Any,
               steps: jax.Array, loss_sum: jax.Array) -> TrainState:
        specs = state_specs(state, axis)
        coded_specs = slot_specs(coded, axis)
        return jax.shard_map(device_apply, mesh=mesh,
                             in_specs=(specs, P(), P(), coded_specs, P(axis), P(axis), P(axis)),
                             out_specs=specs, check_vma=False)(state, mean, total, coded, anchor, steps, loss_sum)

    return jax.jit(mapped, donate_argnums=0)


class InFlight:
    """What an overlapped run's rounds share, with replicas (`Overlapped` below) or with each worker's
    state cut over its devices (jaxdp/step/hsdp_overlap.py): the thread the average runs on, the
    start of the average of the delta a state holds (`self.reduce(coded, delta, steps, loss_sum,
    step)`, the codec's slot if `self.coded`), the last round's length and the steps by process."""

    thread: Any
    reduce: Callable
    coded: bool
    pace: FixedSteps
    first_row: dict[int, int]

    def close(self) -> None:
        self.thread.shutdown(wait=True)

    def _coded(self, state: TrainState) -> Any:
        return codec_slot(state.sync) if self.coded else state.sync.replace(per_device={}, shared={})

    def _in_flight(self, state: TrainState) -> Any:
        """Start averaging the delta the state holds (on the thread); None if it holds none."""
        flight = state.sync.per_device[OVERLAP_NAME]
        if not int(np.asarray(flight["steps"].addressable_shards[0].data)[0]):
            return None
        args = (self._coded(state), flight["delta"], flight["steps"], flight["loss_sum"], state.step)

        def average() -> Any:
            return jax.block_until_ready(self.reduce(*args))

        return self.thread.submit(average)

    def last_round_limit(self, last: list[int] | None, remaining: int) -> int | None:
        return remaining if remaining < self.pace.steps else None

    by_process = Rounds.by_process


class Overlapped(InFlight, Rounds):
    """Rounds of H steps whose average is applied one round late (`--overlap`, see the module
    docstring): round k + 1 trains while round k's pseudo-gradients are averaged. The average is
    the one collective program, dispatched from a thread of its own: on JAX's CPU client a program
    runs on the thread that dispatches it, so from the training thread it would wait for the inner
    steps (and they for it); from a second thread the two run at the same time, given two CPU
    workers (a one-core process: jaxdp.cluster.runtime.two_cpu_workers; measured in docs/slow-links.md).
    The inner steps and the apply run no collective, so no two collective programs are ever in
    flight at once, and every process dispatches them in the same order."""

    def __init__(self, local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, strategy: Any,
                 compression: Any, outer_tx: Any, every: int, data: Callable[[int], Any], rows_per_step: int | None):
        super().__init__(local_grads, tx, mesh, strategy, compression, outer_tx, FixedSteps(every), data, rows_per_step)
        import concurrent.futures

        self.reduce = make_reduce(mesh, strategy, compression)
        self.apply = make_apply(mesh, outer_tx)
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdp-overlap")
        self.coded = codec_of(compression) is not None

    def _landed(self, state: TrainState, pending: Any) -> tuple[Any, Any, Any, dict]:
        """The average in flight, once it has landed; with none in flight, a zero one (no outer step)."""
        if pending is not None:
            mean, total, coded, metrics = pending.result()
            return mean, total, coded, {**metrics, "landed": True}
        nothing = state.sync.replace(per_device={}, shared={})  # (the codec's slot stays as it is)
        zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state.params)
        return zeros, np.float32(0.0), nothing, {"landed": False}

    def round(self, state: TrainState, round_index: int, warm: bool, limit: int | None = None
              ) -> tuple[TrainState, dict, int, float]:
        """Average the delta in flight while this round's H (or `limit`) inner steps train, then
        apply it. The metrics are the round before's (its loss is known now; "landed" False: none)."""
        pending = self._in_flight(state)
        local = self.local
        anchor = jax.tree.map(jnp.copy, state.sync.per_device[STATE_NAME]["params"])  # (the inner steps donate the rows)
        rows = rows_to(state.sync.per_device[STATE_NAME], local)
        position = rows_to(state.sync.per_device[PACE_NAME]["position"], local)
        view = replicated_to(state.replace(params=(), opt_state=(), sync=state.sync.replace(per_device={}, shared={})),
                             local)
        view = view.replace(rng=jax.random.fold_in(view.rng, self.process))
        at = int(np.asarray(position.addressable_shards[0].data)[0])
        loss_sum = jnp.zeros(local.size, jnp.float32, device=NamedSharding(local, P(data_axes(local))))
        started = time.perf_counter()
        planned = self.pace.steps if limit is None else min(self.pace.steps, limit)
        for taken in range(planned):
            rows, position, loss_sum = self.inner(rows, view, position, loss_sum, self._batch(at + taken))
        steps = jnp.full(local.size, planned, jnp.int32, device=NamedSharding(local, P(data_axes(local))))
        jax.block_until_ready(loss_sum)
        mean, total, coded, metrics = self._landed(state, pending)
        sync = state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: rows_to(rows, self.mesh),
                                              PACE_NAME: {"position": rows_to(position, self.mesh)}})
        state = self.apply(state.replace(sync=sync), mean, total, coded, anchor, rows_to(steps, self.mesh),
                           rows_to(loss_sum, self.mesh))
        return state, {**metrics, "round": state.sync.shared[PACE_NAME]["round"]}, planned, time.perf_counter() - started

    def flush(self, state: TrainState) -> TrainState:
        """The end of the run: average the last round's delta and apply it with no new progress, so
        every replica equals the global parameters and nothing is in flight."""
        pending = self._in_flight(state)
        if pending is None:
            return state
        mean, total, coded, _ = pending.result()
        anchor = jax.tree.map(jnp.copy, state.sync.per_device[STATE_NAME]["params"])  # progress 0
        zero = jax.jit(lambda x: x * 0)
        flight = state.sync.per_device[OVERLAP_NAME]
        return self.apply(state, mean, total, coded, anchor, zero(flight["steps"]), zero(flight["loss_sum"]))
