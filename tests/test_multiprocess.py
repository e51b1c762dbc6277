"""Multi-process runs: 2 real processes x 4 devices on 127.0.0.1 train exactly like 1 process x 8.

Also: the pure pieces of `jaxdp.cluster.distributed` (SLURM node lists, GPU layouts, which source wins),
bad input (exit 2), and failure: a process that dies or never arrives makes every survivor exit
with `EXIT_PEER_LOST`, naming the missing process, within seconds.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import jaxdp
from helpers import ROOT, cli_env, free_port, records, run_cli, spawn_cli, step_records
from jaxdp.cluster import detect as cluster
from jaxdp.cluster.detect import Cluster, detect
from jaxdp.config import Config, ConfigError
from jaxdp.errors import EXIT_PEER_LOST
from jaxdp.train import main

# Few steps, a small batch: each process starts JAX in ~2 s on a 2-core machine.
RUN = ["--dataset", "digits", "--steps", "6", "--batch-size", "64", "--log-every", "1", "--no-progress"]


def start(process_id: int, port: int, out: Path, *args: str, num_processes: int = 2) -> subprocess.Popen:
    """Start one process of a run on 127.0.0.1; its output goes to files (gloo is chatty)."""
    flags = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
             "--process-id", str(process_id)]
    return spawn_cli(*args, *flags, stdout=out / f"p{process_id}.out", stderr=out / f"p{process_id}.err")


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------------------------------------
# 2 processes x 4 devices == 1 process x 8 devices, for every strategy.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["psum", "host"])  # every strategy: the notebook-API test below
def test_two_processes_train_like_one_process_with_as_many_devices(tmp_path, strategy):
    port = free_port()
    procs = [start(i, port, tmp_path, *RUN, "--strategy", strategy, "--devices", "4",
                   "--metrics-file", str(tmp_path / f"two.{i}.jsonl")) for i in range(2)]
    one = run_cli(*RUN, "--strategy", strategy, "--devices", "8", "--metrics-file", str(tmp_path / "one.jsonl"))
    assert one.returncode == 0, one.stderr
    assert wait_all(procs, timeout=120) == [0, 0], (tmp_path / "p0.err").read_text()[-2000:]

    assert not (tmp_path / "two.1.jsonl").exists()  # only process 0 writes metrics
    ref_steps, steps = step_records(tmp_path / "one.jsonl"), step_records(tmp_path / "two.0.jsonl")
    ref_done, done = records(tmp_path / "one.jsonl")[-1], records(tmp_path / "two.0.jsonl")[-1]
    assert [r["step"] for r in steps] == [r["step"] for r in ref_steps] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in steps], [r["loss"] for r in ref_steps], rtol=1e-5)
    # Held-out metrics depend on every parameter: the final models agree too.
    assert done["processes"] == 2 and ref_done["processes"] == 1 and done["devices"] == ref_done["devices"] == 8
    np.testing.assert_allclose(done["eval_loss"], ref_done["eval_loss"], rtol=1e-5)
    assert done["eval_accuracy"] == ref_done["eval_accuracy"]
    assert "eval_accuracy=" in (tmp_path / "p0.out").read_text()
    assert "eval_accuracy=" not in (tmp_path / "p1.out").read_text()  # only process 0 prints
    # --hierarchy auto (the default): psum sums inside each process, then across; host already does
    said = [line for line in (tmp_path / "p0.out").read_text().splitlines() if line.startswith("jaxdp: --hierarchy")]
    assert len(said) == (strategy != "host") and all("2 processes x 4 devices" in line for line in said), said
    assert "--hierarchy" not in (tmp_path / "p1.out").read_text()


# ---------------------------------------------------------------------------------------------
# A user's own script: jax.distributed.initialize by hand, then only the notebook API.
# ---------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_notebook_api_in_a_user_started_two_process_run_matches_one_process(tmp_path):
    """2 processes x 2 devices started with jax.distributed.initialize alone (no jaxdp.train, no
    jaxdp.initialize) train like 1 process x 4 devices, for every strategy. (The host strategy
    once summed only its own process's devices here and trained on half the gradient.)"""
    script, strategies, port = str(ROOT / "tests" / "scripts" / "notebook_api_run.py"), ",".join(jaxdp.STRATEGIES), free_port()
    procs = [subprocess.Popen([sys.executable, script, str(tmp_path / "two.json"), strategies, f"127.0.0.1:{port}",
                               "2", str(i), "2"], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    one = subprocess.run([sys.executable, script, str(tmp_path / "one.json"), strategies, "-", "1", "0", "4"],
                         cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:]
    two, reference = (json.loads((tmp_path / name).read_text()) for name in ("two.json", "one.json"))
    assert sorted(two) == sorted(jaxdp.STRATEGIES)
    for strategy in jaxdp.STRATEGIES:  # per-step losses, then the sum of the first kernel after training
        np.testing.assert_allclose(two[strategy], reference[strategy], rtol=1e-6, err_msg=strategy)


# ---------------------------------------------------------------------------------------------
# Failure: every survivor exits with EXIT_PEER_LOST and names the missing process.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("victim", [1, 0])
def test_killing_one_process_stops_the_other_naming_it(tmp_path, victim):
    port, metrics = free_port(), tmp_path / "m.jsonl"
    long_run = [*RUN[:2], "--steps", "100000", *RUN[4:], "--devices", "4", "--metrics-file", str(metrics)]
    procs = [start(i, port, tmp_path, *long_run) for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # training is under way
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (tmp_path / "p0.err").read_text()
            time.sleep(0.1)
        procs[victim].send_signal(signal.SIGKILL)
        survivor = procs[1 - victim]
        rc = survivor.wait(timeout=60)  # the peer watch notices a closed connection at once
    finally:
        wait_all(procs, timeout=10)
    err = (tmp_path / f"p{1 - victim}.err").read_text()
    if victim == 1:
        assert rc == EXIT_PEER_LOST, err[-2000:]
        assert "jaxdp: error: process 1 (one of 2) stopped while process 0 was still running" in err
    else:
        # Losing the coordinator, JAX's own client may abort first (exit 134, "the leader task ... died").
        assert rc != 0, err[-2000:]
        assert "process 0 (the coordinator, one of 2) stopped" in err or "leader task" in err, err[-2000:]


@pytest.mark.multiprocess
def test_a_process_that_never_arrives_is_named(tmp_path):
    proc = start(0, free_port(), tmp_path, *RUN, "--devices", "4", "--startup-timeout", "3")
    assert wait_all([proc], timeout=60) == [EXIT_PEER_LOST]
    err = (tmp_path / "p0.err").read_text().strip().splitlines()
    assert err[-1].startswith("jaxdp: error: process 1 did not join within --startup-timeout=3 s"), err


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2 with one line, before any process waits for another.
# ---------------------------------------------------------------------------------------------

BAD_FLAGS = {
    "malformed address": (["--coordinator-address", "127.0.0.1", "--num-processes", "2", "--process-id", "0"],
                          "--coordinator-address='127.0.0.1' is not HOST:PORT"),
    "port out of range": (["--coordinator-address", "host:70000", "--num-processes", "2", "--process-id", "0"],
                          "is not HOST:PORT"),
    "process id too large": (["--coordinator-address", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
                             "--process-id=2 must be smaller than --num-processes=2"),
    "missing process count": (["--coordinator-address", "127.0.0.1:1234", "--process-id", "0"],
                              "needs --num-processes as well"),
    "zero peer timeout": (["--peer-timeout", "0"], "--peer-timeout must be a positive number"),
    "zero startup timeout": (["--startup-timeout", "0"], "--startup-timeout must be a positive number"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_inconsistent_distribution_flags_exit_2(capsys, case):
    argv, needle = BAD_FLAGS[case]
    assert main([*argv, "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdp: error:") and needle in err[0], err


# ---------------------------------------------------------------------------------------------
# Pure pieces: no processes, no cluster.
# ---------------------------------------------------------------------------------------------

SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "8",
             "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node01,host2", ["node01", "host2"]),
    ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a-b.example.org", ["a-b.example.org"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert cluster.expand_nodelist(nodelist) == hosts


def test_expand_tasks_per_node_and_bad_specs():
    assert cluster.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert cluster.expand_tasks_per_node("8") == [8]
    with pytest.raises(ConfigError):
        cluster.expand_tasks_per_node("two")
    with pytest.raises(ConfigError):
        cluster.expand_nodelist("node[a-c]")


@pytest.mark.parametrize("address, parsed", [
    ("10.0.0.1:12345", ("10.0.0.1", 12345)), ("node01:1", ("node01", 1)), ("[::1]:8476", ("::1", 8476)),
])
def test_parse_address(address, parsed):
    assert cluster.parse_address(address) == parsed


@pytest.mark.parametrize("address", ["node01", ":1234", "node01:0", "node01:65536", "node01:port", "a b:1", "::1:80"])
def test_parse_address_rejects(address):
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        cluster.parse_address(address)


def test_detect_prefers_flags_then_jax_environment_then_slurm_then_single():
    flags = Config(coordinator_address="h:1", num_processes=2, process_id=1)
    jax_env = {"JAX_COORDINATOR_ADDRESS": "c:9", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "2"}
    run = "slurm-4242.0"  # the run id every process presents to process 0 (tests/test_handshake.py)
    assert detect(flags, {**jax_env, **SRUN_TASK}) == Cluster("explicit", "h:1", 2, 1, run_id=run)
    assert detect(Config(), {**jax_env, **SRUN_TASK}) == Cluster("environment", "c:9", 3, 2, run_id=run)
    assert detect(Config(), SRUN_TASK) == Cluster("slurm", f"gpu07:{cluster.slurm_port(4242, 0)}", 8, 5, (1,), run)
    assert detect(Config(), {}) == Cluster("single")


def test_slurm_details():
    assert detect(Config(), {**SRUN_TASK, "JAX_COORDINATOR_PORT": "5000"}).coordinator_address == "gpu07:5000"
    assert detect(Config(), {**SRUN_TASK, "JAX_COORDINATOR_ADDRESS": "head:7"}).coordinator_address == "head:7"
    # One task: nothing to coordinate. The bare batch script (no SLURM_STEP_NODELIST): single process.
    assert detect(Config(), {**SRUN_TASK, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == Cluster("single")
    batch_script = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_NODELIST"}
    assert detect(Config(), batch_script) == Cluster("single")
    assert cluster.in_batch_script_of_several_tasks(batch_script)  # initialize warns: use srun
    assert not cluster.in_batch_script_of_several_tasks(SRUN_TASK)
    with pytest.raises(ConfigError, match="SLURM_PROCID=8 must be between 0 and SLURM_NTASKS - 1 = 7"):
        detect(Config(), {**SRUN_TASK, "SLURM_PROCID": "8"})
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        detect(Config(), {"JAX_COORDINATOR_ADDRESS": "c:9", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"})


@pytest.mark.parametrize("layout, extra, expected", [
    ("one task per GPU: GPU number SLURM_LOCALID", {}, (1,)),
    ("one task per node owns every GPU it sees",
     {"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, (0, 1, 2, 3)),
    ("one task per node, SLURM counted the GPUs", {"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "8"},
     tuple(range(8))),
    ("one task per node without GPUs (a CPU job)", {"SLURM_STEP_TASKS_PER_NODE": "1(x2)"}, None),
    ("SLURM bound one GPU per task (--gpus-per-task=1)", {"CUDA_VISIBLE_DEVICES": "3"}, (0,)),
    ("every task sees the node's GPUs", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, (1,)),
    ("uneven nodes, this one has 1 task", {"SLURM_STEP_TASKS_PER_NODE": "4,1", "SLURM_GPUS_ON_NODE": "2"}, (0, 1)),
    ("JAX_LOCAL_DEVICE_IDS decides", {"JAX_LOCAL_DEVICE_IDS": "0,1"}, None),
])
def test_slurm_gpu_layouts(layout, extra, expected):
    assert cluster.slurm_local_device_ids({**SRUN_TASK, **extra}) == expected, layout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_readme_two_processes(tmp_path):
    """The README's two-process command, as shown (on a free port), from a scratch directory."""
    from helpers import readme_blocks, run_shell, sandbox

    (block,) = readme_blocks("tests/test_multiprocess.py::test_readme_two_processes")
    assert block.code.count("--process-id") == 2 and "127.0.0.1:12355" in block.code
    env = sandbox(tmp_path)
    run_shell(block.code.replace("12355", str(free_port())),
              cwd=tmp_path, env=env, timeout=120)
    done = records(tmp_path / "run.jsonl")[-1]
    assert done["event"] == "done" and done["processes"] == 2 and done["devices"] == 8


@pytest.mark.multiprocess
def test_every_process_loads_the_programs_process_0_cached(tmp_path):
    """JAX writes persistent-cache entries from process 0 only, and keyed CPU programs by a topology
    fingerprint that differs between processes: process 1 missed on every run and compiled
    everything again (jaxdp.cluster.runtime.share_cpu_cache_keys). A program on one process's own
    devices has a key no other process shares, and only process 1 compiles process 1's: it wrote none
    and compiled it again on every run. The second run must load every program in both."""
    first, second = (_two_processes_print("cache_hits.py", str(tmp_path / "cache"), timeout=120) for _ in range(2))
    assert all(float(o["value"]) == 1 * 1 + 2 * 2 for o in first + second)  # process i holds i + 1, times i + 1
    assert int(first[0]["hits"]) == 0  # an empty cache (process 1 may find what process 0 just wrote)
    assert int(second[0]["hits"]) == int(second[1]["hits"]) >= 2, second  # the collective and the local program


@pytest.mark.multiprocess
def test_the_controllers_probes_run_as_often_on_every_process(tmp_path):
    """The controller times all-reduces as the fastest of as many runs as fit in a budget; each
    process once counted by its own clock, and a process that started later ran one all-reduce
    more than the other, which waited in it forever (jaxdp.sync.controller._fastest_time). The guard's
    errors go through the same agreement (the largest), so no last-bit difference splits a decision."""
    printed = _two_processes_print("probe_counts.py", timeout=60)
    counts = [int(p["calls"]) for p in printed]
    assert counts[0] == counts[1] >= 1 + 3, counts  # the warm-up and the 3 repeats, at least
    assert [float(p["largest"]) for p in printed] == [1.25, 1.25]  # process 1's error, on both


def _two_processes_print(script: str, *args: str, timeout: float) -> list[dict[str, str]]:
    """Run tests/scripts/SCRIPT as processes 0 and 1 of a 2-process run on 127.0.0.1 (argv: the
    process id, the coordinator address, ARGS); both must succeed. Each one's last line of output,
    `key=value key=value ...`, as a dict."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / script), str(i), f"127.0.0.1:{port}",
                               *args], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:  # a hang leaves no process behind to slow the rest of the suite
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return [dict(kv.split("=") for kv in out.splitlines()[-1].split()) for out, _ in outs]
