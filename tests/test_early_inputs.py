"""Inputs that used to fail late (after JAX started, or at the first save) or with the wrong code:
each now exits 2 with one line, before JAX is imported."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env, free_port

# Runs main() and reports whether JAX was imported by the time it returned.
PROBE = "import sys; from jaxdp.train import main; code = main(sys.argv[1:]); print('jax' in sys.modules); sys.exit(code)"


def run_main(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *argv, "--steps", "1", "--no-progress"], cwd=ROOT,
                          env=cli_env(), capture_output=True, timeout=120)


CASES = {
    "negative seed": (["--seed", "-1"], "--seed must be between 0 and 4294967295, got -1"),
    "huge seed": (["--seed", "100000000000000000000"], "--seed must be between 0 and 4294967295"),
    "metrics file under a file": (["--metrics-file", "{file}/m.jsonl"], "which is a file, not a directory"),
    "log dir under a file": (["--log-dir", "{file}/tb"], "which is a file, not a directory"),
    "abbreviated flag": (["--step", "3"], "unrecognized arguments: --step"),
    "zero stall timeout": (["--stall-timeout", "0"], "--stall-timeout must be a positive number"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exit_2_with_one_line_before_jax_starts(tmp_path, case):
    (tmp_path / "file").write_text("x")
    argv, needle = CASES[case]
    proc = run_main(*(a.format(file=tmp_path / "file") for a in argv))
    err = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("jaxdp: error:") and needle in err[0], err
    assert proc.stdout.decode().strip() == "False"  # JAX never imported


def test_non_utf8_checkpoint_dir_exits_2_before_training(tmp_path):
    bad = os.fsencode(tmp_path) + b"/ckpt-\xff\xfe"
    proc = subprocess.run([os.fsencode(sys.executable), b"-c", PROBE.encode(), b"--checkpoint-dir", bad,
                           b"--steps", b"1", b"--no-progress"], cwd=ROOT, env=cli_env(), capture_output=True, timeout=120)
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "is not valid UTF-8" in err[0], err
    assert proc.stdout.decode().strip() == "False" and not os.path.exists(bad)


@pytest.mark.multiprocess
def test_coordinator_port_in_use_says_so(tmp_path):
    with __import__("socket").create_server(("127.0.0.1", free_port())) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "jaxdp.train", "--coordinator-address", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", "0", "--steps", "1", "--no-progress"],
                              cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, err
    assert f"port {port} is already in use" in err[0], err
