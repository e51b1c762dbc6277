"""An alive but stuck peer (SIGSTOP): every reachable process exits 69 with one line naming it, within
--stall-timeout + 10 s; the stopped one, once continued, reports the same verdict. And the straggler
report in the metrics."""

import json
import signal
import time

import numpy as np
import pytest

from helpers import free_port, records, spawn_cli, step_records
from jaxdp.errors import EXIT_PEER_LOST

STALL = 5


def start(rank, port, tmp_path, *flags):
    return spawn_cli("--devices", "2", "--batch-size", "64", "--log-every", "1", "--no-progress", *map(str, flags),
                     "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(rank),
                     stderr=tmp_path / f"p{rank}.err")



def verdict(path) -> str:
    """The last line jaxdp wrote to `path`: the runtime's threads may still log after it (the JAX
    coordination client's "Terminating process ..." as the process goes down)."""
    return [line for line in path.read_text().splitlines() if line.startswith("jaxdp: ")][-1]


def reap(procs) -> None:
    """Continue any stopped process, then kill and wait for every one still running."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()

@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", [1, 0])
def test_a_stopped_process_is_named_by_the_others_within_the_stall_timeout(tmp_path, victim):
    port, metrics = free_port(), tmp_path / "m.jsonl"
    procs = [start(i, port, tmp_path, "--steps", 100_000, "--stall-timeout", STALL, "--metrics-file", metrics)
             for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):  # past compilation
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (tmp_path / "p0.err").read_text()
            time.sleep(0.1)
        procs[victim].send_signal(signal.SIGSTOP)
        survivor = procs[1 - victim]
        assert survivor.wait(timeout=STALL + 10) == EXIT_PEER_LOST  # the requirement; also the hang guard
        procs[victim].send_signal(signal.SIGCONT)
        victim_code = procs[victim].wait(timeout=30)
    finally:
        reap(procs)
    err, theirs = (tmp_path / f"p{1 - victim}.err").read_text().strip().splitlines(), verdict(tmp_path / f"p{1 - victim}.err")
    assert theirs.startswith("jaxdp: error:") and f"process {victim}" in theirs, err[-3:]
    assert "stalled" in theirs or "has not answered" in theirs, err[-3:]
    assert "Traceback" not in "\n".join(err)
    assert victim_code == EXIT_PEER_LOST
    if victim == 1:  # the verdict waited on its connection: it blames itself, not process 0
        mine = verdict(tmp_path / "p1.err")
        assert mine.startswith("jaxdp: error: process 1 (of 2) stalled"), mine


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_stopped_during_the_final_evaluation_is_named(tmp_path):
    """The watch used to stop with the training loop: the other process waited in the evaluation's
    collective until JAX aborted it (SIGABRT 134 after 40-50 s, no jaxdp line)."""
    rng = np.random.default_rng(0)
    data, metrics, port = tmp_path / "data.npz", tmp_path / "m.jsonl", free_port()
    np.savez(data, x=rng.standard_normal((256, 4)), y=rng.integers(0, 3, 256),  # held out: 313 batches, seconds
             x_test=rng.standard_normal((80_000, 4)), y_test=rng.integers(0, 3, 80_000))
    procs = [start(i, port, tmp_path, "--dataset", data, "--steps", 5, "--stall-timeout", STALL,
                   "--metrics-file", metrics) for i in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and any(r["step"] == 5 for r in step_records(metrics))):  # the loop is over
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (tmp_path / "p0.err").read_text()
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGSTOP)
        assert procs[0].wait(timeout=STALL + 10) == EXIT_PEER_LOST  # the requirement; also the hang guard
        procs[1].send_signal(signal.SIGCONT)
        assert procs[1].wait(timeout=30) == EXIT_PEER_LOST
    finally:
        reap(procs)
    for rank in range(2):
        err, said = (tmp_path / f"p{rank}.err").read_text().strip().splitlines(), verdict(tmp_path / f"p{rank}.err")
        assert said.startswith("jaxdp: error: process 1 (of 2) stalled"), err[-3:]
        # the phase it published last: the final one, or training if it was stopped before it got there (never
        # start-up: entering training is published at once, a run of 5 steps can end within one beat); or, when
        # its beats lagged its steps under load, the last step it said it finished
        assert any(why in said for why in ("stalled during the final save and evaluation",
                                           "stalled during training, at step ", "stalled: not done with step ")), said
    assert records(metrics)[-1].get("event") != "done"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_metrics_report_each_process_step_time_and_the_slowest(tmp_path):
    port, metrics = free_port(), tmp_path / "m.jsonl"
    procs = [start(i, port, tmp_path, "--steps", 300, "--stall-timeout", 2, "--metrics-file", metrics)
             for i in range(2)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0], (tmp_path / "p0.err").read_text()[-2000:]
    reported = [r for r in records(metrics) if "slowest_process" in r]
    assert reported, "no log point carried the straggler report"
    for r in reported:
        assert len(r["step_time_by_process"]) == 2 and all(t >= 0 for t in r["step_time_by_process"])
        assert r["slowest_process"] == max((0, 1), key=r["step_time_by_process"].__getitem__)


class _Store:
    """The two calls the heartbeat makes of JAX's coordination-service client, in memory."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def test_a_process_stopped_before_its_first_beat_is_named_once_the_others_pass_step_2():
    """With programs in the compilation cache the first steps take milliseconds: a peer stopped
    before it ever published was never judged, and the survivor waited forever."""
    from jaxdp.cluster import heartbeat

    beat = heartbeat.start(_Store(), 0, 2, stall_timeout=60)
    beat.stop()  # its threads end: the checks below read only what is set here
    start = time.monotonic()
    beat._records = {0: {"seq": 3, "done": 4, "own": None, "finished": False}}  # 1 never published
    beat._first_done = {2: start, 3: start, 4: start}  # process 0 finished step 4: 1 was in the loop
    assert beat._verdict(start + 59) is None  # within --stall-timeout of step 2
    verdict = beat._verdict(start + 61)
    assert verdict.startswith("process 1 (of 2) stalled: not done with step 5"), verdict
    beat._first_done = {}  # nobody past step 1 (compiling): never judged, however long
    assert beat._verdict(start + 1000) is None


def test_a_silent_process_is_named_with_the_phase_it_published():
    from jaxdp.cluster import heartbeat

    beat = heartbeat.start(_Store(), 0, 2, stall_timeout=60)
    beat.stop()
    start = time.monotonic()
    beat._records = {1: {"seq": 9, "done": 5, "own": None, "finished": False, "doing": "the final save and evaluation"}}
    beat._first_done = dict.fromkeys(range(1, 6), start)  # both finished step 5: nobody is behind
    beat._changed = {0: start, 1: start}
    assert beat._verdict(start + 59) is None
    verdict = beat._verdict(start + 61)
    assert verdict.startswith("process 1 (of 2) stalled during the final save and evaluation: "
                              "no heartbeat for 60 s"), verdict


def test_a_phase_is_published_at_once_with_the_steps_before_it_done():
    """Published at the next beat, a stop within a second of the phase's start named the phase
    before it, and a step not yet seen completed as missing."""
    import jax.numpy as jnp

    from jaxdp.cluster import heartbeat

    store = _Store()
    beat = heartbeat.start(store, 1, 2, stall_timeout=60)
    try:
        beat.dispatched(5, jnp.zeros(()), waited_s=0.0)
        beat.dispatched(6, np.float32(0.5), waited_s=0.0)  # the host strategy's metrics are numpy
        beat.phase("the final save and evaluation")
        record = json.loads(store.values["jaxdp/heartbeat/1"])
        assert record["done"] == 6 and record["doing"] == "the final save and evaluation", record
    finally:
        beat.stop()
