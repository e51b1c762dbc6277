"""The GPU path's kernels, checked on CPU through their reference paths: the Pallas LayerNorm and
cross-entropy (run by Pallas's interpreter) against the XLA paths and flax / optax, the fp8 products
against a quantization written out here, the fp8 refusals, and the GPT's token lookup (a float32
scatter-add for its gradient)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from helpers import run_cli, write_corpus
from jaxdp.models import fp8, kernels
from jaxdp.models.builtin import GPT


@dataclasses.dataclass
class FakeDevice:  # what fp8.unsupported reads of a jax.Device
    platform: str
    device_kind: str
    compute_capability: str = "0"


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_kernel_choice_auto_takes_xla_and_float32_never_takes_pallas():
    assert kernels.implementation("auto", jnp.bfloat16) == "xla"
    assert kernels.implementation("pallas", jnp.bfloat16) == "pallas"
    assert kernels.implementation("pallas", jnp.float32) == "xla"
    with pytest.raises(ValueError, match="kernels must be one of auto, xla, pallas"):
        kernels.implementation("triton", jnp.bfloat16)


def test_pallas_layer_norm_is_the_xla_path_and_flax_to_rounding():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x = (jax.random.normal(k[0], (2, 3, 200)) * 3 + 1).astype(jnp.bfloat16)  # 200: a masked tail in a 256 block
    scale, bias = 1 + 0.1 * jax.random.normal(k[1], (200,)), 0.1 * jax.random.normal(k[2], (200,))
    cot = jax.random.normal(k[3], x.shape).astype(jnp.bfloat16)

    def run(path):
        y, pull = jax.vjp(lambda x, s, b: kernels.layer_norm(x, s, b, 1e-5, path), x, scale, bias)
        return (y, *pull(cot))

    xla, pallas = run("xla"), run("pallas")
    for a, b in zip(pallas, xla):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert _rel(pallas[0], xla[0]) < 4e-3  # bf16 outputs: at most an ulp apart
    for a, b in zip(pallas[1:], xla[1:]):
        assert _rel(a, b) < 4e-3
    flax_norm = nn.LayerNorm(epsilon=1e-5, dtype=jnp.bfloat16)
    ref = jax.vjp(lambda x, s, b: flax_norm.apply({"params": {"scale": s, "bias": b}}, x), x, scale, bias)
    assert _rel(xla[0], ref[0]) < 4e-3
    for a, b in zip(xla[1:], ref[1](cot)):
        assert _rel(a, b) < 1e-2  # flax's variance is E[x²] - E[x]², this one E[(x - mean)²]


def test_pallas_cross_entropy_is_optax_on_upcast_logits():
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    logits = (jax.random.normal(k[0], (3, 4, 1000)) * 4).astype(jnp.bfloat16)  # 1000: blocks of 1024, masked
    labels = jax.random.randint(k[1], (3, 4), 0, 1000).at[0, 0].set(999)  # the last column, in the masked block
    weights = jax.random.uniform(k[2], (3, 4))

    def loss(f):
        return jax.value_and_grad(lambda z: jnp.sum(f(z) * weights))(logits)

    value, grad = loss(lambda z: kernels.cross_entropy(z, labels))
    ref_value, ref_grad = loss(lambda z: optax.softmax_cross_entropy_with_integer_labels(z.astype(jnp.float32), labels))
    assert kernels.cross_entropy(logits, labels).dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    assert _rel(grad, ref_grad) < 4e-3


def test_the_gpt_takes_the_pallas_path_with_the_same_parameters_and_logits():
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, 64)
    xla = GPT(vocab_size=64, seq_len=16, layers=1, d_model=32, heads=2, dtype=jnp.bfloat16)
    pallas = xla.clone(kernels="pallas")
    params = xla.init(jax.random.PRNGKey(0), tokens)
    assert jax.tree.structure(pallas.init(jax.random.PRNGKey(0), tokens)) == jax.tree.structure(params)
    assert _rel(pallas.apply(params, tokens), xla.apply(params, tokens)) < 1e-2
    assert str(jax.make_jaxpr(pallas.apply)(params, tokens)).count("pallas_call") == 3  # 2 LayerNorms, ln_final
    assert "pallas_call" not in str(jax.make_jaxpr(xla.apply)(params, tokens))


def _fp8_reference(x: np.ndarray, dtype) -> np.ndarray:
    """Current scaling written out: scale = max|x| / the format's largest value; x / scale rounded
    to the format (saturating); back times the scale."""
    top = float(ml_dtypes.finfo(dtype).max)
    scale = np.float32(np.max(np.abs(x)) / top)
    q = np.clip(x.astype(np.float32) / scale, -top, top).astype(dtype)
    return q.astype(np.float64) * np.float64(scale)


def test_fp8_products_are_the_written_out_quantization_in_both_directions():
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(k[0], (64, 96)).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(k[1], (96, 48))).astype(jnp.bfloat16)
    g = jax.random.normal(k[2], (64, 48)).astype(jnp.bfloat16)
    y, pull = jax.vjp(fp8.matmul, x, w)
    dx, dw = pull(g)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    xq = _fp8_reference(np.asarray(x, np.float32), ml_dtypes.float8_e4m3fn)
    wq = _fp8_reference(np.asarray(w, np.float32), ml_dtypes.float8_e4m3fn)
    gq = _fp8_reference(np.asarray(g, np.float32), ml_dtypes.float8_e5m2)
    assert _rel(y, xq @ wq) < 8e-3  # the fp8 product, to bf16 rounding of the scales and the output
    assert _rel(dx, gq @ wq.T) < 8e-3
    assert _rel(dw, xq.T @ gq) < 8e-3
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert 1e-2 < _rel(y, exact) < 0.1  # and it is a quantized product, not the bf16 one


def test_fp8_dense_layers_keep_the_parameters_and_are_close_to_bf16():
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 16), 0, 64)
    bf16 = GPT(vocab_size=64, seq_len=16, layers=2, d_model=32, heads=2, dtype=jnp.bfloat16)
    params = bf16.init(jax.random.PRNGKey(0), tokens)
    on_fp8 = bf16.clone(fp8=True)
    assert jax.tree.structure(on_fp8.init(jax.random.PRNGKey(0), tokens)) == jax.tree.structure(params)
    a, b = on_fp8.apply(params, tokens), bf16.apply(params, tokens)
    assert 0 < _rel(a, b) < 0.05


@pytest.mark.parametrize("device, refused", [
    (FakeDevice("gpu", "NVIDIA H100 80GB HBM3", "9.0"), False),
    (FakeDevice("gpu", "NVIDIA GeForce RTX 4090", "8.9"), False),
    (FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), True),
    (FakeDevice("gpu", "AMD Instinct MI300X"), True),
    (FakeDevice("cpu", "cpu"), True),
])
def test_fp8_runs_only_on_nvidia_gpus_from_compute_capability_8_9(device, refused):
    why = fp8.unsupported(device)
    assert (why is not None) == refused
    if refused:
        assert "\n" not in why and "--precision bf16" in why


def test_the_command_line_refuses_fp8_here_in_one_line(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")
    result = run_cli("--model", "gpt", "--dataset", str(corpus), "--precision", "fp8", "--steps", "1",
                     "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--precision fp8 needs an NVIDIA GPU of compute capability 8.9" in lines[0]
    result = run_cli("--model", "mlp", "--precision", "fp8", "--steps", "1")
    assert result.returncode == 2 and "--model=mlp has no such layers" in result.stderr


def _scatter_results(text: str) -> list[str]:
    """The result types of the scatters in a lowered program's StableHLO text."""
    lines = text.splitlines()
    results = []
    for i, line in enumerate(lines):
        if "stablehlo.scatter" in line:
            end = next(j for j in range(i, len(lines)) if "}) :" in lines[j])
            results.append(lines[end].rsplit("->", 1)[1].strip())
    return results


def test_the_token_lookup_is_a_bf16_copys_rows_and_its_gradient_adds_in_float32():
    tokens = jax.random.randint(jax.random.PRNGKey(5), (4, 16), 0, 40)
    model = GPT(vocab_size=40, seq_len=16, layers=1, d_model=32, heads=2, dtype=jnp.bfloat16)
    params = model.init(jax.random.PRNGKey(0), tokens)
    _, seen = model.apply(params, tokens, capture_intermediates=True)
    rows = seen["intermediates"]["embed"]["__call__"][0]
    table = params["params"]["embed"]["embedding"]
    np.testing.assert_array_equal(rows.astype(jnp.bfloat16), jnp.take(table.astype(jnp.bfloat16), tokens, axis=0))
    grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, tokens).astype(jnp.float32))))
    # both tables' gradients (tokens, positions) are float32 scatter-adds; bf16 ones run through
    # compare-and-swap loops on a GPU, many times slower where rows collide (docs/performance.md)
    assert sorted(_scatter_results(grad.lower(params).as_text())) == ["tensor<16x32xf32>", "tensor<40x32xf32>"]
    # and the float32 sum is the exact one where a bf16 one would round every partial sum
    g = jax.random.normal(jax.random.PRNGKey(6), (64, 64, 32)).astype(jnp.bfloat16)
    same = jnp.full((64, 64), 3)
    added = jax.vjp(lambda t: jnp.take(t, same, axis=0).astype(jnp.bfloat16), table)[1](g)[0]
    exact = np.asarray(g, np.float64).reshape(-1, 32).sum(axis=0)
    assert _rel(added[3], exact) < 1e-5
