"""Processes of one run started with different flags: every process exits 2 within seconds, with
one line naming the first differing flag and each process's value (they used to train different
models quietly, hang, or time out)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, cli_env, free_port, spawn_cli
from jaxdp.cluster.agreement import disagreement

RUN = ["--steps", "3", "--batch-size", "32", "--no-progress"]


def two_processes(tmp_path, flags0, flags1, prefix=((), ())):
    port = free_port()
    procs = []
    for rank, flags in enumerate((flags0, flags1)):
        argv = [*RUN, *flags, "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(rank)]
        if prefix[rank]:  # a command in front (a wrapper): a new process
            procs.append(subprocess.Popen([*prefix[rank], sys.executable, "-m", "jaxdp.train", *argv], cwd=ROOT, env=cli_env(),
                                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"p{rank}.err", "w")))
        else:
            procs.append(spawn_cli(*argv, stderr=tmp_path / f"p{rank}.err"))
    try:
        return [(p.wait(timeout=120), (tmp_path / f"p{rank}.err").read_text().strip().splitlines())
                for rank, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


CASES = {
    "lr": (["--lr", "0.001"], ["--lr", "0.01"], "--lr differs between processes (process 0 has --lr=0.001, process 1 has --lr=0.01)"),
    "strategy": (["--strategy", "psum"], ["--strategy", "ring"], "--strategy differs between processes"),
    "devices": (["--devices", "2"], ["--devices", "1"], "every process must use the same number of devices"),
    "checkpoint dir": (["--checkpoint-dir", "{tmp}/a"], ["--checkpoint-dir", "{tmp}/b"], "--checkpoint-dir differs"),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_processes_with_different_flags_all_exit_2_naming_the_flag(tmp_path, case):
    flags0, flags1, needle = CASES[case]
    flags0, flags1 = ([f.format(tmp=tmp_path) for f in flags] for flags in (flags0, flags1))
    devices = [] if case == "devices" else ["--devices", "2"]
    results = two_processes(tmp_path, [*devices, *flags0], [*devices, *flags1])
    for code, err in results:
        assert code == 2 and err and err[-1].startswith("jaxdp: error:") and needle in err[-1], results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_dir_that_is_not_shared_is_named(tmp_path):
    """The same --checkpoint-dir on both, but process 1 sees its own private directory of that name
    (its own mount namespace with a tmpfs there): node-local disks."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -m (root) to give one process its own directory")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    private = ("unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs "{ckpt}" && exec "$0" "$@"')
    results = two_processes(tmp_path, ["--devices", "2", "--checkpoint-dir", str(ckpt)],
                            ["--devices", "2", "--checkpoint-dir", str(ckpt)], prefix=((), private))
    for code, err in results:
        assert code == 2 and "on process 1 is not the one process 0 writes" in err[-1], results


def test_disagreement_names_the_first_differing_flag_in_flag_order():
    a = {"config": {"batch_size": 64, "lr": 0.1, "seed": 0}, "devices": 4}
    b = {"config": {"batch_size": 64, "lr": 0.2, "seed": 1}, "devices": 4}
    assert disagreement([a, a]) is None
    assert disagreement([a, b]).startswith("--lr differs between processes (process 0 has --lr=0.1, process 1 has --lr=0.2)")
    short = {**a, "devices": "process 1: --devices=4 but this process has only 2 cpu devices; ask for at most 2"}
    assert disagreement([a, short]) == short["devices"]
    assert "--devices with the smallest count, 2" in disagreement([a, {**a, "devices": 2}])


# ---- the same flags, different inputs ------------------------------------------------------------


def write_inputs(directory, case, rank):
    """Process `rank`'s working directory for `case`: the same relative --dataset, another file."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    if case == "bad token id":
        ids = np.arange(4000, dtype=np.int64) % 50
        if rank == 1:
            ids[::97] = 77
        np.save(directory / "t.npy", ids)
    elif not (case == "missing file" and rank == 1):
        rows = 100 if case == "different rows" and rank == 1 else 200
        np.savez(directory / "data.npz", x=rng.standard_normal((rows, 5)), y=rng.integers(0, 3, rows))


INPUT_CASES = {
    "missing file": (["--dataset", "data.npz"],
                     "--dataset: on process 1 (of 2): dataset file 'data.npz' does not exist"),
    "bad token id": (["--dataset", "t.npy", "--vocab-size", "50", "--model", "gpt", "--layers", "1", "--d-model", "32",
                      "--heads", "2", "--seq-len", "16"],
                     "--vocab-size: on process 1 (of 2): dataset file 't.npy' holds token id 77"),
    "different rows": (["--dataset", "data.npz"],
                       "--dataset: the processes read different data (process 0: 180 training and 20 held-out rows "
                       "of float32[5], 3 classes; process 1: 90 training and 10 held-out rows"),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(INPUT_CASES))
def test_input_bad_on_one_process_stops_every_process_with_exit_2_naming_it(tmp_path, case):
    """It used to stop that process alone: the other waited in a collective until JAX aborted it
    (SIGABRT, C++ traces, no jaxdp line), or both trained on different data and exited 0."""
    flags, needle = INPUT_CASES[case]
    env = cli_env(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    port, procs = free_port(), []
    for rank in range(2):
        cwd = tmp_path / f"p{rank}"
        write_inputs(cwd, case, rank)
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxdp.train", *RUN, *flags, "--devices", "2",
                                       "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
                                       "--process-id", str(rank)], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / f"p{rank}.err", "w")))
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    errs = [(tmp_path / f"p{rank}.err").read_text().strip().splitlines() for rank in range(2)]
    assert codes == [2, 2], (codes, [e[-3:] for e in errs])
    for err in errs:
        assert len(err) == 1 and err[0].startswith("jaxdp: error: " + needle), errs
