"""Host-driven rounds of local steps: workers at their own pace (`--sync-seconds S`), and the programs
every round is made of (an inner step on this process's devices, the outer sync over the whole mesh,
and the moves of per-device rows between the two: no copies, the same buffers).

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

Overlapped rounds of H steps (`--overlap`) are jaxdp/step/overlap.py's, on these rounds' programs.
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
from jaxdp.mesh import auto_axes, data_axes, state_specs
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME, default_outer, replica_step
from jaxdp.step.state import TrainState
from jaxdp.sync.collectives import as_collective
from jaxdp.sync.codecs.plain import NoCompression
from jaxdp.sync.exchange import codec as codec_of, leaf_names, make_exchange

PACE_NAME = "paced"  # per_device[PACE_NAME] = {"position": int32 rows}; shared[PACE_NAME] = {"round": int32}


# ---------------------------------------------------------------------------------------------
# Moving rows between the whole mesh and this process's devices (no copies: the same buffers)
# ---------------------------------------------------------------------------------------------


def local_mesh(mesh: Mesh) -> Mesh:
    """This process's devices of `mesh`, in the mesh's order, with the same axis name."""
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return Mesh(np.array(mine), (data_axes(mesh),), axis_types=auto_axes(1))


def _by_row(x: jax.Array) -> list[jax.Array]:
    return [s.data for s in sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)]


def rows_to(tree: Any, mesh: Mesh) -> Any:
    """Per-device rows (leading axis one per device) re-seated on `mesh` (the whole mesh or this
    process's devices): this process's rows, in order, become the rows on its devices there."""
    sharding = NamedSharding(mesh, P(data_axes(mesh)))
    return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
        (mesh.size, *x.shape[1:]), sharding, _by_row(x)), tree)


def replicated_to(tree: Any, mesh: Mesh) -> Any:
    """A replicated array's local copies as a replicated array of `mesh` (this process's devices)."""
    sharding = NamedSharding(mesh, P())

    def one(x: jax.Array) -> jax.Array:
        by_device = {s.device: s.data for s in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [by_device[d] for d in mesh.devices.flat])

    return jax.tree.map(one, tree)


# ---------------------------------------------------------------------------------------------
# The two programs: an inner step on this process's devices, the outer sync over the whole mesh
# ---------------------------------------------------------------------------------------------


def make_inner(local_grads: Callable, tx: optax.GradientTransformation, local: Mesh) -> Callable:
    """`(rows, view, position, loss_sum, batch) -> (rows, position, loss_sum)` over `local` (this
    process's devices), with no collective: each device's `tx` step on its replica. `view` is a
    replicated TrainState for the loss (model state, rng; params come from the rows, the step
    from the position, so dropout keys follow the data position)."""
    axis = data_axes(local)

    def device_inner(rows: Any, view: TrainState, position: jax.Array, loss_sum: jax.Array, batch: Any):
        new, metrics, _ = replica_step(local_grads, tx, view.replace(step=position[0]),
                                       jax.tree.map(lambda x: x[0], rows), batch)
        return jax.tree.map(lambda x: x[None], new), position + 1, loss_sum + metrics["loss"]

    mapped = jax.shard_map(device_inner, mesh=local, in_specs=(P(axis), P(), P(axis), P(axis), P(axis)),
                           out_specs=(P(axis), P(axis), P(axis)), check_vma=False)
    return jax.jit(mapped, donate_argnums=0)  # (not the position and loss: the host waits on the last ones)


def outer_step(outer_tx: optax.GradientTransformation, state: TrainState, mean: Any, moved: jax.Array
                ) -> tuple[Any, Any]:
    """(global params, outer state) after `outer_tx` applies `mean` to `state.params`, or both as
    they were unless `moved` (nobody stepped: momentum would still move the parameters)."""
    names = leaf_names(state.params)
    leaves, treedef = jax.tree.flatten(state.params)
    before, kept = dict(zip(names, leaves)), state.sync.shared[OUTER_NAME][0]
    updates, outer = outer_tx.update(dict(zip(names, jax.tree.leaves(mean))), kept, before)
    after = optax.apply_updates(before, updates)
    params = jax.tree.unflatten(treedef, [jnp.where(moved, after[k], before[k]) for k in names])
    return params, jax.tree.map(lambda new, old: jnp.where(moved, new, old), outer, kept)


def slot_specs(slot: Any, axis: Any) -> Any:
    """shard_map specs of a SyncState: its per-device rows split over `axis`, its shared part replicated."""
    return slot.replace(per_device=jax.tree.map(lambda _: P(axis), slot.per_device),
                        shared=jax.tree.map(lambda _: P(), slot.shared))


def make_sync(mesh: Mesh, strategy: Any, compression: Any, outer_tx: optax.GradientTransformation | None) -> Callable:
    """`(state, steps, loss_sum) -> (state, metrics)` over the whole mesh: the example-weighted mean
    of the pseudo-gradients through the strategy (and codec), the outer step (skipped when no
    device took a step), every replica reset to the new global parameters, `state.step` the
    positions' sum over processes. `steps` and `loss_sum` are per-device rows of the round."""
    axis, n = data_axes(mesh), mesh.size
    exchange = make_exchange(as_collective(strategy), axis, n, codec_of(compression) or NoCompression(), pseudo_gradient=True)
    outer_tx = default_outer(outer_tx)
    processes = len({d.process_index for d in mesh.devices.flat})

    def device_sync(state: TrainState, steps: jax.Array, loss_sum: jax.Array) -> tuple[TrainState, dict]:
        rows = state.sync.per_device[STATE_NAME]
        replica = jax.tree.map(lambda x: x[0], rows["params"])
        weight = steps[0].astype(jnp.float32)
        total = jax.lax.psum(weight, axis)
        share = weight * n / jnp.maximum(total, 1.0)  # so the exchange's mean is the weighted mean
        delta = jax.tree.map(lambda g, r: ((g - r) * share).astype(g.dtype), state.params, replica)
        mean, out, model_state, sync, extra = exchange.mean(delta, {"loss_sum": loss_sum[0]}, state.model_state,
                                                            state.sync, state.step)
        params, outer = outer_step(outer_tx, state, mean, total > 0)
        position = sync.per_device[PACE_NAME]["position"]
        rounds = sync.shared[PACE_NAME]["round"] + 1
        sync = sync.replace(
            per_device={**sync.per_device, STATE_NAME: {"params": jax.tree.map(lambda x: x[None], params),
                                                        "opt_state": rows["opt_state"]}},
            shared={**sync.shared, OUTER_NAME: (outer,), PACE_NAME: {"round": rounds}})
        # Every device of a process holds its position; with G devices each, the sum over devices is
        # G x the sum over processes, and n = G x processes.
        summed = jax.lax.psum(position[0], axis) * processes // n  # the positions' sum over processes
        done = (summed // processes).astype(jnp.int32)
        metrics = {"loss": out["loss_sum"] * n / jnp.maximum(total, 1.0), "round": rounds,
                   "steps_by_device": jax.lax.all_gather(steps[0], axis),
                   "positions_by_device": jax.lax.all_gather(position[0], axis), **extra}
        return state.replace(step=done, params=params, model_state=model_state, sync=sync), metrics

    def mapped(state: TrainState, steps: jax.Array, loss_sum: jax.Array) -> tuple[TrainState, dict]:
        specs = state_specs(state, axis)
        return jax.shard_map(device_sync, mesh=mesh, in_specs=(specs, P(axis), P(axis)), out_specs=(specs, P()),
                             check_vma=False)(state, steps, loss_sum)

    return jax.jit(mapped, donate_argnums=0)


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


class OwnRows:
    """A round's inner steps on this process's devices, a replica per device: the rows move from the
    whole mesh to the process's devices (`start`), train there with no collective (`train`), and move
    back with the round's steps and loss sums (`back`); the same buffers, no copies. What the timed
    rounds (`Rounds`) and the overlapped ones (jaxdp/step/overlap.py, `Replicas`) train with."""

    def __init__(self, local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, data: Callable[[int], Any]):
        self.mesh, self.data, self.local = mesh, data, local_mesh(mesh)
        self.inner = make_inner(local_grads, tx, self.local)
        self.process = jax.process_index()

    def start(self, state: TrainState) -> tuple[tuple, int]:
        """(the inner steps' carry on this process's devices: rows, positions, loss sums; the data position)."""
        local = self.local
        position = rows_to(state.sync.per_device[PACE_NAME]["position"], local)
        view = replicated_to(state.replace(params=(), opt_state=(), sync=state.sync.replace(per_device={}, shared={})),
                             local)
        self.view = view.replace(rng=jax.random.fold_in(view.rng, self.process))  # each process's own dropout keys
        loss_sum = jnp.zeros(local.size, jnp.float32, device=NamedSharding(local, P(data_axes(local))))
        carry = (rows_to(state.sync.per_device[STATE_NAME], local), position, loss_sum)
        return carry, int(np.asarray(position.addressable_shards[0].data)[0])

    def train(self, rows: Any, positions: jax.Array, loss_sum: jax.Array, position: int) -> tuple:
        """One inner step on global batch `position`'s rows of this process: the carry `start` made, then
        the next one."""
        sharding = NamedSharding(self.local, P(data_axes(self.local)))
        batch = jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), self.data(position))
        return self.inner(rows, self.view, positions, loss_sum, batch)

    def back(self, state: TrainState, carry: tuple, taken: int) -> tuple[TrainState, jax.Array, jax.Array]:
        """(`state` holding the trained rows and positions, the round's steps and loss sums as rows of the whole mesh)."""
        rows, position, loss_sum = carry
        steps = jnp.full(self.local.size, taken, jnp.int32, device=NamedSharding(self.local, P(data_axes(self.local))))
        sync = state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: rows_to(rows, self.mesh),
                                              PACE_NAME: {"position": rows_to(position, self.mesh)}})
        return state.replace(sync=sync), rows_to(steps, self.mesh), rows_to(loss_sum, self.mesh)


class Rounds:
    """The inner and sync programs of one run, and one round of them (`round`); the loop that
    runs them round after round is jaxdp/loop/rounds.py."""

    def __init__(self, local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, strategy: Any,
                 compression: Any, outer_tx: Any, pace: Pace, data: Callable[[int], Any], rows_per_step: int | None):
        check(pace, mesh)
        self.mesh, self.pace = mesh, pace
        self.rows = OwnRows(local_grads, tx, mesh, data)
        self.sync = make_sync(mesh, strategy, compression, outer_tx)
        self.process = jax.process_index()
        self.first_row, self.local_rows = process_rows(mesh, rows_per_step)
        self.steps: int | None = None  # --steps: no process's position goes past it (`train` sets it)
        self.stopping: Callable[[], bool] = lambda: False  # a stop signal arrived: end a time-bound round now

    def round(self, state: TrainState, round_index: int, warm: bool, limit: int | None = None
              ) -> tuple[TrainState, dict, int, float]:
        """One round: inner steps until the time (or the schedule, or `limit`) says stop, then the
        sync. Returns (state, metrics on device, this process's steps, the round's seconds). With
        `warm` False, the first step's compilation is left out of the time bound."""
        carry, at = self.rows.start(state)
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
        carry, taken, started = timed_inner(self.rows.train, carry, lambda k: at + k, budget=budget, planned=planned,
                                            room=room, warm=warm, stopping=self.stopping, started=started)
        state, steps, loss_sum = self.rows.back(state, carry, taken)
        state, metrics = self.sync(state, steps, loss_sum)
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
    from jaxdp.sync.exchange import non_finite

    held = {k: v for k, v in state.sync.per_device.items() if k in (STATE_NAME, OVERLAP_NAME)}
    value = float(jax.device_get(non_finite(held)))  # host sync point
    if value:
        raise Diverged(step, "the parameters in flight (the replicas of the round)", value)
