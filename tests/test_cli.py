"""`python -m jaxdp.train` end to end, and every bad input: exit 2, one line, no traceback."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import ROOT, cli_env, records, run_cli, step_records
from jaxdp.cluster.distributed import default_cpu_devices
from jaxdp.train import main


@pytest.mark.slow
def test_default_ring_run_reaches_90_percent(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_cli("--strategy=ring", "--metrics-file", str(metrics), "--log-dir", str(tmp_path / "tb"))
    assert proc.returncode == 0, proc.stderr
    steps, done = step_records(metrics), records(metrics)[-1]
    assert [r["step"] for r in steps] == list(range(10, 301, 10))
    assert all(np.isfinite(r["loss"]) for r in steps) and steps[-1]["loss"] < steps[0]["loss"]
    assert done["event"] == "done" and done["eval_accuracy"] >= 0.90
    assert done["devices"] == default_cpu_devices()  # one per core of this machine, 2 to 8
    assert "eval_accuracy=" in proc.stdout
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("cores, devices", [(1, 2), (2, 2), (3, 2), (4, 4), (6, 4), (8, 8), (12, 8), (64, 8)])
def test_cpu_default_is_one_device_per_core_as_a_power_of_two_from_2_to_8(monkeypatch, cores, devices):
    """More simulated devices than cores only take turns on them (docs/performance.md, "Behind the
    defaults"); a power of two keeps the default batch sizes divisible; 2 keeps a peer for every strategy."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert default_cpu_devices() == devices


def test_cnn_on_user_npz_with_host_strategy(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "data.npz"
    np.savez(path, x=rng.standard_normal((200, 6, 6)), y=rng.integers(0, 4, 200))
    assert main(["--model", "cnn", "--dataset", str(path), "--strategy", "host", "--steps", "5",
                 "--batch-size", "16", "--no-progress"]) == 0


def test_final_line_says_how_much_of_the_held_out_split_it_evaluated(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 200)  # 19,000 bytes: 10 % held out, 118 windows of 16
    gpt = ["--model", "gpt", "--dataset", str(text), "--layers", "1", "--d-model", "16", "--heads", "2",
           "--seq-len", "16", "--batch-size", "16", "--steps", "2", "--no-progress"]
    assert main([*gpt, "--eval-batches", "2"]) == 0
    assert re.search(r"eval_perplexity=\S+ \(held-out: 32 of 118 windows, 27.1 %; --eval-batches 0: all\) steps=2",
                     capsys.readouterr().out)
    assert main([*gpt, "--eval-batches", "0"]) == 0
    assert re.search(r"\(held-out: all \d+ windows\) steps=2", capsys.readouterr().out)


def bad_npz(tmp_path, kind):
    path = tmp_path / f"{kind}.npz"
    if kind == "missing":
        return str(path)
    if kind == "corrupt":
        path.write_bytes(b"PK\x03\x04 this is not a zip archive")
    elif kind == "no_y":
        np.savez(path, x=np.zeros((10, 3)))
    elif kind == "mismatch":
        np.savez(path, x=np.zeros((10, 3)), y=np.zeros(9, np.int32))
    return str(path)


BAD_INPUTS = {
    "unknown strategy": (["--strategy", "tree"], "invalid choice"),
    "unknown model": (["--model", "resnet"], "neither a built-in model"),
    "model not MODULE:ATTR": (["--model", "my models:Net"], "nor MODULE:ATTR"),
    "user model missing": (["--model", "no_such_module_xyz:Net"], "no module named 'no_such_module_xyz'"),
    "user model attribute": (["--model", "jaxdp.models.builtin:Nope"], "has no attribute 'Nope'"),
    "unknown flag": (["--bogus", "1"], "unrecognized arguments"),
    "batch size 0": (["--batch-size", "0"], "--batch-size must be a positive integer"),
    "batch not divisible": (["--batch-size", "12"], "must be divisible by the number of devices (8)"),
    "negative steps": (["--steps", "-5"], "--steps must be 0 or more"),
    "nan lr": (["--lr", "nan"], "--lr must be a positive number"),
    "negative lr": (["--lr", "-0.1"], "--lr must be a positive number"),
    "zero devices": (["--devices", "0"], "--devices must be a positive integer"),
    "too many devices": (["--devices", "64"], "ask for at most 8"),
    "missing npz": (["--dataset", "{missing}"], "does not exist"),
    "corrupt npz": (["--dataset", "{corrupt}"], "not a readable .npz"),
    "npz without y": (["--dataset", "{no_y}"], "has no array 'y'"),
    "x/y mismatch": (["--dataset", "{mismatch}"], "x has 10 rows but y has 9"),
    "cnn on flat data": (["--model", "cnn", "--dataset", "synthetic", "--batch-size", "8"], None),
    "checkpoint dir is a file": (["--checkpoint-dir", "{file}"], "is a file, not a directory"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, case):
    argv, needle = BAD_INPUTS[case]
    if case == "cnn on flat data":  # synthetic is image-shaped: the CNN accepts it; use a flat npz
        path = tmp_path / "flat.npz"
        np.savez(path, x=np.zeros((20, 3)), y=np.zeros(20, np.int32))
        argv, needle = ["--model", "cnn", "--dataset", str(path), "--batch-size", "8"], "--model=cnn needs image data"
    (tmp_path / "file").write_text("not a directory")
    paths = {k: bad_npz(tmp_path, k) for k in ("missing", "corrupt", "no_y", "mismatch")} | {"file": str(tmp_path / "file")}
    argv = [a.format(**paths) for a in argv] + ["--steps", "1", "--no-progress"] if case != "negative steps" else argv
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxdp: error:") and needle in err[0], err
    assert (tmp_path / "file").read_text() == "not a directory"


def test_out_of_device_memory_is_one_line_saying_what_to_change(monkeypatch, capsys):
    import jax

    import jaxdp.train

    report = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 28185722880 bytes.\n"
              "BufferAssignment OOM Debugging.\nBufferAssignment stats:\n  parameter allocation: 26.25GiB")

    def train(config):
        raise jax.errors.JaxRuntimeError(report)

    monkeypatch.setattr(jaxdp.train, "train", train)
    assert main(["--steps", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("jaxdp: error: out of device memory (XLA could not allocate 26.25 GiB more)"), err
    assert "--batch-size" in err[0] and "--shard-params" in err[0] and "--debug" in err[0], err
    assert main(["--steps", "1", "--no-progress", "--debug"]) == 1  # --debug: XLA's report, whole
    assert "BufferAssignment OOM Debugging" in capsys.readouterr().err
    monkeypatch.setattr(jaxdp.train, "train", lambda config: (_ for _ in ()).throw(RuntimeError("RESOURCE_EXHAUSTED: "
                                                                                               "too many files")))
    assert main(["--steps", "1", "--no-progress"]) == 1  # not memory: said as it is
    assert "RuntimeError: RESOURCE_EXHAUSTED: too many files" in capsys.readouterr().err


@pytest.mark.slow  # over 3 s on 2 cores
def test_bad_input_in_a_real_process_has_no_traceback_unless_debug(tmp_path):
    proc = run_cli("--batch-size", "12", "--steps", "1", "--devices", "8")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("jaxdp: error: --batch-size=12")
    proc = run_cli("--batch-size", "12", "--steps", "1", "--devices", "8", "--debug")
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def imported_modules(importtime_stderr: str) -> set[str]:
    """Module names from `python -X importtime` output ("import time: self | cumulative | name")."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("argv, code", [(["--help"], 0), (["--strategy", "tree"], 2), (["--step", "3"], 2)])
def test_help_and_flag_errors_import_no_jax(argv, code):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxdp.train", *argv], capture_output=True,
                          text=True, cwd=ROOT, env=cli_env(JAXDP_MALLOC_ENV="0"), timeout=60)
    assert proc.returncode == code, proc.stderr[-2000:]
    modules = imported_modules(proc.stderr)
    assert "jaxdp.config" in modules  # the measurement works
    heavy = sorted(m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax"))
    assert not heavy, heavy
    if code == 0:
        assert "checkpointing:" in proc.stdout and "--coordinator-address" in proc.stdout
    else:  # one line; --step is not taken as an abbreviation of --steps
        assert proc.stderr.count("jaxdp: error:") == 1 and "Traceback" not in proc.stderr


def test_importing_the_package_has_no_side_effects():
    code = ("import os, sys, jaxdp, jaxdp.config, jaxdp.train; "
            "print('jax' in sys.modules, os.environ.get('JAXDP_MALLOC_ENV'), os.getpid())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={k: v for k, v in cli_env().items() if k != "JAXDP_MALLOC_ENV"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    jax_loaded, marker, _ = proc.stdout.split()
    assert (jax_loaded, marker) == ("False", "None")  # no JAX, no re-exec


@pytest.mark.slow
def test_the_console_script_tunes_malloc_like_python_dash_m(tmp_path):
    script = Path(sys.executable).with_name("jaxdp-train")
    if not script.exists():
        pytest.skip(f"no {script.name} next to {sys.executable} (install the package: pip install -e .)")
    env = {k: v for k, v in cli_env().items() if k != "JAXDP_MALLOC_ENV"}
    proc = subprocess.run([str(script), "--steps", "1", "--no-progress", "--metrics-file", str(tmp_path / "m.jsonl")],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr
    assert records(tmp_path / "m.jsonl")[0]["malloc_env"] == "1"  # it re-executed itself before JAX loaded


def closing_parts(text):
    """(total, [the parts before any ';']) of a closing line's time=..."""
    total = float(re.match(r"time=([\d.]+)s", text).group(1))
    return total, [float(x) for x in re.findall(r"([\d.]+)s", text.split(";")[0])[1:]]


@pytest.mark.parametrize("total, startup, first, decided, expected", [
    (9.5, 8.0, 2.1, None, "time=9.5s (start-up 8.0s, first step with compilation 1.5s)"),
    (13.6, 5.3, 7.1, None, "time=13.6s (start-up 5.3s, first step with compilation 7.1s)"),
    (12.5, 7.7, 4.4, 1.6, "time=12.5s (start-up 7.7s, first step with compilation 4.4s; "
                          "of the 12.5s, --compression/--sync-every auto measuring 1.6s)"),
    (1.04, 0.56, 0.49, 0.0, "time=1.0s (start-up 0.6s, first step with compilation 0.4s)"),
    (3.0, 3.2, 0.5, None, "time=3.0s (start-up 3.0s, first step with compilation 0.0s)"),
])
def test_the_closing_lines_time_parts_add_up_to_no_more_than_its_total(total, startup, first, decided, expected):
    from jaxdp.train import closing_time

    text = closing_time(total, startup, first, decided)
    assert text == expected
    whole, parts = closing_parts(text)
    assert len(parts) == 2 and sum(parts) <= whole + 1e-9


def test_the_closing_lines_time_parts_never_exceed_its_total():
    from jaxdp.train import closing_time

    rng = np.random.default_rng(0)
    for t, s, f in rng.uniform(0, 30, (500, 3)):  # any numbers: the printed parts never exceed the printed total
        whole, parts = closing_parts(closing_time(t, s, f, rng.uniform(0, 5)))
        assert sum(parts) <= whole + 1e-9 and min(parts) >= 0, (t, s, f)
