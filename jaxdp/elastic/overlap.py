"""Overlapped rounds across the workers of an elastic run (`--sync-every H --overlap`): round
k's exchange of pseudo-gradients runs on a thread of its own while round k + 1 trains, and its average is
applied one round late, as in one JAX program's overlapped rounds (jaxdp/step/overlap.py, `Overlapped`,
whose update rule this is). Undisturbed, the final parameters equal a one-process `--overlap` run's over
as many devices, bit for bit (tests/test_elastic_ft_overlap.py).

A round, on each worker:

1. The exchange of the pseudo-gradient in flight (round k's) starts on the thread: the round end of
   jaxdp/elastic/rounds.py (`RoundEnd`: a quorum, one all-gather of one row per worker, the
   commit, the rows added in rank order on the host), so a worker lost in it is left out and the mean is
   taken over the others' rows, weighted by the replicas counted; a non-finite row is left out and named.
2. Meanwhile each device trains H inner steps on its replica (its shard of global batches, by rank, as
   in the fixed rounds), with no collective.
3. When the average has landed: the outer step with it, and every replica restarts from the new global
   parameters minus its own progress of round k + 1 (anchor - replica), which is the next row in flight.
   That row is host memory of this worker (beside its codec's error feedback), not part of the state.

Membership:
- *A joiner* (new, restarted or stalled worker) is behind at the quorum of a live worker's exchange. It
  gets that worker's state as it stood when the exchange started (a copy of the replicas taken then,
  since the inner steps give their buffers up while the engine's thread (torchft's) may still read them), listens to
  the exchange, trains its round from that state and applies the average at the round's end, as the
  live workers do: every worker leaves the round with the same global parameters. A worker healed by an
  exchange it started itself on the thread (it was left out while stalled) trains that round again from
  the state it was given.
- *A lost quorum* (fewer than --min-workers for --quorum-timeout): the survivor applies its own row in
  flight and then its round's progress, alone, and saves that state (exit 75).

What a checkpoint holds: what every worker agrees on. The rows in flight are each worker's own, and the
lead's checkpoint cannot hold the others', so a save in the middle of a run holds the global parameters
of the last average that landed, every replica equal to them, and the step of the round in flight's
start (`held`): a resume trains that round again, and no example is counted twice. A stop signal or the
run's end first averages the rows in flight (`flush`, every worker at the same round: the stop is asked
in a row), so what they save loses nothing.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from jaxdp.elastic.hub import HubGone
from jaxdp.mesh import replicate, shard_batch, state_specs
from jaxdp.elastic.timed import round_of
from jaxdp.elastic.rounds import Ended, Replicas, flat_of
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME
from jaxdp.step.rounds import PACE_NAME, outer_step, timed_inner
from jaxdp.step.state import TrainState
from jaxdp.sync.spec import SyncSpec

KEYS = ["loss", "steps"]  # a row's scalars: the worker's mean loss of the round, and its steps


def init_sync() -> dict:
    """shared[PACE_NAME] of a new state: round 0 (the step is the data position: every worker takes H)."""
    return {PACE_NAME: {"round": np.int32(0)}}


def step_of(state: TrainState) -> int:
    """What the quorum compares: the step (every live worker's is the same at a round's start)."""
    return int(jax.device_get(state.step))


class OverlappedRounds(Replicas):
    """The overlapped rounds of one worker; `round` is what the round loop (jaxdp/loop/rounds.py) runs,
    `flush` applies the rows in flight (a stop, the run's end), `held` is what a save holds."""

    flush_at_stop = True  # (the round loop: every worker stops at the same round, and averages first)

    def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, member: Any,
                 shard_data: Callable[[int, int], Any], *, spec: SyncSpec, stateful: bool = False,
                 grad_accum: int = 1):
        super().__init__(loss_fn, tx, mesh, member, shard_data, spec=spec, stateful=stateful, grad_accum=grad_accum)
        self.every = spec.sync_every
        self.flight: tuple[np.ndarray, np.ndarray] | None = None  # this worker's row in flight: (values, head)
        self.done_in_flight = 0  # the steps of the round in flight (what `held` rewinds)
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdp-ft-overlap")

    # ---- the programs ----

    def build(self, state: TrainState) -> None:
        axis, outer, total = self.axis, self.outer, self.spec.collective.sum

        def device_progress(anchor: Any, rows: Any) -> Any:  # the sum over this worker's devices of anchor - replica
            return total(jax.tree.map(lambda a, r: a[0] - r[0], anchor, rows), axis)

        def apply(state: TrainState, mean: Any, moved: jax.Array, anchor: Any, steps: jax.Array, round_: jax.Array
                  ) -> TrainState:
            """The outer step with `mean` (unless not `moved`), then each replica the new global parameters
            minus its own progress since `anchor` (jaxdp/step/overlap.py's make_apply, on this worker)."""
            params, kept = outer_step(outer, state, mean, moved)
            rows = state.sync.per_device[STATE_NAME]
            replica = jax.tree.map(lambda g, a, r: g[None] - (a - r), params, anchor, rows["params"])
            sync = state.sync.replace(
                per_device={**state.sync.per_device, STATE_NAME: {"params": replica, "opt_state": rows["opt_state"]}},
                shared={**state.sync.shared, OUTER_NAME: (kept,), PACE_NAME: {"round": round_}})
            return state.replace(step=state.step + steps, params=params, sync=sync)

        rows = state_specs(state, axis).sync.per_device[STATE_NAME]["params"]
        self._build(state, KEYS, step_of, apply, copy=jax.jit(lambda tree: jax.tree.map(jnp.copy, tree)),
                    progress=jax.jit(jax.shard_map(device_progress, mesh=self.mesh, in_specs=(rows, rows),
                                                   out_specs=P(), check_vma=False)))

    def warm_up(self, state: TrainState, batch: Any) -> None:
        """Every program compiled, on a copy (a joiner stalls the others until its first round's end)."""
        self.build(state)
        copy = jax.tree.map(jnp.copy, state)
        anchor = self.layout["copy"](copy.sync.per_device[STATE_NAME]["params"])
        rows, position, loss_sum = self._inner(copy.sync.per_device[STATE_NAME], self._view(copy), self._rows(0),
                                               self._rows(0.0), shard_batch(batch, self.mesh))
        copy = copy.replace(sync=copy.sync.replace(per_device={**copy.sync.per_device, STATE_NAME: rows}))
        jax.device_get((self.layout["progress"](anchor, rows["params"]), position, loss_sum))
        jax.block_until_ready(self._apply(copy, None, anchor, 0))

    def close(self) -> None:
        self.thread.shutdown(wait=True)

    def _apply(self, state: TrainState, mean: np.ndarray | None, anchor: Any, steps: int, next_round: int = 1
               ) -> TrainState:
        return self.layout["apply"](state, self._mean(mean), replicate(np.bool_(mean is not None), self.mesh), anchor,
                                    replicate(np.asarray(steps, state.step.dtype), self.mesh),
                                    replicate(np.int32(round_of(state) + next_round), self.mesh))

    def _settled(self, state: TrainState) -> TrainState:
        """`state` with every replica the global parameters, nothing applied, the step and round as they are."""
        anchor = self.layout["copy"](state.sync.per_device[STATE_NAME]["params"])  # (apply gives `state` up)
        return self._apply(state, None, anchor, 0, next_round=0)

    # ---- a round ----

    def _exchange(self, state: TrainState, values: np.ndarray | None, head: np.ndarray | None) -> Ended:
        return self.layout["ends"].exchange(state, step_of(state), values, head)

    def _train(self, state: TrainState, planned: int) -> tuple[TrainState, Any, float]:
        """`planned` inner steps from `state` (its step: the global batch they start at). Returns the state
        with the trained replicas, the anchor (a copy of the replicas at the start) and the mean loss."""
        anchor = self.layout["copy"](state.sync.per_device[STATE_NAME]["params"])
        at, rank = step_of(state), self.member.rank
        rows, view = state.sync.per_device[STATE_NAME], self._view(state)
        (rows, _, loss_sum), _, _ = timed_inner(
            lambda rows, position, loss_sum, batch: self._inner(rows, view, position, loss_sum, batch),
            (rows, self._rows(at), self._rows(0.0)), lambda k: shard_batch(self.shard_data(at + k, rank), self.mesh),
            budget=None, planned=planned, room=None, warm=True, stopping=self.stopping)
        loss = float(np.sum(jax.device_get(loss_sum))) / max(planned * self.n, 1)
        state = state.replace(sync=state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: rows}))
        return state, anchor, loss

    def _progress(self, state: TrainState, anchor: Any) -> Any:
        """The sum over this worker's devices of its progress since `anchor` (dispatched, on the devices)."""
        return self.layout["progress"](anchor, state.sync.per_device[STATE_NAME]["params"])

    def _row(self, progress: Any, planned: int, loss: float) -> tuple[np.ndarray, np.ndarray]:
        """This worker's row of a round: its progress as float32 values, and [weight, loss, steps]."""
        return flat_of(progress), np.array([self.n if planned else 0, loss, planned], np.float64)

    def _alone(self, trained: TrainState, anchor: Any, planned: int, loss: float, flight: Any) -> TrainState:
        """The quorum is lost: this worker's own row in flight applied alone, then its round's progress
        alone, every replica the global parameters: the state it saves (exit 75)."""
        values, head = self._row(self._progress(trained, anchor), planned, loss)
        own = flight is not None and flight[1][0] and np.isfinite(flight[0]).all()
        state = self._apply(trained, flight[0] / np.float32(flight[1][0]) if own else None, anchor, planned)
        if head[0] and np.isfinite(values).all():
            state = self._apply(state, values / np.float32(head[0]), self.layout["copy"](
                state.sync.per_device[STATE_NAME]["params"]), 0)
        return self._settled(state)

    def round(self, state: TrainState, round_index: int, warm: bool, limit: int | None = None
              ) -> tuple[TrainState, dict, int, float]:
        """Start the exchange of the row in flight, train this round's H (or `limit`) steps meanwhile, then
        apply the average once it has landed. The metrics are the round before's (`landed` False: none)."""
        member = self.member
        if "inner" not in self.layout:
            self.build(state)
        started = time.perf_counter()
        landed: Any = None  # the exchange whose average this round applies: a Future, or an Ended at hand
        if member.fresh_quorum:  # the run's start, or a round's start this worker healed at (a listener)
            end = self._ended(lambda: self._exchange(state, None, None), state, None, None, 0, 0.0)
            state, self.flight = end.state, None
            landed = None if end.start else end
        elif self.flight is not None:
            snapshot = state.replace(sync=state.sync.replace(per_device={
                **state.sync.per_device, STATE_NAME: self.layout["copy"](state.sync.per_device[STATE_NAME])}))
            values, head = self.flight
            landed = self.thread.submit(self._exchange, snapshot, values, head)
        planned = self.every if limit is None else min(self.every, limit)
        trained, anchor, loss = self._train(state, planned)
        if self.stopping():  # a stop signal: this worker's next row asks every worker to stop (or it leaves)
            self.on_stop()
        if isinstance(landed, concurrent.futures.Future):
            flight = self.flight
            end = self._ended(landed.result, trained, anchor, flight, planned, loss)
            if end.healed:  # left out, and given a live peer's state at its round's start: this round again
                print(f"jaxdp: rank {member.rank} healed from step {step_of(state)} to {step_of(end.state)} "
                      f"with a live worker's state", file=sys.stderr, flush=True)
                trained, anchor, loss = self._train(end.state, planned)
            landed = end
        progress = self._progress(trained, anchor)  # (before the apply, which gives `trained` up)
        state = self._apply(trained, landed.mean if landed is not None else None, anchor, planned)
        self.flight, self.done_in_flight = self._row(progress, planned, loss), planned
        by_rank = [0] * member.size
        for rank, (_, scalars) in (landed.by_rank.items() if landed is not None else ()):
            by_rank[rank] = int(scalars[1])
        self.absent = {rank for rank, steps in enumerate(by_rank) if not steps}  # (lost, or listening: not idle)
        metrics = {"round": round_of(state), "landed": landed is not None and not landed.start,
                   "loss": self.layout["ends"].loss(landed) if landed is not None else 0.0,
                   "steps_by_device": by_rank, "comm_bytes": self.wire}
        return state, metrics, planned, time.perf_counter() - started

    def _ended(self, wait: Callable[[], Ended], state: TrainState, anchor: Any, flight: Any, planned: int,
               loss: float) -> Ended:
        """The exchange's result; a lost quorum: the state this worker saves (`_alone`) goes with HubGone."""
        try:
            return wait()
        except HubGone as gone:
            if anchor is None:  # (the run's start: nothing trained, nothing in flight)
                gone.state = self._settled(gone.state)
            else:
                gone.state = self._alone(state, anchor, planned, loss, flight)
            raise

    def flush(self, state: TrainState) -> TrainState:
        """Average the rows in flight and apply the result, with no new progress: every replica the global
        parameters, nothing in flight (every worker at the same round: a stop, the run's end)."""
        if self.flight is None:
            return state
        values, head = self.flight
        anchor = self.layout["copy"](state.sync.per_device[STATE_NAME]["params"])  # (progress 0)
        end = self._ended(lambda: self._exchange(state, values, head), state, anchor, self.flight, 0, 0.0)
        self.flight, self.done_in_flight = None, 0
        if end.healed:  # (behind at the end: the peer's state, the average it listened to applied)
            state = end.state
        anchor = self.layout["copy"](state.sync.per_device[STATE_NAME]["params"])
        return self._apply(state, end.mean, anchor, 0)

    def held(self, state: TrainState) -> TrainState:
        """What a save holds (module docstring): with rows in flight, the last average every worker applied,
        every replica equal to it, at the step where the round in flight started; else `state`."""
        if self.flight is None:
            return state
        settled = self._settled(self.layout["copy"](state))
        return settled.replace(step=settled.step - self.done_in_flight)

    def last_round_limit(self, last: list[int] | None, remaining: int) -> int | None:
        return remaining if remaining < self.every else None
