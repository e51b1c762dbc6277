"""The lead of an elastic run: the one worker that writes the metrics, saves the checkpoints
and evaluates. Losing it does not stop the run, nor its metrics and saves: the role moves.

Who leads is agreed in the step's own exchange (jaxdp/elastic/every_step.py, `lead_of`): the lead's row
says so; where no live worker's row does (the lead was lost, or left out as stalled), the lowest live
rank leads from that step on, and keeps the role while it lives, also once rank 0 is back (handing it
back would leave the run without saves while the lock changes hands). A worker healed from a live
peer leads no more until the rows say so. At the run's start rank 0 leads (it restored the checkpoint).

The loop follows, at each step or round (`follow`, the first hook): a worker that now leads opens the
checkpointer, takes over the metrics writer (jaxdp/metrics.py, `take_over`: the JSONL file from this
step on, TensorBoard, W&B, the progress bar) and evaluates from now on, with one console line and a
"lead" record; one that leads no more closes them. The checkpoint directory's lock
(jaxdp/checkpoint/dirlock.py) stays the guard against two writers: a former lead that is stopped
rather than dead still holds it, and the new lead's saves wait, retried each second, until it is
gone. With several nodes the directory must be one they share (as for any multi-host run's saves).
A worker that would lead while the run's files hold steps past its state (left out while it was
stopped, it is back after the others ended or went) leaves instead, writing nothing (`step_aside`).

A quorum lost (fewer than --min-workers for --quorum-timeout): every worker that stops tries to take
the lock and save (`claim`), so the run's state is saved even when the lead was the worker lost; the
lock lets one of them write.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

RETRY_S = 1.0  # a new lead whose directory is still locked tries again after this long


def follows(plan: Any) -> bool:
    """Whether the lead of this run can move (an elastic run, on either engine)."""
    return plan.elastic is not None


def prepare(plan: Any) -> None:
    """A worker that does not lead at its start: orbax imported now, since at a takeover its import
    would stall the whole run (docs/performance.md, "Behind the defaults"). (A restarted worker
    takes the directory's lock only where it finds no live worker: `alone`.) The checkpointer's module
    imports orbax on first use (`orbax_io.ocp`), so that is called here, not at the takeover."""
    from jaxdp.checkpoint import checkpointer, orbax_io  # noqa: F401

    orbax_io.handlers()  # (orbax, and its handlers' modules)


def alone(plan: Any) -> None:
    """A restarted rank 0 whose first quorum found no live worker (the run ended meanwhile, or every
    worker is being restarted): it leads, as at the start, from the latest checkpoint. Another
    process holding the directory (a lead that is stopped, not gone): exit 75."""
    from jaxdp.checkpoint.dirlock import DirectoryInUse
    from jaxdp.errors import EXIT_PREEMPTED

    member = plan.elastic
    if plan.checkpoint.directory:
        try:
            plan.checkpointer = plan.open_checkpointer()
        except DirectoryInUse:
            print(f"jaxdp: rank {member.rank}: restarted, no live worker, and the checkpoint directory is held by "
                  f"another process; exit code {EXIT_PREEMPTED}", file=sys.stderr)
            member.close()
            raise SystemExit(EXIT_PREEMPTED) from None
        plan.state = plan.checkpointer.restore(plan.state)
    plan.is_main, member.leader = True, member.rank


def follow(loop: Any) -> None:
    """The hook: the lead role here exactly while the workers' rows say this worker leads."""
    plan, member = loop.plan, loop.plan.elastic
    if member.lead and not plan.is_main:
        further = went_on(loop)
        if further is not None:
            step_aside(loop, further)
        plan.is_main = True
        loop.writer.take_over(loop.done, loop.history)  # (the steps the former lead took but did not write too)
        loop.writer.decision("lead", loop.done, f"rank {member.rank} leads from step {loop.done}: it writes the "
                             f"metrics, saves the checkpoints and evaluates", rank=member.rank)
    elif not member.lead and plan.is_main:
        plan.is_main = False
        loop.writer.hand_over()
        if plan.checkpointer is not None:
            plan.checkpointer.close()  # (its saves written: the new lead's open waits for this lock)
            plan.checkpointer = None
    if plan.is_main and plan.checkpointer is None and plan.checkpoint.directory:
        open_checkpointer(loop)


def went_on(loop: Any) -> int | None:
    """The furthest step the run's files (its checkpoints, its metrics file) hold past this worker's,
    or None. A worker about to lead whose state is behind them was left out (stopped, not dead) while
    the others went on, and is back after they ended or went: its state is not the run's."""
    from jaxdp.checkpoint.artifacts import checkpoint_steps

    directory = loop.plan.checkpoint.directory
    held = [loop.writer.last_step(), *(checkpoint_steps(directory) if directory and os.path.isdir(directory) else ())]
    return max(held) if max(held) > loop.done else None


def step_aside(loop: Any, further: int) -> None:
    """Leave the run without a save or a metrics record, which would overwrite the run's own with this
    worker's stale state: exit 0 where the run has reached its end, else 75 (resume from its checkpoint)."""
    from jaxdp.errors import EXIT_PREEMPTED

    code = 0 if further >= loop.plan.steps else EXIT_PREEMPTED
    print(f"jaxdp: rank {loop.plan.elastic.rank}: the run went on to step {further} without this worker, which was "
          f"left out at step {loop.done}: it stops without a save; exit code {code}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def open_checkpointer(loop: Any) -> bool:
    """The lead's checkpointer, unless the directory is still locked (then again in RETRY_S; one line)."""
    from jaxdp.checkpoint.dirlock import DirectoryInUse

    plan, now = loop.plan, time.monotonic()
    if now < plan.lead_retry_at:
        return False
    try:
        plan.checkpointer = plan.open_checkpointer()
    except DirectoryInUse:
        if not plan.lead_retry_at:
            print(f"jaxdp: rank {plan.elastic.rank} leads, but the checkpoint directory is still locked by the "
                  f"former lead (stopped, not gone?): its saves wait until the lock is free", file=sys.stderr)
        plan.lead_retry_at = now + RETRY_S
        return False
    plan.lead_retry_at = 0.0
    return True


def claim(loop: Any) -> bool:
    """The quorum is lost: this worker saves its state if it can take the directory's lock (the lead
    it was may be the worker lost), and writes the steps the metrics file lacks. Returns whether it
    holds the checkpointer."""
    from jaxdp.checkpoint.dirlock import DirectoryInUse

    plan = loop.plan
    if plan.checkpointer is None and plan.checkpoint.directory:
        try:
            plan.checkpointer = plan.open_checkpointer()
        except DirectoryInUse:  # another worker saves it
            return False
        loop.writer.take_over(loop.done, loop.history)
    return plan.checkpointer is not None


def stop_held(loop: Any, hooks: Any, gone: BaseException) -> None:
    """An elastic run whose hub went away, or (torchft) whose quorum is lost: the loop stops with the
    state it holds, exit code 75; the lead (torchft: the worker that takes the lock: `claim`) saves it."""
    import jax

    plan = loop.plan
    if getattr(gone, "state", None) is not None:  # (rounds: the state the worker holds, the loop's given up)
        loop.state = gone.state
        loop.done = int(jax.device_get(loop.state.step))
    moves = follows(plan)
    # (no save from a worker that never trained, nor from one the run went on without: `went_on`)
    if moves and not getattr(gone, "untrained", False) and (plan.is_main or went_on(loop) is None):
        plan.is_main = claim(loop)
    if not (plan.is_main and plan.checkpointer):  # (the lead says what it saved: fit's stopped())
        print(f"jaxdp: {gone}: stopping after {loop.where or f'step {loop.done}'}, exit code 75", file=sys.stderr)
    loop.preemption.gone, loop.stop = (str(gone) if moves else True), True
    loop.saveable()
    hooks.run(loop, "stop")


class NeverRaised(Exception):
    """(What a loop catches as `gone_error` in a run that is not elastic.)"""


def gone_error(plan: Any) -> type[BaseException]:
    """What a loop catches as "the hub went away" (torchft: "the quorum is lost"): elastic.HubGone in an
    elastic run, nothing otherwise."""
    return NeverRaised if plan.elastic is None else plan.elastic.Gone
