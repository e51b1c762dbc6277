"""jaxdp under a real SLURM: a one-node cluster on localhost (tests/slurm_cluster.py).

`srun -n2` starts two tasks; each must find the coordinator, the process count and its own
index in the environment srun gives it, with no distribution flags at all. Skipped, with the
reason, only where the cluster cannot run (not root, or the SLURM binaries are missing).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, cli_env, records, step_records
from slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.multiprocess]

RUN = ["--steps", "5", "--batch-size", "64", "--log-every", "1", "--no-progress"]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    reason = SlurmCluster.unavailable()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def job_env() -> dict[str, str]:
    """What a user's shell would pass to srun/sbatch: the venv's python first on PATH, no XLA_FLAGS."""
    env = cli_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_srun_two_tasks_detect_coordinator_count_and_id(slurm, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = slurm.run(["srun", "-n2", "--label", "--kill-on-bad-exit=1", sys.executable, "-m", "jaxdp.train",
                      *RUN, "--devices", "4", "--metrics-file", str(metrics), "--debug"],
                     timeout=150, cwd=ROOT, env=job_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["event"] == "done" and done["processes"] == 2 and done["devices"] == 8
    # Each task logs what it detected: source, its index, the count and the coordinator (first node).
    detected = dict(re.findall(r"^(\d): jaxdp\.cluster\.distributed: (slurm: process \d of 2, coordinator \S+?),",
                               proc.stderr, re.MULTILINE))
    assert set(detected) == {"0", "1"}, proc.stderr[-3000:]
    for task, line in detected.items():
        port = int(re.search(r"coordinator localhost:(\d+)", line).group(1))
        assert line.startswith(f"slurm: process {task} of 2") and 20480 <= port < 32768 and port % 2 == 0, line
    assert detected["0"].split("coordinator ")[1] == detected["1"].split("coordinator ")[1]
    runs = dict(re.findall(r"^(\d): jaxdp\.cluster\.distributed: slurm: .*, run (slurm-\d+\.\d+);", proc.stderr, re.MULTILINE))
    assert set(runs) == {"0", "1"} and runs["0"] == runs["1"], proc.stderr[-3000:]  # the run id both presented
    assert "0: eval_accuracy=" in proc.stdout and "1: eval_accuracy=" not in proc.stdout


def test_cpu_sbatch_example_runs_to_done(slurm, tmp_path):
    metrics, output = tmp_path / "m.jsonl", tmp_path / "job.out"
    proc = slurm.run(["sbatch", "--parsable", f"--output={output}", str(ROOT / "examples/slurm/train_cpu.sbatch"),
                      *RUN, "--strategy", "host", "--metrics-file", str(metrics)],
                     timeout=30, cwd=tmp_path, env=job_env())
    assert proc.returncode == 0, proc.stderr
    state, exit_code = slurm.wait_for_job(proc.stdout.strip().split(";")[0], timeout=150)
    log = output.read_text() if output.exists() else ""
    assert (state, exit_code) == ("COMPLETED", "0:0"), log[-3000:]
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["event"] == "done" and done["processes"] == 2 and done["strategy"] == "host"


def poll(what: str, condition, timeout: float, interval: float = 0.2):
    """condition()'s first truthy value, checked every `interval` s; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def test_cpu_sbatch_example_requeues_itself_when_preempted_and_resumes(slurm, tmp_path):
    """`scancel --signal=USR1` is what `#SBATCH --signal=USR1@90` sends at the time limit. Without
    --full (or --batch) it reaches the job's steps only, i.e. the srun tasks, not the batch shell.
    Every process saves and exits 75, the script runs `scontrol requeue`, and the same job (same id,
    so the script's default --checkpoint-dir) starts again and resumes. Slurm holds a requeued job
    for cred_expire + 1 s (BeginTime; 120 s by default, 5 s in tests/slurm_cluster.py)."""
    metrics, output = tmp_path / "m.jsonl", tmp_path / "job.out"
    proc = slurm.run(["sbatch", "--parsable", f"--output={output}", str(ROOT / "examples/slurm/train_cpu.sbatch"),
                      "--steps", "200", "--save-every", "50", "--log-every", "10", "--batch-size", "64",
                      "--no-progress", "--metrics-file", str(metrics)],
                     timeout=30, cwd=tmp_path, env=job_env())
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    log = lambda: (output.read_text() if output.exists() else "")[-3000:]  # noqa: E731
    try:
        poll("the first logged step in the metrics file", lambda: metrics.exists() and '"loss"' in metrics.read_text(),
             timeout=90)
        signal = slurm.run(["scancel", "--signal=USR1", job_id], timeout=10)
        assert signal.returncode == 0, signal.stderr
        # The first run has ended and the job waits to start again: the metrics written so far.
        requeued = poll("the job to be requeued (PENDING, Restarts=1)",
                        lambda: (job := slurm.job(job_id)).get("Restarts") == "1" and job.get("JobState") == "PENDING"
                        and job, timeout=30)
        first_run = metrics.read_text().splitlines()
        state, exit_code = slurm.wait_for_job(job_id, timeout=90)
    finally:
        slurm.run(["scancel", job_id], timeout=10)  # a no-op once it has ended; never leave a job running
    assert (state, exit_code) == ("COMPLETED", "0:0"), log()
    assert slurm.job(job_id)["Restarts"] == "1" and requeued["Reason"] in ("BeginTime", "None"), requeued
    saved = re.search(r"jaxdp: preempted \(SIGUSR1\): saved step (\d+) to (\S+), exit code 75", output.read_text())
    assert saved, log()  # --open-mode=append: the first run's lines are still in the log
    saved_step, checkpoint_dir = int(saved.group(1)), Path(saved.group(2))
    assert checkpoint_dir == tmp_path / "checkpoints" / f"jaxdp-cpu-{job_id}", checkpoint_dir  # the script's default
    assert "eval_accuracy=" in output.read_text(), log()
    logged = records(metrics)
    assert logged[-1]["event"] == "done" and logged[-1]["step"] == 200 and logged[-1]["processes"] == 2
    assert [r["step"] for r in step_records(metrics)] == list(range(10, 201, 10))  # every step once, in order
    # Resumed, not restarted: the first run's records up to the saved step are kept verbatim (a fresh
    # run truncates the file, and its timings would differ); the second run wrote only the later ones.
    kept = [line for line in first_run if json.loads(line)["step"] <= saved_step]
    assert kept and metrics.read_text().splitlines()[:len(kept)] == kept
    steps = sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit())
    assert steps[-1] == 200 and saved_step < 200, steps
