"""JAX's own fault tolerance (`jax.experimental.multihost_utils.live_devices`) on CPU, recorded: a run of
3 processes should survive the loss of one (the others sum over the 2 left; platform notes saw that with a
psum loop, while the jit'd sum here hangs), and a restarted process cannot rejoin (XLA:CPU keeps gloo's old
rendezvous keys: "ALREADY_EXISTS"). That is
why elastic runs use torchft (jaxdp/elastic/ft.py). The rejoin is a strict xfail: a JAX that fixes it
makes the suite say so, and `live_devices` could then be an Engine of jaxdp/elastic/ft.py."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, cli_env
from jaxdp.launcher.workers import free_port

WORKER = str(Path(__file__).with_name("live_devices_worker.py"))


class NotElastic(AssertionError):
    """The survivors did not sum again without the lost process, or the restarted one did not rejoin."""


def _start(address: str, process: int, log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, WORKER, address, str(process), "3"], cwd=ROOT, env=cli_env(),
                                stdout=out, stderr=subprocess.STDOUT)


def _wait(log: Path, text: str, after: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text()[after:]:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.xfail(strict=True, raises=NotElastic, reason="XLA:CPU never lets a restarted process rejoin its gloo "
                   "communicators (ALREADY_EXISTS; GPU aborts stale NCCL ones); here the survivors' next sum also hung")
def test_live_devices_survives_a_lost_process_but_a_restarted_one_cannot_rejoin_on_cpu(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"p{i}.log" for i in range(3)]
    procs = [_start(address, i, logs[i]) for i in range(3)]
    try:
        assert _wait(logs[0], "live 3 sum 3", 0, 40), logs[0].read_text()  # (a real failure, not the xfail)
        procs[2].kill()  # process 0 hosts the coordination service: its loss would end the run
        procs[2].wait()
        lost_at = len(logs[0].read_text())
        # (platform.md saw them go on; a jit'd sum here hangs). 12 s: over twice the heartbeat timeout
        # (5 s, tests/live_devices_worker.py) after which the survivors would see the loss
        if not _wait(logs[0], "live 2 sum 2", lost_at, 12):
            raise NotElastic(f"the survivors did not sum again without process 2:\n{logs[0].read_text()[-1500:]}")
        procs[2] = _start(address, 2, logs[2])
        restarted_at = len(logs[0].read_text())
        if not _wait(logs[0], "live 3 sum 3", restarted_at, 30):
            raise NotElastic(f"process 2 restarted but never summed again; its log:\n{logs[2].read_text()[-1500:]}")
    finally:
        for proc in procs:
            proc.kill()
