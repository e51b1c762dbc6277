"""Elastic runs on the launcher's hub (`jaxdp.launch --elastic`, jaxdp/elastic/hub.py): the hub forms the
quorums, hands the furthest member's state to one behind, gives every member every piece of an exchange
in rank order, and fails the exchange for all when a member is lost or stalls in it. A real run that
loses both of its processes to kill -9 ends with exactly the parameters of a one-process run of the
same global batch."""

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

from helpers import ROOT, LaunchedRun, cli_env, elastic_rank, run_cli
from jaxdp.bench.goodput import training_processes
from jaxdp.elastic import hub as elastic
from jaxdp.launcher.hub import Hub

PY = sys.executable


class HubThread:
    """A Hub driven by its own selector loop, as the launcher drives it."""

    def __init__(self, size: int, **options):
        self.hub = Hub(size, **options)
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

    def make(size, **options):
        made.append(HubThread(size, **options))
        return made[-1]

    yield make
    for h in made:
        h.close()


def piece(rank: int, step: int) -> np.ndarray:
    """A member's piece of an exchange: distinct bytes per rank and step."""
    return np.random.default_rng(1000 * step + rank).integers(0, 256, (1, 24), np.uint8)


def together(*calls):
    """Each call on its own thread (a member blocks until the others have asked too); their results."""
    out = [None] * len(calls)

    def run(i, call):
        out[i] = call()

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a member still waits for the hub"
    return out


def test_every_member_gets_every_piece_in_rank_order_and_a_lost_member_fails_the_exchange_for_all(hub):
    h = hub(3)
    engines = [elastic.HubEngine(h.hub.address, rank) for rank in range(3)]
    assert together(*[lambda e=e: e.quorum(0, None) for e in engines]) == [None] * 3  # nobody behind
    assert all(e.participants() == 3 and e.participating() for e in engines)
    got = together(*[lambda e=e: e.allgather(piece(e.rank, 0)) for e in engines])
    for pieces in got:
        assert [p.tobytes() for p in pieces] == [piece(r, 0)[0].tobytes() for r in range(3)]
    assert all(e.commit() for e in engines)
    # Rank 2 is lost before its piece of the next exchange: it fails for the others, and their commit says so.
    engines[2].close()
    assert together(*[lambda e=e: e.allgather(piece(e.rank, 1)) for e in engines[:2]]) == [[], []]
    assert not any(e.commit() for e in engines[:2])
    # Asked again, the quorum is the two live members, whose exchange goes through.
    together(*[lambda e=e: e.quorum(1, None) for e in engines[:2]])
    assert engines[0].participants() == 2
    got = together(*[lambda e=e: e.allgather(piece(e.rank, 1)) for e in engines[:2]])
    assert all([p.tobytes() for p in pieces] == [piece(r, 1)[0].tobytes() for r in range(2)] for pieces in got)
    assert all(e.commit() for e in engines[:2])
    for e in engines[:2]:
        e.close(finished=True)


def test_a_member_behind_gets_the_furthest_members_state_and_sits_out_one_exchange(hub):
    h = hub(2)
    a, b = elastic.HubEngine(h.hub.address, 0), elastic.HubEngine(h.hub.address, 1)
    # The run's start: rank 0 restored step 7 from its checkpoint, rank 1 is at step 0.
    received = together(lambda: a.quorum(7, lambda: b"state at 7"), lambda: b.quorum(0, lambda: b"none"))
    assert received == [None, b"state at 7"] and a.participating() and not b.participating()
    together(lambda: a.allgather(piece(0, 7)), lambda: b.allgather(piece(1, 7)))
    assert a.commit() and b.commit() and b.participating()
    # Rank 1 is lost and restarted: it asks for a quorum at once, and joins the live member's next one.
    b.close()
    again = elastic.HubEngine(h.hub.address, 1)
    received = together(lambda: again.quorum(0, None), lambda: (time.sleep(0.2), a.quorum(9, lambda: b"state at 9"))[1])
    assert received == [b"state at 9", None] and again.participants() == 2
    for e in (a, again):
        e.close(finished=True)


def test_a_member_that_owes_its_piece_past_the_stall_timeout_is_left_out(hub):
    h = hub(2)
    a, b = elastic.HubEngine(h.hub.address, 0), elastic.HubEngine(h.hub.address, 1)
    a.set_timeout(0.5)  # (the members' --stall-timeout)
    together(lambda: a.quorum(0, None), lambda: b.quorum(0, None))
    assert a.allgather(piece(0, 0)) == [] and not a.commit()  # rank 1 sent nothing (stopped, say)
    assert h.hub.stalled == [1], h.hub.events
    assert any(line.startswith("rank 1 stalled: sent nothing for exchange 1 of its quorum within 0.5 s")
               for line in h.hub.events), h.hub.events
    assert a.quorum(1, None) is None and a.participants() == 1  # the quorum without it
    a.close(finished=True)
    b.close()


def test_a_stop_reaches_every_member_and_a_joiner_asking_while_the_run_stops_is_told_it_ended(hub):
    h = hub(2, join_timeout_s=0)  # (the start's quorum does not wait for rank 1)
    stops = []
    a = elastic.HubEngine(h.hub.address, 0)
    a.on_stop = lambda: stops.append(0)
    assert a.quorum(0, None) is None  # (alone, once the start's wait is over)
    with h.lock:
        h.hub.request_stop()
    late = elastic.HubEngine(h.hub.address, 1)
    with pytest.raises(elastic.QuorumLost) as ended:
        late.quorum(0, None)
    assert ended.value.ended
    a.allgather(piece(0, 0))
    assert stops == [0]  # the stop came before the exchange's pieces
    a.close(finished=True)
    late.close()


def test_a_stop_signal_while_a_process_compiles_ends_it_with_75_before_it_joins(hub, capsys):
    """A process that joins compiles first (a minute on a slow machine); a SIGTERM then (a preemption,
    or the launcher dying: PR_SET_PDEATHSIG) must not kill it silently with 143, nor let it join."""
    from jaxdp.cluster.preemption import Preemption
    from jaxdp.elastic.workers import HubWorker
    from jaxdp.loop.trainer import _join

    class Compiling:  # the elastic step's warm_up, during which the signal arrives
        def warm_up(self, state, batch):
            os.kill(os.getpid(), signal.SIGTERM)

    h = hub(2)
    member, preemption = HubWorker(h.hub.address, 1, 2), Preemption()  # (a restarted one: it says hello once compiled)
    try:
        with pytest.raises(SystemExit) as stopped:
            _join(member, {"w": np.zeros(2)}, None, Compiling(), lambda step: None, preemption)
    finally:
        preemption.close()
    assert stopped.value.code == 75 and member.engine is None
    assert capsys.readouterr().err == "jaxdp: rank 1: SIGTERM before this process joined; exit code 75\n"
    assert not h.hub.conns  # it never said hello


@pytest.mark.slow  # over 3 s on 2 cores
def test_elastic_flags_are_checked(tmp_path):
    def launch(*args):
        return subprocess.run([PY, "-m", "jaxdp.launch", *args], cwd=ROOT, env=cli_env(), capture_output=True,
                              text=True, timeout=120)

    proc = launch("--elastic", "--nnodes", "2", "--node-rank", "0", "--coordinator", "127.0.0.1:29999",
                  "--nproc-per-node", "1", "--", PY, "-c", "pass")
    assert proc.returncode == 2 and "--elastic with the hub runs on one node" in proc.stderr
    proc = launch("--elastic", "--nproc-per-node", "2", "--max-restarts", "3", "--", PY, "-m", "jaxdp.train",
                  "--devices", "1", "--steps", "2", "--no-progress", "--shard-optimizer")
    assert proc.returncode == 2, proc.stderr
    assert "--shard-optimizer" in proc.stderr and "shard_optimizer=" not in proc.stderr and "Traceback" not in proc.stderr
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
    reference = run_cli("--strategy", "host", "--devices", "2", "--steps", str(saved), "--no-progress",
                        "--checkpoint-dir", str(tmp_path / "reference"), "--save-every", "1000", timeout=300)
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
    # rank 0's stop: its SIGTERM (PR_SET_PDEATHSIG) or its lost connection, whichever it saw first
    assert step >= 20 and ("jaxdp: preempted (the launcher is gone)" in text
                           or "jaxdp: preempted (rank 0 lost the launcher at " in text), text
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
        # Rank 1 must be a member: the run's first quorum waits for it, but on a loaded machine rank 0 may
        # train alone while rank 1 compiles (then it joins later), and a process stopped before it joins
        # is no member for the hub to leave out.
        run.wait_for(lambda: run.reached() >= 20 and ("live ranks [0]" not in run.text() or "rank 1 joined" in run.text()),
                     "step 20 with rank 1 a member")
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


# ---------------------------------------------------------------------------------------------
# Every update rule on the hub: the rules are written once against the engine (jaxdp/elastic/workers.py)
# ---------------------------------------------------------------------------------------------


def _metrics(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())
            if "loss" in r and r.get("event") is None}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("flags, devices", [
    (("--shard-params", "--strategy", "psum"), 2),     # every step, the layout cut over each worker's devices
    (("--sync-every", "4", "--strategy", "psum"), 1),  # H local steps, DiLoCo's outer step at each round's end
], ids=["shard-params", "local-steps"])
def test_undisturbed_on_the_hub_a_rule_trains_as_a_static_mesh_of_as_many_devices(tmp_path, flags, devices):
    steps = 16
    common = [*flags, "--steps", str(steps), "--no-progress", "--log-every", "1", "--save-every", str(steps)]
    elastic_run = run_cli("--elastic", "--nproc-per-node", "2", "--", PY, "-m", "jaxdp.train", "--devices", str(devices),
                          *common, "--checkpoint-dir", "ckpt", "--metrics-file", "elastic.jsonl", module="jaxdp.launch",
                          cwd=tmp_path, timeout=300)
    assert elastic_run.returncode == 0, elastic_run.stderr
    static_run = run_cli("--devices", str(2 * devices), *common, "--checkpoint-dir", "static", "--metrics-file",
                         "static.jsonl", cwd=tmp_path, timeout=300)
    assert static_run.returncode == 0, static_run.stderr
    if "--sync-every" in flags:  # local steps: the global parameters and the outer state, bit for bit
        sums = [{k: v for k, v in json.loads((tmp_path / d / str(steps) / "jaxdp_checksums.json").read_text()).items()
                 if "per_device" not in k} for d in ("ckpt", "static")]
        assert sums[0] == sums[1] and any("outer" in k for k in sums[0])
    else:  # every step: each step's loss
        elastic_losses, static_losses = _metrics(tmp_path / "elastic.jsonl"), _metrics(tmp_path / "static.jsonl")
        assert sorted(elastic_losses) == sorted(static_losses) == list(range(1, steps + 1))
        assert max(abs(elastic_losses[s] - static_losses[s]) / abs(static_losses[s]) for s in static_losses) < 1e-6
