"""The built-in GPT's training recipe, nanoGPT's: GPT-2's initialisation and weight decay on matrices only.

`python -m jaxdp.bench nanogpt` measures what they are for (held-out loss per step against nanoGPT's recipe in
PyTorch); these tests pin down what they are.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdp.checkpoint.resume import with_recorded_defaults
from jaxdp.config import Config
from jaxdp.models.builtin import GPT
from jaxdp.step.optim import make_optimizer


def test_gpt2_initialisation():
    layers = 4
    params = GPT(vocab_size=256, seq_len=32, layers=layers, d_model=128, heads=4).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32))["params"]
    std = {name: float(np.std(p["kernel"] if "kernel" in p else p["embedding"])) for name, p in params.items()
           if name != "ln_final" and not name.startswith("ln_")}
    for name, got in std.items():
        want = 0.02 / math.sqrt(2 * layers) if name.startswith(("proj_", "fc_out_")) else 0.02
        assert got == pytest.approx(want, rel=0.1), name
    assert all(not np.any(p["bias"]) for p in params.values() if "bias" in p and "scale" not in p)
    flax_default = GPT(vocab_size=256, seq_len=32, layers=layers, d_model=128, heads=4, init_std=None).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 32), jnp.int32))["params"]
    assert float(np.std(flax_default["fc_0"]["kernel"])) == pytest.approx(1 / math.sqrt(128), rel=0.1)


@pytest.mark.parametrize("matrices_only", [True, False])
def test_adamw_decays_matrices_only_by_default(matrices_only):
    params = {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3), "embedding": jnp.ones((4, 2)), "scale": jnp.ones(2)}
    tx = make_optimizer("adamw", 0.1, weight_decay=0.5, decay_matrices_only=matrices_only)
    zero = jax.tree.map(jnp.zeros_like, params)  # adam's own update is 0: what moves is the decay
    updates, _ = tx.update(zero, tx.init(params), params)
    after = optax.apply_updates(params, updates)
    decayed = 1 - 0.1 * 0.5
    for name, value in after.items():
        want = decayed if (jnp.ndim(params[name]) >= 2 or not matrices_only) else 1.0
        np.testing.assert_allclose(np.asarray(value), want, rtol=1e-6, err_msg=name)
    # The same optimizer-state arrays either way: a checkpoint of one restores into the other.
    both = [jax.tree.structure(jax.tree.leaves(make_optimizer("adamw", 0.1, decay_matrices_only=m).init(params)))
            for m in (True, False)]
    assert both[0] == both[1]


def test_a_checkpoint_that_records_no_weight_decay_on_resumes_decaying_everything():
    config = Config(optimizer="adamw", model="mlp")
    recorded = {k: v for k, v in config.to_dict().items() if k != "weight_decay_on"}
    resumed, said = with_recorded_defaults(config, recorded)
    assert resumed.weight_decay_on == "all" and said == ["--weight-decay-on all"]
    assert with_recorded_defaults(config, config.to_dict()) == (config, [])  # recorded: as it is
    adam = Config(optimizer="adam", model="mlp")  # no decay to speak of: nothing said
    assert with_recorded_defaults(adam, {k: v for k, v in adam.to_dict().items() if k != "weight_decay_on"}) == (adam, [])
