"""Elastic runs (`jaxdp.launch --elastic`, jaxdp/elastic/hub.py): the hub sums every shard in shard order
whoever computed it, hands a lost member's shards to the others (the step in flight included), and
hands the state to a member that joins. A real run that loses both of its processes to kill -9 ends
with exactly the parameters of a one-process run of the same global batch."""

import json
import os
import re
import selectors
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from helpers import ROOT, LaunchedRun, cli_env, elastic_rank
from jaxdp.bench.goodput import training_processes
from jaxdp.elastic import hub as elastic
from jaxdp.launcher.hub import Hub

PY = sys.executable


class HubThread:
    """A Hub driven by its own selector loop, as the launcher drives it."""

    def __init__(self, size: int):
        self.hub = Hub(size)
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
            with self.lock:
                self.hub.tick()  # the timeouts

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


def test_a_stop_signal_while_a_process_compiles_ends_it_with_75_before_it_joins(hub, capsys):
    """A process that joins compiles first (a minute on a slow machine); a SIGTERM then (a preemption,
    or the launcher dying: PR_SET_PDEATHSIG) must not kill it silently with 143, nor let it join."""
    from jaxdp.cluster.preemption import Preemption
    from jaxdp.loop.trainer import _join

    class Compiling:  # the elastic step's warm_up, during which the signal arrives
        def warm_up(self, state, batch):
            os.kill(os.getpid(), signal.SIGTERM)

    h = hub(2)
    member, preemption = elastic.Member(h.hub.address, 1, 2), Preemption()
    try:
        with pytest.raises(SystemExit) as stopped:
            _join(member, {"w": np.zeros(2)}, None, Compiling(), lambda step: None, preemption)
    finally:
        preemption.close()
    assert stopped.value.code == 75 and member.sock is None
    assert capsys.readouterr().err == "jaxdp: rank 1: SIGTERM before this process joined; exit code 75\n"
    assert not any("rank 1" in line for line in h.hub.events)  # it never said hello


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


def test_a_member_that_owes_its_part_past_the_stall_timeout_is_left_out_and_its_shard_computed_by_another(hub):
    h = hub(2)
    a, b = elastic.Member(h.hub.address, 0, 2), elastic.Member(h.hub.address, 1, 2)
    a.stall_timeout = b.stall_timeout = 0.5  # (the members' --stall-timeout, told in their hellos)
    assert a.connect() is True and b.connect() is False
    out = {}
    first = threading.Thread(target=member_loop, args=(a, range(0, 1), out))
    first.start()
    b.receive_state()
    first.join()
    # Step 1: rank 1 sends nothing (stopped, say); rank 0 is asked for shard 1 and gets the whole total.
    second = threading.Thread(target=member_loop, args=(a, range(1, 2), out), daemon=True)
    second.start()
    second.join(timeout=60)
    assert 1 in out, f"rank 0 still waits for rank 1's part of step 1: {h.hub.events}"
    for got, want in zip(out[1][0], expected(1, 2)):
        np.testing.assert_array_equal(got, want)
    assert out[1][1] == [0, 1] and h.hub.stalled == [1], h.hub.events
    assert any(line.startswith("rank 1 stalled: sent nothing for step 1 within 0.5 s") for line in h.hub.events)
    a.close(finished=True)
    b.close()


@pytest.mark.slow  # over 3 s on 2 cores
def test_elastic_flags_are_checked(tmp_path):
    def launch(*args):
        return subprocess.run([PY, "-m", "jaxdp.launch", *args], cwd=ROOT, env=cli_env(), capture_output=True,
                              text=True, timeout=120)

    proc = launch("--elastic", "--nnodes", "2", "--node-rank", "0", "--coordinator", "127.0.0.1:29999",
                  "--nproc-per-node", "1", "--", PY, "-c", "pass")
    assert proc.returncode == 2 and "--elastic with the hub runs on one node" in proc.stderr
    proc = launch("--elastic", "--nproc-per-node", "2", "--max-restarts", "3", "--", PY, "-m", "jaxdp.train",
                  "--devices", "1", "--steps", "2", "--no-progress")
    assert proc.returncode == 2, proc.stderr
    assert "--strategy" in proc.stderr and "use strategy='host'" not in proc.stderr and "Traceback" not in proc.stderr
    assert "restarting" not in proc.stderr
    from jaxdp.sync import rules

    assert rules.ELASTIC_ENV == elastic.ENV_ADDRESS  # the rules table knows an elastic member by the same variable


@pytest.mark.slow
def test_a_run_that_loses_each_process_to_kill_9_ends_with_a_one_process_runs_parameters(tmp_path):
    from helpers import commands, readme_blocks

    steps = 100_000  # a preemption ends it once each rank has been killed, has rejoined and has trained on
    (block,) = readme_blocks("tests/test_elastic.py::test_a_run_that_loses_each_process_to_kill_9_ends_with_a_one_process_runs_parameters")
    (command,) = commands(block)  # docs/multihost.md's, with a length and a metrics file
    words = [PY if word == "python" else word for word in shlex.split(command)]
    assert words[1:3] == ["-m", "jaxdp.launch"], words
    run = LaunchedRun(words[3:] + ["--steps", str(steps), "--no-progress", "--log-every", "10",
                                   "--metrics-file", str(tmp_path / "m.jsonl")],
                      tmp_path / "launch.log", tmp_path / "m.jsonl", cwd=tmp_path)

    def kill(rank: int) -> None:
        victim = next(p for p in training_processes(run.proc.pid) if elastic_rank(p) == rank)
        os.kill(victim, signal.SIGKILL)

    try:
        run.wait_for(lambda: run.reached() >= 100, "step 100")
        joins = run.text().count("rank 1 joined")  # (once at the start, unless rank 0 was first to step)
        kill(1)  # the other rank trains on, computing shard 1 too
        run.wait_for(lambda: run.text().count("rank 1 joined") > joins, "rank 1's rejoin")
        at = run.reached()
        run.wait_for(lambda: run.reached() >= at + 50, "50 more steps")
        kill(0)  # rank 0, which writes the metrics and checkpoints
        run.wait_for(lambda: "rank 0 joined" in run.text(), "rank 0's rejoin")
        at = run.reached()
        run.wait_for(lambda: run.reached() >= at + 50, "50 more steps with both ranks back")
        run.proc.send_signal(signal.SIGTERM)  # a preemption: rank 0 saves the step it holds, every process exits 75
        assert run.proc.wait(timeout=120) == 75, run.text()
    finally:
        run.close()
    text = run.text()
    assert "restarting it alone (2 of 100)" in text and "all 2 processes ended (2 restarts); exit code 75" in text, text
    assert "no process holds the state" not in text  # each time the other process held it: no checkpoint read
    (saved,) = {int(n) for n in re.findall(r"saved step (\d+) to ", text)}  # the preemption's save
    reference = subprocess.run([PY, "-m", "jaxdp.train", "--strategy", "host", "--devices", "2", "--steps", str(saved),
                                "--no-progress", "--checkpoint-dir", str(tmp_path / "reference"), "--save-every", "1000"],
                               cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr
    final = [json.loads((tmp_path / d / str(saved) / "jaxdp_checksums.json").read_text()) for d in ("ckpt", "reference")]
    assert final[0] == final[1] and any(k.startswith("params") for k in final[0])


# ---------------------------------------------------------------------------------------------
# A real run's hub under bad connections, a killed launcher, a stopped member
# ---------------------------------------------------------------------------------------------


class Run(LaunchedRun):
    """`python -m jaxdp.launch --elastic --nproc-per-node 2` of a long jaxdp.train run, its stderr in a
    file; `reached()` is the last step in its metrics file."""

    def __init__(self, tmp_path, *train_flags: str, max_restarts: int = 0):
        self.ckpt = tmp_path / "ckpt"
        super().__init__(["--elastic", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
                          "--", PY, "-m", "jaxdp.train", "--strategy", "host", "--devices", "1", "--steps", "100000",
                          "--no-progress", "--log-every", "1", "--metrics-file", str(tmp_path / "m.jsonl"),
                          "--checkpoint-dir", str(self.ckpt), "--save-every", "100000", *train_flags],
                         log=tmp_path / "launch.log", metrics=tmp_path / "m.jsonl", cwd=tmp_path)

    def hub(self) -> tuple[str, int]:
        address = self.text().split(", hub ", 1)[1].split()[0].rstrip(",")
        host, port = address.rsplit(":", 1)
        return host, int(port)

    def members(self) -> dict[int, int]:
        return {elastic_rank(p): p for p in training_processes(self.proc.pid)}

    def saved(self) -> int:
        """The step rank 0 says it saved when it stopped, which must be the checkpoint directory's latest."""
        line = next(line for line in self.text().splitlines() if "jaxdp: preempted (" in line)
        step = int(line.split("saved step ", 1)[1].split()[0])
        steps = sorted(int(d.name) for d in self.ckpt.iterdir() if d.name.isdigit())
        assert steps[-1] == step and (self.ckpt / str(step) / "jaxdp_checksums.json").exists(), (steps, line)
        return step



def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_hub_drops_a_malformed_or_silent_connection_and_the_run_goes_on(tmp_path):
    run = Run(tmp_path, "--stall-timeout", "60")
    try:
        run.wait_for(lambda: run.reached() >= 10, "step 10")
        members = run.members()
        # A connection that sends nothing: the members step on while it is open (the hub waits for no one).
        silent = socket.create_connection(run.hub(), timeout=10)
        at = run.reached()
        run.wait_for(lambda: run.reached() >= at + 20, "20 more steps with a silent connection open")
        silent.setblocking(False)
        with pytest.raises(BlockingIOError):
            silent.recv(1)  # still open: the steps did not wait for the hub to give up on it
        # Malformed messages from local processes: each connection is dropped, with one line naming it.
        old = lambda head: struct.pack(">I", len(head)) + head  # noqa: E731 - f0dd332's framing
        new = lambda head, nbytes=0: struct.pack(">IQ", len(head), nbytes) + head  # noqa: E731 - jaxdp/cluster/wire.py's
        bad = [old(b"[1]"),                                   # a 7-byte message whose header is not an object
               old(b'{"op": "hello", "nbytes": "abc"}'),      # a payload length that is not a number
               new(b"[1]"),                                   # a header that is not an object
               new(b'{"op": "hello", "rank": "0"}'),          # a hello whose rank is a string
               new(b"{}", 1 << 62)]                           # an oversize payload
        for message in bad:
            with socket.create_connection(run.hub(), timeout=10) as conn:
                conn.sendall(message)
        run.wait_for(lambda: run.text().count("dropped the connection from 127.0.0.1:") >= len(bad),
                     "a line for each malformed connection")
        at = run.reached()
        run.wait_for(lambda: run.reached() >= at + 20, "20 more steps after the malformed connections")
        assert run.members() == members  # no member was lost or restarted
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=120) == 75, run.text()
        silent.close()
    finally:
        run.close()
    text = run.text()
    assert "Traceback" not in text and "restarting" not in text, text
    assert "all 2 processes ended (0 restarts); exit code 75" in text, text
    for why in ("closed in the middle of a message", "a payload of", "the header is a JSON list, not an object",
                "field 'rank' of a 'hello' message is str, not int"):
        assert why in text, (why, text)
    run.saved()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_killed_launcher_leaves_rank_0_saving_the_state_and_every_member_exiting_75(tmp_path):
    run = Run(tmp_path)
    try:
        run.wait_for(lambda: run.reached() >= 20 and len(run.members()) == 2, "step 20")
        members = run.members()
        run.proc.kill()  # the hub goes with it; the members get SIGTERM too (PR_SET_PDEATHSIG)
        run.proc.wait()
        deadline = time.monotonic() + 120
        while not all(_gone(pid) for pid in members.values()):
            assert time.monotonic() < deadline, run.text()
            time.sleep(0.05)
    finally:
        run.close()
        for pid in run.members().values():
            os.kill(pid, signal.SIGKILL)
    text = run.text()
    step = run.saved()  # rank 0 saved the step it held (no checkpoint before: --save-every 100000)
    assert step >= 20 and "jaxdp: preempted (the launcher is gone)" in text, text
    assert f"saved step {step} to {run.ckpt}, exit code 75" in text, text
    # rank 1 lost the launcher while training, or (a slow join under load) got its SIGTERM or lost the
    # launcher while it was still compiling or joining: exit code 75 all the same, said in one line
    rank_1 = [line for line in text.splitlines() if "rank 1 lost the launcher" in line or "jaxdp: rank 1: " in line]
    assert len(rank_1) == 1 and rank_1[0].endswith("exit code 75"), text
    assert "exit code 69" not in text and "Traceback" not in text, text


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stopped_member_is_left_out_after_the_stall_timeout_and_sigterm_stops_the_run(tmp_path):
    run = Run(tmp_path, "--stall-timeout", "3", max_restarts=1)
    stopped = []
    try:
        # Rank 1 must have joined: on a loaded machine rank 0 trains alone while rank 1 compiles, and a
        # process stopped before it joins is no member for the hub to leave out.
        run.wait_for(lambda: run.reached() >= 20 and "rank 1 joined" in run.text(), "step 20 with rank 1 joined")
        joins = run.text().count("rank 1 joined")
        first = run.members()
        stopped.append(first[1])
        os.kill(stopped[-1], signal.SIGSTOP)  # alive, silent: the hub leaves it out, the launcher restarts it
        run.wait_for(lambda: "rank 1 stalled: " in run.text(), "rank 1 left out")
        run.wait_for(lambda: run.text().count("rank 1 joined") > joins, "rank 1's restart and rejoin")
        at = run.reached()
        run.wait_for(lambda: run.reached() >= at + 10, "10 more steps")
        (again,) = set(training_processes(run.proc.pid)) - {first[0]}  # (forked by the zygote: no rank in its environ)
        stopped.append(again)
        os.kill(again, signal.SIGSTOP)
        run.proc.send_signal(signal.SIGTERM)  # a stop signal with a stopped member: rank 0 saves, all exit 75
        try:
            code = run.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not stop within 90 s of SIGTERM with rank 1 stopped:\n{run.text()}")
    finally:
        for pid in stopped:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        run.close()
    text = run.text()
    assert code == 75, text
    assert "process 1 was left out by the hub (killed by the launcher); restarting it alone (1 of 1)" in text, text
    # Each stop came while rank 1's part of a step was owed (or half sent), and the hub left it out,
    # or (the second) after it was in and the last step summed: the launcher kills the stopped process.
    assert text.count("rank 1 stalled: ") == 2 or "process 1 has been stopped (SIGSTOP) for 3 s" in text, text
    assert " 3 s (--stall-timeout)" in text.split("rank 1 stalled: ", 1)[1].splitlines()[0], text
    assert run.saved() >= at + 10
    assert "all 2 processes ended (1 restart); exit code 75" in text, text
