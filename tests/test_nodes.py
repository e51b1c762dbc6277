"""`python -m jaxdp.launch --nnodes N --node-rank R --coordinator HOST:PORT`: one launcher per node.

Two launchers on this machine play two nodes. With small scripts: the launchers agree on every
attempt (a process lost on node 1 restarts node 0's too), a SIGTERM to either reaches every process,
a second launcher with a taken node rank is refused, and a launcher that disappears ends the other.
With jaxdp.train: two nodes of one process each, one of them killed by kill -9, resume from the
checkpoint and log the same per-step losses as one launcher with two processes, uninterrupted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, cli_env, records

PY = sys.executable


def free_ports() -> int:
    """A port P on 127.0.0.1 with P + 1 and P + 2 free as well (launchers, coordinator, handshake)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for extra in (1, 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + extra))
        except OSError:
            continue
        return port
    raise OSError("no three consecutive free ports")


def node(rank: int, port: int, *command: str, nnodes: int = 2, nproc: int = 1, extra=()) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "jaxdp.launch", "--nnodes", str(nnodes), "--node-rank", str(rank),
                             "--coordinator", f"127.0.0.1:{port}", "--nproc-per-node", str(nproc), "--no-bind",
                             *extra, "--", *command], cwd=ROOT, env=cli_env(), stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    """Each launcher's exit code and stderr; every launcher is killed if one hangs."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.kill()
        raise AssertionError(f"a launcher hung: {[(p.wait(), p.stderr.read()) for p in procs]}") from None
    return [(p.returncode, p.stderr.read()) for p in procs]


def script(body: str, tmp_path: Path) -> list[str]:
    """A child: `d` is tmp_path, `rank` its JAX_PROCESS_ID, `first` True on its first start."""
    head = (f"import os, signal, sys, time; d = {str(tmp_path)!r}; rank = os.environ['JAX_PROCESS_ID']\n"
            "starts = os.path.join(d, 'starts.' + rank); first = not os.path.exists(starts)\n"
            "open(starts, 'a').write(os.environ['JAXDP_RUN_ID'] + ' ' + os.environ['JAX_COORDINATOR_ADDRESS'] + '\\n')\n")
    return [PY, "-c", head + body]


@pytest.mark.slow  # over 4 s on 2 cores
def test_a_process_lost_on_node_1_restarts_every_node(tmp_path):
    body = ("if first and rank == '1': sys.exit(69)\n"
            "if first: time.sleep(60)\n"  # node 0's process waits to be stopped
            "sys.exit(0)")
    port = free_ports()
    results = finish([node(1, port, *script(body, tmp_path), extra=("--max-restarts", "1")),
                      node(0, port, *script(body, tmp_path), extra=("--max-restarts", "1"))])
    assert [code for code, _ in results] == [0, 0], results
    lines = results[1][1].splitlines()
    assert any("restarting all 2 processes (1 of 1)" in line for line in lines), lines
    assert lines[-1] == "jaxdp.launch: all 2 processes finished; exit code 0", lines
    assert "process 1 exited with code 69; stopping the others" in results[0][1], results[0][1]
    starts = [(tmp_path / f"starts.{r}").read_text().split("\n")[:2] for r in range(2)]
    assert starts[0] == starts[1] and starts[0][0] != starts[0][1], starts  # the same run id, a new one per attempt
    assert starts[0][0].split()[1] == f"127.0.0.1:{port + 1}"


def test_a_sigterm_to_any_launcher_reaches_every_process(tmp_path):
    body = ("def stop(signum, frame): open(os.path.join(d, 'term.' + rank), 'w').close(); sys.exit(75)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "open(os.path.join(d, 'up.' + rank), 'w').close()\n"
            "time.sleep(60); sys.exit(1)")
    port = free_ports()
    procs = [node(1, port, *script(body, tmp_path)), node(0, port, *script(body, tmp_path))]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"up.{r}").exists() for r in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the processes did not start"
        time.sleep(0.02)
    procs[0].send_signal(signal.SIGTERM)  # node 1's launcher
    results = finish(procs)
    assert [code for code, _ in results] == [75, 75], results
    assert sorted(p.name for p in tmp_path.glob("term.*")) == ["term.0", "term.1"]


@pytest.mark.slow  # over 4 s on 2 cores
def test_a_taken_node_rank_is_refused_and_a_vanished_launcher_ends_the_other(tmp_path):
    body = "open(os.path.join(d, 'up.' + rank), 'w').close(); time.sleep(60)"
    port = free_ports()
    procs = [node(1, port, *script(body, tmp_path)), node(0, port, *script(body, tmp_path))]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"up.{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the processes did not start"
            time.sleep(0.02)
        [(code, err)] = finish([node(1, port, PY, "-c", "pass")])
        assert code == 2 and err.strip().splitlines() == [
            f"jaxdp.launch: error: node 0's launcher at 127.0.0.1:{port} refused this one: node 1 has joined "
            "already (two launchers with --node-rank 1?)"], err
        procs[1].kill()  # node 0's launcher vanishes (its own process dies with it)
        [(code, err)] = finish(procs[:1], timeout=60)
        assert code == 69 and "node 0's launcher is gone" in err.strip().splitlines()[-1], err
    finally:
        finish(procs, timeout=1)


def step_losses(path: Path) -> dict[int, float]:
    steps = [r for r in records(path) if "event" not in r]
    assert len({r["step"] for r in steps}) == len(steps), "a step was logged twice"
    return {r["step"]: r["loss"] for r in steps}


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_lose_a_process_resume_and_train_like_one_launcher_with_two_processes(tmp_path):
    run = ["--steps", "120", "--batch-size", "64", "--log-every", "1", "--no-progress", "--devices", "2"]
    train = [PY, "-m", "jaxdp.train", *run, "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "5"]
    metrics, port = tmp_path / "two.jsonl", free_ports()
    procs = [node(1, port, *train, "--metrics-file", str(metrics), extra=("--max-restarts", "1")),
             node(0, port, *train, "--metrics-file", str(metrics), extra=("--max-restarts", "1"))]
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 12):  # past a checkpoint
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        os.kill(children(procs[0].pid)[0], signal.SIGKILL)  # process 1, on node 1
        results = finish(procs, timeout=240)
    finally:
        finish(procs, timeout=1)
    assert [code for code, _ in results] == [0, 0], results[1][1][-3000:]
    assert "process 1 was killed by SIGKILL; stopping the others" in results[0][1]
    assert "jaxdp.launch: restarting all 2 processes (1 of 1)" in results[1][1]

    reference = tmp_path / "one.jsonl"
    one = subprocess.run([PY, "-m", "jaxdp.launch", "--nproc-per-node", "2", "--", PY, "-m", "jaxdp.train", *run,
                          "--metrics-file", str(reference)], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                         timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    got, expected = step_losses(metrics), step_losses(reference)
    assert sorted(got) == sorted(expected) == list(range(1, 121))  # every step once
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=1e-6)
