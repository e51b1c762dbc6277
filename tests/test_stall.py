"""An alive but stuck peer (SIGSTOP): every reachable process exits 69 with one line naming it, within
--stall-timeout + 10 s; the stopped one, once continued, reports the same verdict. And the straggler
report in the metrics."""

import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, cli_env, free_port, records
from jaxdp.errors import EXIT_PEER_LOST

STALL = 5


def start(rank, port, tmp_path, *flags):
    err = open(tmp_path / f"p{rank}.err", "w")
    return subprocess.Popen([sys.executable, "-m", "jaxdp.train", "--devices", "2", "--batch-size", "64",
                             "--log-every", "1", "--no-progress", *map(str, flags), "--coordinator-address",
                             f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(rank)],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=err)


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
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
    err = (tmp_path / f"p{1 - victim}.err").read_text().strip().splitlines()
    assert err[-1].startswith("jaxdp: error:") and f"process {victim}" in err[-1], err[-3:]
    assert "stalled" in err[-1] or "has not answered" in err[-1], err[-3:]
    assert "Traceback" not in "\n".join(err)
    assert victim_code == EXIT_PEER_LOST
    if victim == 1:  # the verdict waited on its connection: it blames itself, not process 0
        mine = (tmp_path / "p1.err").read_text().strip().splitlines()
        assert "process 1 (of 2) stalled" in mine[-1], mine[-3:]


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
    from jaxdp import heartbeat

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
