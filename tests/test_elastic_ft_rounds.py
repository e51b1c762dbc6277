"""Local steps across the workers of an elastic run on torchft (`--sync-every H`,
jaxdp/elastic/rounds.py): real worker processes and a real Lighthouse. Undisturbed, the run is a
one-process run of as many devices, bit for bit; a worker killed with -9 (rank 0 included) is left out
of the round, restarts, heals from the live one at a round's end and the run ends near the undisturbed
one; a stalled worker is left out and heals when it runs again; a worker whose pseudo-gradient is not
finite is left out of every round and named once."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, cli_env

pytest.importorskip("torchft", reason="needs torchft: pip install -e '.[elastic]' (or 'jaxdp-trainer[elastic]')")

from test_elastic_ft import Run, finish, kill_and_end, kill_each_and_rejoin, run_nan_on_rank_1, stop_1_and_go_on  # noqa: E402

PY = sys.executable
ROUNDS = ("--sync-every", "4")


def params_of(tmp_path, name: str, steps: int) -> dict:
    """The global parameters' and the outer optimizer's checksums of a run's last checkpoint (each
    process's replicas are its own: an elastic run's checkpoint holds rank 0's)."""
    sums = json.loads((tmp_path / name / str(steps) / "jaxdp_checksums.json").read_text())
    return {k: v for k, v in sums.items() if "per_device" not in k}


def done_of(tmp_path, name: str) -> dict:
    return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines() if '"done"' in line][-1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_undisturbed_local_steps_across_workers_are_a_one_process_run_bit_for_bit(tmp_path):
    steps = 40
    finish(Run(tmp_path, steps, strategy="psum", train_args=ROUNDS))
    reference = subprocess.run([PY, "-m", "jaxdp.train", "--strategy", "psum", "--devices", "2", *ROUNDS, "--steps",
                                str(steps), "--no-progress", "--checkpoint-dir", str(tmp_path / "reference"),
                                "--save-every", str(steps)], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                               timeout=300)
    assert reference.returncode == 0, reference.stderr
    final = params_of(tmp_path, "ckpt", steps)
    assert final == params_of(tmp_path, "reference", steps)
    assert any(k.startswith("params") for k in final) and any("outer" in k for k in final), final


def kill_each_and_end_near_a_calm_run(tmp_path, train_args: tuple[str, ...], steps: int = 4000) -> None:
    """Each worker killed with -9 (rank 0 too) and restarted: each rejoins at a round's boundary (a step
    that is a multiple of the rounds' 4), and the run ends near an undisturbed one. Not to the bit: the
    lost worker's steps of its round are lost with it. The two runs are the same to the first kill and
    then part (this MLP ends near zero training loss either way: its held-out loss is a few examples'
    worth), so they are held to the accuracy. (Local steps make about 200 a second here: a restart
    under load can take 15 s.)"""
    text = kill_each_and_rejoin(Run(tmp_path, steps, "--max-restarts", "10", strategy="psum", train_args=train_args))
    joined = [int(line.split("joined the run at step ")[1].split()[0]) for line in text.splitlines()
              if "joined the run at step" in line]
    assert joined and all(at % 4 == 0 for at in joined), joined
    finish(Run(tmp_path, steps, strategy="psum", train_args=train_args, name="calm"))
    disturbed, calm = done_of(tmp_path, "ckpt"), done_of(tmp_path, "calm")
    assert abs(disturbed["eval_accuracy"] - calm["eval_accuracy"]) <= 0.02, (disturbed, calm)
    assert disturbed["eval_loss"] < 0.15 and calm["eval_loss"] < 0.15, (disturbed, calm)


def stop_1_coding_int8(tmp_path, train_args: tuple[str, ...]) -> None:
    """Rank 1, its rows coded int8, stopped with SIGSTOP and continued (`stop_1_and_go_on`): the run ends
    with no restart, rank 1 back, and trained."""
    # 4,000 steps: the stopped worker waits out its --stall-timeout after SIGCONT while the other trains
    # alone (130 steps/s here); with 1,500 the run could end first (it then stops aside: test_elastic_ft.py)
    run = Run(tmp_path, 4000, "--max-restarts", "0", strategy="psum",
              train_args=(*train_args, "--compression", "int8", "--stall-timeout", "10"))
    stop_1_and_go_on(run)
    text = run.text()
    assert "all 2 workers ended (0 restarts); exit code 0" in text and "back [1]" in text, text
    assert done_of(tmp_path, "ckpt")["eval_accuracy"] > 0.8, text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_worker_killed_in_a_round_rank_0_included_heals_at_a_rounds_end_and_the_run_ends_near_an_undisturbed_one(
        tmp_path):
    kill_each_and_end_near_a_calm_run(tmp_path, ROUNDS)  # (rank 0 finishes a round alone, then rank 1 does)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stopped_worker_is_left_out_of_the_rounds_and_heals_at_a_rounds_end_when_it_runs_again(tmp_path):
    stop_1_coding_int8(tmp_path, ROUNDS)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_whose_pseudo_gradient_is_not_finite_is_left_out_of_the_rounds_and_named_once(tmp_path):
    text = run_nan_on_rank_1(tmp_path, *ROUNDS, strategy="psum")
    assert "step 4: the pseudo-gradient of rank(s) [1] is not finite: left out of the round" in text, text
    assert text.count("is not finite") == 1, text
    assert done_of(tmp_path, "ckpt")["eval_accuracy"] > 0.25, text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_quorum_in_a_round_ends_the_round_with_the_survivor_saves_and_exits_75(tmp_path):
    """Rank 1 killed with --min-workers 2: rank 0's round ends with its own pseudo-gradient alone, it saves
    that state (every replica the global parameters again) and the run exits 75."""
    text = kill_and_end(Run(tmp_path, 400000, "--min-workers", "2", "--quorum-timeout", "5", strategy="psum",
                            train_args=ROUNDS), 1, 75, at=40)
    assert "fewer than --min-workers=2 live workers" in text and "exit code 75" in text, text
    saved = [int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit()]
    assert saved and max(saved) >= 40 and max(saved) % 4 == 0, (saved, text)  # at a round's end
