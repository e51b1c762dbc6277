"""--hierarchy / jaxdp.hierarchical: exact inside each process, then the strategy across processes.

On one process the mesh ("hosts", "local") of shape (2, 4) stands for 2 processes x 4 devices: the
hierarchical collective must equal the flat one over the same 8 devices (the same sum in another
order), give ZeRO-1 the same chunk per device, carry a codec's hops only across "hosts", and train
like the flat ring in every mode. Across real processes `--hierarchy auto` is the default, so
tests/test_multiprocess.py (psum, 2 processes x 4 devices against 1 x 8, and its console line) and
tests/test_local_sgd.py (ring, 2 x 2 against 1 x 4) compare it with a flat process to 1e-5.
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxdp
from helpers import mlp_batches, mlp_problem
from jaxdp.mesh import DATA_AXIS, make_mesh, shard_batch
from jaxdp.sync import codecs as C
from jaxdp.sync.collectives import as_collective
from jaxdp.sync.hierarchy import hierarchical

TWO = ("hosts", "local")


@pytest.fixture(scope="module")
def meshes(devices):
    return make_mesh(devices), make_mesh(devices, axis_name=TWO, shape=(2, 4))


def per_device(mesh, fn, *xs):
    """fn(one device's rows of each x, axis) on every device; its output stacked back, one row per device."""
    axis = TWO if len(mesh.axis_names) == 2 else DATA_AXIS
    spec = P(axis)
    def first(tree):
        return jax.tree.map(lambda leaf: leaf[0], tree)

    body = jax.shard_map(lambda *a: jax.tree.map(lambda o: o[None], fn(*map(first, a), axis)), mesh=mesh,
                         in_specs=(spec,) * len(xs), out_specs=spec, check_vma=False)
    return jax.device_get(jax.jit(body)(*(shard_batch(x, mesh) for x in xs)))


@pytest.mark.parametrize("name", ["psum", "ring"])
def test_sum_and_mean_equal_the_flat_collective(meshes, name):
    flat_mesh, two_mesh = meshes
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((8, 5, 7)).astype(np.float32), "b": rng.standard_normal((8, 3)).astype(np.float32)}
    flat, hier = as_collective(name), hierarchical(name)
    assert hier.hierarchical and hier.name == name and hierarchical(name) is hier  # one value: one compiled step
    for op in ("sum", "mean"):
        got = per_device(two_mesh, lambda t, axis: getattr(hier, op)(t, axis), tree)
        want = per_device(flat_mesh, lambda t, axis: getattr(flat, op)(t, axis), tree)
        for key in tree:
            exact = tree[key].astype(np.float64).sum(0) / (8 if op == "mean" else 1)
            assert all(np.array_equal(got[key][d], got[key][0]) for d in range(8))  # identical on every device
            np.testing.assert_allclose(got[key][0], want[key][0], rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got[key][0], exact, rtol=1e-6, atol=1e-6)
    # On a mesh of one axis it is the strategy itself.
    same = per_device(flat_mesh, lambda t, axis: hier.sum(t, axis), tree)
    np.testing.assert_array_equal(same["w"], per_device(flat_mesh, lambda t, axis: flat.sum(t, axis), tree)["w"])


@pytest.mark.parametrize("name", ["psum", "ring"])
def test_halves_give_each_device_the_chunk_the_flat_halves_give_it(meshes, name):
    flat_mesh, two_mesh = meshes
    x = np.random.default_rng(1).standard_normal((8, 8 * 6)).astype(np.float32)
    hier, flat = hierarchical(name).halves, as_collective(name).halves
    got = per_device(two_mesh, hier.reduce_scatter, x)
    want = per_device(flat_mesh, flat.reduce_scatter, x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got.reshape(-1), x.mean(0), rtol=1e-6, atol=1e-7)  # device i: chunk i
    gathered = per_device(two_mesh, hier.all_gather, got)
    assert all(np.array_equal(gathered[d], got.reshape(-1)) for d in range(8))


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_codec_quantizes_only_across_hosts_and_its_residuals_telescope(meshes, name):
    _, two_mesh = meshes
    comp = C.parse(name)
    chunk, block = comp.chunking(2000, 8)
    wire = comp.wire(chunk, block)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 8 * chunk)).astype(np.float32)
    riders = rng.standard_normal((8, 3)).astype(np.float32)
    coded = hierarchical("ring").coded_sum
    total, residual, exact = per_device(two_mesh, lambda a, r, axis: coded(a, axis, wire, r), x, riders)
    assert all(np.array_equal(total[d], total[0]) for d in range(8))
    np.testing.assert_allclose(exact[0], riders.sum(0), rtol=1e-6, atol=1e-6)
    true = x.astype(np.float64).sum(0)
    # Two hosts: each value is encoded twice (one hop, then its owner), after an exact local sum.
    a = np.repeat(np.abs(x).astype(np.float64).sum(0).reshape(-1, block).max(axis=1), block)
    err = np.abs(total[0] - true)
    assert (err <= ((1 + 1 / (2 * comp.qmax)) ** 2 - 1) * a * (1 + 1e-5) + 1e-4).all() and err.max() > 0
    np.testing.assert_allclose(true - residual.astype(np.float64).sum(0), total[0], atol=1e-5 * a.max())
    # Only the ring across hosts sends messages: 2 (H - 1) collective-permutes, H = 2.
    text = jax.jit(jax.shard_map(lambda v, r: coded(v[0], TWO, wire, r[0])[0][None], mesh=two_mesh,
                                 in_specs=(P(TWO), P(TWO)), out_specs=P(TWO), check_vma=False)).lower(
        shard_batch(x, two_mesh), shard_batch(riders, two_mesh)).as_text()
    assert text.count("collective_permute") == 2


def train_steps(mesh, strategy, steps=12, **options):
    params, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    state = jaxdp.init_state(params, tx, mesh, **options)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy=strategy, **options)
    losses = []
    for batch in mlp_batches(steps):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return state, losses


MODES = {
    "replicated": {},
    "zero1": {"shard_optimizer": True},
    "local steps": {"sync_every": 4, "outer_tx": optax.sgd(0.7, momentum=0.9, nesterov=True)},
    "powersgd": {"compression": "powersgd:2"},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_training_equals_the_flat_ring(meshes, mode):
    flat_mesh, two_mesh = meshes
    flat_state, flat = train_steps(flat_mesh, "ring", **MODES[mode])
    state, hier = train_steps(two_mesh, jaxdp.hierarchical("ring"), **MODES[mode])
    np.testing.assert_allclose(hier, flat, rtol=1e-6, atol=1e-7)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 state.params, flat_state.params)


def test_int8_training_tracks_the_flat_ring_and_replicas_agree(meshes):
    flat_mesh, two_mesh = meshes
    _, flat = train_steps(flat_mesh, "ring", steps=30, compression="int8")
    state, hier = train_steps(two_mesh, jaxdp.hierarchical("ring"), steps=30, compression="int8")
    assert abs(np.mean(hier[-5:]) - np.mean(flat[-5:])) < 0.02 * np.mean(flat[-5:])
    for leaf in jax.tree.leaves(state.params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards)


def test_an_on_host_strategy_is_refused():
    with pytest.raises(ValueError, match="averages on the host.*psum or ring"):
        hierarchical("host")


def test_the_flag_takes_auto_or_flat_only():
    from jaxdp.config import ConfigError, parse_args

    assert parse_args([]).hierarchy == "auto" and parse_args(["--hierarchy", "flat"]).hierarchy == "flat"
    with pytest.raises((ConfigError, SystemExit)):
        parse_args(["--hierarchy", "tree"])


def test_int8_through_the_hierarchy_resumes_bit_identically(meshes, tmp_path):
    """Stop at 4, restore from disk onto a fresh state, go on to 8: the uninterrupted run's bits
    (error feedback laid out by the hierarchy, in state.sync, saved and restored)."""
    _, two_mesh = meshes
    params, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    strategy = jaxdp.hierarchical("ring")
    step = jaxdp.make_train_step(loss_fn, tx, two_mesh, strategy=strategy, compression="int8")
    data = list(mlp_batches(8))

    def fresh():
        return jaxdp.init_state(params, tx, two_mesh, compression="int8")

    def go(state, steps):
        losses = []
        for i in steps:
            state, metrics = step(state, jaxdp.shard_batch(data[i], two_mesh))
            losses.append(np.asarray(metrics["loss"]))
        return state, losses

    whole, whole_losses = go(fresh(), range(8))
    with jaxdp.Checkpointer(tmp_path / "ckpt") as ckpt:
        cut, cut_losses = go(fresh(), range(4))
        ckpt.save(cut)
    with jaxdp.Checkpointer(tmp_path / "ckpt") as ckpt:
        restored = ckpt.restore(fresh())
    assert int(restored.step) == 4
    resumed, resumed_losses = go(restored, range(4, 8))
    assert [x.tobytes() for x in cut_losses + resumed_losses] == [x.tobytes() for x in whole_losses]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.params, whole.params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.sync, whole.sync)
