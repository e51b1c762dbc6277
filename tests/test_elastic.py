"""Elastic runs (`jaxdp.launch --elastic`, jaxdp/cluster/elastic.py): the hub sums every shard in shard order
whoever computed it, hands a lost member's shards to the others (the step in flight included), and
hands the state to a member that joins. A real run that loses both of its processes to kill -9 ends
with exactly the parameters of a one-process run of the same global batch."""

import json
import os
import selectors
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers import ROOT, cli_env
from jaxdp.bench.goodput import training_processes
from jaxdp.cluster import elastic

PY = sys.executable


class HubThread:
    """A Hub driven by its own selector loop, as the launcher drives it."""

    def __init__(self, size: int):
        self.hub = elastic.Hub(size)
        self.selector = selectors.DefaultSelector()
        self.hub.watch(self.selector)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.is_set():
            for key, _ in self.selector.select(timeout=0.02):
                with self.lock:
                    self.hub.ready(key.data)

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.hub.close()


@pytest.fixture
def hub():
    made = []

    def make(size):
        made.append(HubThread(size))
        return made[-1]

    yield make
    for h in made:
        h.close()


def grads(step: int, shard: int) -> list[np.ndarray]:
    """A shard's 'gradient sums' of a step: distinct float32 values, and an int32 counter."""
    rng = np.random.default_rng(1000 * step + shard)
    return [rng.standard_normal(5).astype(np.float32), np.array([shard + 1], np.int32)]


def expected(step: int, size: int) -> list[np.ndarray]:
    total = [np.zeros(5, np.float32), np.zeros(1, np.int32)]
    for shard in range(size):  # in shard order
        for acc, part in zip(total, grads(step, shard)):
            acc += part
    return total


def member_loop(member: elastic.Member, steps: range, out: dict, state: bytes = b"") -> None:
    """A member's steps: send its shards, compute more when asked, record the totals, donate when told."""
    for step in steps:
        payload, donate = member.reduce(step, {s: grads(step, s) for s in member.shards}, lambda s: grads(step, s))
        out[step] = (elastic.unpack(payload, grads(step, 0)), list(member.shards))
        if donate:
            member.send_state(step + 1, [np.frombuffer(state or b"state", np.uint8)])


def test_the_total_is_every_shard_in_shard_order_and_a_lost_members_shard_is_computed_by_another(hub):
    h = hub(3)
    members = [elastic.Member(h.hub.address, rank, 3) for rank in range(3)]
    assert members[0].connect() is True  # rank 0 is the source of the state
    for m in members[1:]:
        assert m.connect() is False
    results = [{} for _ in members]
    # Step 0: rank 0 alone holds the state, so it computes all three shards; then it donates.
    first = threading.Thread(target=member_loop, args=(members[0], range(0, 1), results[0]))
    first.start()
    joined = [m.receive_state() for m in members[1:]]
    first.join()
    assert [j[0] for j in joined] == [1, 1] and bytes(joined[0][1]) == b"state"
    assert results[0][0][1] == [0]  # from step 1 on, each computes its own shard
    for got, want in zip(results[0][0][0], expected(0, 3)):
        np.testing.assert_array_equal(got, want)
    # Steps 1-2 with all three; then rank 2 disappears after sending nothing for step 3.
    threads = [threading.Thread(target=member_loop, args=(m, range(1, 3), r)) for m, r in zip(members, results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    members[2].close()  # lost in the middle of step 3: its shard is asked of another member
    threads = [threading.Thread(target=member_loop, args=(m, range(3, 5), r)) for m, r in zip(members[:2], results)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for step in range(1, 5):
        for rank in (0, 1):
            for got, want in zip(results[rank][step][0], expected(step, 3)):
                np.testing.assert_array_equal(got, want)
    assert sorted(results[0][4][1] + results[1][4][1]) == [0, 1, 2]  # shard 2 now has a live owner
    assert any("rank 2 lost" in line for line in h.hub.events)
    for m in members[:2]:
        m.close(finished=True)


def test_with_no_live_holder_rank_0_becomes_the_source_again(hub):
    h = hub(2)
    a, b = elastic.Member(h.hub.address, 0, 2), elastic.Member(h.hub.address, 1, 2)
    assert a.connect() is True and b.connect() is False
    a.close()  # the only holder is gone before any step: rank 1 waits for rank 0
    deadline = time.monotonic() + 10
    while h.hub.holders and time.monotonic() < deadline:
        time.sleep(0.01)
    again = elastic.Member(h.hub.address, 0, 2)
    assert again.connect() is True
    out = {}
    first = threading.Thread(target=member_loop, args=(again, range(7, 8), out))
    first.start()  # (the source restored step 7 from its checkpoint, say)
    step, _ = b.receive_state()
    first.join()
    assert step == 8
    for got, want in zip(out[7][0], expected(7, 2)):
        np.testing.assert_array_equal(got, want)
    again.close(finished=True)
    b.close(finished=True)


def test_elastic_flags_are_checked(tmp_path):
    def launch(*args):
        return subprocess.run([PY, "-m", "jaxdp.launch", *args], cwd=ROOT, env=cli_env(), capture_output=True,
                              text=True, timeout=120)

    proc = launch("--elastic", "--nnodes", "2", "--node-rank", "0", "--coordinator", "127.0.0.1:29999",
                  "--nproc-per-node", "1", "--", PY, "-c", "pass")
    assert proc.returncode == 2 and "--elastic runs on one node" in proc.stderr
    proc = launch("--elastic", "--nproc-per-node", "2", "--max-restarts", "3", "--", PY, "-m", "jaxdp.train",
                  "--devices", "1", "--steps", "2", "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert "--strategy" in proc.stderr and "use strategy='host'" not in proc.stderr and "Traceback" not in proc.stderr
    assert "restarting" not in proc.stderr


def _elastic_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    rank = env.get(elastic.ENV_RANK.encode())
    return None if rank is None else int(rank)


@pytest.mark.slow
def test_a_run_that_loses_each_process_to_kill_9_ends_with_a_one_process_runs_parameters(tmp_path):
    from helpers import commands, readme_blocks

    steps = 2000  # rank 0 rejoins by step ~600 here; the rest is margin for a loaded machine
    (block,) = readme_blocks("tests/test_elastic.py::test_a_run_that_loses_each_process_to_kill_9_ends_with_a_one_process_runs_parameters")
    (command,) = commands(block)  # docs/multihost.md's, with a length and a metrics file
    log = tmp_path / "launch.log"
    metrics = tmp_path / "m.jsonl"
    with open(log, "w") as err:
        proc = subprocess.Popen([PY if word == "python" else word for word in shlex.split(command)]
                                + ["--steps", str(steps), "--no-progress", "--log-every", "10", "--metrics-file", str(metrics)],
                                cwd=tmp_path, env=cli_env(), stderr=err, stdout=subprocess.DEVNULL)

    def reached() -> int:
        try:
            lines = metrics.read_text().splitlines()
        except OSError:
            return 0
        return max((json.loads(line).get("step", 0) for line in lines if line.strip().startswith("{")), default=0)

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no {what} within 120 s:\n{log.read_text()}"
            time.sleep(0.01)

    def kill(rank: int) -> None:
        victim = next(p for p in training_processes(proc.pid) if _elastic_rank(p) == rank)
        os.kill(victim, signal.SIGKILL)

    try:
        wait_for(lambda: reached() >= 100, "step 100")
        joins = log.read_text().count("rank 1 joined")  # (once at the start, unless rank 0 was first to step)
        kill(1)  # the other rank trains on, computing shard 1 too
        wait_for(lambda: log.read_text().count("rank 1 joined") > joins, "rank 1's rejoin")
        at = reached()
        wait_for(lambda: reached() >= at + 50, "50 more steps")
        kill(0)  # rank 0, which writes the metrics and checkpoints
        wait_for(lambda: "rank 0 joined" in log.read_text(), "rank 0's rejoin")
        assert proc.wait(timeout=300) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "restarting it alone (2 of 100)" in text and "all 2 processes ended (2 restarts); exit code 0" in text, text
    assert "no process holds the state" not in text  # each time the other process held it: no checkpoint read
    reference = subprocess.run([PY, "-m", "jaxdp.train", "--strategy", "host", "--devices", "2", "--steps", str(steps),
                                "--no-progress", "--checkpoint-dir", str(tmp_path / "reference"), "--save-every", "1000"],
                               cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr
    final = [json.loads((tmp_path / d / str(steps) / "jaxdp_checksums.json").read_text()) for d in ("ckpt", "reference")]
    assert final[0] == final[1] and any(k.startswith("params") for k in final[0])
