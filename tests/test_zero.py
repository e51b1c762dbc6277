"""ZeRO-1 (shard_optimizer=True): the same parameters as the replicated step, 1/N of the optimizer
state per device, any device count on resume, and clear refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import records, run_cli, step_records
from jaxdp.errors import InputError
from jaxdp.models.builtin import CNN, MLP
from jaxdp.step import zero

STEPS = 20
OPTIMIZERS = {
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(3e-3),
    # clipping at 0.5 binds on every step here: the global norm must span every device's chunk
    "adamw+clip": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3, weight_decay=0.1)),
}


def data(n_steps, batch=48, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((batch, 13)).astype(np.float32),
             "y": rng.integers(0, 10, batch).astype(np.int32)} for _ in range(n_steps)]


def loss_fn_for(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss_fn


MODEL = MLP(hidden=(37, 19))  # leaf sizes 13*37, 37, ... divide by none of 2, 3, 8: every buffer is padded
PARAMS = MODEL.init(jax.random.PRNGKey(0), jnp.zeros((1, 13)))["params"]


def train(mesh, tx, strategy, shard_optimizer, batches, state=None, grad_norm=False):
    state = state or jaxdp.init_state(PARAMS, tx, mesh, shard_optimizer=shard_optimizer)
    step = jaxdp.make_train_step(loss_fn_for(MODEL), tx, mesh, strategy, shard_optimizer=shard_optimizer,
                                 grad_norm=grad_norm)
    history = []
    for batch in batches:
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        history.append(jax.device_get(metrics))
    return state, history


def assert_params_close(a, b, rtol=1e-6, atol=0.0):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.max(np.abs(x - y)) <= rtol * np.max(np.abs(y)) + atol, np.max(np.abs(x - y)) / np.max(np.abs(y))


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow), 8])
@pytest.mark.parametrize("strategy", ["psum", "ring"])
def test_sharded_optimizer_trains_like_the_replicated_one(devices, n, strategy):
    mesh = jaxdp.make_mesh(devices[:n])
    batches = data(STEPS, batch=8 * 3 * 2)
    for name, make in OPTIMIZERS.items():
        tx = make()
        replicated, ref_metrics = train(mesh, tx, strategy, False, batches, grad_norm=True)
        sharded, metrics = train(mesh, tx, strategy, True, batches, grad_norm=True)
        assert int(sharded.step) == STEPS
        assert_params_close(sharded.params, replicated.params)
        for got, want in zip(metrics, ref_metrics):  # loss and the global gradient norm, every step
            np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6, err_msg=name)
            np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5, err_msg=name)
        # The updates moved the parameters far from where they started: the comparison has teeth.
        assert_moved = [np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in
                        zip(jax.tree.leaves(sharded.params), jax.tree.leaves(PARAMS))]
        assert min(assert_moved) > 1e-3, name


def test_each_device_holds_one_nth_of_the_optimizer_state(devices):
    mesh = jaxdp.make_mesh(devices)
    tx = optax.adam(1e-3)
    replicated = jaxdp.init_state(PARAMS, tx, mesh)
    sharded = jaxdp.init_state(PARAMS, tx, mesh, shard_optimizer=True)
    full, part = zero.bytes_per_device(replicated.opt_state), zero.bytes_per_device(sharded.opt_state)
    size = sum(x.size for x in jax.tree.leaves(PARAMS))
    assert full == 2 * 4 * size + 4  # mu and nu in float32, and the int32 count
    # 1/N of every moment buffer (each leaf padded up to a multiple of N), plus the replicated count
    padded = sum(-(-x.size // 8) for x in jax.tree.leaves(PARAMS))
    assert part == 2 * 4 * padded + 4
    assert part < full / 8 + 2 * 4 * len(jax.tree.leaves(PARAMS)) + 4
    for leaf in jax.tree.leaves(sharded.opt_state.inner):
        if leaf.ndim:  # a moment buffer: 8 distinct shards, one per device
            assert len({str(s.index) for s in leaf.addressable_shards}) == 8


@pytest.mark.slow  # over 3 s on 2 cores
def test_metrics_and_batchnorm_statistics_are_the_same_as_replicated(devices):
    mesh = jaxdp.make_mesh(devices)
    model = CNN(axis_name=jaxdp.DATA_AXIS)
    variables = model.init(jax.random.PRNGKey(1), jnp.zeros((1, 8, 8, 1)))
    params, model_state = variables.pop("params"), dict(variables)
    # Not Adam: a conv bias before BatchNorm has a gradient of pure rounding noise, which Adam
    # scales up to a full step, so two summation orders (the ring's chunks) would part ways.
    tx = optax.sgd(0.05, momentum=0.9)

    def loss_fn(params, model_state, batch, rng):
        logits, new_state = model.apply({"params": params, **model_state}, batch["x"], train=True, mutable=list(model_state))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {"logit_mean": logits.mean()}, new_state

    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((32, 8, 8, 1)).astype(np.float32), "y": rng.integers(0, 10, 32).astype(np.int32)}
               for _ in range(5)]
    results = []
    for sharded in (False, True):
        state = jaxdp.init_state(params, tx, mesh, model_state=model_state, shard_optimizer=sharded)
        step = jaxdp.make_train_step(loss_fn, tx, mesh, "ring", stateful=True, shard_optimizer=sharded)
        history = []
        for batch in batches:
            state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
            history.append(jax.device_get(metrics))
        results.append((state, history))
    (ref, ref_history), (got, history) = results
    assert set(history[0]) == set(ref_history[0]) == {"loss", "logit_mean"}
    for a, b in zip(history, ref_history):
        np.testing.assert_allclose([a["loss"], a["logit_mean"]], [b["loss"], b["logit_mean"]], rtol=1e-5)
    assert_params_close(got.model_state, ref.model_state, rtol=1e-5)
    assert_params_close(got.params, ref.params, rtol=1e-5, atol=1e-7)  # conv biases before BatchNorm: ~1e-9 noise


@pytest.mark.slow  # over 4 s on 2 cores
def test_checkpoint_resumes_on_another_device_count_and_with_or_without_sharding(devices, tmp_path):
    tx = OPTIMIZERS["adamw+clip"]()
    batches = data(20, batch=48)
    mesh8 = jaxdp.make_mesh(devices)
    uninterrupted, _ = train(mesh8, tx, "ring", True, batches)
    half, _ = train(mesh8, tx, "ring", True, batches[:10])
    with jaxdp.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(half)
    for n, sharded, strategy in ((3, True, "psum"), (8, True, "ring"), (2, False, "ring")):
        mesh = jaxdp.make_mesh(devices[:n])
        with jaxdp.Checkpointer(str(tmp_path)) as ckpt:
            state = ckpt.restore(jaxdp.init_state(PARAMS, tx, mesh, shard_optimizer=sharded))
        assert int(state.step) == 10 and zero.is_sharded(state.opt_state) == sharded
        resumed, _ = train(mesh, tx, strategy, sharded, batches[10:], state=state)
        assert_params_close(resumed.params, uninterrupted.params)


@pytest.mark.parametrize("name, tx", [
    ("adafactor", optax.adafactor(1e-3)),  # factored second moments of 2-D leaves
    ("masked weight decay", optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))),
    ("multi_transform", optax.multi_transform({"a": optax.adam(1e-3), "b": optax.sgd(1e-3)},
                                              lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "b", p))),
])
def test_optimizers_that_read_the_parameter_tree_are_refused(devices, name, tx):
    with pytest.raises(InputError, match="cannot run on the flat, sharded parameter buffers.*without shard_optimizer"):
        jaxdp.init_state(PARAMS, tx, jaxdp.make_mesh(devices), shard_optimizer=True)


def test_per_leaf_statistics_work_because_every_leaf_is_its_own_buffer(devices):
    """LAMB's trust ratio is a norm per leaf: each leaf is one buffer, and XLA sums its chunks."""
    mesh, tx = jaxdp.make_mesh(devices[:3]), optax.lamb(3e-3)
    batches = data(10)
    sharded, _ = train(mesh, tx, "ring", True, batches)
    replicated, _ = train(mesh, tx, "ring", False, batches)
    assert_params_close(sharded.params, replicated.params, rtol=1e-5)


def test_host_strategy_and_mismatched_states_are_refused(devices):
    mesh, tx = jaxdp.make_mesh(devices), optax.adam(1e-3)
    with pytest.raises(InputError, match=r"in-graph strategy \(strategy psum or ring\): strategy='host' does not qualify"):
        jaxdp.make_train_step(loss_fn_for(MODEL), tx, mesh, "host", shard_optimizer=True)
    batch = jaxdp.shard_batch(data(1)[0], mesh)
    sharded_step = jaxdp.make_train_step(loss_fn_for(MODEL), tx, mesh, "psum", shard_optimizer=True)
    with pytest.raises(ValueError, match="pass the same shard_optimizer to init_state and make_train_step"):
        sharded_step(jaxdp.init_state(PARAMS, tx, mesh), batch)
    replicated_step = jaxdp.make_train_step(loss_fn_for(MODEL), tx, mesh, "psum")
    with pytest.raises(ValueError, match="pass the same shard_optimizer"):
        replicated_step(jaxdp.init_state(PARAMS, tx, mesh, shard_optimizer=True), batch)


def test_ring_halves_compose_to_the_all_reduce(devices):
    """reduce-scatter leaves chunk i's sum on device i; all-gather puts every chunk everywhere."""
    from jax.sharding import PartitionSpec as P

    from jaxdp.sync.collectives import ring_all_gather, ring_reduce_scatter

    for n in (2, 3, 8):
        mesh = jaxdp.make_mesh(devices[:n])
        x = np.random.default_rng(n).standard_normal((n, 5 * n)).astype(np.float32)

        def halves(row):
            owned = ring_reduce_scatter(row[0], "data")
            return owned[None], ring_all_gather(owned, "data")[None]

        owned, whole = jax.jit(jax.shard_map(halves, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                             check_vma=False))(x)
        total = x.sum(axis=0)
        np.testing.assert_allclose(np.asarray(owned), total.reshape(n, 5), rtol=1e-5)  # device i: chunk i
        np.testing.assert_allclose(np.asarray(whole), np.broadcast_to(total, (n, 5 * n)), rtol=1e-5)


@pytest.mark.slow
def test_cli_shard_optimizer_matches_and_resumes_on_fewer_devices(tmp_path):
    run = ["--devices", "8", "--dataset", "digits", "--batch-size", "64", "--log-every", "1", "--no-progress",
           "--optimizer", "adamw", "--clip-norm", "0.5"]  # (the second leg's --devices 4 comes after: it counts)
    ref = run_cli(*run, "--steps", "12", "--metrics-file", str(tmp_path / "ref.jsonl"))
    assert ref.returncode == 0, ref.stderr
    first = run_cli(*run, "--steps", "6", "--shard-optimizer", "--strategy", "ring", "--checkpoint-dir",
                    str(tmp_path / "ck"), "--metrics-file", str(tmp_path / "a.jsonl"))
    assert first.returncode == 0, first.stderr
    second = run_cli(*run, "--steps", "12", "--shard-optimizer", "--devices", "4", "--checkpoint-dir",
                     str(tmp_path / "ck"), "--metrics-file", str(tmp_path / "b.jsonl"))
    assert second.returncode == 0, second.stderr
    got = step_records(tmp_path / "a.jsonl") + step_records(tmp_path / "b.jsonl")
    want = step_records(tmp_path / "ref.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 13))
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5)
    start = [r for r in records(tmp_path / "a.jsonl") if r.get("event") == "start"][0]
    ref_start = [r for r in records(tmp_path / "ref.jsonl") if r.get("event") == "start"][0]
    assert start["param_bytes_per_device"] == ref_start["param_bytes_per_device"]
    assert start["optimizer_bytes_per_device"] < ref_start["optimizer_bytes_per_device"] / 7
    bad = run_cli(*run, "--steps", "2", "--shard-optimizer", "--strategy", "host")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("jaxdp: error: --shard-optimizer needs an in-graph strategy")
