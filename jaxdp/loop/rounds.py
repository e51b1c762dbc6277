"""The round loop: host-driven rounds of local steps (`sync_seconds`, or `overlap` with `sync_every`
H >= 2), then the hooks (jaxdp/loop/hooks.py), the same as the step loop's.

The rounds themselves, their programs and what they average, are jaxdp/step/rounds.py's `Rounds`
and `Overlapped`; this module drives them: one host sync point per round, a record per round
(the steps each process took, its seconds), and at the end the overlapped average still in flight.
`state.step` counts global batches, so `eval_every` and `save_every` fire at the round that reaches
or passes a multiple (`Hooks`' `every=`), and a run ends at the first round that reaches `steps` (with
timed rounds: where every process's stream has been read to `steps`).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from jaxdp.loop import lead
from jaxdp.loop.hooks import Hook, Loop, periodic


def make_rounds(loop: Loop) -> Any:
    """The plan's rounds: `Overlapped` (overlap, H steps; a replica per device, or with shard_params
    each worker's cut over its devices) or `Rounds` (sync_seconds)."""
    from jaxdp.step import overlap, rounds as paced

    plan, sync, run = loop.plan, loop.options["sync"], loop.options["run"]
    made = loop.train_step
    if made.rounds is not None:  # rounds across an elastic engine's workers (jaxdp/elastic/timed.py, overlap.py)
        made.rounds.local_rows = run.examples_per_step // plan.elastic.size if run.examples_per_step else None
        return made.rounds
    args = (made.local_grads, plan.tx, plan.mesh, loop.spec.strategy, loop.spec.compression, plan.outer_tx)
    if not plan.overlap:
        return paced.Rounds(*args, sync.sync_seconds, plan.data, run.examples_per_step)
    if loop.spec.shard_params:  # each worker's state cut over its devices
        layout: Any = overlap.Cut(made.loss_fn, plan.tx, plan.mesh, loop.spec, plan.outer_tx, plan.data,
                                  stateful=made.stateful, grad_accum=made.grad_accum)
    else:
        layout = overlap.Replicas(*args, plan.data)
    return overlap.Overlapped(layout, loop.spec.sync_every, run.examples_per_step)


def run_rounds(loop: Loop) -> None:
    """Rounds until `state.step` reaches the plan's `steps`, or until a hook stops the loop."""
    import jax

    from jaxdp.step.rounds import PACE_NAME, check_in_flight

    plan, rounds = loop.plan, make_rounds(loop)
    rounds.steps = plan.steps  # no process's position goes past --steps
    if loop.preemption is not None:  # SIGTERM ends a time-bound round at once: what was trained is averaged, saved
        rounds.stopping = lambda: getattr(loop.preemption, "signal", None) is not None
        if plan.elastic is not None:  # (timed rounds on torchft: ask the others to stop, or leave: ElasticStop)
            rounds.on_stop = lambda: loop.preemption.should_stop(loop.state)
    loop.in_flight = check_in_flight  # the replicas (and the delta) in flight: the loss lands a round late
    if hasattr(rounds, "held"):  # (overlapped rounds on torchft: a save holds what every worker agrees on)
        loop.held = rounds.held
    landed: dict[str, Any] = {}  # the last round's figures on the host (empty: none landed yet, --overlap)

    def log_round(loop: Loop) -> None:
        if landed:
            _log_round(loop, rounds, landed)

    def flush(loop: Loop) -> None:  # the last round's average, applied: every replica equals the global
        loop.state = rounds.flush(loop.state)

    hooks = periodic(loop, Hook(log_round, at=("round",)))
    hub_gone = lead.gone_error(plan)
    overlapped = hasattr(rounds, "flush")  # (overlapped rounds: an average in flight at the end)
    if overlapped:
        hooks.add(flush, at=("end",))
    try:
        hooks.run(loop, "start")
        state = loop.state
        done = int(jax.device_get(state.step))
        round_index = int(jax.device_get(state.sync.shared[PACE_NAME]["round"]))
        first, last = True, None  # the steps each process took in the last round
        unread = False  # a stream (timed rounds) not yet read to `steps` while state.step reached it
        while done < plan.steps or unread:
            before = done
            dispatch = time.perf_counter()
            try:
                state, metrics, taken, seconds = rounds.round(
                    state, round_index, warm=not first,
                    limit=rounds.last_round_limit(last, plan.steps - done) if done < plan.steps else None)
            except hub_gone as gone:  # torchft: the quorum is lost; a worker that takes the lock saves
                lead.stop_held(loop, hooks, gone)
                return
            host = jax.device_get(metrics)  # host sync point: one per round
            round_index, done = int(host["round"]), int(jax.device_get(state.step))
            # A resume whose --steps is below a stream's saved position (it ran ahead before the save):
            # state.step, the positions' mean, reaches `steps` before the streams behind have; the run
            # goes on until every stream is read to `steps` (one past it takes no steps, `room`).
            unread = "positions_by_device" in host and min(rounds.by_process(host["positions_by_device"])) < plan.steps
            plan.beat.dispatched(round_index, state.step, waited_s=time.perf_counter() - dispatch)
            if first:
                loop.writer.first_step_done(done)
                first = False
            else:
                loop.writer.step(done - before)
            landed.clear()
            if host.get("landed", True):  # (--overlap: a round's figures arrive with the next round)
                landed.update(host, round_s=seconds, round_index=round_index)
                loop.window.add(done, {"loss": host["loss"]})
            loop.state, loop.before, loop.done, loop.where = state, before, done, f"round {round_index}"
            hooks.run(loop, "round")
            if loop.stop:
                if getattr(rounds, "flush_at_stop", False):  # (torchft: every worker stops at this round)
                    try:
                        loop.state = rounds.flush(loop.state)
                    except hub_gone as gone:
                        lead.stop_held(loop, hooks, gone)
                        return
                hooks.run(loop, "stop")
                return
            last = rounds.by_process(host["steps_by_device"]) if landed else last
        hooks.run(loop, "end")
    finally:
        if overlapped:
            rounds.close()


def _log_round(loop: Loop, rounds: Any, host: dict) -> None:
    """A round's record: its loss, the steps each process took and its seconds; a process that took
    no step is named (weight 0 in the average)."""
    loop.window.check()
    done, round_index, seconds = loop.done, host["round_index"], host["round_s"]
    by_process = rounds.by_process(host["steps_by_device"])
    extra = {"round": round_index, "round_s": seconds, "round_steps_by_process": by_process}
    if "positions_by_device" in host:  # each process's data position (torchft: each rank's stream's)
        extra["positions_by_process"] = rounds.by_process(host["positions_by_device"])
    if rounds.local_rows:
        extra["examples_per_sec_by_process"] = [k * rounds.local_rows / seconds for k in by_process]
    loop.history.append(loop.writer.log(done, {"loss": host["loss"], **{k: v for k, v in host.items() if k in (
        "comm_bytes", "compression_ratio")}}, extra))
    idle = [p for p, k in enumerate(by_process) if k == 0 and p not in getattr(rounds, "absent", ())]
    if idle and "positions_by_device" in host:  # (a process whose position reached `steps` is done, not idle)
        positions = rounds.by_process(host["positions_by_device"])
        idle = [p for p in idle if positions[p] < loop.steps]
    if idle:
        loop.writer.event("no_progress", done, round=round_index, processes=idle)
        if loop.plan.is_main:
            who = f"process {idle[0]}" if len(idle) == 1 else f"processes {idle}"
            print(f"jaxdp: --sync-seconds: {who} took no step in round {round_index} (weight 0 in its average); "
                  f"steps by process: {by_process}", file=sys.stderr)
