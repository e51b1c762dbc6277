"""Stalled and straggling peers: a per-step progress heartbeat and a watchdog, off the training path.

The peer watch (jaxdp/cluster/peer_watch.py) catches a process that *dies*. A process that is alive but makes
no progress (SIGSTOP, a frozen node, a deadlock) keeps its connections open, and the others wait in
the next collective until gloo or JAX's heartbeat aborts them with a C++ trace (jax-ml/jax#38503).
Here every process of a multi-process run publishes its progress, and every process watches all:

* The training thread only hands each dispatched step's output (a small metrics array) to
  `Heartbeat.dispatched`: a deque append and a clock read. It never waits for anything here.
* A *waiter* thread waits for those outputs in order (`block_until_ready` in this thread, not in the
  training thread) and records "completed step k". This adds no host sync to the training path: the
  step's program runs exactly as before; only a background thread learns when it ended.
* A *publisher* thread writes this process's record every `beat` seconds to the key-value store of
  JAX's coordination service (`jaxdp/heartbeat/<process>`: a beat counter, the last completed step,
  what the process is doing, the time per step this process spent on its own work) and reads
  everyone's records.
* The watch runs from start-up (right after the mesh: data loading, compilation, the `--sync-every
  auto` measurement) to the end of the final save and evaluation, not only in the training loop:
  the training thread names each phase (`phase`), and a verdict names the phase the stalled
  process was in. A process that is stopped outside the loop used to leave the others waiting in a
  collective until JAX aborted them, with no jaxdp line.
* A *checker* thread never blocks. From the latest records, on this process's own clock, it finds:
  - a process that has not completed step k within `stall_timeout` seconds of the first process
    completing it, for k >= 2 (step 1 includes compilation, which may take each process a different
    time; it is never judged);
  - a process whose beat has not changed for `stall_timeout` seconds (stopped: SIGSTOP freezes its
    publisher too), or the coordination service itself not answering (process 0 stopped);
  and then every process that sees it exits with EXIT_PEER_LOST and one line naming the stalled
  process(es) and the step, telling the others through the peer watch's connections, so that a
  stopped process that is later continued reports the verdict instead of blaming its peers.

Straggler report: at each log point process 0 adds `step_time_by_process` (seconds per step each
process spent on its own work: the loop's wall time minus the time the training thread waited in the
step call for its devices, which includes waiting for the other processes in the collective) and
`slowest_process` (the largest) to the metrics record. On CPU meshes a step waits for the previous
one (jaxdp/step/train_step.py), so the waiting is measured there; where steps are queued freely (GPUs), the
time is each process's wall time per step and the processes look alike.
"""

from __future__ import annotations

import atexit
import collections
import json
import threading
import time
from typing import Any

from jaxdp.cluster import peer_watch

_KEY = "jaxdp/heartbeat/"
_OBSERVE_FROM_STEP = 2  # step 1 includes compilation


class Heartbeat:
    """A no-op in a single process; `start` returns a live one for a multi-process run."""

    def dispatched(self, step: int, output: Any, waited_s: float) -> None:
        """Step `step` was handed to the devices; `output` becomes ready when it is done."""

    def stragglers(self) -> dict[str, Any]:
        """Extra keys for the metrics record at a log point (process 0 of a multi-process run)."""
        return {}

    def phase(self, doing: str) -> None:
        """What this process does now, outside training steps ("the final evaluation"): published
        at once, and named in a verdict if it stalls there. Call it once the steps dispatched so
        far are done (after a host sync); they count as completed from here on."""

    def stop(self) -> None:
        """Training is over: stop publishing and watching (the others stop judging this process)."""


def start(client: Any, process: int, count: int, stall_timeout: float) -> "LiveHeartbeat":
    """Start the waiter, publisher and checker threads of this process."""
    return LiveHeartbeat(client, process, count, stall_timeout)


class LiveHeartbeat(Heartbeat):
    def __init__(self, client: Any, process: int, count: int, stall_timeout: float):
        self._client, self._me, self._count, self._timeout = client, process, count, float(stall_timeout)
        self._beat = min(1.0, self._timeout / 5)
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._ready = threading.Condition(self._lock)
        self._completed = 0
        self._last_call: float | None = None
        self._own_sum, self._own_steps, self._own = 0.0, 0, None
        self._seq = 0
        self._doing, self._dispatched = "start-up", 0
        self._stopped = threading.Event()
        atexit.register(self.stop)  # whatever ends the process (bad input too), the others learn it finished
        # what the checker sees: the latest record of every process, and when (our clock) each changed
        now = time.monotonic()
        self._records: dict[int, dict] = {}
        self._changed = {p: now for p in range(count)}
        self._first_done: dict[int, float] = {}  # step -> when some process was first seen completing it
        self._last_answer = now                  # the coordination service last answered
        for target, name in ((self._wait_loop, "waiter"), (self._publish_loop, "publisher"),
                             (self._check_loop, "checker")):
            threading.Thread(target=target, name=f"jaxdp-heartbeat-{name}", daemon=True).start()

    # -- the training thread ---------------------------------------------------------------------

    def dispatched(self, step: int, output: Any, waited_s: float) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._last_call is not None:
                self._own_sum += max(0.0, now - self._last_call - waited_s)
                self._own_steps += 1
            self._last_call = now
            entering = not self._doing.startswith("training")
            self._doing, self._dispatched = f"training, at step {step + 1}", step
            self._pending.append((step, output))
            self._ready.notify()
        if entering and not self._stopped.is_set():
            self._publish()  # now, not at the next beat: a short run may end within a beat of its first step

    def phase(self, doing: str) -> None:
        with self._lock:
            waiting = list(self._pending)
        for _, output in waiting:  # done already where the caller synced (the CLI does, before each phase)
            try:
                _wait_for(output)
            except Exception:  # noqa: BLE001 - a failed step is the training thread's to report
                pass
        with self._lock:  # published with the phase, so the others never see those steps as missing
            self._completed = max(self._completed, self._dispatched)
            self._doing = doing
        if not self._stopped.is_set():
            self._publish()  # now, not at the next beat: a phase may be stopped in within a beat of its start

    def stragglers(self) -> dict[str, Any]:
        with self._lock:
            own = [self._records.get(p, {}).get("own") for p in range(self._count)]
        if any(value is None for value in own):
            return {}
        return {"step_time_by_process": own, "slowest_process": max(range(self._count), key=own.__getitem__)}

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        with self._lock:
            self._stopped.set()
            self._ready.notify()
        self._publish(finished=True)

    # -- the waiter: learns when each step is done, in the background -------------------------------

    def _wait_loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stopped.is_set():
                    self._ready.wait()
                if self._stopped.is_set():
                    return
                step, output = self._pending.popleft()
            try:
                _wait_for(output)  # this thread waits; the training thread does not
            except Exception:  # noqa: BLE001 - a failed step is the training thread's to report
                return
            with self._lock:
                self._completed = max(self._completed, step)

    # -- the publisher: our record out, everyone's records in ---------------------------------------

    def _record(self, finished: bool) -> str:
        with self._lock:
            if self._own_steps:
                self._own = self._own_sum / self._own_steps
                self._own_sum, self._own_steps = 0.0, 0
            self._seq += 1
            return json.dumps({"seq": self._seq, "done": self._completed, "own": self._own, "finished": finished,
                               "doing": self._doing})

    def _publish(self, finished: bool = False) -> None:
        try:
            self._client.key_value_set(f"{_KEY}{self._me}", self._record(finished), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the checker notices a service that stopped answering
            pass

    def _publish_loop(self) -> None:
        while not self._stopped.wait(self._beat):
            self._publish()
            try:
                entries = self._client.key_value_dir_get(_KEY)
            except Exception:  # noqa: BLE001 - as above
                continue
            now = time.monotonic()
            with self._lock:
                self._last_answer = now
                for key, value in entries:
                    process, record = int(key.rsplit("/", 1)[1]), json.loads(value)
                    if self._records.get(process, {}).get("seq") != record["seq"]:
                        self._changed[process] = now
                    self._records[process] = record
                    for step in range(max(self._first_done, default=0) + 1, record["done"] + 1):
                        self._first_done[step] = now

    # -- the checker: never blocks ------------------------------------------------------------------

    def _check_loop(self) -> None:
        tick = time.monotonic()
        while not self._stopped.wait(min(0.5, self._beat)):
            now = time.monotonic()
            if now - tick > 2.0:
                # This process itself was not running (stopped, or starved of CPU): give it a fresh
                # start, so that it does not blame peers for time it was frozen. If it was the one
                # stopped, the peer watch delivers the others' verdict meanwhile.
                with self._lock:
                    self._changed = dict.fromkeys(self._changed, now)
                    self._last_answer = now
                    self._first_done = dict.fromkeys(self._first_done, now)
            tick = now
            verdict = self._verdict(now)
            if verdict and not self._stopped.is_set():
                peer_watch.stalled(verdict)

    def _verdict(self, now: float) -> str | None:
        with self._lock:
            if self._me != 0 and now - self._last_answer > self._timeout:
                return (f"process 0 (the coordinator) has not answered for {self._timeout:g} s "
                        f"(--stall-timeout): it is alive but stopped or stuck")
            stalled, at_step, doing = [], None, None
            for p in range(self._count):
                record = self._records.get(p)
                if p == self._me or (record or {}).get("finished"):
                    continue
                if record is None:
                    # Never heard from. Step 2 needed every process inside the training loop, where
                    # its publisher starts, so one silent for stall_timeout after the first process
                    # finished step 2 is stopped (a SIGSTOP before its first beat: fast starts).
                    since = self._first_done.get(_OBSERVE_FROM_STEP)
                    if since is not None and now - since > self._timeout:
                        stalled.append(p)
                        missing = max(self._first_done) + 1
                        at_step = missing if at_step is None else min(at_step, missing)
                    continue
                missing = record["done"] + 1
                first = self._first_done.get(missing)
                behind = (missing >= _OBSERVE_FROM_STEP and first is not None and now - first > self._timeout)
                silent = now - self._changed[p] > self._timeout
                if behind:
                    stalled.append(p)
                    at_step = missing if at_step is None else min(at_step, missing)
                elif silent:
                    stalled.append(p)
                    doing = doing or record.get("doing") or f"step {missing}"
        if not stalled:
            return None
        who = f"process {stalled[0]}" if len(stalled) == 1 else f"processes {stalled}"
        if at_step is None:  # silent, not behind: say in which phase
            return (f"{who} (of {self._count}) stalled during {doing}: no heartbeat for {self._timeout:g} s "
                    f"(--stall-timeout); it is alive but stopped or stuck (SIGSTOP, a frozen node, a deadlock)")
        return (f"{who} (of {self._count}) stalled: not done with step {at_step} {self._timeout:g} s "
                f"(--stall-timeout) after another process finished it, or not answering; it is alive "
                f"but stopped or stuck (SIGSTOP, a frozen node, a deadlock)")


def _wait_for(output: Any) -> None:
    """Until a step's output is ready: a jax.Array's, or at once for a host value (the host strategy's
    metrics are numpy, ready when the step call returns)."""
    ready = getattr(output, "block_until_ready", None)
    if ready is not None:
        ready()


def for_run(stall_timeout: float) -> Heartbeat:
    """A live heartbeat in a multi-process run (JAX started), else the no-op one."""
    import jax

    if jax.process_count() == 1:
        return Heartbeat()
    from jaxdp.cluster.coordination import client as coordination_client

    return start(coordination_client(), jax.process_index(), jax.process_count(), stall_timeout)
