"""The GPU path, checked on CPU: the attention choice, the prefetching input pipeline, the
persistent compilation cache, and the dependency pins."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import threading
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packaging.requirements import Requirement

from helpers import ROOT, records, run_cli, write_corpus
from jaxdp.config import parse_args
from jaxdp.data.prefetch import Prefetcher
from jaxdp.models.builtin import GPT, attention_implementation
from jaxdp.train import train


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str
    compute_capability: str = "0"


H100 = FakeDevice("gpu", "NVIDIA H100 80GB HBM3", "9.0")


@pytest.mark.parametrize("device, dtype, head_dim, expected", [
    (H100, jnp.bfloat16, 64, "cudnn"),                       # GPT-2-small on an H100: cuDNN flash attention
    (H100, jnp.float16, 128, "cudnn"),
    (H100, jnp.float32, 64, "xla"),                          # cuDNN's flash attention is 16-bit only
    (H100, jnp.bfloat16, 256, "xla"),                        # head size above what it supports
    (FakeDevice("gpu", "NVIDIA Tesla V100", "7.0"), jnp.bfloat16, 64, "xla"),  # before Ampere
    (FakeDevice("gpu", "AMD Instinct MI300X"), jnp.bfloat16, 64, "xla"),
    (FakeDevice("cpu", "cpu"), jnp.bfloat16, 64, "xla"),
])
def test_attention_auto_picks_cudnn_only_where_it_runs(device, dtype, head_dim, expected):
    assert attention_implementation("auto", dtype, head_dim, device) == expected
    assert attention_implementation("xla", dtype, head_dim, device) == "xla"  # an explicit choice wins


def test_gpt_on_cpu_uses_xla_attention_and_rejects_unknown_names():
    assert attention_implementation("auto", jnp.bfloat16, 64) == "xla"  # this machine: CPU
    model = GPT(vocab_size=64, seq_len=16, layers=1, d_model=32, heads=2, dtype=jnp.bfloat16)
    tokens = jnp.zeros((2, 16), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)
    explicit = GPT(vocab_size=64, seq_len=16, layers=1, d_model=32, heads=2, dtype=jnp.bfloat16, attention="xla")
    np.testing.assert_array_equal(model.apply(params, tokens), explicit.apply(params, tokens))
    assert "cudnn" not in jax.jit(model.apply).lower(params, tokens).as_text()
    with pytest.raises(ValueError, match="attention must be auto, xla or cudnn"):
        GPT(vocab_size=64, seq_len=16, layers=1, d_model=32, heads=2, attention="flash").init(jax.random.PRNGKey(0), tokens)


# ---- prefetch -----------------------------------------------------------------------------------


def test_prefetch_prepares_the_next_batches_while_the_current_step_runs():
    """Proof of overlap without a clock: the consumer holds batch k and waits until the producer has
    made batch k + 2 (possible only if making batches runs concurrently with the loop's body)."""
    made = {k: threading.Event() for k in range(8)}

    def make(step):
        made[step].set()
        return {"x": np.full((4,), step)}

    seen = []
    with Prefetcher(make, 0, 8, depth=2) as batches:
        for step, batch in batches:
            seen.append(int(batch["x"][0]))
            if step + 2 < 8:
                assert made[step + 2].wait(timeout=30), f"batch {step + 2} was not prepared during step {step}"
    assert seen == list(range(8))  # in order, each once


def test_prefetch_raises_the_thread_error_at_its_step_and_depth_zero_is_inline():
    def make(step):
        if step == 3:
            raise OSError("disk gone")
        return step

    got = []
    with pytest.raises(OSError, match="disk gone"):
        with Prefetcher(make, 0, 6, depth=2) as batches:
            for _, batch in batches:
                got.append(batch)
    assert got == [0, 1, 2]
    calls = []
    with Prefetcher(lambda s: calls.append(s) or s, 5, 8, depth=0) as batches:
        assert [b for _, b in batches] == [5, 6, 7] and calls == [5, 6, 7]


@pytest.mark.slow
def test_prefetched_training_equals_unprefetched(tmp_path):
    corpus = write_corpus(tmp_path / "c.txt", sentences=300)
    common = ["--model", "gpt", "--dataset", str(corpus), "--layers", "1", "--d-model", "32", "--heads", "2",
              "--seq-len", "16", "--batch-size", "16", "--steps", "6", "--log-every", "1", "--no-progress"]
    losses = [[r["loss"] for r in train(parse_args([*common, "--prefetch", depth])).history] for depth in ("0", "3")]
    assert losses[0] == losses[1]


# ---- compilation cache ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_loads_its_compiled_programs_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    done = {}
    for run, setting in (("first", str(cache)), ("second", str(cache))):
        proc = run_cli("--steps", "3", "--no-progress", "--compile-cache", setting,
                       "--metrics-file", str(tmp_path / f"{run}.jsonl"))
        assert proc.returncode == 0, proc.stderr
        start, *_, done[run] = records(tmp_path / f"{run}.jsonl")
        assert start["compile_cache"] == str(cache)
    assert done["first"]["compile_cache_hits"] == 0 and any(cache.rglob("*"))
    assert done["second"]["compile_cache_hits"] > 0  # the train and eval steps came from disk


def test_compile_cache_settings(monkeypatch, tmp_path):
    from jaxdp.cluster import runtime

    assert runtime.cache_directory("off") is None and runtime.enable_compile_cache("off") is None
    monkeypatch.setenv(runtime.CACHE_ENV, str(tmp_path / "env"))
    assert runtime.cache_directory("auto") == str(tmp_path / "env")
    monkeypatch.delenv(runtime.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert runtime.cache_directory("auto") == str(tmp_path / "xdg" / "jaxdp" / "xla")
    assert runtime.cache_directory("~/c").startswith("/") and runtime.cache_directory("rel") == str(tmp_path.cwd() / "rel")
    environ = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    assert runtime.add_gpu_xla_flags(environ) == [] and environ["XLA_FLAGS"].endswith("=false")  # the user's value wins
    environ = {}
    assert runtime.add_gpu_xla_flags(environ) == ["--xla_gpu_enable_latency_hiding_scheduler=true"]


# ---- pins -----------------------------------------------------------------------------------------


def test_installed_versions_are_inside_the_pins_and_the_cuda_extra_matches_jax():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    for name in ("jax", "flax", "optax", "orbax-checkpoint", "chex"):
        assert pins[name].specifier.contains(importlib.metadata.version(name)), (name, str(pins[name]))
    assert "0.11.2" in pins["jax"].specifier  # the JAX that current GPU images ship (CUDA 13)
    cuda = [Requirement(r) for r in project["optional-dependencies"]["cuda"]]
    assert cuda[0].name == "jax" and cuda[0].extras == {"cuda13"} and cuda[0].specifier == pins["jax"].specifier


def test_token_cross_entropy_is_optax_on_upcast_logits_and_a_float64_reference():
    """The language model's loss takes bf16 logits as they come and upcasts as it reads: the same
    value and gradient as optax's cross-entropy on float32 logits, and as numpy in float64."""
    import optax

    from jaxdp.models.tasks import token_cross_entropy

    rng = np.random.default_rng(0)
    labels = jnp.asarray(rng.integers(0, 97, (3, 8)), jnp.int32)
    for dtype in (jnp.bfloat16, jnp.float32):
        logits = jnp.asarray(rng.normal(size=(3, 8, 97)) * 4, dtype)
        wide = np.asarray(logits.astype(jnp.float32), np.float64)
        shifted = wide - wide.max(-1, keepdims=True)
        softmax = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
        picked = np.take_along_axis(shifted, np.asarray(labels)[..., None], -1)[..., 0]
        expected = np.log(np.exp(shifted).sum(-1)) - picked
        expected_grad = (softmax - np.eye(97)[np.asarray(labels)]) / labels.size

        def mean_loss(x):
            return token_cross_entropy(x, labels).mean()

        def optax_loss(x):
            return optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels).mean()

        losses = jax.jit(token_cross_entropy)(logits, labels)
        assert losses.dtype == jnp.float32
        np.testing.assert_allclose(losses, expected, rtol=1e-6)
        np.testing.assert_allclose(losses, optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels),
                                   rtol=1e-6)
        grad = jax.jit(jax.grad(mean_loss))(logits)
        assert grad.dtype == dtype  # the gradient is written in the logits' dtype
        tolerance = 1e-2 if dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(np.asarray(grad, np.float64), expected_grad, rtol=tolerance, atol=1e-7)
        np.testing.assert_allclose(np.asarray(grad, np.float64), np.asarray(jax.grad(optax_loss)(logits), np.float64),
                                   rtol=tolerance, atol=1e-7)


def test_the_gpt_hands_the_loss_its_logits_in_the_compute_dtype_on_request_and_on_a_gpu():
    """language_model(compute_dtype_logits=True) trains the GPT with logits_dtype=None (no float32
    copy of the logits): the loss of the bf16-rounded logits. The module itself still returns float32
    logits, and on a CPU (the default there) the loss is optax's on them, bit for bit."""
    import optax

    from jaxdp.models.tasks import language_model

    model = GPT(vocab_size=61, seq_len=8, layers=1, d_model=16, heads=2, dtype=jnp.bfloat16)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 61, (2, 9)), jnp.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    params = model.init(jax.random.PRNGKey(0), batch["x"])["params"]
    assert model.apply({"params": params}, batch["x"]).dtype == jnp.float32
    rounded = model.clone(logits_dtype=None).apply({"params": params}, batch["x"])
    assert rounded.dtype == jnp.bfloat16

    def loss(task):
        return jax.jit(lambda p: task.loss_fn(p, {}, batch, jax.random.PRNGKey(1))[0])(params)

    reference = jax.jit(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": p}, batch["x"]), batch["y"]).mean())(params)
    assert loss(language_model(model)) == reference  # CPU: as before
    expected = optax.softmax_cross_entropy_with_integer_labels(rounded.astype(jnp.float32), batch["y"]).mean()
    # (to 1e-4, not exactly: under jit XLA:CPU may still take some of its passes from the float32 product)
    np.testing.assert_allclose(loss(language_model(model, compute_dtype_logits=True)), expected, rtol=1e-4)
    np.testing.assert_allclose(expected, reference, rtol=1e-2)  # bf16 rounding of the logits, no more

    def grads(task):  # the whole model's gradient through the loss's own backward pass
        return jax.jit(jax.grad(lambda p: task.loss_fn(p, {}, batch, jax.random.PRNGKey(1))[0]))(params)

    for got, want in zip(jax.tree.leaves(grads(language_model(model, compute_dtype_logits=True))),
                         jax.tree.leaves(grads(language_model(model)))):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6)
