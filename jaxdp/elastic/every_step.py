"""The every-step rule of an elastic run (`make_every_step`), written once against the engine (the
launcher's hub or torchft: jaxdp/elastic/hub.py, ft.py), and the state a joining process receives
(`state_arrays`, `state_from_arrays`).

Each call takes the quorum (who takes part; a behind worker is healed there), every QUORUM_SECONDS while
nothing fails and started (on torchft's thread) while this worker computes its shard; every worker taking part sums
its own shard over its devices (in device order, or by psum or the ring) and sends it as raw bytes in
one row, whose header also says that it takes part and whether it asks to stop: one all-gather gives
every worker the live ranks and their sums. Only when a rank is missing does a second all-gather carry
its shard, computed by the live rank `ft.assign` names. Then the engine's commit. A failed commit (a worker died or
stalled mid-step) does the same step again over the new quorum, from the same state: a lost worker's
shard of that step is computed by a survivor, and no shard is counted twice. A row is made, and the
rows are read, on the devices (jaxdp/elastic/rows.py: one program each, then the update; a step
crosses to the host once each way, as bytes); the total is added in shard order, so the result is
the same to the bit whoever computed what (with --strategy host, a one-process run's of the same global batch).
A shard whose sums are not finite crosses as a tag alone and is left out of the step's mean (named
once by the lowest live rank), instead of stopping the run.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jaxdp.mesh import data_axes, shard_batch
from jaxdp.step import fsdp
from jaxdp.step.state import TrainState
from jaxdp.step.train_step import TrainStep, _accumulated, _host_programs, _local_grads_fn
from jaxdp.sync.spec import SyncSpec

Batch = Any
Metrics = dict


def state_arrays(state: TrainState) -> list[np.ndarray]:
    """Every array of `state` on the host, in `jax.tree.leaves` order (what a joining process gets)."""
    return [np.asarray(x) for x in jax.device_get(jax.tree.leaves(state))]


def state_from_arrays(template: TrainState, payload: Any) -> TrainState:
    """`template` (a state of the same run) with the arrays of `state_arrays`'s bytes, placed as
    `template`'s are."""
    from jaxdp.elastic import hub as elastic

    leaves, treedef = jax.tree.flatten(template)
    arrays = elastic.unpack(payload, leaves)
    return jax.tree.unflatten(treedef, [jax.device_put(a, x.sharding) for a, x in zip(arrays, leaves)])



HEADER = 16  # bytes before each row's sums: the shard's tag (int64), then its flags (int64)
TAKES_PART, ASKS_STOP, FRESH, LEADS = 1, 2, 4, 8  # FRESH: at the run's start, no step applied yet; LEADS: the lead
QUORUM_DUE = 16  # (every-step exchange) this worker's last quorum is QUORUM_SECONDS old: one next step
WAITS = 32  # (rank 0 at the run's start) it still waits for the workers not live yet (`wait_at_start`)
RANK_SHIFT = 32  # the flags' bits from here on: the row's worker's rank + 1 (`flags_of`, `present_of`)
# While nothing fails, a quorum once QUORUM_SECONDS have passed since the last, and at the step after
# one where a worker sat out: every worker reads both from the same rows (QUORUM_DUE, TAKES_PART), so
# all agree. A lost or stalled worker makes the step's exchange fail, and the step is done again after
# a new quorum at once; only a joiner (a new or restarted worker, which waits in its own quorum) waits
# for the next one, up to this long. A quorum costs a round trip to the Lighthouse: one every step,
# waited for, cost a slow link most of its steps/s, one every half second little (docs/performance.md,
# "Behind the defaults"). In time, not steps: a slow step pays one a step at most.
QUORUM_SECONDS = 0.5


def cut(pieces: list[np.ndarray]) -> list[tuple[int, int, np.ndarray]]:
    """(tag, flags, the sums' bytes) of every row of the gathered pieces."""
    return [(int(np.frombuffer(row[:8].tobytes(), np.int64)[0]), int(np.frombuffer(row[8:16].tobytes(), np.int64)[0]),
             row[HEADER:]) for piece in pieces for row in piece]


def to_bytes(arrays: list[np.ndarray]) -> bytes:
    return b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def wait_for_rank_0(member: Any) -> None:
    """A moment's wait for rank 0 at the run's start (its quorum again next); elastic.HubGone once
    --quorum-timeout has passed since the first. This worker has trained nothing: it saves nothing."""
    from jaxdp.elastic import hub as elastic

    if waited(member) > member.quorum_timeout_s:
        gone = elastic.HubGone(f"rank {member.rank}: rank 0 did not join within {member.quorum_timeout_s:g} s "
                               f"(--quorum-timeout) at the run's start")
        gone.untrained = True  # (jaxdp/loop/lead.py: no save of a state that is not the run's)
        raise gone
    time.sleep(0.1)


def waited(member: Any) -> float:
    """Seconds since this worker's first exchange at the run's start (its clock starts there)."""
    if member.waiting_since is None:
        member.waiting_since = time.monotonic()
    return time.monotonic() - member.waiting_since


def wait_at_start(member: Any, heads: list[tuple[int, int]], where: str) -> bool:
    """Whether an exchange at the run's start (every worker taking part fresh) is taken again, over a new
    quorum, after a moment's wait: every worker waits for rank 0, which restored the checkpoint (without
    it they would train from their own step 0 and then, being further on, hand that state to rank 0);
    and, while rank 0's row says WAITS, for every launched worker. A worker that starts late (a slower
    start-up, another node's launcher) would otherwise miss rounds: local steps it does not take are
    lost, so the run would not be the run every worker took part in."""
    live = live_of(heads)
    if not live or not all(flags & FRESH for _, flags in heads if flags & TAKES_PART):
        return False
    if 0 not in live:
        wait_for_rank_0(member)
        return True
    if len(live) == member.size or not any(flags & WAITS for _, flags in heads if flags >> RANK_SHIFT == 1):
        return False
    if not member.said_waiting:
        member.said_waiting = True
        missing = [r for r in range(member.size) if r not in live]
        member.say(f"{where}: waiting for rank(s) {missing} to join, up to {member.quorum_timeout_s:g} s "
                   f"(--quorum-timeout), before the first step")
    time.sleep(0.1)
    return True


def say_live(member: Any, at: int | str, live: list[int], more: str = "", present: list[int] | tuple = ()) -> None:
    """Where the live ranks changed, one line from the lowest live rank ("step S: live ranks [...]": the
    goodput bench reads them, jaxdp/bench/goodput.py), and `member.live` updated. `present`: the ranks
    whose rows came (`present_of`); one present but not live is healing, not lost. An exchange in which
    no rank took part (a joiner listened, and the worker it healed from was lost in it) says nothing of
    who is live: the ranks known live stay so, and the next exchange names the lost one."""
    if live == member.live or not live:
        return
    gone, back = sorted(set(member.live) - set(live)), sorted(set(live) - set(member.live))
    healing, gone = [r for r in gone if r in present], [r for r in gone if r not in present]
    member.live = live
    where = at if isinstance(at, str) else f"step {at}"
    member.say(f"{where}: live ranks {live}" + (f"; left out {gone} (lost, or stalled past --stall-timeout)"
               if gone else "") + (f"; healing {healing} (it took a live worker's state: it takes part from the "
                                   f"next exchange)" if healing else "") + (f"; back {back}" if back else "") + more)


def present_of(heads: list[tuple[int, int]]) -> list[int]:
    """The ranks whose rows an exchange's (tag, flags) come from, taking part or not (`flags_of`)."""
    return sorted({(flags >> RANK_SHIFT) - 1 for _, flags in heads if flags >> RANK_SHIFT})


def live_of(heads: list[tuple[int, int]]) -> list[int]:
    """The ranks taking part in an exchange whose rows have these (tag, flags), in order."""
    return sorted({abs(tag) - 1 for tag, flags in heads if flags & TAKES_PART and tag})


def lead_of(heads: list[tuple[int, int]], now: int | None) -> int | None:
    """The rank that leads after an exchange whose rows have these (tag, flags) (every worker reads the
    same): the lowest taking part whose row says it leads (jaxdp/loop/lead.py); where none does (the
    lead was lost or left out, or the rows came from restarted workers only) the lowest live rank,
    which then keeps the role while it lives. `now`: the lead so far, where no rank took part."""
    live = live_of(heads)
    leading = [abs(tag) - 1 for tag, flags in heads if flags & TAKES_PART and flags & LEADS and tag]
    return min(leading) if leading else live[0] if live else now


def step_number(state: TrainState, layout: dict) -> int:
    """`state`'s step number: the one recorded in `layout["known"]` when `state` is the state the last
    call returned (no wait for the devices), read from the devices otherwise (a healed or restored one)."""
    known = layout.get("known")
    return known[1] if known is not None and state.step is known[0] else int(jax.device_get(state.step))


def quorum_at(state: TrainState) -> int:
    """The number a quorum compares (a worker behind it is healed): the step, or the round where the
    workers' steps differ (timed rounds: jaxdp/elastic/timed.py, whose state has a positions table)."""
    from jaxdp.step.rounds import PACE_NAME

    paced = state.sync.shared.get(PACE_NAME)
    if paced is not None and "positions" in paced:
        return int(jax.device_get(paced["round"]))
    return int(jax.device_get(state.step))


def flags_of(member: Any, taking_part: bool) -> int:
    """This worker's row flags: whether it takes part, asks to stop, is at the run's start, leads; WAITS
    from rank 0 at the run's start until --quorum-timeout has passed since its first exchange there
    (rank 0 decides alone, so every worker reads the same decision from its row); and its rank + 1 from
    bit RANK_SHIFT on (a row that takes no part still says whose it is)."""
    waits = member.rank == 0 and member.fresh and waited(member) <= member.quorum_timeout_s
    return (TAKES_PART * taking_part | ASKS_STOP * member.stop_asked | FRESH * member.fresh
            | LEADS * (taking_part and member.lead) | WAITS * waits | (member.rank + 1) << RANK_SHIFT)


def offer(state: TrainState, pending: bool = False) -> Callable[[], bytes]:
    """What a live worker hands a behind one in a quorum: a byte that says whether `state` is at a
    round's end before its exchange (local steps: jaxdp/elastic/rounds.py), then its arrays."""
    return lambda: (b"\1" if pending else b"\0") + to_bytes(state_arrays(state))


def take_quorum(member: Any, state: TrainState, at: int, pending: bool = False,
                meanwhile: Callable[[], Any] | None = None) -> tuple[TrainState | None, bool, Any]:
    """This step's (or round end's: `pending`) quorum: (a live peer's state if this worker was behind,
    else None; whether that state is at a round's end before its exchange; what `meanwhile` returned,
    computed while the engine formed the quorum). No quorum of --min-workers for
    --quorum-timeout: elastic.HubGone (the loop saves and exits 75)."""
    from jaxdp.elastic import ft, hub as elastic
    from jaxdp.elastic.every_step import state_from_arrays

    try:
        member.engine.begin(at, offer(state, pending))
        early = meanwhile() if meanwhile is not None else None
        received = member.engine.settled()
    except ft.QuorumLost as err:  # the loop stops with `state` (the worker that takes the lock saves it), exit 75
        raise elastic.HubGone(ft.lost_line(member, err, f"at step {at}")) from None
    if received is None:
        return None, False, early
    member.leader = None  # behind, so not leading any more: the next exchange's rows say who does
    return state_from_arrays(state, memoryview(received)[1:]), received[:1] == b"\1", None


def make_every_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, member: Any,
                    shard_data: Callable[[int, int], Batch], *, spec: SyncSpec, stateful: bool = False,
                    grad_accum: int = 1, grad_norm: bool = False) -> TrainStep:
    """`spec`: the run's sync choices (checked against jaxdp/sync/rules.py). Its strategy:
    how a worker sums its own devices' gradients: "host" (each device's added in device
    order, as the host path and the hub add them), or a collective (psum, the ring). Across workers
    it is always the byte rows below. `spec.shard_params`: the layout inside each worker is
    `--shard-params`'s (parameters, gradients and optimizer state cut over its devices:
    jaxdp/step/fsdp.py); its row is the same sums, and the update keeps the cut.

    Its compression ("bf16", "int8", "int4"; None: none) codes what crosses between
    workers: each shard's gradient sum travels as the codec's message (the metrics and model state
    exactly), and every worker decodes every row and adds them in shard order, so the result is
    still the same on every worker. int8 / int4 keep error feedback per shard in this worker's
    device memory (rows.RowCoder): a worker that joins, or computes a lost worker's shard, starts
    that shard's feedback at zero, and so does a shard whose sums were not finite."""
    from jaxdp.elastic import ft
    from jaxdp.elastic.rows import RowCoder, RowPrograms

    axis = data_axes(mesh)
    local_grads = _accumulated(_local_grads_fn(loss_fn, stateful, axis), grad_accum)
    codec = spec.codec
    if spec.shard_params:  # the same rule on a cut layout: the worker's sums and the update from jaxdp/step/fsdp.py
        worker_sum = fsdp.worker_sums(loss_fn, mesh, stateful=stateful, grad_accum=grad_accum)
        grads_fn, update_fn = jax.jit(worker_sum), fsdp.make_update(tx, mesh)
    else:
        worker_sum = None  # (RowPrograms sums the replicated path's per-device gradients)
        grads_fn, update_fn, _ = _host_programs(local_grads, tx, mesh)
    devices = member.size * mesh.size
    size, rank = member.size, member.rank
    programs = RowPrograms(local_grads, mesh, spec, lambda values: RowCoder(codec, values) if codec else None,
                           grad_norm, size, update_fn, worker_sum)
    layout: dict[str, Any] = {}

    def row_of(state: TrainState, batch: Batch, shard: int) -> tuple[np.ndarray, bool, Any]:
        """One shard's row (its sums' bytes), whether they are finite, and its new error feedback."""
        coder = programs.coder
        return programs.send(state, batch, coder.feedback.get(shard) if coder is not None else None)

    def rows_of(state: TrainState, batch_of: Callable, shards: list[int], count: int, kept: dict,
                flags: int = 0, ready: Any = None) -> np.ndarray:
        """`count` rows, the first ones `shards`' sums: a 16-byte header each (the shard + 1, negated for
        sums that are not finite, which are left out, 0 for none; then `flags`: `flags_of`), then the
        sums' bytes (a codec's message for the gradient)."""
        programs.layout(state, batch_of(rank))
        piece = np.zeros((count, HEADER + programs.nbytes), np.uint8)
        piece[:, 8:16] = np.frombuffer(np.int64(flags).tobytes(), np.uint8)
        for i, shard in enumerate(shards):
            payload, finite, kept[shard] = ready if ready is not None and shard == rank else \
                row_of(state, batch_of(shard), shard)
            piece[i, :8] = np.frombuffer(np.int64(shard + 1 if finite else -shard - 1).tobytes(), np.uint8)
            if finite:
                piece[i, HEADER:] = payload
        return piece

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        if layout.get("skip"):  # healed past these steps: the state already holds them
            layout["skip"] -= 1
            return state, layout["metrics"]
        at = step_number(state, layout)
        batch_of = lambda shard: batch if shard == rank else shard_batch(shard_data(at, shard), mesh)  # noqa: E731
        retry = False
        while True:
            own = None  # this worker's shard's sums, computed while the quorum forms
            if member.fresh_quorum:
                member.fresh_quorum = False
            elif not retry and not layout.get("quorum_next", True):
                pass  # the last quorum's members, as every worker's rows said (a failure fails the exchange)
            else:
                layout["quorum_at"] = time.monotonic()
                healed, _, own = take_quorum(member, state, at, meanwhile=lambda: row_of(state, batch, rank))
                if healed is not None:  # behind after a commit only the others made: their state
                    further = int(jax.device_get(healed.step))
                    if further > at and "metrics" in layout:  # (a stalled worker that runs again)
                        layout["skip"] = further - at - 1  # the loop's next calls catch up with the state
                        print(f"jaxdp: rank {rank} healed from step {at} to {further} with a live worker's state",
                              file=sys.stderr, flush=True)
                        return healed, layout["metrics"]
                    state, at = healed, further
            # First round: every worker taking part computes its own shard and sends it in one row whose
            # header also says that it takes part and whether it asks to stop, so the live ranks come with
            # the sums (one collective). Only if a rank is missing, a second round computes its shard.
            kept, taking_part = {}, member.engine.participating()
            mine = [rank] if taking_part else []
            due = QUORUM_DUE * (time.monotonic() - layout.get("quorum_at", 0.0) >= QUORUM_SECONDS)
            first = cut(member.engine.allgather(rows_of(state, batch_of, mine, 1, kept,
                                                        flags_of(member, taking_part) | due,
                                                        ready=own)))
            heads = [(tag, flags) for tag, flags, _ in first]
            live = live_of(heads)
            # The next step's quorum, decided from what every worker received alike: once a worker's last
            # is QUORUM_SECONDS old, and at once after a step with a worker that sat it out (one that just healed).
            layout["quorum_next"] = any(not flags & TAKES_PART or flags & QUORUM_DUE for _, flags in heads)
            stop = any(flags & ASKS_STOP for _, flags in heads)
            if wait_at_start(member, heads, f"step {at}"):  # nobody applies this step; the quorum again
                member.engine.commit()
                retry = True
                continue
            owner = ft.assign(live, size) if live else {}
            missing = [s for s in range(size) if s not in live]
            second = []
            if live and missing and first:  # a lost rank's shard: the live rank with the fewest computes it
                extra = [s for s in missing if owner[s] == rank]
                count = max(collections.Counter(owner[s] for s in missing).values())
                second = cut(member.engine.allgather(rows_of(state, batch_of, extra, count, kept)))
            if not member.engine.commit() or not live:  # someone failed mid-step: again, over the new quorum
                retry = True
                continue
            rows, bad = np.zeros((size, programs.nbytes), np.uint8), []
            for tag, _, payload in first + second:
                if tag > 0:
                    rows[tag - 1] = payload
                elif tag < 0:
                    bad.append(-tag - 1)
            mine = [s for s in range(size) if owner[s] == rank]
            break
        member.fresh, member.leader = False, lead_of(heads, member.leader)
        bad = sorted(bad)
        if programs.coder is not None:  # the exchange went through: this step's feedback is owed, of the finite shards
            programs.coder.settle(kept, bad)
        moved = {s: o for s, o in owner.items() if o != s}
        say_live(member, at, live, f"; shards computed elsewhere {moved}" if moved else "", present_of(heads))
        if bad != layout.get("bad", []):  # a worker's non-finite sums: left out of the step, named once
            member.say(f"step {at}: the sums of shard(s) {bad} (computed by rank(s) {sorted({owner[b] for b in bad})}) "
                       f"are not finite: left out of the step, the mean taken over the other shards" if bad else
                       f"step {at}: every shard's sums are finite again")
            layout["bad"] = bad
        member.shards, member.stop = mine, member.stop or stop
        counted = devices * (size - len(bad)) // size  # (every shard not finite: NaN, which stops the run as ever)
        state, metrics = programs.apply(state, rows, np.isin(np.arange(size), bad, invert=True), counted)
        layout["metrics"], layout["known"] = metrics, (state.step, at + 1)
        return state, metrics

    made = TrainStep(step, grads_fn, tx, spec, local_grads)
    made.warm_up = programs.warm_up
    return made


def settle(member: Any, state: Any) -> tuple[Any, bool]:
    """The first quorum: (the state to start from, whether it came from a live peer). A worker behind
    the furthest one in the quorum (a new or restarted one, or every worker but rank 0 when rank 0
    restored a checkpoint) gets that worker's state; no checkpoint is read for it."""
    from jaxdp.elastic import ft
    from jaxdp.errors import EXIT_PREEMPTED
    from jaxdp.elastic.every_step import state_from_arrays

    at = quorum_at(state)
    try:
        received = member.engine.quorum(at, offer(state))
        if received is None and member.rank != 0 and alone(member):  # (its peers may be starting still)
            received = wait_for_a_peer(member, state, at)
    except ft.QuorumLost as err:
        line = (f"rank {member.rank}: the run stopped before this worker joined" if err.ended else
                ft.lost_line(member, err, "before its first step") if err.gone else
                f"rank {member.rank}: no quorum of --min-workers={member.min_workers} ({err})")
        print(f"jaxdp: {line}; exit code {EXIT_PREEMPTED}", file=sys.stderr)
        member.close()
        raise SystemExit(EXIT_PREEMPTED) from None
    member.fresh_quorum = True  # this quorum's collectives are the first step's
    member.fresh = not member.restarted and received is None  # at the run's start: it waits for rank 0 (step)
    member.alone = received is None and alone(member)
    if member.alone and member.rank != 0:
        # still no live worker: the run ended meanwhile (or every worker is being restarted); a
        # restarted rank 0 goes on from the checkpoint instead, and leads (jaxdp/loop/lead.py, `alone`)
        print(f"jaxdp: rank {member.rank}: restarted, but no live worker to take the state from within "
              f"{member.quorum_timeout_s:g} s (--quorum-timeout); exit code {EXIT_PREEMPTED}", file=sys.stderr)
        member.close()
        raise SystemExit(EXIT_PREEMPTED)
    member.pending_round = received is not None and received[:1] == b"\1"  # a peer's round end: its exchange next
    if received is None:
        return state, False
    member.leader = None  # (the live workers' rows say who leads)
    state = state_from_arrays(state, memoryview(received)[1:])
    print(f"jaxdp: rank {member.rank} joined the run at step {int(jax.device_get(state.step))} with a live "
          f"worker's state (no checkpoint read)", file=sys.stderr, flush=True)
    return state, True


def alone(member: Any) -> bool:
    """Whether a restarted worker's last quorum held no other worker."""
    return member.restarted and member.engine.participants() <= 1


def wait_for_a_peer(member: Any, state: Any, at: int) -> bytes | None:
    """A restarted worker (not rank 0) whose first quorum held no other worker: the others may not have
    reached their first quorum yet (a start-up under load takes many seconds), so it asks again, for up
    to --quorum-timeout, until another worker takes part. Returns the state a live peer handed over, if
    any (still alone at the end: None, and `settle` exits 75)."""
    print(f"jaxdp: rank {member.rank}: restarted, and no other worker in its quorum yet: asking again for up to "
          f"{member.quorum_timeout_s:g} s (--quorum-timeout)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + member.quorum_timeout_s
    while time.monotonic() < deadline:
        member.engine.commit()  # (this quorum had no collective: it ends before the next, as wait_for_rank_0's)
        time.sleep(0.1)  # (wait_for_rank_0's pace)
        received = member.engine.quorum(at, offer(state))
        if received is not None or not alone(member):
            return received
    return None
