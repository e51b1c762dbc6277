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
