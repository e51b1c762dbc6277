"""Overlapped rounds across the workers of an elastic run on torchft (`--sync-every H --overlap`,
jaxdp/elastic/overlap.py): real worker processes and a real Lighthouse. Undisturbed, the run is a
one-process `--overlap` run of as many devices, bit for bit, and so is what a save in the middle of it
holds (the last average that landed, at the step where the round in flight started) and what a stop
signal saves (every worker averages what is in flight first); a worker killed with -9, rank 0 included,
heals at a round's start and listens to that round's exchange; a stalled one is left out and trains
its round again from a live worker's state; a lost quorum saves the survivor's state and exits 75."""

import json
import os
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, LaunchedRun, cli_env

pytest.importorskip("torchft", reason="needs torchft: pip install -e '.[elastic]' (or 'jaxdp-trainer[elastic]')")

from test_elastic_ft import Run, finish, kill_and_end  # noqa: E402
from test_elastic_ft_rounds import done_of, kill_each_and_end_near_a_calm_run, params_of, stop_1_coding_int8  # noqa: E402

PY = sys.executable
OVERLAP = ("--sync-every", "4", "--overlap")


def reference(tmp_path, steps: int) -> dict:
    """A one-process `--overlap` run of `steps` over 2 devices, saved only at its end (after its last
    average landed): its global parameters' and outer optimizer's checksums."""
    name = f"reference-{steps}"
    proc = subprocess.run([PY, "-m", "jaxdp.train", "--strategy", "psum", "--devices", "2", *OVERLAP, "--steps",
                           str(steps), "--no-progress", "--checkpoint-dir", str(tmp_path / name), "--save-every",
                           str(10 ** 6)], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return params_of(tmp_path, name, steps)


def saved_steps(tmp_path) -> list[int]:
    return sorted(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_undisturbed_overlapped_rounds_and_a_save_in_the_middle_are_a_one_process_run_bit_for_bit(tmp_path):
    """--save-every 40 falls due at the end of round 10, with round 10's rows in flight: that save holds
    the last average that landed, at step 36, which is a 36-step run's end. The run's own end averages
    round 10's rows and saves step 40."""
    finish(Run(tmp_path, 40, strategy="psum", train_args=OVERLAP))
    assert saved_steps(tmp_path) == [36, 40]
    final = params_of(tmp_path, "ckpt", 40)
    assert any(k.startswith("params") for k in final) and any("outer" in k for k in final), final
    assert final == reference(tmp_path, 40)
    assert params_of(tmp_path, "ckpt", 36) == reference(tmp_path, 36)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_that_starts_late_is_waited_for_and_the_run_is_still_a_one_process_run_bit_for_bit(tmp_path):
    """Rank 1 starts 20 s after rank 0 (a slow start-up, another node's launcher): rank 0 waits for it
    at the run's start instead of training its rounds alone (a round's local steps that a worker does
    not take are lost), so both take part in every round."""
    text = start_rank_1_late(tmp_path, 40)
    assert "waiting for rank(s) [1] to join" in text and "left out" not in text, text
    assert params_of(tmp_path, "ckpt", 40) == reference(tmp_path, 40)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_later_than_the_quorum_timeout_is_left_out_and_saves_nothing_when_it_comes(tmp_path):
    """With --quorum-timeout 5, rank 0 waits 5 s for rank 1, then trains alone to the run's end; rank 1,
    20 s late, finds nobody, waits for rank 0 as long and exits 75 without a save of its untrained state."""
    text = start_rank_1_late(tmp_path, 40, "--quorum-timeout", "5")
    assert "waiting for rank(s) [1] to join" in text and "left out [1]" in text, text
    assert "rank 1: rank 0 did not join within 5 s" in text and "saved step 0" not in text, text
    assert saved_steps(tmp_path) == [36, 40]  # (no step 0: the save in the middle, the end)


def start_rank_1_late(tmp_path, steps: int, *launch_args: str) -> str:
    """An overlapped run of `steps` on torchft whose rank 1 starts 20 s after rank 0, to its end; its output."""
    train = [PY, "-m", "jaxdp.train", *OVERLAP, "--strategy", "psum", "--devices", "1", "--steps", str(steps),
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", str(steps), "--no-progress",
             "--metrics-file", str(tmp_path / "ckpt.jsonl")]
    late = f'if [ "$JAXDP_ELASTIC_RANK" = 1 ]; then sleep 20; fi; exec {" ".join(train)}'
    run = LaunchedRun(["--elastic", "--elastic-engine", "torchft", "--nproc-per-node", "2", *launch_args, "--",
                       "sh", "-c", late], log=tmp_path / "ckpt.log", metrics=tmp_path / "ckpt.jsonl", cwd=ROOT)
    finish(run)
    return run.text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_worker_killed_rank_0_included_heals_at_a_rounds_start_and_the_run_ends_near_an_undisturbed_one(
        tmp_path):
    kill_each_and_end_near_a_calm_run(tmp_path, OVERLAP)  # (a joiner listens to the exchange it healed in)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stopped_worker_is_left_out_and_trains_its_round_again_from_a_live_workers_state(tmp_path):
    stop_1_coding_int8(tmp_path, OVERLAP)  # (healed by its own exchange on the thread: the round again)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_quorum_saves_the_survivors_state_at_a_rounds_end_and_exits_75(tmp_path):
    """Rank 1 killed with --min-workers 2: rank 0 applies its own rows alone (the one in flight, then its
    round's), saves that state and the run exits 75."""
    text = kill_and_end(Run(tmp_path, 400000, "--min-workers", "2", "--quorum-timeout", "5", strategy="psum",
                            train_args=OVERLAP), 1, 75, at=40)
    assert "fewer than --min-workers=2 live workers" in text and "exit code 75" in text, text
    saved = saved_steps(tmp_path)
    assert saved and saved[-1] >= 40 and saved[-1] % 4 == 0, (saved, text)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stop_signal_averages_what_is_in_flight_saves_a_one_process_runs_state_and_the_run_resumes(tmp_path):
    """SIGTERM to the launcher: the stop rides the next round's rows, every worker stops after that round
    and averages the rows in flight, and the lead saves: a one-process run of as many steps, bit for
    bit. The same command, with more steps, resumes from it."""
    run = Run(tmp_path, 10 ** 7, strategy="psum", train_args=OVERLAP)
    try:
        run.wait_for(lambda: run.reached() >= 40, "step 40")
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=120) == 75, run.text()
    finally:
        run.close()
    stopped = saved_steps(tmp_path)[-1]
    assert stopped >= 40 and stopped % 4 == 0, saved_steps(tmp_path)
    assert params_of(tmp_path, "ckpt", stopped) == reference(tmp_path, stopped)
    further = stopped + 40
    finish(Run(tmp_path, further, strategy="psum", train_args=OVERLAP))
    records = [json.loads(line) for line in (tmp_path / "ckpt.jsonl").read_text().splitlines()]
    resumed = [r["step"] for r in records if "round" in r and "event" not in r and r["step"] > stopped]
    assert resumed and resumed[0] == stopped + 8, resumed  # (its first round's figures land with its second)
    assert done_of(tmp_path, "ckpt")["step"] == further, records[-3:]
