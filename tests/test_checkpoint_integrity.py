"""Checkpoint integrity: checksums catch silently corrupted arrays, a missing description is damage
(not "other flags"), each damaged checkpoint is one warning line, a full disk is one line and its own
exit code, and one directory takes one run at a time."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxdp
from helpers import ROOT, cli_env, records, run_cli
from jaxdp.checkpoint.checkpointer import CHECKSUMS_FILE
from jaxdp.config import parse_args
from jaxdp.errors import EXIT_CANNOT_SAVE, EXIT_DIVERGED
from jaxdp.train import main, train

FAST = ["--log-every", "1", "--no-progress", "--save-every", "5", "--keep", "5"]


def first_run(ckpt: Path, steps: int = 10) -> None:
    assert main(["--checkpoint-dir", str(ckpt), "--steps", str(steps), *FAST]) == 0


def resume(ckpt: Path, metrics: Path, steps: int = 12) -> subprocess.CompletedProcess:
    return run_cli("--checkpoint-dir", str(ckpt), "--steps", str(steps), "--metrics-file", str(metrics), *FAST)


def step_records(path: Path) -> list[dict]:
    return [r for r in records(path) if "event" not in r]


@pytest.mark.slow
def test_overwritten_bytes_in_an_array_file_are_caught_moved_aside_and_the_run_falls_back(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    first_run(ckpt)
    blob = max((ckpt / "10" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    with open(blob, "r+b") as f:  # 4 bytes in the middle of the largest array file: orbax reads garbage
        f.seek(blob.stat().st_size // 2)
        f.write(b"\xff\xff\xff\x7f")

    proc = resume(ckpt, metrics)

    err = [line for line in proc.stderr.strip().splitlines() if not line.startswith("jaxdp: resumed from step")]
    assert proc.returncode == 0 and len(err) == 1, err
    assert err[0].startswith("jaxdp: warning: checkpoint") and "moved it to" in err[0] and "resuming from step 5" in err[0]
    assert "<bound method" not in err[0] and "Traceback" not in proc.stderr
    assert (ckpt / "10.unreadable" / "state").is_dir()  # kept for inspection, never deleted
    assert step_records(metrics)[0]["step"] == 6 and all(r["loss"] < 10 for r in step_records(metrics))


@pytest.mark.slow  # over 4 s on 2 cores
def test_a_missing_state_description_is_damage_not_other_flags(tmp_path):
    """state/_METADATA gone: moved aside and resumed from the step before (it used to exit 2 with
    "use the flags it was made with", and fail the same way on every requeue)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    first_run(ckpt)
    (ckpt / "10" / "state" / "_METADATA").unlink()

    proc = resume(ckpt, metrics)

    err = [line for line in proc.stderr.strip().splitlines() if not line.startswith("jaxdp: resumed from step")]
    assert proc.returncode == 0 and len(err) == 1 and "state/_METADATA" in err[0] and "resuming from step 5" in err[0], err
    assert (ckpt / "10.unreadable").is_dir() and step_records(metrics)[0]["step"] == 6


@pytest.mark.slow
def test_damaged_array_files_give_one_warning_line_and_no_tracebacks(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    first_run(ckpt)
    for blob in (ckpt / "10" / "state").rglob("d/*"):
        with open(blob, "r+b") as f:
            f.truncate(7)
    proc = resume(ckpt, metrics)
    err = [line for line in proc.stderr.strip().splitlines() if not line.startswith("jaxdp: resumed from step")]
    assert proc.returncode == 0 and len(err) == 1 and "could not be read" in err[0], err
    assert "<bound method" not in err[0] and "pybind" not in err[0]


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_its_own_exit_code_and_one_line(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a 2 MB tmpfs here: {mount.stderr.strip()}")
    try:
        metrics = tmp_path / "m.jsonl"
        # Each checkpoint of the MLP takes ~0.9 MB: the third save cannot be written.
        proc = run_cli("--checkpoint-dir", str(disk / "ckpt"), "--steps", "100", "--metrics-file", str(metrics), *FAST)
        err = [line for line in proc.stderr.strip().splitlines() if not line.startswith("jaxdp: resumed from step")]
        assert proc.returncode == EXIT_CANNOT_SAVE == 73 and len(err) == 1, proc.stderr[-3000:]
        assert "cannot write checkpoint step 15" in err[0] and "no space left" in err[0], err
        assert step_records(metrics)[-1]["step"] < 100  # stopped soon after the failed save, not at the end
        assert {"5", "10"} <= set(os.listdir(disk / "ckpt"))  # the earlier checkpoints are intact
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow  # over 4 s on 2 cores
def test_a_background_save_that_fails_exits_73_at_once(tmp_path):
    """The checkpoint directory replaced by a file mid-run (as a read-only remount after a disk error
    does): exit 73 comes with its message, not 300 s later (orbax's threads of the failed save
    waited for a signal that never came, and Python waited for them at exit)."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "jaxdp.train", "--checkpoint-dir", str(ckpt), "--steps", "1000000",
                             "--save-every", "200", "--log-every", "1000", "--no-progress"],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (ckpt / "200").is_dir() and proc.poll() is None:
            time.sleep(0.01)
        shutil.move(ckpt, tmp_path / "moved")
        ckpt.write_text("")
        try:
            _, err = proc.communicate(timeout=60)  # (300 s before the fix)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"no exit 60 s after the failed save: {proc.communicate()[1][-3000:]}")
    finally:
        proc.kill()
    assert proc.returncode == EXIT_CANNOT_SAVE, err[-3000:]
    lines = err.strip().splitlines()  # one line, as for a full disk
    assert len(lines) == 1 and lines[0].startswith("jaxdp: error: cannot write checkpoint step"), err[-3000:]


@pytest.mark.slow  # over 4 s on 2 cores
def test_a_second_run_on_the_same_directory_exits_2(tmp_path, capsys):
    with jaxdp.Checkpointer(str(tmp_path / "ckpt")):  # a run that holds the directory
        proc = run_cli("--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "2", "--no-progress")
    err = [line for line in proc.stderr.strip().splitlines() if not line.startswith("jaxdp: resumed from step")]
    assert proc.returncode == 2 and len(err) == 1 and "is in use by another run" in err[0], err
    assert sorted(os.listdir(tmp_path / "ckpt")) == []  # nothing written, no lock file left behind
    first_run(tmp_path / "ckpt", steps=5)  # released: the next run takes it


def save_without_checksums(ckpt: Path, config, state) -> None:
    """Write `state` as checkpoint `state.step` of `ckpt` with no checksum record: damage that a
    checksum would have caught, in a checkpoint of an older jaxdp or of a run killed before writing it."""
    step = int(state.step)
    shutil.rmtree(ckpt / str(step))
    with jaxdp.Checkpointer(str(ckpt), config=config) as writer:
        writer.save(state)
    (ckpt / str(step) / CHECKSUMS_FILE).unlink()


def test_a_checkpoint_without_checksums_restores_with_a_warning_and_is_never_called_intact(tmp_path, capsys):
    """Wrong but finite arrays and no checksum record: restored (refusing would throw away every
    checkpoint made before checksums existed) but said so, and a divergence that follows names it
    as the likely cause instead of calling it intact and blaming the learning rate."""
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--no-progress", "--optimizer", "sgd", "--lr", "0.01", "--log-every", "1"]
    result = train(parse_args([*flags, "--steps", "5"]))
    damaged = result.state.replace(params=jax.tree.map(lambda p: p * 1e20, result.state.params))
    save_without_checksums(ckpt, parse_args([*flags, "--steps", "5"]), damaged)
    capsys.readouterr()

    assert main([*flags, "--steps", "10"]) == EXIT_DIVERGED
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"jaxdp: warning: checkpoint {ckpt / '5'} has no checksum record"), err
    assert err[0].endswith("restored it unverified"), err
    assert err[-1].startswith("jaxdp: error: training diverged") and "is intact" not in err[-1], err
    assert "resumed from checkpoint step 5, which has no checksum record, so it could not be verified" in err[-1]


def test_non_finite_arrays_without_checksums_are_damage(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--no-progress", "--save-every", "5", "--keep", "5"]
    result = train(parse_args([*flags, "--steps", "10"]))
    damaged = result.state.replace(params=jax.tree.map(lambda p: p.at[0].set(np.nan), result.state.params))
    save_without_checksums(ckpt, parse_args([*flags, "--steps", "10"]), damaged)
    capsys.readouterr()

    assert main([*flags, "--steps", "12"]) == 0  # it used to restore the NaN and exit 65 at step 11
    err = capsys.readouterr().err.strip().splitlines()
    assert "holds non-finite values, and there is no checksum record" in err[0], err
    assert "resuming from step 5" in err[0], err
    assert (ckpt / "10.unreadable").is_dir()
