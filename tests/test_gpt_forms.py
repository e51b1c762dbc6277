"""The GPT's own forms of two products, each against the plain form it replaces: causal attention in
blocks of queries (`causal_attention`) and the Dense layers' product with the input's leading
dimensions flattened (`dense_dot_general`). Values and gradients equal to rounding, in float32 and bf16."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.models.builtin import causal_attention, dense_dot_general


def _close(a, b, dtype):
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(x, y, rtol=tolerance, atol=tolerance * max(1.0, np.abs(y).max()))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("length", [1, 31, 100, 128, 300])
def test_causal_attention_in_query_blocks_equals_the_whole_matrix(length, dtype):
    q, k, v = (jax.random.normal(key, (2, length, 3, 16)).astype(dtype)
               for key in jax.random.split(jax.random.PRNGKey(length), 3))
    weights = jax.random.normal(jax.random.PRNGKey(7), (2, length, 3, 16))

    def loss(attend):
        return lambda q, k, v: jnp.vdot(attend(q, k, v).astype(jnp.float32), weights)

    def plain(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def blocked(q, k, v):
        return causal_attention(q, k, v, "xla")

    assert blocked(q, k, v).dtype == dtype
    _close(blocked(q, k, v), plain(q, k, v), dtype)
    _close(jax.grad(loss(blocked), argnums=(0, 1, 2))(q, k, v), jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v), dtype)


def test_causal_attention_never_writes_the_whole_score_matrix():
    q = jnp.zeros((2, 256, 3, 16))
    text = jax.jit(lambda q: causal_attention(q, q, q, "xla")).lower(q).as_text()
    assert "256x256" not in text  # 8 blocks of 32 queries: the largest scores are 32 x 256
    assert "32x256" in text
    whole = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True)).lower(q).as_text()
    assert "256x256" in whole  # what the check above would see without the blocks


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, features", [((5, 7), 3), ((2, 4, 7), 6)])
def test_dense_product_on_flattened_rows_equals_the_plain_product(shape, features, dtype):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    plain, own = nn.Dense(features, dtype=dtype), nn.Dense(features, dtype=dtype, dot_general=dense_dot_general)
    params = plain.init(jax.random.PRNGKey(1), x)

    def grads(model):
        return jax.jit(jax.grad(lambda p, x: (model.apply(p, x).astype(jnp.float32) ** 2).sum(), argnums=(0, 1)))(params, x)

    _close(own.apply(params, x), plain.apply(params, x), dtype)
    _close(grads(own), grads(plain), dtype)
    if len(shape) == 3:  # the kernel's gradient contracts one flattened dimension, not batch and positions
        backward = jax.jit(jax.grad(lambda p: own.apply(p, x).sum())).lower(params).as_text()
        assert "contracting_dims = [0] x [0]" in backward and "contracting_dims = [0, 1]" not in backward
        plain_backward = jax.jit(jax.grad(lambda p: plain.apply(p, x).sum())).lower(params).as_text()
        assert "contracting_dims = [0, 1] x [0, 1]" in plain_backward  # what the check above tells apart


def test_dense_dot_general_leaves_other_contractions_to_xla():
    x, kernel = jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))
    batched = (((2,), (1,)), ((0,), (0,)))  # a batch dimension: not a Dense layer's product
    np.testing.assert_array_equal(dense_dot_general(x, kernel, batched), jax.lax.dot_general(x, kernel, batched))
