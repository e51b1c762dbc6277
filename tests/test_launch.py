"""`python -m jaxdp.launch`: environment, core binding, exit codes, restarts; a real run that loses a
process to kill -9 restarts from its checkpoint and ends with the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, cli_env, records, run_cli
from jaxdp.launch import bindings

PY = sys.executable


def launch(*args, timeout=240, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "jaxdp.launch", *map(str, args)], cwd=kwargs.pop("cwd", ROOT), env=cli_env(),
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def test_bindings_are_disjoint_and_cover_the_cores():
    assert bindings(2, [0, 1]) == [{0}, {1}]
    assert bindings(2, [0, 1, 2, 3, 4]) == [{0, 1, 2}, {3, 4}]
    assert bindings(3, [4, 5]) == [{4}, {5}, {4}]  # more processes than cores: one core each, shared


def test_children_get_the_jax_environment_and_their_own_cores(tmp_path):
    script = ("import json, os; json.dump({'env': [os.environ[k] for k in ('JAX_COORDINATOR_ADDRESS', "
              "'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')], 'cores': sorted(os.sched_getaffinity(0))}, "
              f"open(os.path.join({str(tmp_path)!r}, os.environ['JAX_PROCESS_ID']), 'w'))")
    proc = launch("--nproc-per-node", 2, "--", PY, "-c", script)
    assert proc.returncode == 0, proc.stderr
    seen = [json.loads((tmp_path / str(rank)).read_text()) for rank in range(2)]
    assert [s["env"][1:] for s in seen] == [["2", "0"], ["2", "1"]] and seen[0]["env"][0] == seen[1]["env"][0]
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(seen[0]["cores"]) & set(seen[1]["cores"])
        assert "bound to cores" in proc.stderr.splitlines()[0]
    unbound = launch("--nproc-per-node", 2, "--no-bind", "--", PY, "-c", script)
    assert "not bound to cores (--no-bind)" in unbound.stderr
    assert all(json.loads((tmp_path / str(r)).read_text())["cores"] == sorted(os.sched_getaffinity(0)) for r in range(2))


def test_exit_codes_and_restarts(tmp_path):
    # Any other failure: the children's code, no restart.
    proc = launch("--nproc-per-node", 2, "--max-restarts", 3, "--", PY, "-c", "import sys; sys.exit(3)")
    assert proc.returncode == 3 and "restarting" not in proc.stderr, proc.stderr
    # A lost peer (exit 69) on the first attempt only: one restart, then success.
    marker = tmp_path / "failed-once"
    script = (f"import os, sys; m = {str(marker)!r}\n"
              "if os.environ['JAX_PROCESS_ID'] == '1' and not os.path.exists(m): open(m, 'w').close(); sys.exit(69)")
    proc = launch("--nproc-per-node", 2, "--max-restarts", 1, "--", PY, "-c", script)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert any("process 1 exited with code 69" in line for line in lines)
    assert any("restarting all 2 processes (1 of 1)" in line for line in lines)
    # Restarts used up: the lost code.
    proc = launch("--nproc-per-node", 2, "--max-restarts", 1, "--", PY, "-c", "import sys; sys.exit(69)")
    assert proc.returncode == 69 and "no restarts left" in proc.stderr.strip().splitlines()[-1]
    # Bad usage: exit 2, one line.
    proc = launch("--nproc-per-node", 2, PY, "-c", "pass")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.multiprocess
def test_a_user_script_with_jaxdp_initialize_runs_under_the_launcher(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text(
        "import json, sys, numpy as np, jax, jaxdp\n"
        "jaxdp.initialize()\n"
        "from jax.experimental import multihost_utils\n"
        "total = multihost_utils.process_allgather(np.float32(jax.process_index() + 1)).sum()\n"
        "json.dump([jax.process_index(), jax.process_count(), float(total)], open(sys.argv[1] + str(jax.process_index()), 'w'))\n")
    proc = launch("--nproc-per-node", 2, "--", PY, str(script), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads((tmp_path / f"out{r}").read_text()) for r in range(2)] == [[0, 2, 3.0], [1, 2, 3.0]]


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def rank_of(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"JAX_PROCESS_ID=")), None)


def step_losses(path: Path) -> dict[int, float]:
    steps = [r for r in records(path) if "event" not in r]
    assert len({r["step"] for r in steps}) == len(steps), "a step was logged twice"
    return {r["step"]: r["loss"] for r in steps}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_9_of_one_child_restarts_from_the_checkpoint_and_loses_no_step(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    run = ["--steps", "300", "--batch-size", "64", "--log-every", "1", "--no-progress"]
    launcher = subprocess.Popen([PY, "-m", "jaxdp.launch", "--nproc-per-node", "2", "--max-restarts", "1", "--",
                                 PY, "-m", "jaxdp.train", *run, "--devices", "2", "--checkpoint-dir", str(ckpt),
                                 "--save-every", "5", "--metrics-file", str(metrics)],
                                cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 12):  # past a checkpoint
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
            time.sleep(0.05)
        victim = next(pid for pid in children(launcher.pid) if rank_of(pid) == "1")
        os.kill(victim, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stderr[-3000:]
    events = [line for line in stderr.splitlines() if line.startswith("jaxdp.launch:")]
    assert any("process 1 was killed by SIGKILL" in line for line in events), events
    assert any("restarting all 2 processes (1 of 1)" in line for line in events), events

    reference = tmp_path / "reference.jsonl"
    assert run_cli(*run, "--devices", "4", "--metrics-file", str(reference)).returncode == 0
    got, expected = step_losses(metrics), step_losses(reference)
    assert sorted(got) == sorted(expected) == list(range(1, 301))  # every step once
    np.testing.assert_allclose([got[s] for s in sorted(got)], [expected[s] for s in sorted(got)], rtol=1e-5)
    assert records(metrics)[-1]["event"] == "done"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_readme_launcher(tmp_path):
    """The README's two-process command through the launcher, as shown, from a scratch directory."""
    from helpers import readme_blocks, run_shell, sandbox

    (block,) = readme_blocks("tests/test_launch.py::test_readme_launcher")
    assert block.code.startswith("python -m jaxdp.launch --nproc-per-node 2 -- ")
    run_shell(block.code, cwd=tmp_path, env=sandbox(tmp_path), timeout=180)
    done = records(tmp_path / "run.jsonl")[-1]
    assert done["event"] == "done" and done["processes"] == 2 and done["devices"] == 8


@pytest.mark.slow
@pytest.mark.multiprocess
def test_readme_launcher_restarts(tmp_path):
    """The Launcher section's commands: a checkpointed run, and a script of one's own (written here)."""
    from helpers import commands, readme_blocks, run_shell, sandbox

    (block,) = readme_blocks("tests/test_launch.py::test_readme_launcher_restarts")
    env = sandbox(tmp_path)
    (tmp_path / "my_script.py").write_text(
        "import jax, jaxdp\njaxdp.initialize()\nprint(f'process {jax.process_index()} of {jax.process_count()}')\n")
    train, script = commands(block)
    run_shell(train, cwd=tmp_path, env=env, timeout=180)
    assert "40" in os.listdir(tmp_path / "ckpt")
    proc = run_shell(script, cwd=tmp_path, env=env, timeout=180)
    assert "started 2 processes" in proc.stderr
