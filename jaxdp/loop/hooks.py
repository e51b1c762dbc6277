"""The periodic work of a training loop, as hooks: written once, run by the step loop
(jaxdp/loop/steps.py) and the round loop (jaxdp/loop/rounds.py) alike.

    hooks = Hooks()
    hooks.add(log, every=10, at=("last",))   # after every 10th step, and after the last
    hooks.add(save, at=("step", "round"))    # after every step or round: the checkpointer keeps its own frequency
    hooks.run(loop, "step")                  # the loop, after each step

A hook is a function of the `Loop` (the state of the run: its train state, the steps done, the
writer, ...). It runs at the events it names (`at`) and, with `every=N`, after each step or round
that reaches or passes a multiple of N (a round may take several steps). Events, in a run's order:

* "start": before the first step (the controller's first decision; --save-every auto resumed);
* "step" / "round": after each step (the step loop) or round (the round loop); "last": the step
  that reaches `steps` too;
* "stop": a stop signal (SIGTERM, SIGUSR1, an elastic run's stop) ended the loop early;
* "end": the loop reached `steps` (the overlapped rounds' last average lands).

A hook that sets `loop.stop` ends the loop: the hooks after it in the list do not run.

The hooks of every run (`periodic`), in order: the log record (each loop brings its own), the
evaluation (`every=eval_every`), the save (the checkpointer's plan: every N steps, or
`--save-every auto`'s measured interval), the stop check (preemption signals, every step or
round), and the compression controller's re-decision (`every=compression_every`, and at "start").
Before any of them reads or saves a state, the NaN window (`NanWindow`) checks every step's metrics
not checked yet, and before a save `Loop.saveable` checks what the checkpoint holds beyond them too
(the gradient or the round's replicas in flight, which a resume would apply at once): nothing
non-finite is ever saved.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

# Steps whose metrics may wait on the devices for the NaN / Inf check: it runs at every log point,
# and at least this often, so a large log_every does not keep every step's metrics alive.
MAX_PENDING_STEPS = 100

TICKS = ("step", "round")  # the events `every=` counts at


@dataclasses.dataclass(frozen=True)
class Hook:
    fn: Callable[[Any], None]
    every: int = 0                      # steps: after each step or round that passes a multiple of it
    at: tuple[str, ...] = ()            # events


class Hooks:
    """An ordered list of hooks, run at a loop's events."""

    def __init__(self) -> None:
        self.hooks: list[Hook] = []

    def add(self, fn: Callable[[Any], None], every: int = 0, at: tuple[str, ...] = ()) -> None:
        self.hooks.append(Hook(fn, every, tuple(at)))

    def run(self, loop: Loop, *events: str) -> None:
        """Every hook due at `events` (after a tick: the steps from `loop.before` to `loop.done`), in order."""
        ticked = any(event in TICKS for event in events)
        for hook in self.hooks:
            if loop.stop and "stop" not in events:
                return
            passed = ticked and hook.every and loop.done // hook.every > loop.before // hook.every
            if passed or any(event in hook.at for event in events):
                hook.fn(loop)


class NanWindow:
    """Every step's metrics stay on the devices until a hook needs the host's view: then `check`
    brings them over (a host sync point) and raises Diverged naming the first non-finite step."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, Any]] = []  # (step, metrics) on device, not yet checked
        self.unchecked: set[int] = set()        # pending steps whose metrics are this process's own
        self.last: dict[str, Any] = {}          # the metrics of the last step checked, on the host

    def add(self, step: int, metrics: Any, checked: bool = True) -> None:
        """`checked=False`: a step whose metrics are this process's own (local steps with
        metrics_at_sync, between syncs): logged, but left to the next sync's check, which every
        process shares, so that no process stops alone."""
        self.pending.append((step, metrics))
        if not checked:
            self.unchecked.add(step)
        if len(self.pending) >= MAX_PENDING_STEPS:  # a large log_every: memory stays bounded, the check exact
            self.check()

    def check(self) -> dict[str, float]:
        """The pending steps' metrics checked for NaN / Inf; returns the latest step's."""
        import jax

        from jaxdp.metrics import check_finite

        host = jax.device_get(self.pending)  # host sync point
        unchecked, self.unchecked = self.unchecked, set()
        self.pending.clear()
        for step, metrics in host:
            if step not in unchecked:
                check_finite(step, metrics)
        if host:
            self.last = dict(host[-1][1])
        return dict(self.last)


@dataclasses.dataclass
class Loop:
    """A running loop: what its hooks read, and change (the state, `stop`)."""

    plan: Any                           # jaxdp.loop.resolve.Plan
    writer: Any                         # jaxdp.metrics.MetricsWriter
    state: Any
    start: int                          # the step the run started (or resumed) at
    preemption: Any = None              # SIGTERM / SIGUSR1 (jaxdp.cluster.preemption), None without a checkpointer
    options: Any = None                 # the option groups (jaxdp.loop.options)
    done: int = 0                       # steps trained
    before: int = 0                     # steps trained before the last tick (a step: done - 1; a round: fewer)
    where: str = ""                     # the last tick, for the console: "step 12", "round 3"
    history: list = dataclasses.field(default_factory=list)  # every logged step record
    window: NanWindow = dataclasses.field(default_factory=NanWindow)
    stop: bool = False                  # a stop signal ended the loop
    spec: Any = None                    # the sync choices now (compression "auto" switches)
    decided_s: float = 0.0              # the controller's own time
    startup_s: float = 0.0              # from the process's start to the loop's
    in_flight: Callable[[Any, int], None] | None = None  # (state, step) -> Diverged if what is in flight is not finite
    held: Callable[[Any], Any] | None = None  # state -> what a save holds (None: the state itself)

    def to_save(self) -> Any:
        """The state a save writes: the loop's, or what `held` makes of it (jaxdp/elastic/overlap.py)."""
        return self.state if self.held is None else self.held(self.state)

    def saveable(self) -> None:
        """Before a save: the pending metrics, then what is in flight (Diverged instead of a non-finite save)."""
        self.window.check()
        if self.in_flight is not None:
            self.in_flight(self.state, self.done)

    @property
    def steps(self) -> int:
        return self.plan.steps

    @property
    def train_step(self) -> Any:
        return self.plan.step_for(self.spec)


def periodic(loop: Loop, log: Hook) -> Hooks:
    """The hooks of a run, in order: `log` (the loop's own record), then evaluate, save, stop, re-decide."""
    from jaxdp.loop import lead

    hooks, plan = Hooks(), loop.plan
    moves = lead.follows(plan)  # an elastic run on torchft: the lead (metrics, saves, evaluation) may move here
    if moves:
        hooks.add(lead.follow, at=("start", *TICKS))
    hooks.hooks.append(log)
    if plan.evaluate is not None:
        hooks.add(evaluate, every=loop.options["evaluation"].every)
    if plan.checkpointer or (moves and plan.checkpoint.directory):
        hooks.add(report_save_decision, at=("start",))
        hooks.add(save_when_due, at=TICKS)
        hooks.add(save_now, at=("stop",))
    if loop.preemption:
        hooks.add(stop_on_signal, at=TICKS)
    if plan.begun.controller and not plan.rounds_run:  # (at the start unless --sync-every auto decided it already)
        hooks.add(redecide, every=loop.options["sync"].compression_every, at=() if plan.begun.decided else ("start",))
    return hooks


def log_step(loop: Loop) -> None:
    """The step loop's record: the latest step's metrics (and lr, stragglers, what plain averaging sends)."""
    latest = loop.window.check()
    if not latest:  # (none yet: every-step overlap's first step applied nothing)
        return
    schedule = loop.options["logging"].schedule
    extra = {"lr": float(schedule(loop.done - 1))} if schedule is not None else {}
    loop.history.append(loop.writer.log(loop.done, latest, {**extra, **loop.plan.beat.stragglers(),
                                                            **({} if "comm_bytes" in latest else loop.plan.plain_comm)}))


def evaluate(loop: Loop) -> None:
    """Held-out metrics during training (the last step's come with the final record instead)."""
    if loop.done >= loop.steps or not loop.plan.evaluates:
        return
    loop.window.check()
    loop.plan.beat.phase(f"the evaluation after {loop.where}")
    evaluated = time.perf_counter()
    loop.writer.eval(loop.done, {**loop.plan.evaluate(loop.state), "eval_s": time.perf_counter() - evaluated})


def report_save_decision(loop: Loop) -> None:
    """--save-every auto, resumed: decided from the recorded save cost."""
    if loop.plan.checkpointer:  # (an elastic run: the lead's)
        loop.plan.checkpointer.report_decision(loop.writer, loop.start)


def save_when_due(loop: Loop) -> None:
    """The checkpointer as a hook with its own frequency (every N steps, or --save-every auto's)."""
    checkpointer = loop.plan.checkpointer
    if checkpointer is None:  # an elastic run's worker that does not lead
        return
    checkpointer.poll()  # a background save that failed stops the run here (exit 73)
    if checkpointer.due(loop.before, loop.done):
        loop.saveable()  # never write a non-finite state over a good checkpoint
        checkpointer.save(loop.to_save())
        checkpointer.report_decision(loop.writer, loop.done)  # --save-every auto: the measuring save chose


def save_now(loop: Loop) -> None:
    """A stop signal: save the state reached (a no-op if it was just saved; `stop_on_signal` checked it)."""
    if loop.plan.checkpointer:  # (an elastic run: the lead's)
        loop.plan.checkpointer.save(loop.to_save())


def stop_on_signal(loop: Loop) -> None:
    """Multi-process: a tiny all-reduce, so every process stops after the same step (with
    --metrics-at-sync only after sync steps: nothing else crosses the link between them)."""
    if loop.spec is not None and not loop.spec.metrics_shared(loop.done):
        return
    if loop.done < loop.steps and loop.preemption.should_stop(loop.state):
        loop.saveable()
        loop.stop = True


def redecide(loop: Loop) -> None:
    """--compression auto: the controller measures the codecs on the next batches and picks one."""
    from jaxdp.sync.controller import GUARD_BATCHES

    if loop.done >= loop.steps:  # (no step left to decide for)
        return
    loop.window.check()
    at, batch_at = loop.done, loop.plan.batch_at
    decision = loop.plan.begun.controller.decide(loop.state, [batch_at(at + k) for k in range(GUARD_BATCHES)], at)
    loop.writer.event("compression", at, **decision.record)
    loop.writer.restart_clock()  # its measurements are neither training nor compilation
    loop.decided_s += sum(decision.record["cost_s"].values())
    if loop.plan.is_main:  # one line per decision
        cost = decision.record["cost_s"]
        print(f"jaxdp: --compression auto at step {at}: {decision.record['why']} (measuring "
              f"{cost['measure']:.1f}s, quality guard {cost['quality']:.1f}s)", file=sys.stderr)
        if decision.record["propose_local_steps"] and loop.spec.sync_every == 1:
            print(f"jaxdp: --compression auto: {decision.record['propose_local_steps']['why']}", file=sys.stderr)
    loop.spec = loop.spec.replace(compression=decision.compressor)


class ElasticStop:
    """An elastic run's preemption: a signal here asks the launcher to stop every rank, and all
    stop after the step whose total says so (the lead saves it: rank 0, or on torchft whichever leads)."""

    def __init__(self, preemption: Any, member: Any):
        self._preemption, self._member = preemption, member
        self.gone: bool | str = False  # the launcher (the hub) went away; torchft: why the quorum is lost

    def should_stop(self, state: Any) -> bool:
        if self._preemption.signal is not None:
            if self._member.leaves(self._preemption.orphaned):
                self._member.leave()  # its launcher is gone, the Lighthouse elsewhere: the others train on
            self._member.ask_stop()
        return self._member.stop

    @property
    def signal(self) -> int | None:
        """The stop signal this process received, if any (timed rounds end the round at it)."""
        return self._preemption.signal

    @property
    def reason(self) -> str:
        if self.gone:
            return self.gone if isinstance(self.gone, str) else "the launcher is gone"
        return self._preemption.reason if self._preemption.signal else "a stop signal to the launcher or another rank"

    def close(self) -> None:
        self._preemption.close()
