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
from pathlib import Path

import pytest

from conftest import ROOT, cli_env
from slurm_cluster import SlurmCluster

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
    detected = dict(re.findall(r"^(\d): jaxdp\.distributed: (slurm: process \d of 2, coordinator \S+?),",
                               proc.stderr, re.MULTILINE))
    assert set(detected) == {"0", "1"}, proc.stderr[-3000:]
    for task, line in detected.items():
        port = int(re.search(r"coordinator localhost:(\d+)", line).group(1))
        assert line.startswith(f"slurm: process {task} of 2") and 61440 <= port < 65536, line
    assert detected["0"].split("coordinator ")[1] == detected["1"].split("coordinator ")[1]
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
