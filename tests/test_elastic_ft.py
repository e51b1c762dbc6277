"""Elastic runs on torchft (`jaxdp.launch --elastic --elastic-engine torchft`, jaxdp/elastic/ft.py): real
worker processes and a real Lighthouse. A worker killed with -9 is left out and its shard computed by the
other; restarted, it heals from the live worker (no checkpoint read); losing rank 0 does not stop the run;
the final parameters equal, to the bit, those of a one-process run of the same global batch (the shard
sums are added in shard order). Too few workers for the quorum timeout: the run saves and exits 75."""

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, LaunchedRun, cli_env, elastic_rank
from jaxdp.launcher.workers import free_port
from jaxdp.bench.goodput import training_processes
from jaxdp.elastic import ft

PY = sys.executable
pytest.importorskip("torchft", reason="needs torchft: pip install -e '.[elastic]' (or 'jaxdp-trainer[elastic]')")


def test_shards_of_lost_ranks_go_to_the_live_rank_with_the_fewest():
    assert ft.assign([0, 1, 2], 3) == {0: 0, 1: 1, 2: 2}
    assert ft.assign([1], 3) == {0: 1, 1: 1, 2: 1}
    assert ft.assign([0, 2], 4) == {0: 0, 2: 2, 1: 0, 3: 2}  # one each, the lowest rank first
    assert ft.assign([2, 3], 4) == {2: 2, 3: 3, 0: 2, 1: 3}


def test_without_torchft_one_line_says_how_to_install_it(tmp_path):
    shadow = tmp_path / "shadow" / "torchft"  # an import of torchft that fails, as where it is not installed
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no torchft here')\n")
    proc = subprocess.run([PY, "-m", "jaxdp.launch", "--elastic", "--elastic-engine", "torchft", "--nproc-per-node", "2",
                           "--", PY, "-c", "pass"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=cli_env(PYTHONPATH=os.pathsep.join([str(shadow.parent), str(ROOT)])))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["jaxdp.launch: error: " + ft.INSTALL], proc.stderr


def test_torchft_flags_are_checked():
    def launch(*args):
        return subprocess.run([PY, "-m", "jaxdp.launch", *args, "--", PY, "-c", "pass"], cwd=ROOT, env=cli_env(),
                              capture_output=True, text=True, timeout=60)

    proc = launch("--nproc-per-node", "2", "--min-workers", "2")  # without the engine it would be ignored
    assert proc.returncode == 2 and "need --elastic --elastic-engine torchft" in proc.stderr, proc.stderr
    proc = launch("--elastic", "--elastic-engine", "torchft", "--nproc-per-node", "2", "--min-workers", "3")
    assert proc.returncode == 2 and "1 <= --min-workers <= --nproc-per-node x --nnodes (2)" in proc.stderr, proc.stderr
    proc = launch("--nproc-per-node", "2", "--heartbeat-timeout", "1")
    assert proc.returncode == 2 and "need --elastic --elastic-engine torchft" in proc.stderr, proc.stderr
    proc = launch("--elastic", "--elastic-engine", "torchft", "--nproc-per-node", "2", "--heartbeat-timeout", "0")
    assert proc.returncode == 2 and "--heartbeat-timeout must be a positive number of seconds, got 0" in proc.stderr
    proc = launch("--elastic", "--elastic-engine", "torchft", "--nproc-per-node", "2", "--heartbeat-timeout", "2",
                  "--lighthouse", "127.0.0.1:29400")
    assert proc.returncode == 2 and "with --lighthouse, set it where that one runs" in proc.stderr, proc.stderr


class Run(LaunchedRun):
    """`jaxdp.launch --elastic --elastic-engine torchft --nproc-per-node 2` of jaxdp.train, stderr in a file."""

    wait_timeout = 90.0

    def __init__(self, tmp_path, steps: int, *launch_args: str, train_args: tuple[str, ...] = (), strategy: str = "host",
                 devices: int = 1, name: str = "ckpt"):
        super().__init__(["--elastic", "--elastic-engine", "torchft", "--nproc-per-node", "2", *launch_args,
                          "--", PY, "-m", "jaxdp.train", *train_args, "--strategy", strategy, "--devices", str(devices),
                          "--steps", str(steps), "--checkpoint-dir", str(tmp_path / name), "--save-every", str(steps),
                          "--no-progress", "--log-every", "1", "--metrics-file", str(tmp_path / f"{name}.jsonl")],
                         log=tmp_path / f"{name}.log", metrics=tmp_path / f"{name}.jsonl", cwd=ROOT)

    def kill(self, rank: int) -> None:
        os.kill(next(p for p in training_processes(self.proc.pid) if elastic_rank(p) == rank), signal.SIGKILL)


def assert_ends_as_one_process(tmp_path, steps: int) -> None:
    """The run's final checkpoint (tmp_path/ckpt) holds a one-process run's parameters over 2 devices, bit for bit."""
    reference = subprocess.run([PY, "-m", "jaxdp.train", "--strategy", "host", "--devices", "2", "--steps", str(steps),
                                "--no-progress", "--checkpoint-dir", str(tmp_path / "reference"), "--save-every", str(steps)],
                               cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr
    final = [json.loads((tmp_path / d / str(steps) / "jaxdp_checksums.json").read_text()) for d in ("ckpt", "reference")]
    assert final[0] == final[1] and any(k.startswith("params") for k in final[0])


def kill_1_and_rejoin(run: Run) -> None:
    """Worker 1 killed at step 30 and restarted; the run ends. (Rank 0 trains alone meanwhile, "left out
    [1]", only if rank 1 is back after the Lighthouse's heartbeat timeout: a quick restart rejoins the
    step rank 0 is doing again.)"""
    try:
        run.wait_for(lambda: run.reached() >= 30, "step 30")
        run.kill(1)
        run.wait_for(lambda: "rank 1 joined the run at step" in run.text(), "rank 1's rejoin")
        assert run.proc.wait(timeout=120) == 0, run.text()
    finally:
        run.close()
    assert "worker 1 was killed by SIGKILL" in run.text(), run.text()


def kill_each_and_rejoin(run: Run) -> str:
    """Worker 1 killed at step 30, then, once it rejoined, worker 0 (which writes the metrics and
    checkpoints: the run goes on without it); both restarted, the run ends. Returns its output."""
    try:
        run.wait_for(lambda: run.reached() >= 30, "step 30")
        run.kill(1)  # rank 0 trains on, computing shard 1 too
        run.wait_for(lambda: "rank 1 joined the run at step" in run.text(), "rank 1's rejoin")
        run.kill(0)  # rank 0, which writes the metrics and checkpoints: the run goes on without it
        run.wait_for(lambda: "rank 0 joined the run at step" in run.text(), "rank 0's rejoin")
        assert run.proc.wait(timeout=120) == 0, run.text()
    finally:
        run.close()
    text = run.text()
    assert "restarting it alone (2 of 10)" in text and "all 2 workers ended (2 restarts); exit code 0" in text, text
    assert "rank 1 leads from step" in text, text  # (and keeps the lead once rank 0 is back: it saves the end)
    return text


def is_live(text: str, rank: int) -> bool:
    """Whether the last "live ranks [...]" line of a run's output names `rank` (no such line: all are)."""
    said = re.findall(r"live ranks \[([\d, ]*)\]", text)
    return not said or str(rank) in said[-1].replace(" ", "").split(",")


def stop_1_and_go_on(run: Run, rank: int = 1, healed: str = "healed from step") -> None:
    """Worker `rank` stopped (SIGSTOP) at step 30, once it takes part (under load a worker may still be
    starting while the others train), until the others have left it out and trained 20 steps without it,
    then continued; it heals from a live worker and the run ends."""
    try:
        run.wait_for(lambda: run.reached() >= 30 and is_live(run.text(), rank), f"step 30 with rank {rank} live")
        stopped = next(p for p in training_processes(run.proc.pid) if elastic_rank(p) == rank)
        os.kill(stopped, signal.SIGSTOP)
        run.wait_for(lambda: not is_live(run.text(), rank), f"rank {rank} left out")
        at = run.reached()
        run.wait_for(lambda: run.reached() >= at + 20, f"20 more steps without rank {rank}")
        os.kill(stopped, signal.SIGCONT)
        run.wait_for(lambda: f"rank {rank} {healed}" in run.text(), f"rank {rank}'s heal")
        assert run.proc.wait(timeout=300) == 0, run.text()  # a hang guard: the rest of a long run, under load
    finally:
        run.close()


def kill_and_end(run: Run, rank: int, code: int, at: int = 30, timeout: float = 150) -> str:
    """Worker `rank` killed once the run reached step `at`; the launcher must end with `code`. Returns its output."""
    try:
        run.wait_for(lambda: run.reached() >= at, f"step {at}")
        run.kill(rank)
        assert run.proc.wait(timeout=timeout) == code, run.text()
    finally:
        run.close()
    return run.text()


def logged_once(tmp_path, steps: int) -> list[dict]:
    """The run's metrics records, asserting that every step 1..steps is logged exactly once."""
    records = [json.loads(line) for line in (tmp_path / "ckpt.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in records if "event" not in r]
    assert logged == list(range(1, steps + 1)), logged
    return records


def finish(run: Run) -> None:
    """An undisturbed run to its end."""
    try:
        assert run.proc.wait(timeout=180) == 0, run.text()
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_kill_9_of_each_worker_rank_0_included_heals_from_the_other_and_ends_with_a_one_process_runs_parameters(tmp_path):
    steps = 2500  # each restart takes ~15 s under load, while the survivor alone trains 800 steps in less
    run = Run(tmp_path, steps, "--max-restarts", "10")
    text = kill_each_and_rejoin(run)
    assert "(heartbeat timeout 0.5 s)" in text, text  # one node: the shorter default (jaxdp/launcher/ft.py)
    # (The survivor computes both shards, "left out [r]", only where the restarted worker is back after
    # the Lighthouse's heartbeat timeout; with torch preloaded in the zygote it is often back before.)
    assert_ends_as_one_process(tmp_path, steps)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_restarted_before_its_peers_first_quorum_asks_again_and_the_run_ends_undisturbed(tmp_path):
    """Rank 0 stopped (SIGSTOP) at its start, before its first quorum, and rank 1 killed then: the
    restarted rank 1's first quorum holds no other worker. It must ask again until rank 0, continued,
    takes part, and the run end as an undisturbed one (it exited 75 at once, and rank 0 trained alone)."""
    steps = 60
    run = Run(tmp_path, steps, "--max-restarts", "1")
    try:
        run.wait_for(lambda: {elastic_rank(p) for p in training_processes(run.proc.pid)} >= {0, 1}, "both workers")
        first = next(p for p in training_processes(run.proc.pid) if elastic_rank(p) == 0)
        os.kill(first, signal.SIGSTOP)
        run.kill(1)
        run.wait_for(lambda: "no other worker in its quorum yet" in run.text(), "rank 1's restart finding no worker")
        os.kill(first, signal.SIGCONT)
        assert run.proc.wait(timeout=150) == 0, run.text()
    finally:
        run.close()
    text = run.text()
    assert "all 2 workers ended (1 restart); exit code 0" in text and "no live worker" not in text, text
    assert_ends_as_one_process(tmp_path, steps)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_three_workers_end_with_a_three_device_runs_parameters_bit_for_bit(tmp_path):
    """3 workers of 43 rows each: the mean divides by 3, not a power of two, and still equals a one-process
    run over 3 devices to the bit (XLA had turned the division into a multiplication by 1/3)."""
    steps = 40
    finish(Run(tmp_path, steps, "--nproc-per-node", "3", train_args=("--batch-size", "129")))
    reference = subprocess.run([PY, "-m", "jaxdp.train", "--strategy", "host", "--devices", "3", "--batch-size", "129",
                                "--steps", str(steps), "--no-progress", "--checkpoint-dir", str(tmp_path / "reference"),
                                "--save-every", str(steps)], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                               timeout=300)
    assert reference.returncode == 0, reference.stderr
    final = [json.loads((tmp_path / d / str(steps) / "jaxdp_checksums.json").read_text()) for d in ("ckpt", "reference")]
    assert final[0] == final[1] and any(k.startswith("params") for k in final[0])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_workers_of_two_devices_summing_by_the_ring_lose_and_heal_one_and_end_as_an_undisturbed_run(tmp_path):
    """--strategy ring inside each worker (2 devices), torchft across: worker 1 killed and healed; the
    final parameters are an undisturbed elastic run's, bit for bit (each shard's ring sum is the same
    program on the same number of devices, whichever worker runs it)."""
    steps = 2000  # rank 1's restart must come back before rank 0, alone, ends: 400 steps were too few under load
    kill_1_and_rejoin(Run(tmp_path, steps, "--max-restarts", "10", strategy="ring", devices=2))
    finish(Run(tmp_path, steps, strategy="ring", devices=2, name="calm"))
    final = [json.loads((tmp_path / d / str(steps) / "jaxdp_checksums.json").read_text()) for d in ("ckpt", "calm")]
    assert final[0] == final[1] and any(k.startswith("params") for k in final[0])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_int8_between_workers_loses_and_heals_one_and_ends_near_the_undisturbed_runs(tmp_path):
    """--compression int8 codes each worker's sum once (jaxdp/elastic/rows.py, RowCoder) between the workers: worker 1
    killed and healed, the run ends; undisturbed, int8 ends less than 1 % above the uncompressed
    run's held-out loss; disturbed, its held-out accuracy within 0.01 of the undisturbed int8 run's and its
    loss within 5 % (not to the bit: the lost worker's error feedback is lost with it, and its shard's
    feedback starts again at zero; near 0.05, where these runs end, the loss moves by a few % with
    where the kill lands: 0.7 % and 2.8 % seen)."""
    steps = 1500  # rank 1's restart must come back before rank 0, alone, ends: 300 steps were too few under load
    kill_1_and_rejoin(Run(tmp_path, steps, "--max-restarts", "10", train_args=("--compression", "int8")))
    losses, accuracy = {}, {}  # (rank 1's feedback is gone with it, and rank 0 has none for shard 1)
    for name, train_args in (("calm", ("--compression", "int8")), ("plain", ())):
        finish(Run(tmp_path, steps, train_args=train_args, name=name))
    for name in ("ckpt", "calm", "plain"):
        done = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines() if '"done"' in line]
        losses[name], accuracy[name] = done[-1]["eval_loss"], done[-1]["eval_accuracy"]
    assert losses["calm"] != losses["plain"]  # the codec is on: the sums differ
    assert losses["calm"] < losses["plain"] * 1.01, losses  # int8 costs under 1 % (it may end lower: 0.0530 vs 0.0539)
    assert abs(accuracy["ckpt"] - accuracy["calm"]) <= 0.01, accuracy
    assert abs(losses["ckpt"] / losses["calm"] - 1) < 0.05, losses


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("lost", [1, 0])
def test_fewer_than_min_workers_for_the_quorum_timeout_saves_and_exits_75(tmp_path, lost):
    """The survivor saves the state it holds, also where the worker lost is the lead (rank 0): it takes
    the directory's lock. (--save-every is the run's length: every checkpoint here is that save.)"""
    text = kill_and_end(Run(tmp_path, 100000, "--min-workers", "2", "--quorum-timeout", "5"), lost, 75, at=20)
    assert "fewer than --min-workers=2 live workers" in text and "all 2 workers ended (0 restarts); exit code 75" in text, text
    saved = [int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit()]
    assert saved and max(saved) >= 20, (saved, text)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_run_stopped_by_a_lost_quorum_resumes_from_its_checkpoint_and_ends_as_one_process(tmp_path):
    """Rank 0 killed with --min-workers 2: rank 1 saves the step it holds and the run exits 75. The same
    command again resumes from that checkpoint (rank 0 restores it, rank 1 takes it from rank 0), and
    the run ends with a one-process run's parameters, bit for bit; the metrics file has every step once."""
    steps = 300
    command = (tmp_path, steps, "--min-workers", "2", "--quorum-timeout", "5")  # no restarts
    text = kill_and_end(Run(*command), 0, 75)
    saved = max(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit())
    assert 30 <= saved < steps, (saved, text)
    again = Run(*command)
    try:
        assert again.proc.wait(timeout=150) == 0, again.text()
    finally:
        again.close()
    assert "all 2 workers ended (0 restarts); exit code 0" in again.text(), again.text()
    records = logged_once(tmp_path, steps)
    assert [r["resumed_from"] for r in records if r.get("event") == "start"] == [None, saved], records
    assert_ends_as_one_process(tmp_path, steps)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank_0_lost_for_good_the_lowest_live_rank_leads_saves_and_evaluates_and_ends_as_one_process(tmp_path):
    """Rank 0 (the lead: metrics, checkpoints, evaluation) is killed and not restarted: rank 1 leads from
    the next step, continues the metrics file, saves the run's end and evaluates it; the final
    parameters are a one-process run's, bit for bit (rank 1 computes both shards, added in shard order)."""
    steps = 300
    text = kill_and_end(Run(tmp_path, steps), 0, 0)  # no restarts
    assert "rank 1 leads from step" in text and "all 2 workers ended (0 restarts); exit code 0" in text, text
    records = logged_once(tmp_path, steps)  # the file continued where rank 0 stopped
    lead = [r for r in records if r.get("event") == "lead"]
    assert len(lead) == 1 and lead[0]["rank"] == 1 and lead[0]["step"] >= 30, lead
    assert records[-1]["event"] == "done" and records[-1]["eval_accuracy"] > 0.5, records[-1]
    sent = {r["comm_bytes"] for r in records if "event" not in r}  # both leads count the rows sent (it was 0.0)
    assert len(sent) == 1 and min(sent) > 0, sent
    assert_ends_as_one_process(tmp_path, steps)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", [1, 0])
def test_a_stopped_worker_is_left_out_after_the_stall_timeout_and_heals_when_it_runs_again(tmp_path, rank):
    """Rank 0 stopped is the lead stopped: rank 1 leads, and saves once rank 0, running again and healed,
    has let go of the directory's lock."""
    # The stopped rank waits out its --stall-timeout after SIGCONT while the other trains alone (up to about
    # 300 steps/s here once the step stopped waiting for the devices): 700, then 1500 steps ended first.
    steps = 5000
    # jaxdp.train's --stall-timeout (default 20 s): the all-reduce in flight with the stopped worker
    # fails after it. 10 s here: half the test's wait, still far above a step of this run
    run = Run(tmp_path, steps, "--max-restarts", "0", train_args=("--stall-timeout", "10"))
    stop_1_and_go_on(run, rank)
    text = run.text()
    assert "all 2 workers ended (0 restarts); exit code 0" in text, text
    if rank == 0:
        assert "rank 1 leads from step" in text and "still locked by the former lead" in text, text
    reference = subprocess.run([PY, "-m", "jaxdp.train", "--strategy", "host", "--devices", "2", "--steps", str(steps),
                                "--no-progress", "--checkpoint-dir", str(tmp_path / "reference"), "--save-every", str(steps)],
                               cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr
    final = [json.loads((tmp_path / d / str(steps) / "jaxdp_checksums.json").read_text()) for d in ("ckpt", "reference")]
    assert final[0] == final[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_stopped_until_the_run_ended_overwrites_neither_its_checkpoints_nor_its_metrics(tmp_path):
    """Rank 1 stopped (SIGSTOP) at step 30 and continued only once rank 0 has trained alone to the end and
    exited: rank 1 finds itself alone and would lead, but the run's files hold step 300, past its own
    state. It stops without a save and without a record (exit 0: the run had ended), so the checkpoint
    and the metrics file stay rank 0's, "done" record included."""
    steps = 300
    run = Run(tmp_path, steps, "--max-restarts", "0", train_args=("--stall-timeout", "10"))
    try:
        run.wait_for(lambda: run.reached() >= 30 and is_live(run.text(), 1), "step 30 with rank 1 live")
        stopped = next(p for p in training_processes(run.proc.pid) if elastic_rank(p) == 1)
        os.kill(stopped, signal.SIGSTOP)
        run.wait_for(lambda: training_processes(run.proc.pid) == [stopped], "rank 0's end", timeout=180)
        ended = (tmp_path / "ckpt.jsonl").read_text()
        saved = json.loads((tmp_path / "ckpt" / str(steps) / "jaxdp_checksums.json").read_text())
        os.kill(stopped, signal.SIGCONT)
        assert run.proc.wait(timeout=120) == 0, run.text()
    finally:
        run.close()
    text = run.text()
    assert f"rank 1: the run went on to step {steps} without this worker" in text, text
    assert "exit code 0" in text and "rank 1 leads" not in text, text
    assert (tmp_path / "ckpt.jsonl").read_text() == ended
    assert json.loads(ended.splitlines()[-1])["event"] == "done"
    assert json.loads((tmp_path / "ckpt" / str(steps) / "jaxdp_checksums.json").read_text()) == saved


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lighthouse_elsewhere_is_used_and_none_starts_in_the_launcher(tmp_path):
    lighthouse = ft.start_lighthouse("127.0.0.1", 0, 1, 2.0, 60.0)  # "elsewhere": this test's process
    port = lighthouse.address().rsplit(":", 1)[1]
    try:
        run = Run(tmp_path, 20, "--lighthouse", f"127.0.0.1:{port}")
        try:
            assert run.proc.wait(timeout=120) == 0, run.text()
        finally:
            run.close()
    finally:
        lighthouse.shutdown()
    assert f"Lighthouse http://127.0.0.1:{port}" in run.text(), run.text()
    assert (tmp_path / "ckpt" / "20").is_dir()


NAN_ON_RANK_1 = """
import os

import flax.linen as nn
import jax.numpy as jnp


class Net(nn.Module):  # a linear classifier whose every output is NaN on worker 1 (say, a broken card)
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))
        return y * jnp.nan if os.environ.get("JAXDP_ELASTIC_RANK") == "1" else y
"""


def run_nan_on_rank_1(tmp_path, *train_args: str, strategy: str = "host") -> str:
    """60 steps of a linear classifier whose every output is NaN on worker 1, to the end; its output."""
    (tmp_path / "nan_models.py").write_text(NAN_ON_RANK_1)
    run = Run(tmp_path, 60, strategy=strategy,
              train_args=(*train_args, "--model", "nan_models:Net", "--model-path", str(tmp_path)))
    try:
        assert run.proc.wait(timeout=150) == 0, run.text()
    finally:
        run.close()
    return run.text()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_worker_whose_sums_are_not_finite_is_left_out_and_named_and_the_run_trains_on_the_others(tmp_path):
    """Worker 1's model gives NaN: its shard is left out of every step (the mean over the other shard),
    named in one line, and the run ends with a finite loss, where the NaN guard would have stopped it."""
    text = run_nan_on_rank_1(tmp_path)
    assert "step 0: the sums of shard(s) [1] (computed by rank(s) [1]) are not finite: left out" in text, text
    assert text.count("are not finite") == 1, text  # named once, not every step
    done = [json.loads(line) for line in (tmp_path / "ckpt.jsonl").read_text().splitlines() if '"done"' in line]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "ckpt.jsonl").read_text().splitlines()
              if '"loss"' in line and '"event"' not in line]
    assert losses and all(loss == loss for loss in losses) and losses[-1] < losses[0], losses
    assert done and done[-1]["eval_accuracy"] > 0.25, done  # (chance: 0.1; a linear model, 60 steps, half the rows)


class Node(LaunchedRun):
    """One node's launcher of a two-node torchft run on 127.0.0.1 (one worker each: rank = node rank)."""

    wait_timeout = 90.0

    def __init__(self, tmp_path, steps: int, node: int, port: int, log: str, save_every: int = 0,
                 train_args: tuple[str, ...] = ("--strategy", "host")):
        super().__init__(["--elastic", "--elastic-engine", "torchft", "--nnodes", "2", "--node-rank", str(node),
                          "--coordinator", f"127.0.0.1:{port}", "--nproc-per-node", "1", "--max-restarts", "10",
                          "--", PY, "-m", "jaxdp.train", *train_args, "--devices", "1", "--steps", str(steps),
                          "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", str(save_every or steps),
                          "--no-progress",
                          "--log-every", "1", "--metrics-file", str(tmp_path / "ckpt.jsonl")],
                         log=tmp_path / f"{log}.log", metrics=tmp_path / "ckpt.jsonl", cwd=ROOT)

    def kill_all(self) -> None:
        """The launcher and its workers, as when the machine goes away: all stopped first, so that none
        reacts to another's end (a worker whose launcher dies gets SIGTERM, PR_SET_PDEATHSIG, and acts
        on it: `kill_launcher`), then killed."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        workers = training_processes(self.proc.pid)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in workers:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self.proc.kill()
        self.proc.wait()

    def kill_launcher(self) -> list[int]:
        """The launcher alone, by SIGKILL (its workers get SIGTERM: PR_SET_PDEATHSIG). Returns its workers."""
        workers = training_processes(self.proc.pid)
        self.proc.kill()
        self.proc.wait()
        return workers

    def kill_worker(self) -> None:
        os.kill(training_processes(self.proc.pid)[0], signal.SIGKILL)


def ended(pid: int) -> bool:
    """The process has exited (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_launchers_as_two_nodes_lose_a_whole_node_and_rank_0s_worker_and_end_with_a_one_process_runs_parameters(
        tmp_path):
    """Node 0's launcher hosts the Lighthouse on --coordinator. Node 1's launcher is killed (kill -9): its
    worker, whose launcher is gone and did not host the Lighthouse, leaves the run by itself, and node 0
    trains on, computing both shards; node 1's launcher started again brings its worker back, healed
    from rank 0. Then rank 0's worker is killed: node 0's launcher restarts it and it heals from rank 1.
    The end: a one-process run's parameters over 2 devices, bit for bit."""
    steps, port = 6000, free_port()  # (node 1 must be back before node 0 ends: its start takes ~10 s under load,
    # while node 0 alone trains 2,500 steps in less)
    nodes = [Node(tmp_path, steps, 0, port, "node0"), Node(tmp_path, steps, 1, port, "node1")]
    try:
        nodes[0].wait_for(lambda: nodes[0].reached() >= 30, "step 30")
        workers = nodes[1].kill_launcher()
        nodes[0].wait_for(lambda: all(ended(pid) for pid in workers), "node 1's worker to leave")
        at = nodes[0].reached()
        nodes[0].wait_for(lambda: nodes[0].reached() >= at + 20, "20 steps of node 0 alone")
        nodes[1] = Node(tmp_path, steps, 1, port, "node1-again")
        nodes[1].wait_for(lambda: "rank 1 joined the run at step" in nodes[1].text(), "node 1's rejoin")
        nodes[0].kill_worker()
        nodes[0].wait_for(lambda: "rank 0 joined the run at step" in nodes[0].text(), "rank 0's rejoin")
        assert nodes[0].proc.wait(timeout=150) == 0, nodes[0].text()
        assert nodes[1].proc.wait(timeout=60) == 0, nodes[1].text()
    finally:
        for node in nodes:
            node.close()
    gone = (tmp_path / "node1.log").read_text()  # (the first node 1, whose worker wrote on after its launcher)
    assert "rank 1: its launcher is gone: this worker leaves the run, the others train on" in gone, gone
    assert "left out [1]" in nodes[0].text(), nodes[0].text()  # node 0 alone: it computed shard 1 too
    assert "(heartbeat timeout 1 s)" in nodes[0].text(), nodes[0].text()  # several nodes: the longer default
    assert "worker 0 was killed by SIGKILL; restarting it alone" in nodes[0].text(), nodes[0].text()
    assert "ranks 1..1 of 2" in nodes[1].text() and "all 1 workers ended" in nodes[1].text(), nodes[1].text()
    assert_ends_as_one_process(tmp_path, steps)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank_0_restarted_with_no_live_worker_goes_on_alone_from_the_checkpoint(tmp_path):
    """Node 1 and rank 0's worker killed together: node 0's launcher restarts rank 0, which finds no
    live worker, takes the directory's lock, restores the latest checkpoint and trains on alone, both
    shards, to a one-process run's parameters, bit for bit."""
    steps, port = 400, free_port()
    nodes = [Node(tmp_path, steps, 0, port, "node0", save_every=50),  # (the same flags on both: workers compare them)
             Node(tmp_path, steps, 1, port, "node1", save_every=50)]
    try:
        nodes[0].wait_for(lambda: nodes[0].reached() >= 120, "step 120")
        nodes[1].kill_all()
        nodes[0].kill_worker()
        assert nodes[0].proc.wait(timeout=150) == 0, nodes[0].text()
    finally:
        for node in nodes:
            node.close()
    text = nodes[0].text()
    assert "jaxdp: resumed from step" in text and "joined the run" not in text, text
    assert "all 1 workers ended (1 restart); exit code 0" in text, text
    assert_ends_as_one_process(tmp_path, steps)


def listeners(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listening in these processes (/proc/net/tcp and tcp6)."""
    owner = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in owner:  # 0A: LISTEN
                    continue
                hexed, port = local.split(":")
                raw = bytes.fromhex(hexed)  # the kernel's words, each in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((str(ipaddress.ip_address(raw[:width])), int(port, 16), owner[inode]))
    return found


# Listeners a one-node run keeps on a wildcard address, because torchft leaves no way to bind them
# elsewhere: none (jaxdp/elastic/ft.py binds torch's TCPStore, torchft's manager server and its
# checkpoint server to the announced address; docs/multihost.md, "What listens").
FORCED_WILDCARD: list[str] = []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_one_node_run_listens_on_loopback_only(tmp_path):
    """Each worker's TCPStore, manager server (gRPC: its Kill ends the worker) and checkpoint server (the
    whole state, during a heal), the gloo pairs and the Lighthouse: 127.0.0.1, none on every interface."""
    run = Run(tmp_path, 400)
    try:
        run.wait_for(lambda: run.reached() >= 20, "step 20")
        workers = training_processes(run.proc.pid)
        found = listeners([run.proc.pid, *workers])
        assert run.proc.wait(timeout=120) == 0, run.text()
    finally:
        run.close()
    assert len(workers) == 2 and {pid for _, _, pid in found} >= set(workers), (workers, found)
    wild = [f for f in found if f[0] in ("0.0.0.0", "::") and f[0] not in FORCED_WILDCARD]
    assert not wild, found
    assert all(address == "127.0.0.1" for address, _, _ in found), found


def test_the_state_transfer_serves_only_the_members_of_the_quorum():
    """The checkpoint server a heal fetches from listens on the announced address and serves a client
    only where the engine admits it (a member of the last quorum, by the address its replica id names)."""
    import urllib.request
    from datetime import timedelta

    import torch

    admitted: list[str] = []
    for admit in (True, False):
        with ft.bound_to("127.0.0.1", lambda address: admitted.append(address) or admit):
            transport = ft.transport("127.0.0.1", timedelta(seconds=5))
        try:
            assert transport._server.server_address[0] == "127.0.0.1"
            assert transport.address().startswith("http://127.0.0.1:")
            transport.send_checkpoint([1], 3, {"x": torch.arange(4)}, timedelta(seconds=5))
            if admit:
                got = transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=5))
                assert got["x"].tolist() == [0, 1, 2, 3]
            else:
                with pytest.raises(Exception):
                    urllib.request.urlopen(f"{transport.metadata()}3/full", timeout=5).read()
        finally:
            transport.shutdown()
    assert admitted and set(admitted) == {"127.0.0.1"}, admitted


def test_replica_ids_carry_the_address_the_flags_and_the_rank():
    from torchft.manager import extract_trailing_digits

    for host in ("127.0.0.1", "10.1.2.3", "fe80::1", None):
        replica = ft.replica_id(7, host, "ab12" * 3) + ":0c7d-uuid"
        assert ft.member_of(replica) == ft.Member(7, host, "ab12" * 3)
        assert extract_trailing_digits(replica.split(":")[0]) == 7  # (how torchft reads the rank back)
    assert ft.member_of("someone_else:uuid") is None
    assert ft.same_ip("::ffff:10.1.2.3", {"10.1.2.3"}) and not ft.same_ip("10.1.2.4", {"10.1.2.3"})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_with_different_flags_are_refused_naming_the_flag(tmp_path):
    """--lr 0.5 on node 1 only: each worker's first quorum compares the flags' prints in the members'
    replica ids, and every worker refuses, exit 2, with one line naming --lr (as jax.distributed runs do)."""
    port = free_port()
    nodes = [Node(tmp_path, 200, 0, port, "node0"),
             Node(tmp_path, 200, 1, port, "node1", train_args=("--strategy", "host", "--lr", "0.5"))]
    try:
        codes = [node.proc.wait(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            node.close()
    for node, code in zip(nodes, codes):
        text = node.text()
        assert code == 2, text
        said = [line for line in text.splitlines() if line.startswith("jaxdp: error:")]
        assert len(said) == 1 and "--lr differs between workers" in said[0], text
        assert "Traceback" not in text, text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_launcher_with_a_node_rank_in_use_is_refused_and_the_run_goes_on(tmp_path):
    """`--node-rank 1` given to a third launcher while the run trains: its worker's first quorum finds
    rank 1 twice; it refuses, exit 2, one line; the two nodes train on."""
    steps, port = 100000, free_port()
    nodes = [Node(tmp_path, steps, 0, port, "node0"), Node(tmp_path, steps, 1, port, "node1")]
    try:
        nodes[0].wait_for(lambda: nodes[0].reached() >= 30, "step 30")
        twin = Node(tmp_path, steps, 1, port, "twin")
        nodes.append(twin)
        assert twin.proc.wait(timeout=150) == 2, twin.text()
        at = nodes[0].reached()
        nodes[0].wait_for(lambda: nodes[0].reached() >= at + 30, "30 more steps")
        assert nodes[1].proc.poll() is None, nodes[1].text()
    finally:
        for node in nodes:
            node.close()
    said = [line for line in twin.text().splitlines() if line.startswith("jaxdp: error:")]
    assert len(said) == 1 and "rank 1 is taken" in said[0] and "--node-rank" in said[0], twin.text()
    assert "Traceback" not in twin.text(), twin.text()


@pytest.mark.slow  # torchft's 30 s connect timeout, waited out
def test_a_worker_whose_lighthouse_went_away_while_it_started_exits_75_naming_it(capsys):
    """A worker slow to start (a loaded machine) first connects after the Lighthouse went away: the
    others have saved and exited 75; this one said "RuntimeError: failed to connect" and exited 1."""
    from jaxdp.elastic.workers import FtWorker

    worker = FtWorker(f"http://127.0.0.1:{free_port()}", 1, 2)  # nothing listens there
    with pytest.raises(SystemExit) as ended:
        worker.start()
    assert ended.value.code == 75
    line = capsys.readouterr().err.strip()
    assert line.startswith("jaxdp: rank 1: the Lighthouse at 127.0.0.1:") and line.endswith(
        "went away before this worker joined; exit code 75"), line


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lighthouse_that_goes_away_is_named_and_the_run_saves_and_exits_75(tmp_path):
    """The Lighthouse (--lighthouse: another process) is killed mid-run: the workers' next quorum fails,
    they tell a dead Lighthouse from a quorum too small by connecting to its address, and the run saves
    and exits 75 with one line naming it: no "--min-workers", no gRPC text."""
    port = free_port()
    host = subprocess.Popen([PY, "-c", f"import time\nfrom jaxdp.cluster.ft_env import start_lighthouse\n"
                             f"lighthouse = start_lighthouse('127.0.0.1', {port}, 1, 2.0, 60.0)\ntime.sleep(600)"],
                            cwd=ROOT, env=cli_env(), stderr=subprocess.DEVNULL)
    try:
        run = Run(tmp_path, 100000, "--lighthouse", f"127.0.0.1:{port}", "--quorum-timeout", "5")
        try:
            run.wait_for(lambda: run.reached() >= 30, "step 30")
            host.kill()
            assert run.proc.wait(timeout=150) == 75, run.text()
        finally:
            run.close()
    finally:
        host.kill()
        host.wait()
    text = run.text()
    assert f"the Lighthouse at 127.0.0.1:{port} went away at step" in text, text
    assert "all 2 workers ended (0 restarts); exit code 75" in text, text
    assert "--min-workers" not in text and "status:" not in text and "tonic" not in text.lower(), text
    saved = [int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit()]
    assert saved and max(saved) >= 30, (saved, text)
