"""One run per coordinator: process 0 admits only the other processes of its own run.

The pure pieces first (the admission rules, run ids, the SLURM port rule), then the case that broke
runs: a second run started on a running run's coordinator address. Its process 0 finds the port
taken and its process 1 is refused by the running run's process 0; both exit 2 with one line, and
the running run trains on.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers import free_port, spawn_cli
from jaxdp.cluster import detect as cluster, handshake
from jaxdp.cluster.detect import detect, handshake_port, slurm_port
from jaxdp.config import Config, ConfigError

SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "8",
             "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}


# ---------------------------------------------------------------------------------------------
# The admission rules, over real sockets on 127.0.0.1 (no JAX).
# ---------------------------------------------------------------------------------------------


def admission(run_id: str, count: int) -> tuple[handshake.Admission, str, int]:
    port = free_port()
    address = f"127.0.0.1:{port}"
    return handshake.Admission("127.0.0.1", handshake_port(port), run_id, count, address).start(), address, handshake_port(port)


def join(address: str, port: int, run_id: str, process: int, count: int, timeout: float = 10) -> None:
    handshake.join(address, port, run_id, process, count, timeout)


def test_process_0_admits_each_process_of_its_run_once_and_then_no_one():
    door, address, port = admission("run-a", 3)
    try:
        join(address, port, "run-a", 1, 3)
        with pytest.raises(ConfigError, match=r"belongs to another run \(run id 'run-a'; this process is of run id 'run-b'\)"):
            join(address, port, "run-b", 2, 3)
        with pytest.raises(ConfigError, match="runs 3 processes but this one was started as one of 2"):
            join(address, port, "run-a", 1, 2)
        with pytest.raises(ConfigError, match="its process 1 has joined already"):
            join(address, port, "run-a", 1, 3)
        with pytest.raises(ConfigError, match="runs processes 0..2; this is process 3"):
            join(address, port, "run-a", 3, 3)
        # Not a handshake at all (a port scanner, a browser): refused, and process 0 serves on.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as visitor:
            visitor.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert b'"ok": false' in visitor.recv(4096)
        assert not door.formed
        join(address, port, "run-a", 2, 3)
        assert door.formed and door.admitted == {1, 2}
        # A formed run refuses everyone, even a process that presents its own run id and a number.
        with pytest.raises(ConfigError, match=r"^process 0 at 127\.0\.0\.1:\d+ refused this process: its run "
                                              r"\(run id 'run-a'\) is running with all of its 3 processes"):
            join(address, port, "run-a", 1, 3)
        assert door.refused == 6
    finally:
        door.close()


def test_without_run_ids_a_formed_run_still_refuses_newcomers():
    door, address, port = admission("", 2)
    try:
        join(address, port, "", 1, 2)
        with pytest.raises(ConfigError, match=r"its run \(no run id\) is running with all of its 2 processes"):
            join(address, port, "", 1, 2)
    finally:
        door.close()


def test_a_process_waits_for_process_0_and_gives_up_at_its_deadline():
    port = free_port()
    address, door_port = f"127.0.0.1:{port}", handshake_port(port)
    with pytest.raises(TimeoutError):
        join(address, door_port, "r", 1, 2, timeout=0.5)
    # Started before process 0 listens: retried until it does.
    errors: list[BaseException] = []
    waiter = threading.Thread(target=lambda: _catch(errors, join, address, door_port, "r", 1, 2))
    waiter.start()
    door = handshake.Admission("127.0.0.1", door_port, "r", 2, address).start()
    try:
        waiter.join(timeout=30)
        assert not waiter.is_alive() and errors == [] and door.formed
    finally:
        door.close()


def _catch(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as err:  # noqa: BLE001 - reported by the test
        errors.append(err)


def test_a_taken_handshake_port_and_a_stranger_on_it_are_one_sentence_each():
    with socket.create_server(("127.0.0.1", 0)) as stranger:
        port = stranger.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} is already in use on this machine: jaxdp's run handshake"):
            handshake.Admission("127.0.0.1", port, "r", 2, f"127.0.0.1:{port - 1}")
        def answer():  # another program's greeting
            conn = stranger.accept()[0]
            with conn:
                conn.recv(4096)
                conn.sendall(b"220 ready\r\n")

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 answered, but not as jaxdp's run handshake"):
            join(f"127.0.0.1:{port - 1}", port, "r", 1, 2)


def test_process_0_listens_where_the_coordinator_is_announced():
    from jaxdp.cluster.handshake import bind_host

    assert bind_host("127.0.0.1:1234", environ={}) == "127.0.0.1"
    assert ipaddress.ip_address(bind_host("localhost:1234", environ={})).is_loopback
    assert bind_host("192.0.2.254:1234", environ={}) is None  # not this machine's: every interface
    # A host name that resolves to a loopback address here may be reached elsewhere on another one.
    assert bind_host(f"{socket.gethostname()}:1234", environ={}) in (None, *_my_addresses())
    assert bind_host("127.0.0.1:1234", environ={"JAX_COORDINATOR_BIND_ADDRESS": "[::]:1234"}) is None
    assert bind_host("node0:1234", environ={"JAX_COORDINATOR_BIND_ADDRESS": "10.1.2.3:1234"}) == "10.1.2.3"
    for address in _my_addresses():
        assert bind_host(f"{address}:1234", environ={}) == address


def _my_addresses() -> list[str]:
    from jaxdp.cluster import gloo

    found = (gloo.ipv4_of(name) for name in gloo.interfaces())
    return [a for a in found if a and not ipaddress.ip_address(a).is_loopback]


# ---------------------------------------------------------------------------------------------
# Run ids and ports: pure functions of the environment.
# ---------------------------------------------------------------------------------------------


def test_run_ids_come_from_the_launcher_or_slurm():
    assert cluster.run_id({}) == ""
    assert cluster.run_id({**SRUN_TASK, "SLURM_STEP_ID": "3"}) == "slurm-4242.3"
    assert cluster.run_id(SRUN_TASK) == "slurm-4242.0"
    assert cluster.run_id({**SRUN_TASK, "JAXDP_RUN_ID": "launch-1"}) == "launch-1"
    jax_env = {"JAX_COORDINATOR_ADDRESS": "c:9", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2", "JAXDP_RUN_ID": "x"}
    assert detect(Config(), jax_env).run_id == "x"
    assert detect(Config(), {**SRUN_TASK, "SLURM_STEP_ID": "1"}).run_id == "slurm-4242.1"
    assert detect(Config(), {"JAXDP_RUN_ID": "x"}).run_id == ""  # one process: nothing to admit


def slurm_address(**env: str) -> str:
    return detect(Config(), {**SRUN_TASK, **env}).coordinator_address


def test_slurm_ports_differ_between_steps_and_between_jobs_4096_apart():
    assert slurm_address(SLURM_STEP_ID="0") != slurm_address(SLURM_STEP_ID="1")  # JAX's rule: the same
    assert slurm_address(SLURM_JOB_ID="4242") != slurm_address(SLURM_JOB_ID=str(4242 + 4096))  # JAX's rule: the same
    assert slurm_address() == f"gpu07:{slurm_port(4242, 0)}"
    assert slurm_address(JAX_COORDINATOR_PORT="5000") == "gpu07:5000"


def test_the_slurm_port_rule():
    steps = [slurm_port(4242, step) for step in range(64)]
    jobs = [slurm_port(job, 0) for job in range(10_000, 10_000 + cluster.SLURM_PORT_PAIRS)]
    assert len(set(steps)) == len(steps) and len(set(jobs)) == len(jobs)  # no two collide
    for port in steps + jobs:  # even, below Linux's ephemeral range, the handshake on the next port
        assert port % 2 == 0 and 20480 <= port and handshake_port(port) == port + 1 <= 32767
    assert handshake_port(65535) == 65534


# ---------------------------------------------------------------------------------------------
# A second run on a running run's coordinator address.
# ---------------------------------------------------------------------------------------------

RUN = ["--dataset", "digits", "--batch-size", "64", "--log-every", "1", "--no-progress", "--devices", "2"]


def start(process_id: int, port: int, out: Path, *args: str) -> subprocess.Popen:
    flags = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id)]
    out.mkdir(exist_ok=True)
    return spawn_cli(*args, *flags, stderr=out / f"p{process_id}.err")


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_run_on_a_running_runs_address_is_refused_and_the_running_run_trains_on(tmp_path):
    port, metrics = free_port(), tmp_path / "a.jsonl"
    first = [start(i, port, tmp_path / "a", *RUN, "--steps", "100000", "--metrics-file", str(metrics)) for i in range(2)]
    second: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 120
        while lines(metrics) < 3:  # the first run is training
            assert time.monotonic() < deadline and all(p.poll() is None for p in first), (tmp_path / "a" / "p0.err").read_text()
            time.sleep(0.1)
        second = [start(i, port, tmp_path / "b", *RUN, "--steps", "5") for i in (1, 0)]
        codes = [p.wait(timeout=120) for p in second]
        errors = [(tmp_path / "b" / f"p{i}.err").read_text().strip().splitlines() for i in (1, 0)]
        assert [p.poll() for p in first] == [None, None], (tmp_path / "a" / "p0.err").read_text()[-3000:]
        assert codes == [2, 2], errors
        assert len(errors[0]) == 1 and errors[0][0].startswith(
            f"jaxdp: error: process 0 at 127.0.0.1:{port} refused this process: its run (no run id) is running "
            "with all of its 2 processes, and this process 1 is not one of them"), errors[0]
        assert len(errors[1]) == 1 and f"port {port} is already in use" in errors[1][0], errors[1]
        # The first run trains on, untouched (it used to abort within seconds).
        seen, deadline = lines(metrics), time.monotonic() + 120
        while lines(metrics) < seen + 20:
            assert all(p.poll() is None for p in first), (tmp_path / "a" / "p0.err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run stopped logging steps"
            time.sleep(0.1)
    finally:
        for p in first + second:
            if p.poll() is None:
                p.kill()
            p.wait()
