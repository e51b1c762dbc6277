"""Workers at their own pace across an elastic run on torchft (`--sync-seconds S`,
jaxdp/elastic/timed.py): real worker processes and a real Lighthouse. With a schedule of steps
by (round, rank) the run equals the timed-rounds rule written out (test_paced.py's reference); a worker
killed with -9, rank 0 included, heals at a round's end and every rank's stream is read exactly to
--steps, once; a rank lost for good leaves its stream to a live worker; a lost quorum saves the
positions table and the same command resumes from it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from helpers import ROOT, cli_env, mlp_batches, mlp_problem

pytest.importorskip("torchft", reason="needs torchft: pip install -e '.[elastic]' (or 'jaxdp-trainer[elastic]')")

from test_elastic_ft import Node, Run, ended, finish, kill_and_end, kill_each_and_rejoin, stop_1_and_go_on  # noqa: E402
from jaxdp.launcher.workers import free_port  # noqa: E402
from test_paced import _reference  # noqa: E402

PY = sys.executable
PACED = ("--sync-seconds", "0.2")


def rounds_of(tmp_path, name: str = "ckpt") -> dict[int, dict]:
    """The run's round records by round (a former lead's and its successor's copies are one round)."""
    records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    return {r["round"]: r for r in records if "round" in r and "event" not in r}


def done_of(tmp_path, name: str = "ckpt") -> dict:
    return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines() if '"done"' in line][-1]


def assert_every_stream_read_once(tmp_path, steps: int) -> dict[int, dict]:
    """Every rank's stream read to `steps` and no further, and every step a round counted advanced one
    stream by one: the steps of all rounds add up to the streams' total (none counted twice)."""
    rounds = rounds_of(tmp_path)
    assert sorted(rounds) == list(range(1, max(rounds) + 1)), sorted(rounds)  # every round logged
    last = rounds[max(rounds)]
    assert last["positions_by_process"] == [steps, steps] and last["step"] == steps, last
    assert sum(sum(r["round_steps_by_process"]) for r in rounds.values()) == 2 * steps, rounds
    return rounds


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_schedule_of_steps_by_round_and_rank_equals_the_timed_rounds_rule_written_out(tmp_path):
    out = tmp_path / "params.npy"
    proc = subprocess.run([PY, "-m", "jaxdp.launch", "--elastic", "--elastic-engine", "torchft", "--nproc-per-node", "2",
                           "--", PY, str(ROOT / "tests" / "scripts" / "ft_paced_run.py"), str(out)],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "process 1 took no step in round 2" in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[-2:] == ["step=5 positions=5,5"] * 2, proc.stdout
    params, loss_fn = mlp_problem()
    expected, position = _reference(params, loss_fn, optax.sgd(0.1, momentum=0.9), list(mlp_batches(12, batch=64)),
                                    [[3, 1], [2, 0], [0, 4]], processes=2, per_process=1)
    assert position == [5, 5]
    flat = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(expected)])
    assert np.max(np.abs(np.load(out) - flat)) < 1e-5
    assert np.max(np.abs(np.asarray(jax.tree.leaves(params)[0]).ravel()[:8] - flat[:8])) > 1e-3  # (it trained)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_resume_whose_steps_a_stream_already_passed_reads_every_other_stream_to_them(tmp_path):
    """Rank 0 takes 4 steps a round, rank 1 one. The checkpoint of step 5 holds positions [8, 2]; resumed
    with --steps 6, rank 0's stream is past the end (it takes no more steps) and rank 1's behind it. The
    run goes on until rank 1's stream is read to 6 ([8, 6], step 7), where it used to end at the
    positions' mean ([8, 4], step 6) with two of rank 1's batches unread."""
    def run(steps):
        proc = subprocess.run([PY, "-m", "jaxdp.launch", "--elastic", "--elastic-engine", "torchft", "--nproc-per-node",
                               "2", "--", PY, str(ROOT / "tests" / "scripts" / "ft_paced_run.py"), str(tmp_path / "p.npy"),
                               str(steps), str(tmp_path / "ckpt")], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.splitlines()[-2:]

    assert run(20) == ["step=20 positions=20,20"] * 2
    for saved in os.listdir(tmp_path / "ckpt"):
        if saved.isdigit() and int(saved) != 5:
            shutil.rmtree(tmp_path / "ckpt" / saved)
    assert run(6) == ["step=7 positions=8,6"] * 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_worker_killed_rank_0_included_heals_at_a_rounds_end_and_every_stream_is_read_once(tmp_path):
    steps = 20000  # about 2,400 a second here undisturbed: long enough for two restarts
    text = kill_each_and_rejoin(Run(tmp_path, steps, "--max-restarts", "10", strategy="psum", train_args=PACED))
    assert "left out [1]" in text and "left out [0]" in text, text
    assert_every_stream_read_once(tmp_path, steps)
    finish(Run(tmp_path, steps, strategy="psum", train_args=PACED, name="calm"))
    disturbed, calm = done_of(tmp_path), done_of(tmp_path, "calm")
    # Timed rounds differ from run to run anyway; the held-out accuracy is what both must reach.
    assert abs(disturbed["eval_accuracy"] - calm["eval_accuracy"]) <= 0.03, (disturbed, calm)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank_0_lost_for_good_leaves_its_stream_to_the_live_worker_which_reads_it_to_the_end(tmp_path):
    steps = 3000
    text = kill_and_end(Run(tmp_path, steps, strategy="psum", train_args=PACED), 0, 0, at=100)  # no restarts
    assert "rank 1 leads from step" in text and "all 2 workers ended (0 restarts); exit code 0" in text, text
    rounds = assert_every_stream_read_once(tmp_path, steps)
    # once its own stream was done, rank 1 read rank 0's: rounds where rank 1 took steps past its own
    alone = [r for r in rounds.values() if r["round_steps_by_process"][0] == 0]
    assert alone and sum(r["round_steps_by_process"][1] for r in alone) > 0, rounds
    assert done_of(tmp_path)["eval_accuracy"] > 0.9


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_quorum_saves_the_positions_and_the_same_command_resumes_from_them(tmp_path):
    steps = 400000
    command = (tmp_path, steps, "--min-workers", "2", "--quorum-timeout", "5")
    text = kill_and_end(Run(*command, strategy="psum", train_args=PACED), 1, 75, at=500)
    assert "fewer than --min-workers=2 live workers" in text, text
    saved = max(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit())
    assert saved >= 500, (saved, text)
    last = max(rounds_of(tmp_path).values(), key=lambda r: r["round"])  # the last round logged before the loss
    # Resumed to one step past the save: the survivor's stream (it ended its last round alone, ahead of the
    # lost worker's) is then past the new end, and the lost worker's is behind it. The run ends when every
    # stream is read to it, not when their mean is (that ended with a stream unread).
    further = saved + 1
    again = Run(tmp_path, further, *command[2:], strategy="psum", train_args=PACED)
    try:
        assert again.proc.wait(timeout=150) == 0, again.text()
    finally:
        again.close()
    records = [json.loads(line) for line in (tmp_path / "ckpt.jsonl").read_text().splitlines()]
    assert [r["resumed_from"] for r in records if r.get("event") == "start"] == [None, saved], records
    resumed = [r for r in records if "round" in r and "event" not in r and r["round"] > last["round"]]
    # The first round after the resume went on from the saved table: the round the survivor ended alone
    # (its own steps counted, the lost worker's not), saved at floor(sum of positions / 2).
    first = resumed[0]
    table = [p - s for p, s in zip(first["positions_by_process"], first["round_steps_by_process"])]
    assert sum(table) // 2 == saved and sum(table) >= sum(last["positions_by_process"]), (first, last, saved)
    # Every stream read to the new --steps; one that ran past it before the save (the survivor, far ahead
    # under load) takes no more steps, and the run goes on until the other stream reaches it.
    assert resumed[-1]["positions_by_process"] == [max(further, p) for p in table], (table, resumed[-1:])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stopped_worker_coding_int8_is_left_out_and_heals_at_a_rounds_end_when_it_runs_again(tmp_path):
    steps = 40000
    run = Run(tmp_path, steps, "--max-restarts", "0", strategy="psum",
              train_args=(*PACED, "--compression", "int8", "--stall-timeout", "10"))
    stop_1_and_go_on(run, healed="healed from round")
    text = run.text()
    assert "all 2 workers ended (0 restarts); exit code 0" in text and "back [1]" in text, text
    assert_every_stream_read_once(tmp_path, steps)
    assert done_of(tmp_path)["eval_accuracy"] > 0.9, text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_ends_the_round_in_flight_saves_and_the_run_resumes(tmp_path):
    """Rounds of 60 s: a SIGTERM in the first ends it at once (not a minute later), every worker stops
    after it, the lead saves it and the run exits 75; the same command resumes from it."""
    run = Run(tmp_path, 10 ** 7, strategy="psum", train_args=("--sync-seconds", "60"))
    try:
        run.wait_for(lambda: (tmp_path / "ckpt.jsonl").exists() and '"start"' in (tmp_path / "ckpt.jsonl").read_text(),
                     "the start record")
        time.sleep(2)  # (in the first round's 60 s)
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=120) == 75, run.text()
    finally:
        run.close()
    rounds = rounds_of(tmp_path)
    assert list(rounds) == [1] and rounds[1]["round_s"] < 60, rounds  # the round the signal arrived in, cut short
    saved = max(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit())
    assert saved == rounds[1]["step"] > 0, (saved, rounds)
    further = max(rounds[1]["positions_by_process"]) + 50  # (past every stream: each ends there, so does the run)
    again = Run(tmp_path, further, strategy="psum", train_args=("--sync-seconds", "60"))  # (--steps ends the round)
    try:
        assert again.proc.wait(timeout=150) == 0, again.text()
    finally:
        again.close()
    assert done_of(tmp_path)["step"] == further and rounds_of(tmp_path)[2]["positions_by_process"] == [further] * 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_launchers_as_two_nodes_lose_a_whole_node_which_rejoins_at_a_rounds_end(tmp_path):
    """Node 1's launcher killed: its worker leaves, node 0 trains on alone; node 1 started again heals
    from rank 0 at a round's end; the run ends with every stream read once."""
    steps, port, args = 40000, free_port(), ("--strategy", "psum", *PACED)
    nodes = [Node(tmp_path, steps, 0, port, "node0", train_args=args), Node(tmp_path, steps, 1, port, "node1",
                                                                          train_args=args)]
    try:
        nodes[0].wait_for(lambda: nodes[0].reached() >= 500, "step 500")
        workers = nodes[1].kill_launcher()
        nodes[0].wait_for(lambda: all(ended(pid) for pid in workers), "node 1's worker to leave")
        nodes[0].wait_for(lambda: "left out [1]" in nodes[0].text(), "node 0 alone")
        nodes[1] = Node(tmp_path, steps, 1, port, "node1-again", train_args=args)
        nodes[1].wait_for(lambda: "rank 1 joined the run at step" in nodes[1].text(), "node 1's rejoin")
        assert nodes[0].proc.wait(timeout=150) == 0, nodes[0].text()
        assert nodes[1].proc.wait(timeout=60) == 0, nodes[1].text()
    finally:
        for node in nodes:
            node.close()
    assert "rank 1: its launcher is gone: this worker leaves the run" in (tmp_path / "node1.log").read_text()
    assert "back [1]" in nodes[0].text(), nodes[0].text()
    assert_every_stream_read_once(tmp_path, steps)
