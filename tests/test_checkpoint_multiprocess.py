"""Checkpoints across processes: 2 real processes x 4 devices, one of them preempted by a signal.

The signal reaches process 1 only; both processes must stop after the same step, save it together
and exit 75. The run then resumes as 2 processes, and finally as 1 process with 8 devices.
"""

import json
import signal
import time

import numpy as np
import pytest

from helpers import free_port, saved, spawn_cli
from jaxdp.config import parse_args
from jaxdp.errors import EXIT_PREEMPTED
from jaxdp.train import train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def start_two_processes(tmp_path, name, *flags):
    port = free_port()
    procs = []
    for i in range(2):
        log = tmp_path / f"{name}-{i}.log"
        procs.append(spawn_cli("--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                               str(i), "--devices", "4", "--no-progress", *map(str, flags), stdout=log, stderr=log))
    return procs


def wait_all(procs, tmp_path, name, timeout=120):
    codes = [p.wait(timeout=timeout) for p in procs]
    return codes, [(tmp_path / f"{name}-{i}.log").read_text() for i in range(len(procs))]


def step_losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "event" not in r}


def test_two_processes_stop_together_save_and_resume_on_two_then_one(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    flags = ["--checkpoint-dir", ckpt, "--metrics-file", metrics, "--log-every", 1]

    # 1. Preempt: SIGUSR1 (SLURM's --signal) to process 1 only, once training is under way.
    procs = start_two_processes(tmp_path, "first", *flags, "--steps", 100_000)
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGUSR1)
    codes, logs = wait_all(procs, tmp_path, "first", timeout=60)
    assert codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], logs
    stopped = max(step_losses(metrics))
    assert saved(ckpt) == [str(stopped)]  # one step, saved by both together
    assert f"preempted (SIGTERM or SIGUSR1 on another process): saved step {stopped}" in logs[0]

    # 2. Resume as 2 processes for 5 more steps.
    procs = start_two_processes(tmp_path, "second", *flags, "--steps", stopped + 5)
    codes, logs = wait_all(procs, tmp_path, "second")
    assert codes == [0, 0], logs
    losses = step_losses(metrics)
    assert sorted(losses) == list(range(1, stopped + 6))  # every step once, continued in place

    # 3. Resume that checkpoint in this process: 1 process, 8 devices.
    resumed = train(parse_args([*map(str, flags), "--steps", str(stopped + 8), "--no-progress"]))
    assert [r["step"] for r in resumed.history] == [stopped + 6, stopped + 7, stopped + 8]

    # The same trajectory as one process that never stopped (gloo sums in another order: ~1e-7).
    reference = train(parse_args(["--steps", str(stopped + 8), "--log-every", "1", "--no-progress"]))
    expected = {r["step"]: r["loss"] for r in reference.history}
    steps = sorted(step_losses(metrics))
    np.testing.assert_allclose([step_losses(metrics)[s] for s in steps], [expected[s] for s in steps], rtol=1e-5)
