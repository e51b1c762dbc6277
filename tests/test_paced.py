"""Workers at their own pace (jaxdp/step/rounds.py, `--sync-seconds`): rounds of fixed steps equal
lockstep local steps; the example-weighted average equals a reference; resume is exact given the
recorded positions; a process with no step in a round is named; two processes with different
step counts equal a plain reference loop."""

import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from helpers import ROOT, cli_env, free_port, mlp_batches, mlp_problem, run_cli

import jaxdp
from jaxdp.errors import InputError
from jaxdp.mesh import make_mesh
from jaxdp.step import rounds as paced


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_rounds_of_h_steps_equal_lockstep_local_steps(devices):
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(12))
    tx = optax.adam(1e-2)
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    paced_run = jaxdp.fit(loss_fn, params, tx, lambda k: data[k], steps=12, strategy="ring", outer_tx=outer,
                          sync_seconds=lambda r, p: 4, progress=False)
    lockstep = jaxdp.fit(loss_fn, params, tx, lambda k: data[k], steps=12, strategy="ring", outer_tx=outer,
                         sync_every=4, progress=False)
    assert int(paced_run.state.step) == 12
    assert _max_diff(paced_run.state.params, lockstep.state.params) < 1e-6
    assert [r["round_steps_by_process"] for r in paced_run.history] == [[4], [4], [4]]


def test_the_average_is_weighted_by_each_devices_steps(devices):
    """make_sync on hand-made replicas and step counts against numpy: sum n_d (g - r_d) / sum n_d,
    applied by outer SGD(1); replicas reset to the result; no outer step when nobody stepped."""
    params, _ = mlp_problem()
    mesh = make_mesh(devices)
    tx = optax.sgd(0.1)
    state = jaxdp.init_state(params, tx, mesh, outer_tx=optax.sgd(1.0))
    rows, shared = paced.init_sync(mesh)
    rng = np.random.default_rng(0)
    replicas = jax.tree.map(lambda x: np.asarray(x)[None] + rng.standard_normal((8, *x.shape)).astype(np.float32),
                            params)
    state = state.replace(sync=state.sync.replace(
        per_device={**state.sync.per_device, **rows,
                    "local_sgd": {**state.sync.per_device["local_sgd"], "params": paced.rows_to(
                        jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(
                            mesh, jax.sharding.PartitionSpec("data"))), replicas), mesh)}},
        shared={**state.sync.shared, **shared}))
    sync = paced.make_sync(mesh, "ring", None, optax.sgd(1.0))
    put = lambda v: jax.device_put(v, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))  # noqa: E731
    counts = np.array([3, 0, 1, 7, 2, 2, 0, 5], np.int32)
    new, metrics = sync(jax.tree.map(lambda x: x, state), put(counts), put(np.ones(8, np.float32)))
    w = counts / counts.sum()
    expected = jax.tree.map(lambda g, r: g - np.tensordot(w, np.asarray(g)[None] - r, axes=1), params, replicas)
    assert _max_diff(new.params, expected) < 1e-5
    assert _max_diff(jax.tree.map(lambda x: np.asarray(x)[3], new.sync.per_device["local_sgd"]["params"]), new.params) == 0
    assert list(np.asarray(metrics["steps_by_device"])) == list(counts)
    assert abs(float(metrics["loss"]) - 8 / counts.sum()) < 1e-6  # the loss sums over the round's steps
    kept = jax.tree.map(np.asarray, new.params)  # (the sync donates its state)
    idle, _ = sync(new, put(np.zeros(8, np.int32)), put(np.zeros(8, np.float32)))
    assert _max_diff(idle.params, kept) == 0


def test_resume_is_exact_given_the_recorded_positions(devices, tmp_path):
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(40))
    tx = optax.adam(1e-2)
    schedule = lambda r, p: [3, 5, 2, 4, 1, 6, 3][r]  # noqa: E731
    common = dict(strategy="psum", outer_tx=optax.sgd(0.7, momentum=0.9), sync_seconds=schedule, progress=False)
    whole = jaxdp.fit(loss_fn, params, tx, lambda k: data[k], steps=20, **common)
    first = jaxdp.fit(loss_fn, params, tx, lambda k: data[k], steps=10, checkpoint_dir=str(tmp_path / "c"),
                      save_every=1, **common)
    assert int(first.state.step) == 10  # rounds of 3, 5 and 2 steps
    resumed = jaxdp.fit(loss_fn, params, tx, lambda k: data[k], steps=20, checkpoint_dir=str(tmp_path / "c"),
                        save_every=1, **common)
    assert int(resumed.state.step) == int(whole.state.step) == 20  # the last round's 6 steps cut to 5: never past steps
    assert _max_diff(resumed.state.params, whole.state.params) == 0
    assert [r["round"] for r in resumed.history] == [4, 5, 6]


@pytest.mark.timeout(60)  # (such a schedule used to run for ever)
def test_a_schedule_that_gives_no_process_a_step_is_refused(devices):
    """A round where nobody steps trains nothing; a schedule of them never ended. (A process with no
    step in a round while others step is named: test_two_processes_at_different_paces_...)"""
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(10))
    with pytest.raises(InputError, match="gives no process a step in round 1"):
        jaxdp.fit(loss_fn, params, optax.sgd(0.1), lambda k: data[k], steps=4, sync_seconds=lambda r, p: [2, 0, 2][r],
                  progress=False)


@pytest.mark.timeout(60)  # (every round used to take no step, for ever)
def test_a_round_shorter_than_a_step_still_takes_one_step_per_process(devices, tmp_path):
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(5))
    metrics = tmp_path / "m.jsonl"
    result = jaxdp.fit(loss_fn, params, optax.sgd(0.1), lambda k: data[k], steps=5, sync_seconds=1e-9, progress=False,
                       metrics_file=str(metrics), log_every=1)
    assert int(result.state.step) == 5
    assert [r["round_steps_by_process"] for r in result.history] == [[1]] * 5
    assert "no_progress" not in metrics.read_text()


def test_a_time_bound_round_never_goes_past_steps(devices, tmp_path):
    """The first round used to train for its whole time bound (hundreds of steps past steps=10, and
    the same call again refused the checkpoint as past steps)."""
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(64))
    common = dict(steps=10, sync_seconds=0.5, progress=False, checkpoint_dir=str(tmp_path / "c"))
    result = jaxdp.fit(loss_fn, params, optax.sgd(0.1), lambda k: data[k % 64], **common)
    assert int(result.state.step) == 10
    assert [r["round_steps_by_process"] for r in result.history] == [[10]]
    again = jaxdp.fit(loss_fn, params, optax.sgd(0.1), lambda k: data[k % 64], **common)
    assert int(again.state.step) == 10 and again.history == []


@pytest.mark.slow  # over 4 s on 2 cores
def test_sigterm_ends_a_time_bound_round_early_saves_and_exits_75(tmp_path):
    """With --sync-seconds 60, SIGTERM was acted on when the round's 60 s ended, past the 30 s grace
    of SLURM and Kubernetes."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "jaxdp.train", "--sync-seconds", "60", "--steps", "1000000",
                             "--checkpoint-dir", str(ckpt), "--metrics-file", str(metrics), "--no-progress"],
                            cwd=ROOT, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (metrics.exists() and '"start"' in metrics.read_text()) and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(1.0)  # into the first round
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)  # (the round's 60 s before the fix)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]
    saved = [int(d.name) for d in ckpt.iterdir() if d.name.isdigit()]
    assert len(saved) == 1 and saved[0] > 0 and f"saved step {saved[0]}" in err, err[-2000:]


def test_time_bounded_rounds_train(devices):
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(64))
    result = jaxdp.fit(loss_fn, params, optax.adam(1e-2), lambda k: data[k % 64], steps=60, sync_seconds=0.05,
                       progress=False)
    assert 60 <= int(result.state.step) < 60 + max(r["round_steps_by_process"][0] for r in result.history)
    # It learned: the loss over the data, before and after (not the first round's logged loss against the
    # last's: under load a time-bound round may be one step, whose batch's loss is noise).
    whole = lambda p: float(np.mean([loss_fn(p, b) for b in data]))  # noqa: E731
    assert whole(jax.device_get(result.state.params)) < 0.9 * whole(params)


@pytest.mark.parametrize("kwargs, says", [
    (dict(sync_every=4), "sync_every=4"), (dict(compression="auto"), "compression='auto'"),
    (dict(strategy="host"), "in-graph strategy"), (dict(sync_seconds=-1.0), "positive number of seconds")])
def test_what_sync_seconds_does_not_combine_with_is_one_line(devices, kwargs, says):
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(2))
    with pytest.raises(InputError, match=says):
        jaxdp.fit(loss_fn, params, optax.sgd(0.1), lambda k: data[k], steps=2, progress=False,
                  **{"sync_seconds": 1.0, **kwargs})


def test_cli_refuses_sync_seconds_with_sync_every():
    proc = run_cli("--sync-seconds", "1", "--sync-every", "8", "--steps", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("jaxdp: error: --sync-seconds does not combine with "
                                                           "--sync-every=8")


def _reference(params, loss_fn, tx, batches, schedule, processes=2, per_process=2):
    """The paced rule written out: every device its own replica and inner state, the mean of the
    pseudo-gradients weighted by steps, outer SGD(1)."""
    grad = jax.jit(jax.grad(loss_fn))
    rows = 64 // processes // per_process
    opt = [[tx.init(params) for _ in range(per_process)] for _ in range(processes)]
    position, global_params = [0] * processes, params
    for steps in schedule:
        deltas, weights = [], []
        for p in range(processes):
            for j in range(per_process):
                replica = global_params
                for k in range(position[p], position[p] + steps[p]):
                    start = 32 * p + rows * j
                    batch = jax.tree.map(lambda x: x[start: start + rows], batches[k])
                    updates, opt[p][j] = tx.update(grad(replica, batch), opt[p][j], replica)
                    replica = optax.apply_updates(replica, updates)
                deltas.append(jax.tree.map(lambda g, r: g - r, global_params, replica))
                weights.append(steps[p])
            position[p] += steps[p]
        if sum(weights):
            mean = jax.tree.map(lambda *d: sum(w * x for w, x in zip(weights, d)) / sum(weights), *deltas)
            global_params = jax.tree.map(lambda g, m: g - m, global_params, mean)
    return global_params, position


@pytest.mark.multiprocess
def test_two_processes_at_different_paces_equal_the_reference(tmp_path):
    port, out = free_port(), tmp_path / "params.npy"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "scripts" / "paced_run.py"), str(i),
                               f"127.0.0.1:{port}", str(out)], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    printed = [dict(kv.split("=") for kv in o.splitlines()[-1].split()) for o, _ in outs]
    assert "process 1 took no step in round 2" in outs[0][1]
    assert "process 0 took no step" not in outs[0][1]  # (in round 3 it had reached steps: done, not idle)
    params, loss_fn = mlp_problem()
    expected, position = _reference(params, loss_fn, optax.sgd(0.1, momentum=0.9), list(mlp_batches(12, batch=64)),
                                    [[3, 1], [2, 0], [0, 4]])  # (process 0's 1 step in round 3 would pass steps=5)
    assert [int(p["position"]) for p in printed] == position == [5, 5]
    assert [int(p["step"]) for p in printed] == [5, 5]
    flat = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(expected)])
    assert np.max(np.abs(np.load(out) - flat)) < 1e-5
