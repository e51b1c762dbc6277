"""--overlap: the average of round k's pseudo-gradients runs while round k + 1 trains and is applied
one round late (jaxdp/step/overlap.py, `Overlapped`), against a reference delayed-update loop written out
here; exact resume with the average in flight; the flag's errors."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.config import ConfigError, parse_args
from jaxdp.sync.rules import check_config
from jaxdp.errors import InputError
from jaxdp.mesh import make_mesh
from jaxdp.models.builtin import MLP

H, STEPS, ROWS = 4, 22, 16  # 22 = 5 rounds of 4, then a last round of 2
MODEL = MLP(hidden=(8,), num_classes=3)
X = np.random.default_rng(0).standard_normal((ROWS * STEPS, 6)).astype(np.float32)
Y = (np.abs(X[:, :3]).argmax(1)).astype(np.int32)
PARAMS = MODEL.init(jax.random.PRNGKey(0), X[:1])["params"]
TX = optax.sgd(0.2)
OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


def loss_fn(params, batch):
    logits = MODEL.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def data(step):
    return {"x": X[step * ROWS:(step + 1) * ROWS], "y": Y[step * ROWS:(step + 1) * ROWS]}


def reference(devices: int) -> dict:
    """The delayed update, device by device: each round every replica takes its inner steps on its
    rows; then the outer step applies the mean of the PREVIOUS round's deltas, and every replica
    restarts from the new global parameters minus its own delta of this round (not averaged yet).
    At the end the last round's mean is applied and every replica is the global parameters."""
    grad = jax.jit(jax.grad(loss_fn))
    tree_sub = lambda a, b: jax.tree.map(lambda x, y: x - y, a, b)  # noqa: E731
    global_ = PARAMS
    outer_state = OUTER.init(global_)
    replicas = [PARAMS] * devices
    inner = [TX.init(PARAMS) for _ in range(devices)]
    in_flight = None
    step = 0
    while step < STEPS:
        anchor = list(replicas)
        for _ in range(min(H, STEPS - step)):
            batch = data(step)
            for d in range(devices):
                rows = {k: v[d * ROWS // devices:(d + 1) * ROWS // devices] for k, v in batch.items()}
                updates, inner[d] = TX.update(grad(replicas[d], rows), inner[d], replicas[d])
                replicas[d] = optax.apply_updates(replicas[d], updates)
            step += 1
        deltas = [tree_sub(a, r) for a, r in zip(anchor, replicas)]
        if in_flight is not None:
            mean = jax.tree.map(lambda *xs: sum(xs) / devices, *in_flight)
            updates, outer_state = OUTER.update(mean, outer_state, global_)
            global_ = optax.apply_updates(global_, updates)
        replicas = [tree_sub(global_, d) for d in deltas]
        in_flight = deltas
    mean = jax.tree.map(lambda *xs: sum(xs) / devices, *in_flight)
    updates, outer_state = OUTER.update(mean, outer_state, global_)
    return optax.apply_updates(global_, updates)


def overlapped_fit(mesh, **kwargs):
    return jaxdp.fit(loss_fn, PARAMS, TX, data, steps=STEPS, mesh=mesh, sync_every=H, outer_tx=OUTER, overlap=True,
                     progress=False, log_every=H, **kwargs)


@pytest.mark.parametrize("strategy", [pytest.param("psum", marks=pytest.mark.slow), "ring"])
def test_overlapped_training_equals_the_reference_delayed_update_loop(devices, strategy):
    mesh = make_mesh(devices[:4])
    result = overlapped_fit(mesh, strategy=strategy)
    expected = reference(4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 result.state.params, expected)
    # Every replica ends equal to the global parameters: nothing in flight.
    rows = result.state.sync.per_device["local_sgd"]["params"]
    jax.tree.map(lambda r, g: np.testing.assert_array_equal(np.asarray(r), np.broadcast_to(g, r.shape)),
                 rows, result.state.params)
    assert int(result.state.step) == STEPS
    # One round is in flight when each logged round lands: the first round's loss arrives with the second.
    assert [r["step"] for r in result.history] == [8, 12, 16, 20, 22]


@pytest.mark.slow
def test_resumed_with_the_average_in_flight_equals_the_uninterrupted_run(devices, tmp_path):
    mesh = make_mesh(devices[:4])
    whole = overlapped_fit(mesh, checkpoint_dir=str(tmp_path), save_every=8)
    shutil.rmtree(tmp_path / str(STEPS))  # back to step 16: its round's average was in flight when saved
    resumed = overlapped_fit(mesh, checkpoint_dir=str(tmp_path), save_every=8)
    assert [r["step"] for r in resumed.history] == [20, 22]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 resumed.state, whole.state)


def sharded_fit(devices, **kwargs):
    """overlapped_fit with shard_params on 2 workers of 4 devices (jaxdp/step/overlap.py, the `Cut` layout)."""
    mesh = make_mesh(devices, axis_name=("hosts", "local"), shape=(2, 4))
    return overlapped_fit(mesh, shard_params=True, **kwargs)


def test_with_shard_params_each_worker_cut_over_its_devices_equals_the_reference_loop(devices, tmp_path):
    """2 workers of 4 devices, each replica cut over its worker's devices: the reference delayed
    update with a replica per worker (its 4 devices' mean gradient is the gradient of its half of
    the rows); every worker's replica ends equal to the global parameters, each device holding a
    slice of its worker's row. Its checkpoint with an average in flight resumes replicated on 2
    devices, a device per worker, and ends the same."""
    result = sharded_fit(devices, strategy="ring", checkpoint_dir=str(tmp_path), save_every=8)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 result.state.params, reference(2))
    rows = result.state.sync.per_device["local_sgd"]["params"]
    assert tuple(rows["Dense_0"]["kernel"].sharding.spec) == ("hosts", None, "local")  # (6, 8): cut on its 8
    jax.tree.map(lambda r, g: np.testing.assert_array_equal(np.asarray(r), np.broadcast_to(g, r.shape)),
                 rows, result.state.params)
    assert int(result.state.step) == STEPS
    assert [r["step"] for r in result.history] == [8, 12, 16, 20, 22]
    shutil.rmtree(tmp_path / str(STEPS))  # back to step 16, an average in flight
    resumed = overlapped_fit(make_mesh(devices[:2]), strategy="ring", checkpoint_dir=str(tmp_path), save_every=8)
    assert [r["step"] for r in resumed.history] == [20, 22]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 resumed.state.params, reference(2))


def test_with_shard_params_a_codec_sends_slices_and_a_resume_in_flight_is_exact(devices, tmp_path):
    """bf16 across workers on each device's slice: the replicated run with a device per worker
    (to bf16's rounding of values that differ in their last bits); a checkpoint taken with the
    average in flight resumes bit for bit."""
    whole = sharded_fit(devices, strategy="ring", compression="bf16", checkpoint_dir=str(tmp_path), save_every=8)
    replicated = overlapped_fit(make_mesh(devices[:2]), strategy="ring", compression="bf16")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=1e-3),
                 whole.state.params, replicated.state.params)
    np.testing.assert_allclose([r["loss"] for r in whole.history], [r["loss"] for r in replicated.history], rtol=1e-3)
    shutil.rmtree(tmp_path / str(STEPS))  # back to step 16: its round's average was in flight when saved
    resumed = sharded_fit(devices, strategy="ring", compression="bf16", checkpoint_dir=str(tmp_path), save_every=8)
    assert [r["step"] for r in resumed.history] == [20, 22]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.state, whole.state)


@pytest.mark.parametrize("flags, says", [
    (["--overlap", "--sync-every", "8", "--compression", "auto"], "--compression=auto"),
    (["--overlap", "--sync-seconds", "2"], "--sync-seconds=2.0"),
    (["--overlap", "--sync-every", "8", "--sync-fragments", "2"], "--sync-fragments=2"),
])
def test_overlap_flag_errors_are_one_line(flags, says):
    with pytest.raises(ConfigError, match=says.replace("+", r"\+")):
        check_config(parse_args(flags))


def test_fit_refuses_overlap_of_rounds_with_a_host_strategy(devices):
    with pytest.raises(InputError, match="overlap does not combine with strategy='host'"):  # (rules.py: one message)
        jaxdp.fit(loss_fn, PARAMS, TX, data, steps=2, mesh=make_mesh(devices[:2]), overlap=True, sync_every=2,
                  strategy="host", progress=False)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_overlapped_train_like_one_process(tmp_path):
    # Across real processes the average runs on its own thread, through gloo, while the other thread
    # trains: the numbers must still be the one-process run's.
    from helpers import records, step_records, two_processes_and_one

    two_processes_and_one(tmp_path, ["--steps", "12", "--batch-size", "64", "--log-every", "1", "--no-progress",
                                     "--sync-every", "3", "--overlap", "--strategy", "ring"])
    ref, two = step_records(tmp_path / "one.jsonl"), step_records(tmp_path / "two.0.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in ref] == [6, 9, 12]  # each round lands with the next
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose(records(tmp_path / "two.0.jsonl")[-1]["eval_loss"],
                               records(tmp_path / "one.jsonl")[-1]["eval_loss"], rtol=1e-5)


CHILD = """
import os, sys, json
from jaxdp.cluster import runtime
core = os.sched_getaffinity(0)
with runtime.two_cpu_workers():
    widened = sorted(os.sched_getaffinity(0))
    import jax
    jax.numpy.ones(3).block_until_ready()
threads = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps({"core": sorted(core), "widened": widened, "threads": threads}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to lend one")
def test_a_one_core_process_starts_its_backend_with_two_cores_then_every_thread_is_back_on_one():
    from helpers import ROOT, cli_env

    core = min(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=cli_env(JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=120, preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["core"] == [core] and len(seen["widened"]) == 2 and core in seen["widened"]
    assert len(seen["threads"]) > 1 and all(cores == [core] for cores in seen["threads"].values()), seen
