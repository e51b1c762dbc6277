"""When to save: every N steps, or `--save-every auto`, an interval chosen from the measured save cost.

    plan = SavePlan("auto", restarts=1, mtbf_s=12.0)     # the launcher's failure record (env, see below)
    plan.due(before, done)        # is a save due after training from step `before` to `done`?
    plan.probing(done)            # is this save the one that measures?
    record = plan.decide(done, step_s=..., blocked_s=..., written_s=...)   # -> plan.every, one line

No JAX here: the checkpointer (jaxdp/checkpoint/checkpointer.py) measures, this module decides.

How auto decides. A save costs the training loop C seconds (`blocked_s`: the state copied to host
memory and handed to orbax; the files are written in the background, `written_s`), and a failure
costs the work since the last save. The first save, 20 steps after the compiling step, is the
measurement: its C, its background write W, and the step time t of those 20 steps. Then:

* no failure seen yet: save as often as a budget of OVERHEAD (1 %) of the training time allows,
  N = C / (0.01 t) steps: a run that never fails loses at most 1 % to its checkpoints;
* the launcher has restarted this run (JAXDP_RESTARTS > 0): with M the mean time between the
  failures seen so far (JAXDP_MTBF_S, the launcher's), Young's interval T = sqrt(2 C M) (Young 1974;
  Daly 2006), the interval that minimises save cost plus lost work, N = T / t steps;
* never less than W / t: a background write finishes before the next save starts, so saves never
  queue up behind each other (orbax waits for the previous write at every save).

The first save's C includes one-time costs (orbax's first save sets up its threads), so it errs
towards saving less often. Every process of a multi-process run must save at the same steps: the
probe is at a fixed step, and process 0's N is the run's (the checkpointer shares it). Checkpoints
record the costs, so a restarted run decides again at once, with the failures seen until then,
without a measuring save (on the same device count; else it measures again). The decision is one
console line and a `save_every` event in the metrics file.
"""

from __future__ import annotations

import math
import os
import time

from jaxdp.registry import AUTO  # --save-every auto

OVERHEAD = 0.01  # the share of training time checkpoints may take when no failure has been seen
PROBE_AFTER = 20  # the measuring save: this many steps after the first (compiling) step
ENV_RESTARTS = "JAXDP_RESTARTS"  # set by jaxdp.launch: how many times it has restarted a lost process
ENV_MTBF = "JAXDP_MTBF_S"  # and the mean time between those failures (seconds), when there was one
COSTS = ("step_s", "blocked_s", "written_s")  # what a decision is made from (checkpoints record them)


def parse(text: str) -> int | str:
    """--save-every's value: an int >= 0, or "auto"; ValueError (one line) otherwise."""
    if str(text).strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"--save-every must be a number of steps (0: only at the end) or auto, got {text!r}") from None
    if value < 0:
        raise ValueError(f"--save-every must be 0 or more (0: only at the end) or auto, got {value}")
    return value


def failures_from_env(environ: dict | None = None) -> tuple[int, float | None]:
    """(restarts, mean time between failures) from the launcher's environment; (0, None) outside it."""
    environ = os.environ if environ is None else environ
    try:
        restarts = max(int(environ.get(ENV_RESTARTS, "0")), 0)
        mtbf_s = float(environ[ENV_MTBF]) if restarts and ENV_MTBF in environ else None
    except ValueError:
        return 0, None
    return restarts, mtbf_s if mtbf_s is None or mtbf_s > 0 else None


def mtbf(launched_at: float, failures: list[float]) -> float | None:
    """Mean seconds between failures: from the launch to the last failure, over their count."""
    return (failures[-1] - launched_at) / len(failures) if failures else None


class SavePlan:
    """Which steps to save at: `every` steps (0: none but the final save), or "auto" (see the module
    docstring): a probe save at `PROBE_AFTER` steps past the first step, then every `every` steps
    from there once `decide` has set it."""

    def __init__(self, every: int | str, *, restarts: int = 0, mtbf_s: float | None = None):
        self.auto = every == AUTO
        self.every = 0 if self.auto else int(every)
        self.restarts, self.mtbf_s = restarts, mtbf_s
        self.probe: int | None = None  # auto: the measuring save's step, fixed at the first `due`
        self.start: tuple[int, float] | None = None  # auto: (step, time) of the first `due`, after compiling
        self.decision: dict | None = None

    def due(self, before: int, done: int) -> bool:
        """Is a save due after training from step `before` to `done` (one step, or a paced round)?
        The first call of an auto plan (after the compiling step) starts its clock."""
        if self.auto and self.start is None:
            self.start, self.probe = (done, time.perf_counter()), done + PROBE_AFTER
            return False
        if self.auto and self.decision is None:
            return before < self.probe <= done
        if not self.every:
            return False
        origin = self.probe if self.auto else 0
        return (done - origin) // self.every > (before - origin) // self.every

    def probing(self, done: int) -> bool:
        """Is the save at `done` an auto plan's measurement (the checkpointer then times it)?"""
        return self.auto and self.decision is None and self.probe is not None and done >= self.probe

    def step_s(self, done: int, now: float) -> float:
        """Seconds per step since the clock started (the caller waits for step `done` first)."""
        step, then = self.start
        return (now - then) / max(done - step, 1)

    def decide(self, done: int, *, step_s: float, blocked_s: float, written_s: float, recalled: bool = False) -> dict:
        """Set `every` from the measured costs; returns the decision's record (with "why", the line).
        The same costs and failure record give the same interval on every process."""
        step_s = max(step_s, 1e-9)
        floor = max(1, math.ceil(written_s / step_s))  # writes never queue behind each other
        if self.mtbf_s is None:
            wanted = math.ceil(blocked_s / (OVERHEAD * step_s))
            reason = f"{OVERHEAD:.0%} of the training time at most, no failure seen"
        else:
            wanted = math.ceil(math.sqrt(2 * blocked_s * self.mtbf_s) / step_s)
            reason = (f"Young's interval sqrt(2 x save cost x {self.mtbf_s:.1f} s between failures, "
                      f"{self.restarts} restart{'s' if self.restarts != 1 else ''} so far)")
        every = max(floor, wanted)
        if floor > wanted:
            reason += f", raised to the background write's {written_s:.2f} s"
        self.every = every
        if recalled:  # a restarted run: the costs its checkpoint recorded, no measuring save
            self.start, self.probe = (done, time.perf_counter()), done
        measured = "measured before the restart" if recalled else "measured"
        self.decision = {"save_every": every, "from_step": done, "step_s": step_s, "blocked_s": blocked_s,
                         "written_s": written_s, "mtbf_s": self.mtbf_s, "restarts": self.restarts,
                         "recalled": recalled,
                         "why": (f"every {every} steps ({every * step_s:.1f} s): a save blocks training "
                                 f"{blocked_s * 1e3:.0f} ms and writes for {written_s:.2f} s in the background, "
                                 f"a step takes {step_s * 1e3:.1f} ms ({measured}); {reason}")}
        return self.decision

    def costs(self) -> dict | None:
        """What the decision was made from, for checkpoints to record (None before it)."""
        return None if self.decision is None else {k: self.decision[k] for k in COSTS}
