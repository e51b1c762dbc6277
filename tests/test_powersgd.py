"""PowerSGD when a gradient's rank is below r: a zero-initialised layer trains, full rank is exact,
and a rank-deficient step lowers the rank of that step only (jaxdp/sync/codecs/lowrank.py, `basis`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp.data.datasets import digits
from jaxdp.mesh import DATA_AXIS, make_mesh, shard_batch
from jaxdp.models.builtin import MLP
from jaxdp.sync import codecs as C
from jaxdp.sync.collectives import ring_allreduce

REDUCE = {"psum": lambda t: jax.lax.psum(t, DATA_AXIS), "ring": lambda t: ring_allreduce(t, DATA_AXIS)}


def cross_entropy(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss_fn


def train(mesh, model, params, batches, spec, strategy="psum", tx=None):
    """(final params, losses) of `batches` through the notebook API with compression `spec`."""
    tx = tx or optax.sgd(0.1, momentum=0.9)
    state = jaxdp.init_state(params, tx, mesh, compression=spec)
    step = jaxdp.make_train_step(cross_entropy(model), tx, mesh, strategy, compression=spec)
    losses = []
    for batch in batches:
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return jax.device_get(state.params), losses


def max_relative(a, b):
    return max(float(np.max(np.abs(x - y)) / np.max(np.abs(y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_a_layer_behind_a_zero_initialised_output_layer_trains(devices):
    """The output kernel starts at 0, so the hidden layer's first gradient is exactly 0: its P is 0
    and its Q after the first step too. Without new directions for the dropped columns that Q stayed
    0, the layer never moved, and the loss ended more than twice the uncompressed one."""
    model = MLP(hidden=(32,))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 13)))["params"]
    params = {**params, "Dense_1": jax.tree.map(jnp.zeros_like, params["Dense_1"])}
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((13, 10)).astype(np.float32)
    batches = []
    for _ in range(40):
        x = rng.standard_normal((64, 13)).astype(np.float32)
        batches.append({"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)})
    mesh = jaxdp.make_mesh(devices[:4])
    assert list(C.parse("powersgd:4").layout(params)) == ["['Dense_0']['kernel']"]  # the hidden layer is compressed

    plain, plain_losses = train(mesh, model, params, batches, None)
    low, low_losses = train(mesh, model, params, batches, "powersgd:4")
    low_moved, plain_moved = (float(np.linalg.norm(p["Dense_0"]["kernel"] - params["Dense_0"]["kernel"]))
                              for p in (low, plain))
    assert low_moved > 0.5 * plain_moved, (low_moved, plain_moved)
    low_loss, plain_loss = np.mean(low_losses[-5:]), np.mean(plain_losses[-5:])
    assert low_loss <= 1.1 * plain_loss, (low_loss, plain_loss)


@pytest.mark.parametrize("strategy", ["psum", "ring"])
def test_full_rank_on_sparse_inputs_equals_uncompressed_training(devices, strategy):
    """The digits' pixels are often exactly 0 (some in every image), so the first layer's gradient
    has rows of zeros and a rank that changes from batch to batch. Each rank-deficient step used to
    drop columns of Q for good, and full rank drifted from uncompressed training (4e-6 after 40
    steps); with new directions it stays within rounding of it."""
    data = digits()
    model = MLP(hidden=(32,))
    params = model.init(jax.random.PRNGKey(0), jnp.asarray(data.example()))["params"]
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(40):
        rows = rng.choice(len(data.x_train), 64, replace=False)
        batches.append({"x": data.x_train[rows], "y": data.y_train[rows]})
    mesh = jaxdp.make_mesh(devices[:4])
    spec = "powersgd:64:min_rate=0"  # r = min(n, m) for every matrix, and every matrix compressed
    assert len(C.parse(spec).layout(params)) == 2

    plain, _ = train(mesh, model, params, batches, None, strategy)
    full, _ = train(mesh, model, params, batches, spec, strategy)
    deviation = max_relative(full, plain)
    assert deviation <= 1e-6, deviation


def runner(devices, comp, n):
    """(stacked grads, stacked state, step) -> stacked (mean, state): `comp.mean` on n devices, psum."""
    mesh = make_mesh(devices[:n])

    def body(grads, state, step):
        mean, state, _ = comp.mean(jax.tree.map(lambda x: x[0], grads), jax.tree.map(lambda x: x[0], state),
                                   REDUCE["psum"], n, step)
        return jax.tree.map(lambda x: x[None], (mean, state))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(DATA_AXIS), P(DATA_AXIS), P()), out_specs=P(DATA_AXIS),
                               check_vma=False))
    return lambda grads, state, step: jax.device_get(fn(*shard_batch((grads, state), mesh), jnp.int32(step)))


def one_entry(n, shape):
    grads = np.zeros((n, *shape), np.float32)
    grads[:, 5, 3] = np.arange(1, n + 1)
    return grads


DEGENERATE = {  # per-device gradients whose mean has rank 0 or 1, of exact float32 values
    "zero": lambda n, shape: np.zeros((n, *shape), np.float32),
    "constant": lambda n, shape: np.broadcast_to(np.arange(1, n + 1, dtype=np.float32)[:, None, None], (n, *shape)),
    "one entry": one_entry,  # a sparse gradient: one weight's input was nonzero in the whole batch
}


@pytest.mark.parametrize("kind", DEGENERATE)
def test_a_rank_deficient_step_lowers_the_rank_of_that_step_only(devices, kind):
    n, r, shape = 4, 4, (40, 30)
    comp = C.parse(f"powersgd:{r}")
    state = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))).copy(),
                         comp.init({"w": jax.ShapeDtypeStruct(shape, jnp.float32)}))
    run = runner(devices, comp, n)

    grads = DEGENERATE[kind](n, shape)
    mean, state = run({"w": grads}, state, 0)
    np.testing.assert_allclose(mean["w"][0], grads.mean(0), rtol=1e-5, atol=1e-6)  # rank <= 1 <= r: exact, no NaN

    # Then gradients whose mean has rank exactly r: one power iteration from a Q of rank r finds it
    # (to the rounding the devices' errors from the first step leave in their mean). A Q that kept
    # the first step's rank found a rank-1 part of it: an error of 0.5 or more.
    rng = np.random.default_rng(0)
    grads = (rng.standard_normal((n, shape[0], r)) @ rng.standard_normal((r, shape[1]))).astype(np.float32)
    mean, state = run({"w": grads}, state, 1)
    true = grads.mean(0)
    error = float(np.linalg.norm(mean["w"][0] - true) / np.linalg.norm(true))
    assert error <= 1e-4, error
    q = state.q["['w']"]
    assert (q == q[:1]).all()  # the new directions are the same on every device
    norms = np.linalg.norm(q[0], axis=0)
    assert norms.min() > 1e-2 * norms.max() and np.linalg.matrix_rank(q[0]) == r, norms
