"""Workers at their own pace across an elastic run (`--sync-seconds S`): each worker takes as
many local steps as it manages in S seconds, then the round ends as a fixed round's does
(jaxdp/elastic/rounds.py, `RoundEnd`: a quorum, one all-gather of one row per worker, the engine's
commit, the rows added in rank order on every worker). The pseudo-gradients are averaged weighted by
the examples each worker trained on in the round, as in one JAX program's timed rounds
(jaxdp/step/rounds.py, whose docstring says why by examples):

    mean = sum_w k_w * (sum over w's devices of (global - replica)) / sum_w k_w * devices_w

Data: a stream per rank. The global batch of step k is cut into one shard per rank (--nproc-per-node x
--nnodes of them, `data(step, shard)`); rank r's stream is its shards of batches 0, 1, 2, ..., and
`positions[r]` (in the state: `shared["paced"]["positions"]`, checkpointed, handed to joiners) is how
far it has been read. A worker reads its own stream; once that reaches --steps it reads in its place
the stream of a rank that is not live (the live rank `ft.assign` names), so a worker lost for good
leaves nothing unread. Each row says which stream it advanced and by how many steps, and every worker
adds them to the table alike. A worker lost in a round loses that round's steps with it: its stream's
position does not move, so those examples are read again later (by it when it is back, or by a live
worker once its own stream is done). No example is counted twice, and at the end every stream has
been read to --steps. `state.step` is floor(sum of positions / ranks): the training done, in global
batches.

The quorum compares rounds, not steps (the workers' step counts differ): a worker behind by a round (a
new, restarted or stalled one) is healed at a round's end with a live peer's state as it stands before
that round's exchange, and listens to the exchange. A time-bound round takes at least one step per
worker, and none past --steps; `sync_seconds` may be a schedule `(round, rank) -> steps` that replays
a run exactly (the tests' reference). Everything else is the fixed rounds' (their docstring): the
worker's devices are replicas with no collective between round ends, a non-finite row is left out and
named, bf16 / int8 / int4 code the rows with error feedback per worker.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from jaxdp.errors import InputError
from jaxdp.mesh import replicate, shard_batch, state_specs
from jaxdp.elastic.rounds import Replicas, flat_of
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME
from jaxdp.step.rounds import PACE_NAME, outer_step
from jaxdp.step.rounds import check as paced_check, last_round_share, timed_inner
from jaxdp.step.state import TrainState
from jaxdp.sync.spec import SyncSpec

KEYS = ["loss", "steps", "stream"]  # a row's scalars: its mean loss, the steps it took, the stream it read


def init_sync(workers: int) -> dict:
    """shared[PACE_NAME] of a new state: round 0, every stream at 0."""
    return {PACE_NAME: {"round": np.int32(0), "positions": np.zeros(workers, np.int32)}}


def round_of(state: TrainState) -> int:
    """The round `state` is at: what the quorum compares."""
    return int(jax.device_get(state.sync.shared[PACE_NAME]["round"]))


def positions_of(state: TrainState) -> np.ndarray:
    return np.array(jax.device_get(state.sync.shared[PACE_NAME]["positions"]), np.int64)


class TimedRounds(Replicas):
    """The timed rounds of one worker; `round` is what the round loop (jaxdp/loop/rounds.py) runs."""

    def __init__(self, loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, member: Any,
                 shard_data: Callable[[int, int], Any], *, spec: SyncSpec, pace: Any, stateful: bool = False,
                 grad_accum: int = 1):
        paced_check(pace, mesh)
        super().__init__(loss_fn, tx, mesh, member, shard_data, spec=spec, stateful=stateful, grad_accum=grad_accum)
        self.pace = pace

    # ---- the programs ----

    def build(self, state: TrainState) -> None:
        axis, n, outer, size, total = self.axis, self.n, self.outer, self.member.size, self.spec.collective.sum

        def device_delta(state: TrainState) -> Any:  # sum over this worker's devices of (global - replica)
            replica = jax.tree.map(lambda x: x[0], state.sync.per_device[STATE_NAME]["params"])
            return total(jax.tree.map(lambda g, r: g - r, state.params, replica), axis)

        def apply(state: TrainState, mean: Any, moved: jax.Array, positions: jax.Array, round_: jax.Array
                  ) -> TrainState:
            params, kept = outer_step(outer, state, mean, moved)
            rows = state.sync.per_device[STATE_NAME]
            rows = {"params": jax.tree.map(lambda p: jnp.broadcast_to(p, (n, *p.shape)), params),
                    "opt_state": rows["opt_state"]}
            sync = state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: rows}, shared={
                **state.sync.shared, OUTER_NAME: (kept,), PACE_NAME: {"round": round_, "positions": positions}})
            return state.replace(step=(jnp.sum(positions) // size).astype(state.step.dtype), params=params, sync=sync)

        specs = state_specs(state, axis)
        self._build(state, KEYS, round_of, apply, delta=jax.jit(jax.shard_map(
            device_delta, mesh=self.mesh, in_specs=(specs,), out_specs=P(), check_vma=False)))
        self.layout["ends"].where = lambda state, at: f"round {at}, step {int(jax.device_get(state.step))}"

    def warm_up(self, state: TrainState, batch: Any) -> None:
        """Every program compiled, on a copy (a joiner stalls the others until its first round's end)."""
        self.build(state)
        copy = jax.tree.map(jnp.copy, state)
        rows, position, loss_sum = self._inner(copy.sync.per_device[STATE_NAME], self._view(copy),
                                               self._rows(0), self._rows(0.0), batch)
        copy = copy.replace(sync=copy.sync.replace(per_device={**copy.sync.per_device, STATE_NAME: rows}))
        jax.device_get((self.layout["delta"](copy), position, loss_sum))
        jax.block_until_ready(self._apply(copy, None, positions_of(copy), round_of(copy)))

    def _apply(self, state: TrainState, mean: np.ndarray | None, positions: np.ndarray, round_: int) -> TrainState:
        return self.layout["apply"](state, self._mean(mean), replicate(np.bool_(mean is not None), self.mesh),
                                    replicate(positions.astype(np.int32), self.mesh),
                                    replicate(np.int32(round_), self.mesh))

    # ---- a round ----

    def stream(self, positions: np.ndarray) -> int:
        """The stream this worker reads: its own, or once that reached --steps, one of a rank whose row did
        not come at the last round's end. (Not merely one not live: a rank that healed there sent a row
        that took no part, and reads its own stream this round.)"""
        rank, live, present = self.member.rank, self.member.live, self.layout["ends"].present
        if self.steps is None or positions[rank] < self.steps or rank not in live:
            return rank
        from jaxdp.cluster.ft_env import assign

        owner = assign(live, self.member.size)
        mine = [r for r in range(self.member.size)
                if r not in live and r not in present and owner[r] == rank and positions[r] < self.steps]
        return mine[0] if mine else rank

    def _end(self, state: TrainState, delta: np.ndarray | None, head: np.ndarray | None) -> tuple[TrainState, Any]:
        """A round's end: the exchange, then the outer step and the table, as every worker applies them."""
        from jaxdp.elastic.hub import HubGone

        at = round_of(state)
        try:
            end = self.layout["ends"].exchange(state, at, delta, head)
        except HubGone as gone:  # the quorum is lost: the round ends with this worker alone, held to be saved
            gone.state = self._alone(gone.state, delta if gone.state is state else None, head)
            raise
        state = end.state
        if end.healed and round_of(state) != at:
            print(f"jaxdp: rank {self.member.rank} healed from round {at} to {round_of(state)} with a live worker's "
                  f"state", file=sys.stderr, flush=True)
        positions = positions_of(state)
        if end.start:  # (only who takes part was exchanged: nothing moves)
            return state, (end, [0] * self.member.size, positions)
        by_rank = [0] * self.member.size
        for rank, (_, scalars) in end.by_rank.items():
            steps, stream = int(scalars[1]), int(scalars[2])
            positions[stream] += steps
            by_rank[rank] = steps
        state = self._apply(state, end.mean, positions, round_of(state) + 1)
        self.absent = set(range(self.member.size)) - set(self.member.live)
        return state, (end, by_rank, positions)

    def _alone(self, state: TrainState, delta: np.ndarray | None, head: np.ndarray | None) -> TrainState:
        """The round ended with this worker's row alone (its quorum lost): its pseudo-gradient applied and
        its stream advanced, as a round whose other workers were all lost mid-round; without a row of
        its own (a listener), the round's start again. Every replica restarts from the global parameters:
        the state a save may hold (the inner step gave up the round start's buffers)."""
        positions = positions_of(state)
        if delta is None or not head[0] or not np.isfinite(delta).all():
            return self._apply(state, None, positions, round_of(state))
        positions[int(head[3])] += int(head[2])
        return self._apply(state, delta / np.float32(head[0]), positions, round_of(state) + 1)

    def round(self, state: TrainState, round_index: int, warm: bool, limit: int | None = None
              ) -> tuple[TrainState, dict, int, float]:
        """A round: inner steps until the time (or the schedule, or `limit`) says stop, then the round's
        end. The first call after a join is that join's exchange first: at the run's start, then the
        round; where the worker healed at a round's end, that round alone (its figures are the call's,
        so a lead lost before it wrote them leaves them to this worker). Returns (state, the round's
        metrics on the host, this worker's steps, the round's seconds)."""
        member, rank = self.member, self.member.rank
        if "inner" not in self.layout:
            self.build(state)
        if member.fresh_quorum:
            started = time.perf_counter()
            state, ended = self._end(state, None, None)
            if not ended[0].start:  # it listened to a round's end (it healed there): that round's figures are
                return state, self._figures(state, *ended), 0, time.perf_counter() - started  # this call's
        round_index, positions = round_of(state), positions_of(state)
        stream = self.stream(positions)
        at = int(positions[stream])
        budget = None if callable(self.pace) else float(self.pace)
        planned = int(self.pace(round_index, rank)) if callable(self.pace) else None
        if planned is not None and not any(self.pace(round_index, r) for r in range(member.size)):
            raise InputError(f"the sync_seconds schedule gives no rank a step in round {round_index}: such a round "
                             f"trains nothing, and a run of them never ends; give some rank a step", setting="sync_seconds")
        if limit is not None and planned is None:
            planned, budget = limit, None
        room = None if self.steps is None else max(self.steps - at, 0)
        rows, view = state.sync.per_device[STATE_NAME], self._view(state)
        position, loss_sum = self._rows(at), self._rows(0.0)
        (rows, position, loss_sum), taken, started = timed_inner(
            lambda rows, position, loss_sum, batch: self._inner(rows, view, position, loss_sum, batch),
            (rows, position, loss_sum), lambda k: shard_batch(self.shard_data(at + k, stream), self.mesh),
            budget=budget, planned=planned, room=room, warm=warm, stopping=self.stopping)
        if self.stopping():  # a stop signal ended the round early: this round's row asks every worker to stop
            self.on_stop()  # (or, its launcher gone and the Lighthouse elsewhere, this worker leaves: ElasticStop)
        state = state.replace(sync=state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: rows}))
        delta = flat_of(self.layout["delta"](state)) * np.float32(taken)
        loss = float(np.sum(jax.device_get(loss_sum))) / max(taken * self.n, 1)
        state, ended = self._end(state, delta, np.array([taken * self.n, loss, taken, stream], np.float64))
        return state, self._figures(state, *ended), taken, time.perf_counter() - started

    def _figures(self, state: TrainState, end: Any, by_rank: list[int], positions: np.ndarray) -> dict:
        """A round's metrics, the same on every worker (a worker that healed at its end listened to it)."""
        return {"round": round_of(state), "loss": self.layout["ends"].loss(end), "steps_by_device": by_rank,
                "positions_by_device": [int(p) for p in positions], "comm_bytes": self.wire}

    def last_round_limit(self, last: list[int] | None, remaining: int) -> int | None:
        """This worker's steps in what will be the last round (jaxdp/step/rounds.py's rule, by rank)."""
        return last_round_share(last, remaining, self.member.rank)

