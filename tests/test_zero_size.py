"""A model with a zero-size parameter (`self.param("empty", zeros, (0, 4))`): it saves, resumes
exactly and loads (orbax cannot save a zero-size array: the step's meta records its shape, see
jaxdp/checkpoint/portable.py), and a save that fails leaves no unfinished step directory behind.

The runs call `jaxdp.train.train` in this process (8 simulated devices, a few seconds each); the
model is a real file in a temporary working directory, imported as `--model MODULE:ATTR` imports it.
"""

import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.checkpoint import portable
from jaxdp.config import parse_args
from jaxdp.errors import CheckpointWriteError
from jaxdp.train import train

FAST = ["--log-every", "1", "--no-progress"]

EMPTY_MODEL = '''
import flax.linen as nn
import jax.numpy as jnp


class Empty(nn.Module):
    """A classifier with a zero-size parameter (its sum, 0, is added: it takes part in the graph)."""
    num_classes: int = 10

    @nn.compact
    def __call__(self, x):
        empty = self.param("empty", nn.initializers.zeros, (0, 4))
        return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1))) + jnp.sum(empty)
'''


@pytest.fixture
def empty_model(tmp_path, monkeypatch, request):
    """`--model MODULE:Empty` for a module in the working directory, unique per test."""
    name = f"zero_size_{request.node.name.split('[')[0][5:]}"
    (tmp_path / f"{name}.py").write_text(EMPTY_MODEL)
    monkeypatch.chdir(tmp_path)
    yield f"{name}:Empty"
    sys.modules.pop(name, None)


def assert_same_arrays(got, want):
    got, want = jax.device_get(got), jax.device_get(want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        np.testing.assert_array_equal(a, b)


# -- checkpoints -------------------------------------------------------------------------------


def test_a_zero_size_parameter_saves_resumes_exactly_and_loads(empty_model, tmp_path):
    flags = [*FAST, "--model", empty_model, "--optimizer", "adam"]
    whole = train(parse_args([*flags, "--steps", "4"]))
    ckpt = tmp_path / "ckpt"
    train(parse_args([*flags, "--steps", "2", "--save-every", "2", "--checkpoint-dir", str(ckpt)]))
    assert sorted(p.name for p in ckpt.iterdir() if p.name[0].isdigit()) == ["2"]
    meta = json.loads((ckpt / "2" / "meta" / "metadata").read_text())
    # orbax's files lack them: the meta records the parameter and Adam's two moments of it
    assert meta[portable.ZERO_SIZE] == {name: [[0, 4], "float32"] for name in
                                        ("params/empty", "opt_state/0/mu/empty", "opt_state/0/nu/empty")}

    resumed = train(parse_args([*flags, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(ckpt)]))
    assert int(resumed.state.step) == 4
    assert_same_arrays(resumed.state.params, whole.state.params)
    assert_same_arrays(resumed.state.opt_state, whole.state.opt_state)
    assert resumed.history == [r for r in resumed.history if r["step"] > 2]  # resumed, not trained again
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history[2:]]

    loaded = jaxdp.load_params(ckpt)  # the latest step, 4, without a template
    assert loaded["empty"].shape == (0, 4) and loaded["empty"].dtype == np.float32
    assert_same_arrays(loaded, whole.state.params)
    module, params = jaxdp.load_model(ckpt)
    assert_same_arrays(params, whole.state.params)


def test_a_failed_save_leaves_no_unfinished_step_directory(empty_model, tmp_path, monkeypatch):
    """The save of a zero-size array as orbax refuses it (the state handed to orbax unchanged): the
    run stops with the one-line error, and its unfinished `2.orbax-checkpoint-tmp` is gone, so a
    rerun finds no trace of it. The same rerun with the zero-size array kept out of orbax saves."""
    flags = [*FAST, "--model", empty_model, "--steps", "2", "--save-every", "2", "--checkpoint-dir", str(tmp_path / "c")]
    with monkeypatch.context() as patched:
        patched.setattr(portable, "without_zero_size", lambda tree: tree, raising=False)
        with pytest.raises(CheckpointWriteError, match="cannot write checkpoint step 2"):
            train(parse_args(flags))
    assert [name for name in os.listdir(tmp_path / "c") if name[0].isdigit()] == []
    assert int(train(parse_args(flags)).state.step) == 2
    assert sorted(name for name in os.listdir(tmp_path / "c") if name[0].isdigit()) == ["2"]


def test_a_checkpoint_whose_zero_size_parameter_is_now_another_shape_is_refused(tmp_path, devices):
    mesh = jaxdp.make_mesh()
    tx = optax.sgd(0.1)
    saved = jaxdp.init_state({"w": np.ones((3, 4), np.float32), "empty": np.zeros((0, 4), np.float32)}, tx, mesh)
    with jaxdp.Checkpointer(str(tmp_path / "c")) as ckpt:
        ckpt.save(saved)
    for other, needle in ((np.zeros((0, 5), np.float32), r"params/empty is float32\[0, 4\].*need float32\[0, 5\]"),
                          (np.zeros((2, 4), np.float32), r"params/empty is float32\[0, 4\].*need float32\[2, 4\]")):
        template = jaxdp.init_state({"w": np.zeros((3, 4), np.float32), "empty": other}, tx, mesh)
        with jaxdp.Checkpointer(str(tmp_path / "c")) as ckpt, pytest.raises(jaxdp.InputError, match=needle):
            ckpt.restore(template)
    assert sorted(os.listdir(tmp_path / "c")) == ["0"]  # refused, not moved aside as damaged


# -- ZeRO-1 (shard_optimizer) ------------------------------------------------------------------


class EmptyMLP(nn.Module):
    """Two float32 leaves that need padding on 8 devices, and a zero-size one of its own dtype
    group (bf16): an empty buffer, alone and beside others."""

    @nn.compact
    def __call__(self, x):
        empty = self.param("empty", nn.initializers.zeros, (0, 4))
        empty16 = self.param("empty16", nn.initializers.zeros, (3, 0), jnp.bfloat16)
        return nn.Dense(10)(nn.tanh(nn.Dense(7)(x))) + jnp.sum(empty) + jnp.sum(empty16).astype(jnp.float32)


def zero_size_loss(params, batch):
    logits = EmptyMLP().apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def zero_size_run(mesh, strategy, shard_optimizer, steps=5):
    params = EmptyMLP().init(jax.random.PRNGKey(0), jnp.zeros((1, 13)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(3e-3))
    state = jaxdp.init_state(params, tx, mesh, shard_optimizer=shard_optimizer)
    step = jaxdp.make_train_step(zero_size_loss, tx, mesh, strategy, shard_optimizer=shard_optimizer)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        batch = {"x": rng.standard_normal((48, 13)).astype(np.float32), "y": rng.integers(0, 10, 48).astype(np.int32)}
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return state, losses, tx


@pytest.mark.parametrize("strategy", ["psum", "ring"])
def test_zero1_with_a_zero_size_parameter_trains_like_the_replicated_step(devices, tmp_path, strategy):
    mesh = jaxdp.make_mesh(devices)
    replicated, want, tx = zero_size_run(mesh, strategy, False)
    sharded, got, _ = zero_size_run(mesh, strategy, True)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert sharded.params["empty"].shape == (0, 4) and sharded.params["empty16"].dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(replicated.params), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape and np.max(np.abs(a - b), initial=0.0) <= 1e-6 * np.max(np.abs(b), initial=0.0)

    # Its checkpoint (the optimizer state in tree form) restores sharded and replicated alike.
    with jaxdp.Checkpointer(str(tmp_path / "c")) as ckpt:
        ckpt.save(sharded)
    for shard_optimizer in (True, False):
        template = jaxdp.init_state(jax.tree.map(jnp.zeros_like, sharded.params), tx, mesh,
                                    shard_optimizer=shard_optimizer)
        with jaxdp.Checkpointer(str(tmp_path / "c")) as ckpt:
            restored = ckpt.restore(template)
        assert int(restored.step) == 5
        assert_same_arrays(restored.params, sharded.params)
        assert_same_arrays(portable.to_portable(restored).opt_state, portable.to_portable(sharded).opt_state)


@pytest.mark.parametrize("strategy", ["psum", "ring"])
def test_the_halves_of_an_empty_buffer_are_empty(devices, strategy):
    """A strategy's reduce-scatter and all-gather of a zero-length buffer (XLA's verifier refuses
    its own collectives of zero length): an empty result, no collective."""
    from jax.sharding import PartitionSpec as P

    from jaxdp.sync.collectives import as_collective

    mesh = jaxdp.make_mesh(devices)
    axis = jaxdp.mesh.data_axes(mesh)
    halves = as_collective(strategy).halves

    def both(buffer):
        owned = halves.reduce_scatter(buffer, axis)
        return owned, halves.all_gather(owned, axis)

    owned, whole = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P(), out_specs=(P(axis), P()), check_vma=False))(
        jnp.zeros((0,), jnp.float32))
    assert owned.shape == whole.shape == (0,)
