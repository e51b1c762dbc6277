"""Every strategy trains exactly like one device on the whole global batch (plain flax + optax)."""

import collections
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.models.builtin import CNN, MLP

STEPS = 20
OPTIMIZERS = {"momentum": lambda: optax.sgd(0.05, momentum=0.9), "adam": lambda: optax.adam(3e-3)}


def batches(n_steps, batch, shape, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n_steps):
        yield {"x": rng.standard_normal((batch, *shape)).astype(np.float32),
               "y": rng.integers(0, 10, batch).astype(np.int32)}


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def reference_run(model, tx, params, data, model_state=None):
    """One device, whole global batch, written with nothing but flax and optax."""
    model_state = model_state or {}
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, model_state, batch):
        def loss(p):
            logits, new_state = model.apply({"params": p, **model_state}, batch["x"], train=True,
                                            mutable=list(model_state))
            return xent(logits, batch["y"]), new_state
        (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_state, value

    losses = []
    for batch in data:
        params, opt_state, model_state, value = step(params, opt_state, model_state, batch)
        losses.append(float(value))
    return params, model_state, losses


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy", sorted(jaxdp.STRATEGIES))
def test_plain_loss_fn_matches_single_device_reference(devices, strategy, optimizer):
    mesh = jaxdp.make_mesh(devices)
    model, tx = MLP(hidden=(64, 32)), OPTIMIZERS[optimizer]()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12)))["params"]
    ref_params, _, ref_losses = reference_run(model, tx, params, batches(STEPS, 64, (12,)))

    def loss_fn(p, batch):
        return xent(model.apply({"params": p}, batch["x"]), batch["y"])

    state = jaxdp.init_state(params, tx, mesh)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy=strategy)
    losses = []
    for batch in batches(STEPS, 64, (12,)):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref_params), rtol=1e-5, atol=1e-6)
    assert int(state.step) == STEPS


@pytest.mark.parametrize("strategy, axis", [(s, jaxdp.DATA_AXIS) for s in sorted(jaxdp.STRATEGIES)]
                         + [("ring", "batch")])
def test_batchnorm_model_state_is_synchronised_and_matches_reference(devices, strategy, axis):
    # Synchronised BatchNorm (axis_name = the mesh's axis) computes statistics over the global batch,
    # so the data-parallel run must equal the single-device run, batch_stats included. A mesh whose
    # axis has another name (pmap code ported as is: Flax's ImageNet example says "batch") works too.
    mesh = jaxdp.make_mesh(devices, axis_name=axis)
    tx = optax.sgd(0.05, momentum=0.9)
    reference = CNN(features=(8,), axis_name=None)
    variables = reference.init(jax.random.PRNGKey(0), jnp.zeros((1, 6, 6, 1)))
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
    ref_params, ref_state, ref_losses = reference_run(reference, tx, params, batches(STEPS, 32, (6, 6, 1)), model_state)

    model = CNN(features=(8,), axis_name=axis)

    def loss_fn(p, model_state, batch, rng):
        logits, new_state = model.apply({"params": p, **model_state}, batch["x"], train=True, mutable=["batch_stats"])
        return xent(logits, batch["y"]), {}, new_state

    state = jaxdp.init_state(params, tx, mesh, model_state=model_state)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy=strategy, stateful=True)
    losses = []
    for batch in batches(STEPS, 32, (6, 6, 1)):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref_params), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(jax.device_get(state.model_state), jax.device_get(ref_state), rtol=1e-5, atol=1e-6)


class Noisy(nn.Module):
    """Dropout before a linear layer: the gradient depends on the per-device key."""

    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(10)(nn.Dropout(0.5, deterministic=not train)(x))


@pytest.mark.parametrize("strategy", ["psum", "host"])
def test_dropout_keys_differ_per_device_and_step_as_documented(devices, strategy):
    # Reference: split the global batch into 8 per-device slices, each with the documented key
    # fold_in(fold_in(rng, step), device_index); average their gradients.
    mesh = jaxdp.make_mesh(devices)
    model, tx = Noisy(), optax.sgd(0.1)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12)))["params"]

    def loss_fn(p, model_state, batch, rng):
        logits = model.apply({"params": p}, batch["x"], train=True, rngs={"dropout": rng})
        return xent(logits, batch["y"]), {}, model_state

    state = jaxdp.init_state(params, tx, mesh, rng=7)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy=strategy, stateful=True)
    ref = params
    for i, batch in enumerate(batches(3, 64, (12,))):
        state, _ = step(state, jaxdp.shard_batch(batch, mesh))
        grads = []
        for d in range(8):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(7), i), d)
            part = jax.tree.map(lambda x: x[d * 8:(d + 1) * 8], batch)
            grads.append(jax.grad(lambda p: loss_fn(p, {}, part, key)[0])(ref))
        mean = jax.tree.map(lambda *g: sum(g) / 8, *grads)
        ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, mean)
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", sorted(jaxdp.STRATEGIES))
def test_step_traces_once_and_donates_the_old_state(devices, strategy):
    mesh = jaxdp.make_mesh(devices)
    model, tx = MLP(hidden=(16,)), optax.adam(1e-3)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12)))["params"]
    traces = []

    def loss_fn(p, batch):
        traces.append(1)  # Python side effect: runs only while tracing
        logits = model.apply({"params": p}, batch["x"])
        return xent(logits, batch["y"]), {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    state = jaxdp.init_state(params, tx, mesh)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy=strategy)
    for batch in batches(5, 64, (12,)):
        old = state
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        assert set(metrics) == {"loss", "accuracy"}
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old.params))
    assert len(traces) == 1


@pytest.mark.parametrize("n", [1, 8])
def test_the_params_given_to_init_state_survive_the_donating_step(devices, n):
    # Params already on a device of the mesh: init_state copies them, so the step's donation deletes
    # its own copy, never the caller's arrays (a notebook inits twice from the same params). JAX's
    # device_put to a replicated sharding keeps the source device's buffer, may_alias=False or not.
    mesh = jaxdp.make_mesh(devices[:n])
    model, tx = MLP(hidden=(16,)), optax.adam(1e-3)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12)))["params"]
    step = jaxdp.make_train_step(lambda p, b: xent(model.apply({"params": p}, b["x"]), b["y"]), tx, mesh)
    batch = jaxdp.shard_batch(next(batches(1, 8, (12,))), mesh)
    first, _ = step(jaxdp.init_state(params, tx, mesh), batch)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
    second, _ = step(jaxdp.init_state(params, tx, mesh), batch)
    chex.assert_trees_all_equal(jax.device_get(first.params), jax.device_get(second.params))


def test_works_on_a_mesh_of_any_size(devices):
    # 3 devices: batch 24 -> 8 rows each; ring with a non-power-of-two count inside a real step.
    mesh = jaxdp.make_mesh(devices[:3])
    model, tx = MLP(hidden=(16,)), optax.sgd(0.1)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12)))["params"]
    ref_params, _, _ = reference_run(model, tx, params, batches(5, 24, (12,)))
    state = jaxdp.init_state(params, tx, mesh)
    step = jaxdp.make_train_step(lambda p, b: xent(model.apply({"params": p}, b["x"]), b["y"]), tx, mesh, "ring")
    for batch in batches(5, 24, (12,)):
        state, _ = step(state, jaxdp.shard_batch(batch, mesh))
    chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(ref_params), rtol=1e-5, atol=1e-6)


def test_one_ring_per_step_carries_gradients_metrics_and_model_state(devices):
    # The ring step runs exactly one ring: loss, aux metrics and the float leaves of the model
    # state ride in the gradients' buffer (no all-reduce of their own); integer leaves stay local.
    n = 4
    mesh = jaxdp.make_mesh(devices[:n])
    model, tx = MLP(hidden=(16,)), optax.sgd(0.1)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12)))["params"]

    def loss_fn(p, model_state, batch, rng):
        logits = model.apply({"params": p}, batch["x"])
        loss = xent(logits, batch["y"])
        new_state = {"loss_sum": model_state["loss_sum"] + loss, "calls": model_state["calls"] + 1}
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}, new_state

    model_state = {"loss_sum": jnp.zeros((), jnp.float32), "calls": jnp.zeros((), jnp.int32)}
    state = jaxdp.init_state(params, tx, mesh, model_state=model_state)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy="ring", stateful=True)
    batch = jaxdp.shard_batch(next(batches(1, 32, (12,))), mesh)
    text = step.lower(state, batch).as_text()
    assert text.count("collective_permute") == 2 * (n - 1)
    assert "all_reduce" not in text

    local_losses = [float(xent(model.apply({"params": params}, part["x"]), part["y"]))
                    for part in (jax.tree.map(lambda a: a[i * 8:(i + 1) * 8], next(batches(1, 32, (12,)))) for i in range(n))]
    state, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(local_losses), rtol=1e-5)
    np.testing.assert_allclose(float(state.model_state["loss_sum"]), np.mean(local_losses), rtol=1e-5)
    assert int(state.model_state["calls"]) == 1


@pytest.mark.parametrize("n", [1, 8])
def test_psum_step_is_the_hand_written_step_plus_its_step_counter(devices, n):
    # jaxdp's overhead, shown without timing noise: the compiled program is the hand-written
    # step's (plain jit on 1 device; shard_map + pmean on 8), plus the fused `state.step + 1`.
    from jax.sharding import PartitionSpec as P

    model, tx = MLP(hidden=(32, 32)), optax.adam(1e-3)
    batch = next(batches(1, 16, (12,)))
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 12)))["params"]
    loss_fn = lambda p, b: xent(model.apply({"params": p}, b["x"]), b["y"])  # noqa: E731
    mesh = jaxdp.make_mesh(devices[:n])

    def hand_written(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if n > 1:
            grads, loss = jax.lax.pmean((grads, loss), jaxdp.DATA_AXIS)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def ops(compiled):
        entry = compiled.as_text().split("ENTRY", 1)[1]
        return collections.Counter(op for op in re.findall(r"= \S+ ([\w-]+)\(", entry) if op not in ("parameter", "constant"))

    if n == 1:
        reference = jax.jit(hand_written, donate_argnums=(0, 1)).lower(params, tx.init(params), batch)
    else:
        p = jaxdp.replicate(params, mesh)
        reference = jax.jit(jax.shard_map(hand_written, mesh=mesh, in_specs=(P(), P(), P(jaxdp.DATA_AXIS)),
                                          out_specs=(P(), P(), P()), check_vma=False), donate_argnums=(0, 1)
                            ).lower(p, jax.jit(tx.init)(p), jaxdp.shard_batch(batch, mesh))
    step = jaxdp.make_train_step(loss_fn, tx, mesh, "psum")
    ours = step.lower(jaxdp.init_state(params, tx, mesh), jaxdp.shard_batch(batch, mesh))
    ours, reference = ops(ours.compile()), ops(reference.compile())
    assert ours - reference == collections.Counter({"fusion": 1}), (ours, reference)
    assert not reference - ours, (ours, reference)


def test_a_step_built_with_another_optimizer_than_the_state_is_refused(devices):
    mesh = jaxdp.make_mesh(devices)
    params = {"w": jnp.ones((4,))}
    loss_fn = lambda p, b: jnp.sum(p["w"] * b["x"])  # noqa: E731
    batch = jaxdp.shard_batch({"x": np.ones((8, 4), np.float32)}, mesh)
    state = jaxdp.init_state(params, optax.sgd(0.1), mesh)
    for strategy in jaxdp.STRATEGIES:
        step = jaxdp.make_train_step(loss_fn, optax.sgd(0.5), mesh, strategy=strategy)  # another lr
        with pytest.raises(ValueError, match="pass the same tx object to both"):
            step(state, batch)
    tx = optax.sgd(0.1)
    same = jaxdp.make_train_step(loss_fn, tx, mesh)
    state, _ = same(jaxdp.init_state(params, tx, mesh), batch)
    assert int(state.step) == 1


@pytest.mark.parametrize("loss_fn, stateful, words", [
    (lambda p, s, b, rng: (jnp.sum(p["w"] * b["x"]), {}), True,
     "a stateful loss_fn(params, model_state, batch, rng) returns (loss, aux, new_model_state); got a tuple of 2"),
    (lambda p, b: (jnp.sum(p["w"] * b["x"]), {}, {}), False, "returns a scalar loss or (loss, aux); got a tuple of 3"),
    (lambda p, b: p["w"] * b["x"], False, "loss must be a scalar (the mean over the batch); got shape (1, 4)"),
], ids=["stateful-two", "plain-three", "not-scalar"])
def test_a_loss_of_the_wrong_shape_is_one_sentence(devices, loss_fn, stateful, words):
    mesh = jaxdp.make_mesh(devices)
    params = {"w": jnp.ones((4,))}
    batch = jaxdp.shard_batch({"x": np.ones((len(devices), 4), np.float32)}, mesh)
    tx = optax.sgd(0.1)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, stateful=stateful)
    with pytest.raises(jaxdp.InputError, match=re.escape(words)):
        step(jaxdp.init_state(params, tx, mesh), batch)
