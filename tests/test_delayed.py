"""Every-step --overlap (jaxdp/step/delayed.py): each step's all-reduce runs on a thread while the next
step computes its gradients, and lands one step late. Against a reference delayed-update loop on
one device written out here; exact resume with a gradient in flight; across real processes like
one process; the errors."""

import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import records

import jaxdp
from jaxdp.config import ConfigError, parse_args
from jaxdp.sync.rules import check_config
from jaxdp.errors import EXIT_DIVERGED, InputError
from jaxdp.mesh import make_mesh, shard_batch
from jaxdp.models.builtin import MLP
from jaxdp.step.state import init_state
from jaxdp.step.train_step import make_train_step
from jaxdp.train import main

STEPS, ROWS = 9, 16
MODEL = MLP(hidden=(8,), num_classes=3)
X = np.random.default_rng(0).standard_normal((ROWS * STEPS, 6)).astype(np.float32)
Y = (np.abs(X[:, :3]).argmax(1)).astype(np.int32)
PARAMS = MODEL.init(jax.random.PRNGKey(0), X[:1])["params"]
TX = optax.adam(0.05)


def loss_fn(params, batch):
    logits = MODEL.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def data(step):
    return {"x": X[step * ROWS:(step + 1) * ROWS], "y": Y[step * ROWS:(step + 1) * ROWS]}


def reference() -> tuple[dict, list[float]]:
    """One device, the whole batch: step k computes its gradient at w_k, then applies step k - 1's
    (step 0 applies nothing); the end applies the last. Returns the parameters and, per call, the
    loss of the gradient it applied (0 for the first call, then the last one's at the end)."""
    grad = jax.jit(jax.value_and_grad(loss_fn))
    params, opt_state, held, losses = PARAMS, TX.init(PARAMS), None, []
    for k in range(STEPS):
        loss, g = grad(params, data(k))
        if held is not None:
            updates, opt_state = TX.update(held[1], opt_state, params)
            params = optax.apply_updates(params, updates)
        losses.append(0.0 if held is None else float(held[0]))
        held = (loss, g)
    updates, opt_state = TX.update(held[1], opt_state, params)
    losses.append(float(held[0]))
    return optax.apply_updates(params, updates), losses


@pytest.mark.parametrize("strategy", [pytest.param("psum", marks=pytest.mark.slow), "ring"])
def test_overlapped_steps_equal_the_reference_delayed_update_loop(devices, strategy):
    mesh = make_mesh(devices[:4])
    step = make_train_step(loss_fn, TX, mesh, strategy, overlap=True)
    state, losses = init_state(PARAMS, TX, mesh), []
    try:
        for k in range(STEPS):
            state, metrics = step(state, shard_batch(data(k), mesh))
            losses.append(float(metrics["loss"]))
        state, metrics = step.flush(state)
    finally:
        step.close()
    losses.append(float(metrics["loss"]))
    expected, expected_losses = reference()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 state.params, expected)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert int(state.step) == STEPS
    assert int(np.asarray(state.sync.per_device["delayed"]["held"]).max()) == 0  # nothing in flight after flush
    # One step late is not synchronous: the same steps without overlap end elsewhere.
    plain = jaxdp.fit(loss_fn, PARAMS, TX, data, steps=STEPS, mesh=mesh, strategy=strategy, progress=False)
    assert not np.allclose(np.asarray(plain.state.params["Dense_0"]["kernel"]),
                           np.asarray(state.params["Dense_0"]["kernel"]), atol=1e-4)


def overlapped_fit(mesh, steps=STEPS, **kwargs):
    return jaxdp.fit(loss_fn, PARAMS, TX, lambda k: data(k % STEPS), steps=steps, mesh=mesh, strategy="ring",
                     overlap=True, progress=False, log_every=1, **kwargs)


def test_a_step_that_applied_nothing_logs_nothing(devices, tmp_path):
    """The first step of a run, and the first after extending a finished one (flushed: nothing in
    flight), apply no gradient; they logged loss, accuracy and grad_norm 0.0 to every sink."""
    mesh, metrics = make_mesh(devices[:4]), tmp_path / "m.jsonl"
    overlapped_fit(mesh, steps=4, checkpoint_dir=str(tmp_path / "c"), metrics_file=str(metrics))
    extended = overlapped_fit(mesh, steps=7, checkpoint_dir=str(tmp_path / "c"), metrics_file=str(metrics))
    logged = [r for r in records(metrics) if "event" not in r]
    assert [r["step"] for r in logged] == [2, 3, 4, 6, 7]
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in logged), logged
    assert [r["step"] for r in extended.history] == [6, 7]


@pytest.mark.parametrize("flags", [["--overlap"], ["--sync-every", "4", "--overlap"]])
def test_no_checkpoint_holds_non_finite_values_in_flight(flags, tmp_path, capsys):
    """SGD at lr 1e9: the values in flight (every-step: the gradient; rounds: the replicas) become
    NaN before the applied gradient does. They were saved, and the exit-65 message called that
    checkpoint intact."""
    ckpt = tmp_path / "ckpt"
    code = main(["--checkpoint-dir", str(ckpt), "--optimizer", "sgd", "--lr", "1e9", "--save-every", "1", "--steps",
                 "40", "--no-progress", *flags])
    err = capsys.readouterr().err
    assert code == EXIT_DIVERGED, err
    for step in [d for d in ckpt.iterdir() if d.name.isdigit()]:
        state = ocp.PyTreeCheckpointer().restore(str(step / "state"))
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state) if np.issubdtype(np.asarray(x).dtype,
                                                                                              np.floating)), step.name
    intact = re.search(r"the last checkpoint \(step (\d+)\) is intact", err)
    assert intact is None or (ckpt / intact.group(1)).is_dir(), err


def test_fit_with_overlap_is_the_reference_and_resumes_bit_identically_with_a_gradient_in_flight(devices, tmp_path):
    mesh = make_mesh(devices[:4])
    whole = overlapped_fit(mesh, checkpoint_dir=str(tmp_path), save_every=4)
    expected, expected_losses = reference()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
                 whole.state.params, expected)
    # Each logged loss is the step before's (its average landed during this step); the last step's
    # own lands with the flush that ends the run. The first step applied nothing: no record.
    assert [r["step"] for r in whole.history] == list(range(2, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in whole.history],
                               expected_losses[1:STEPS - 1] + expected_losses[STEPS:], rtol=1e-5)
    shutil.rmtree(tmp_path / str(STEPS))  # back to step 8: step 7's gradient was in flight when saved
    resumed = overlapped_fit(mesh, checkpoint_dir=str(tmp_path), save_every=4)
    assert [r["step"] for r in resumed.history] == [STEPS]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.state, whole.state)


@pytest.mark.slow
def test_int8_ring_with_overlap_resumes_bit_identically(devices, tmp_path):
    mesh = make_mesh(devices[:4])
    whole = overlapped_fit(mesh, checkpoint_dir=str(tmp_path), save_every=4, compression="int8")
    error = whole.state.sync.per_device["compression"]
    assert any(float(np.abs(np.asarray(e)).max()) > 0 for e in jax.tree.leaves(error))  # error feedback is carried
    shutil.rmtree(tmp_path / str(STEPS))
    resumed = overlapped_fit(mesh, checkpoint_dir=str(tmp_path), save_every=4, compression="int8")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), resumed.state, whole.state)


@pytest.mark.parametrize("flags, says", [
    (["--overlap", "--strategy", "host"], "--overlap does not combine with --strategy=host"),
    (["--overlap", "--compression", "auto"], "--overlap does not combine with --compression=auto"),
    (["--overlap", "--shard-optimizer"], "--overlap does not combine with --shard-optimizer=true"),
])
def test_every_step_overlap_flag_errors_are_one_line(flags, says):
    with pytest.raises(ConfigError, match=says):
        check_config(parse_args(flags))


def test_fit_and_the_step_refuse_what_every_step_overlap_does_not_do(devices):
    mesh = make_mesh(devices[:2])
    with pytest.raises(InputError, match="overlap does not combine with strategy='host'"):
        jaxdp.fit(loss_fn, PARAMS, TX, data, steps=2, mesh=mesh, overlap=True, strategy="host", progress=False)
    with pytest.raises(InputError, match="overlap does not combine with shard_optimizer"):
        jaxdp.fit(loss_fn, PARAMS, TX, data, steps=2, mesh=mesh, overlap=True, shard_optimizer=True, progress=False)
    with pytest.raises(InputError, match="overlap does not combine with compression='auto'"):
        jaxdp.fit(loss_fn, PARAMS, TX, data, steps=2, mesh=mesh, overlap=True, compression="auto", progress=False)

    class Normed(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            return nn.BatchNorm(use_running_average=not train)(nn.Dense(3)(x))

    variables = Normed().init(jax.random.PRNGKey(0), X[:2])
    with pytest.raises(InputError, match="overlap keeps no float model state"):
        jaxdp.fit(lambda p, s, b, r: (jnp.mean(p["Dense_0"]["kernel"]), {}, s), variables["params"], TX, data,
                  steps=2, mesh=mesh, overlap=True, stateful=True, model_state={"batch_stats": variables["batch_stats"]},
                  progress=False)
    # A state holding a gradient in flight goes back to an overlapped step (or its flush), not a plain one.
    overlapped = make_train_step(loss_fn, TX, mesh, "ring", overlap=True)
    state, _ = overlapped(init_state(PARAMS, TX, mesh), shard_batch(data(0), mesh))
    overlapped.close()
    with pytest.raises(ValueError, match="holds a gradient in flight"):
        make_train_step(loss_fn, TX, mesh, "ring")(state, shard_batch(data(1), mesh))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_with_every_step_overlap_train_like_one_process(tmp_path):
    # Across real processes the all-reduce runs on its own thread through gloo while the other
    # thread computes the next gradients: the numbers must still be the one-process run's.
    from helpers import records, step_records, two_processes_and_one

    two_processes_and_one(tmp_path, ["--steps", "12", "--batch-size", "64", "--log-every", "4", "--no-progress",
                                     "--overlap", "--strategy", "ring"])
    ref, two = step_records(tmp_path / "one.jsonl"), step_records(tmp_path / "two.0.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in ref] == [4, 8, 12]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose(records(tmp_path / "two.0.jsonl")[-1]["eval_loss"],
                               records(tmp_path / "one.jsonl")[-1]["eval_loss"], rtol=1e-5)
