"""Local steps (DiLoCo, jaxdp/step/local_sgd.py): H = 1 is synchronous training, replicas diverge between
syncs and meet at each sync, checkpoints resume exactly (mid-period too) and on another device count."""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import ROOT, cli_env, mlp_batches, mlp_problem, records, step_records
from jaxdp.config import parse_args
from jaxdp.step import local_sgd
from jaxdp.train import train

STEPS = 12
DILOCO = lambda: optax.sgd(0.7, momentum=0.9, nesterov=True)  # noqa: E731


def train_steps(mesh, tx, strategy="psum", steps=STEPS, **local):
    params, loss_fn = mlp_problem()
    state = jaxdp.init_state(params, tx, mesh, **{k: v for k, v in local.items() if k != "metrics_at_sync"})
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy=strategy, **local)
    losses, synced = [], []
    for batch in mlp_batches(steps):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
        synced.append(float(metrics.get("synced", 1.0)))
    return state, losses, synced


@pytest.mark.parametrize("strategy", ["psum", "ring"])
@pytest.mark.parametrize("n", [4, 8])
def test_h1_with_outer_sgd_lr_1_is_synchronous_training(devices, strategy, n):
    mesh = jaxdp.make_mesh(devices[:n])
    tx = optax.sgd(0.1)
    sync_state, sync_losses, _ = train_steps(mesh, tx, strategy)
    local_state, local_losses, synced = train_steps(mesh, tx, strategy, sync_every=1, outer_tx=optax.sgd(1.0))
    assert synced == [1.0] * STEPS
    np.testing.assert_allclose(local_losses, sync_losses, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(jax.device_get(local_state.params), jax.device_get(sync_state.params), atol=1e-6, rtol=0)


def test_h4_differs_from_synchronous_but_trains(devices):
    mesh = jaxdp.make_mesh(devices)
    tx = optax.adam(1e-2)
    _, sync_losses, _ = train_steps(mesh, tx, steps=40)
    state, losses, synced = train_steps(mesh, tx, steps=40, sync_every=4, outer_tx=DILOCO())
    assert synced == [float((i + 1) % 4 == 0) for i in range(40)]
    assert not np.allclose(losses, sync_losses, rtol=1e-3)
    assert np.mean(losses[-8:]) < 0.8 * np.mean(losses[:4]), losses


def test_replicas_diverge_between_syncs_and_equal_the_global_params_after_a_sync(devices):
    mesh = jaxdp.make_mesh(devices)
    params, loss_fn = mlp_problem()
    tx = optax.sgd(0.1)
    state = jaxdp.init_state(params, tx, mesh, sync_every=3, outer_tx=DILOCO())
    step = jaxdp.make_train_step(loss_fn, tx, mesh, sync_every=3, outer_tx=DILOCO())
    assert state.opt_state == () and local_sgd.is_local(state)
    rows = state.sync.per_device[local_sgd.STATE_NAME]["params"]
    assert all(leaf.sharding.spec == jax.sharding.PartitionSpec(jaxdp.DATA_AXIS) for leaf in jax.tree.leaves(rows))
    for i, batch in enumerate(mlp_batches(6)):
        before = jax.device_get(state.params)
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        replicas = jax.device_get(state.sync.per_device[local_sgd.STATE_NAME]["params"])
        glob = jax.device_get(state.params)
        if (i + 1) % 3:  # a local step: the global params stand still, the replicas differ from each other
            assert float(metrics["synced"]) == 0 and float(metrics["comm_bytes"]) == 0
            jax.tree.map(np.testing.assert_array_equal, glob, before)
            spread = max(float(np.abs(r - r[:1]).max()) for r in jax.tree.leaves(replicas))
            assert spread > 1e-4
        else:  # a sync: every replica equals the new global params, which moved
            assert float(metrics["synced"]) == 1 and float(metrics["comm_bytes"]) > 0
            jax.tree.map(lambda r, g: np.testing.assert_array_equal(r, np.broadcast_to(g, r.shape)), replicas, glob)
            assert any(not np.array_equal(g, b) for g, b in zip(jax.tree.leaves(glob), jax.tree.leaves(before)))


@pytest.mark.parametrize("spec", ["bf16", "powersgd:2"])
def test_compressed_pseudo_gradients_train(devices, spec):
    mesh = jaxdp.make_mesh(devices)
    params, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    state = jaxdp.init_state(params, tx, mesh, sync_every=4, outer_tx=DILOCO(), compression=spec)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, sync_every=4, outer_tx=DILOCO(), compression=spec)
    losses, ratios = [], []
    for batch in mlp_batches(24):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
        ratios.append(float(metrics["compression_ratio"]))
    assert ratios[3] > 1.5 and ratios[0] == 0, ratios  # the pseudo-gradient is compressed at the syncs
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses


def test_powersgd_compresses_each_fragment(devices):
    mesh = jaxdp.make_mesh(devices)
    params, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    local = dict(sync_every=4, sync_fragments=2, outer_tx=DILOCO(), compression="powersgd:2")
    state = jaxdp.init_state(params, tx, mesh, **local)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, **local)
    losses, sent = [], []
    for batch in mlp_batches(24):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
        sent.append(float(metrics["comm_bytes"]))
    assert sent[0] == sent[2] == 0 and sent[1] > 0 and sent[3] > 0
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses


def test_bad_combinations_raise_one_line(devices):
    mesh = jaxdp.make_mesh(devices)
    params, loss_fn = mlp_problem()
    tx = optax.sgd(0.1)
    for kwargs, needle in [({"strategy": "host"}, "strategy='host' does not qualify"),
                           ({"shard_optimizer": True}, "do not combine")]:
        with pytest.raises(jaxdp.InputError, match=needle):
            jaxdp.make_train_step(loss_fn, tx, mesh, sync_every=4, **kwargs)
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        jaxdp.make_train_step(loss_fn, tx, mesh, sync_every=0)
    state = jaxdp.init_state(params, tx, mesh)  # synchronous state, local step
    step = jaxdp.make_train_step(loss_fn, tx, mesh, sync_every=4)
    with pytest.raises(ValueError, match="pass the same sync_every"):
        step(state, jaxdp.shard_batch(next(mlp_batches(1)), mesh))


# ---- checkpoints -------------------------------------------------------------------------------

def run(*flags):
    return train(parse_args(["--log-every", "1", "--no-progress", "--sync-every", "4", *map(str, flags)]))


def without_timing(path):
    timing = ("steps_per_sec", "examples_per_sec", "elapsed_s")
    return [{k: v for k, v in r.items() if k not in timing} for r in step_records(path)]


@pytest.mark.slow
@pytest.mark.parametrize("fragments", [1, 2])
def test_resume_in_the_middle_of_a_period_is_bit_identical(tmp_path, fragments):
    whole = run("--steps", 14, "--metrics-file", tmp_path / "whole.jsonl", "--sync-fragments", fragments)
    flags = ["--checkpoint-dir", tmp_path / "ckpt", "--save-every", 5, "--metrics-file", tmp_path / "m.jsonl",
             "--sync-fragments", fragments]
    run(*flags, "--steps", 5)  # step 5: one step into the second period of 4
    resumed = run(*flags, "--steps", 14)
    assert [r["step"] for r in resumed.history] == list(range(6, 15))
    assert without_timing(tmp_path / "m.jsonl") == without_timing(tmp_path / "whole.jsonl")
    every = 4 // fragments
    assert [r["synced"] for r in step_records(tmp_path / "m.jsonl")] == [float(s % every == 0) for s in range(1, 15)]
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), resumed.state, whole.state)


def test_restore_on_another_device_count_gives_each_device_the_mean_replica(devices, tmp_path):
    params, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    eight, four = jaxdp.make_mesh(devices), jaxdp.make_mesh(devices[:4])
    state = jaxdp.init_state(params, tx, eight, sync_every=4, outer_tx=DILOCO())
    step = jaxdp.make_train_step(loss_fn, tx, eight, sync_every=4, outer_tx=DILOCO())
    for batch in mlp_batches(6):  # two steps into the second period: the replicas differ
        state, _ = step(state, jaxdp.shard_batch(batch, eight))
    with jaxdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state)
    template = jaxdp.init_state(params, tx, four, sync_every=4, outer_tx=DILOCO())
    with jaxdp.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(template)

    old = jax.device_get(state.sync.per_device[local_sgd.STATE_NAME])
    new = jax.device_get(restored.sync.per_device[local_sgd.STATE_NAME])
    jax.tree.map(lambda o, n: np.testing.assert_allclose(n, np.broadcast_to(o.mean(axis=0, dtype=o.dtype), n.shape),
                                                         rtol=1e-6), old, new)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), jax.device_get(state.params))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.sync.shared), jax.device_get(state.sync.shared))
    # The next sync's mean pseudo-gradient is unchanged by the move: global - mean(replicas).
    step4 = jaxdp.make_train_step(loss_fn, tx, four, sync_every=4, outer_tx=DILOCO())
    for batch in mlp_batches(2, seed=1):
        restored, metrics = step4(restored, jaxdp.shard_batch(batch, four))
    assert int(restored.step) == 8 and float(metrics["synced"]) == 1 and np.isfinite(float(metrics["loss"]))


# ---- the command line --------------------------------------------------------------------------


@pytest.mark.slow  # over 4 s on 2 cores
def test_cli_marks_sync_steps_and_reports_bytes_per_step(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([sys.executable, "-m", "jaxdp.train", "--sync-every", "3", "--steps", "6", "--log-every", "1",
                           "--devices", "4", "--no-progress", "--strategy", "ring", "--metrics-file", str(metrics)],
                          cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    steps = step_records(metrics)
    assert [r["synced"] for r in steps] == [0, 0, 1, 0, 0, 1]
    assert [r["comm_bytes"] > 0 for r in steps] == [False, False, True, False, False, True]
    assert all(r["comm_bytes_per_step"] == steps[2]["comm_bytes"] / 3 for r in steps)
    assert records(metrics)[0]["config"]["sync_every"] == 3 and records(metrics)[-1]["event"] == "done"


PROBE = "import sys; from jaxdp.train import main; code = main(sys.argv[1:]); print('jax' in sys.modules); sys.exit(code)"
BAD = {
    "zero": (["--sync-every", "0"], "--sync-every must be a positive integer"),
    "host": (["--sync-every", "4", "--strategy", "host"], "--sync-every needs an in-graph strategy"),
    "zero-1": (["--sync-every", "4", "--shard-optimizer"], "--sync-every and --shard-optimizer do not combine"),
    "outer lr": (["--sync-every", "4", "--outer-lr", "-1"], "--outer-lr must be a positive number"),
    "outer momentum": (["--sync-every", "4", "--outer-momentum", "1.5"], "--outer-momentum must be at least 0"),
    "nesterov without momentum": (["--sync-every", "4", "--outer-momentum", "0"], "needs --outer-momentum > 0"),
    "outer kind": (["--outer-optimizer", "adam"], "invalid choice: 'adam'"),
    "fragments": (["--sync-every", "4", "--sync-fragments", "3"], "--sync-fragments=3 must be a positive integer that divides"),
    "word": (["--sync-every", "fast"], "--sync-every must be a positive integer (1: synchronous training) or auto"),
    "auto fragments": (["--sync-every", "auto", "--sync-fragments", "2"], "--sync-fragments=2 needs a fixed --sync-every"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line_before_jax_starts(case):
    argv, needle = BAD[case]
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv, "--steps", "1", "--no-progress"], cwd=ROOT,
                          env=cli_env(), capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("jaxdp: error:") and needle in err[0], err
    assert proc.stdout.strip() == "False"


# ---- for the controller ------------------------------------------------------------------------


def test_make_outer_optimizer():
    from jaxdp.step.optim import make_outer_optimizer

    grads = {"w": jnp.ones(3)}
    for name, momentum in (("nesterov", 0.9), ("sgd", 0.0), ("sgd", 0.5)):
        tx = make_outer_optimizer(name, 0.7, momentum)
        updates, _ = tx.update(grads, tx.init(grads))
        assert updates["w"].shape == (3,)
    with pytest.raises(ValueError, match="needs a momentum"):
        make_outer_optimizer("nesterov", 0.7, 0.0)


# ---- across processes --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ring"])  # psum's local steps: the one-process tests; what crosses processes is the same
def test_two_processes_with_local_steps_train_like_one_process(tmp_path, strategy):
    from helpers import two_processes_and_one

    two_processes_and_one(tmp_path, ["--steps", "7", "--batch-size", "64", "--log-every", "1", "--no-progress",
                                     "--sync-every", "3", "--strategy", strategy])
    ref, two = step_records(tmp_path / "one.jsonl"), step_records(tmp_path / "two.0.jsonl")
    assert [r["synced"] for r in two] == [r["synced"] for r in ref] == [0, 0, 1, 0, 0, 1, 0]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose(records(tmp_path / "two.0.jsonl")[-1]["eval_loss"],
                               records(tmp_path / "one.jsonl")[-1]["eval_loss"], rtol=1e-5)


# ---- the benchmark's arithmetic ----------------------------------------------------------------


def test_bench_curve_leaves_out_compilation_and_evaluation_and_finds_the_target():
    from jaxdp.bench.localsgd import curve, time_to
    from jaxdp.bench.slowlink import Training

    recs = [{"event": "start", "step": 0},
            {"step": 10, "loss": 3.0, "elapsed_s": 12.0},
            {"event": "eval", "step": 10, "eval_loss": 2.9, "eval_s": 1.0, "elapsed_s": 13.0},
            {"step": 20, "loss": 2.5, "elapsed_s": 20.0},
            {"event": "done", "step": 20, "eval_loss": 2.4, "compile_s": 5.0}]
    points = curve(Training(recs, 30.0, [0, 0], ["", ""]))
    assert points == [(10, 7.0, 2.9), (20, 14.0, 2.4)]
    assert time_to(points, 2.5) == (20, 14.0) and time_to(points, 2.0) == (None, None)


# ---- fragments (Streaming DiLoCo) --------------------------------------------------------------


def test_fragments_are_contiguous_balanced_and_cover_every_leaf():
    params = {"a": jnp.zeros(100), "b": jnp.zeros(10), "c": jnp.zeros(90), "d": jnp.zeros(100)}
    assert local_sgd.fragments(params, 1) == [[0, 1, 2, 3]]
    assert local_sgd.fragments(params, 2) == [[0, 1], [2, 3]]
    assert local_sgd.fragments(params, 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="more than the model's 4 parameter arrays"):
        local_sgd.fragments(params, 5)


def test_each_fragment_syncs_in_turn_every_h_over_f_steps(devices):
    mesh = jaxdp.make_mesh(devices)
    params, loss_fn = mlp_problem()
    tx = optax.sgd(0.1)
    local = dict(sync_every=4, sync_fragments=2, outer_tx=DILOCO())
    state = jaxdp.init_state(params, tx, mesh, **local)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, **local)
    groups = local_sgd.fragments(params, 2)
    assert len(state.sync.shared[local_sgd.OUTER_NAME]) == 2
    full = None
    for i, batch in enumerate(mlp_batches(8)):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        replicas = jax.tree.leaves(jax.device_get(state.sync.per_device[local_sgd.STATE_NAME]["params"]))
        glob = jax.tree.leaves(jax.device_get(state.params))
        same = [bool(np.array_equal(r, np.broadcast_to(g, r.shape))) for r, g in zip(replicas, glob)]
        s = i + 1
        if s % 2:
            assert float(metrics["synced"]) == 0 and not any(same)
            continue
        f = (s // 2 - 1) % 2  # fragment 0 at steps 2, 6; fragment 1 at steps 4, 8
        assert float(metrics["synced"]) == 1
        assert [same[j] for j in groups[f]] == [True] * len(groups[f])
        assert not any(same[j] for j in groups[1 - f])
        full = full or float(metrics["comm_bytes_per_step"]) * 4
        assert 0 < float(metrics["comm_bytes"]) < full
    assert np.isfinite(float(metrics["loss"]))


def test_metrics_at_sync_sends_nothing_between_syncs_and_changes_no_number(devices):
    """metrics_at_sync=True: the same parameters bit for bit, the sync steps' metrics the same
    average; between syncs a device's own metrics (device 0's replica: a one-device run on its rows,
    in the first period before any sync), and fewer collectives in the program (the local branch's
    riders are gone)."""
    mesh = jaxdp.make_mesh(devices)
    tx = optax.adam(1e-2)
    kwargs = dict(steps=8, sync_every=4, outer_tx=DILOCO())
    want_state, want, synced = train_steps(mesh, tx, "ring", **kwargs)
    got_state, got, _ = train_steps(mesh, tx, "ring", metrics_at_sync=True, **kwargs)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got_state.params), jax.device_get(want_state.params))
    for i, flag in enumerate(synced):
        if flag:
            assert got[i] == want[i]
    params, loss_fn = mlp_problem()  # device 0 alone on its eighth of each batch, steps 1-3
    one = jaxdp.make_mesh(devices[:1])
    state = jaxdp.init_state(params, tx, one, sync_every=4, outer_tx=DILOCO())
    step = jaxdp.make_train_step(loss_fn, tx, one, sync_every=4, outer_tx=DILOCO())
    for i, batch in enumerate(mlp_batches(3)):
        rows = jax.tree.map(lambda x: x[: len(x) // 8], batch)
        state, metrics = step(state, jaxdp.shard_batch(rows, one))
        np.testing.assert_allclose(got[i], float(metrics["loss"]), rtol=1e-6)
        assert got[i] != pytest.approx(want[i], rel=1e-4)  # (not the average over the devices)
    batch = jaxdp.shard_batch(next(iter(mlp_batches(1))), mesh)

    def collectives(at_sync):  # in the whole program: the sync branch's, and the local branch's riders unless at_sync
        step = jaxdp.make_train_step(loss_fn, tx, mesh, "ring", sync_every=4, outer_tx=DILOCO(), metrics_at_sync=at_sync)
        text = step.lower(jaxdp.init_state(params, tx, mesh, sync_every=4, outer_tx=DILOCO()), batch).as_text()
        return sum(text.count(op) for op in ("all_reduce", "collective_permute", "all_gather", "reduce_scatter"))

    assert 0 < collectives(True) < collectives(False)


def test_metrics_at_sync_needs_local_steps_and_no_float_state():
    from jaxdp.config import ConfigError
    from jaxdp.sync.rules import check_config

    for flags, message in ((["--metrics-at-sync"], "needs local steps"),
                           (["--metrics-at-sync", "--sync-every", "auto"], "needs local steps with a fixed"),
                           (["--metrics-at-sync", "--sync-every", "4", "--overlap"], "does not combine with --overlap")):
        with pytest.raises(ConfigError, match=message):
            check_config(parse_args(flags))
