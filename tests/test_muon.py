"""--optimizer muon (optax.contrib.muon, Adam for the leaves that are not matrices): it trains the GPT,
and its state checkpoints and resumes bit-identically."""

import numpy as np
import pytest

from helpers import records, write_corpus
from jaxdp.config import parse_args
from jaxdp.step.optim import make_optimizer
from jaxdp.train import train

TINY_GPT = ["--model", "gpt", "--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32",
            "--batch-size", "16", "--lr", "3e-3", "--no-progress", "--log-every", "1", "--optimizer", "muon"]


@pytest.mark.parametrize("on", ["hidden", "all"])
def test_muon_is_optax_contrib_muon_with_the_same_state(on):
    """make_optimizer("muon") batches Newton-Schulz by matrix shape (jaxdp/step/optim.py, `batched_muon`); its state is
    optax.contrib.muon's, leaf for leaf (so checkpoints of either resume with the other), and four
    updates of a 3-layer GPT's parameters agree with optax's to float32 rounding."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdp.models.builtin import GPT
    from jaxdp.step.optim import hidden_matrices

    params = GPT(vocab_size=64, seq_len=16, layers=3, d_model=32, heads=4).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))["params"]
    mine = make_optimizer("muon", 3e-3, muon_lr=0.02, muon_on=on)
    theirs = optax.contrib.muon(0.02, adam_learning_rate=3e-3,
                                muon_weight_dimension_numbers=hidden_matrices if on == "hidden" else None)
    ours, ref = mine.init(params), theirs.init(params)
    assert jax.tree.structure(ours) == jax.tree.structure(ref)
    for step in range(4):
        grads = jax.tree.map(lambda x: jax.random.normal(jax.random.PRNGKey(step), x.shape), params)
        a, ours = jax.jit(mine.update)(grads, ours, params)
        b, ref = jax.jit(theirs.update)(grads, ref, params)
        for x, y in zip(jax.tree.leaves((a, ours)), jax.tree.leaves((b, ref))):
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-7)


def test_batched_newton_schulz_is_each_matrix_s_own():
    """One batched Newton-Schulz over matrices of one shape equals optax's, one matrix at a time; a tall
    matrix is orthogonalised through its transpose, and a [d, 3, h, hd] kernel as three matrices."""
    import jax
    import jax.numpy as jnp
    from optax.contrib import MuonDimensionNumbers as Dims
    from optax.contrib._muon import orthogonalize_via_newton_schulz as one

    from jaxdp.step.optim import NS_COEFFS, orthogonalize

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    tree = {"wide": jax.random.normal(keys[0], (8, 24)), "tall": jax.random.normal(keys[1], (24, 8)),
            "qkv": jax.random.normal(keys[2], (8, 3, 2, 4)), "other": jax.random.normal(keys[3], (5, 6))}
    dims = {"wide": Dims(), "tall": Dims(), "qkv": Dims(reduction_axis=0, output_axis=(2, 3)), "other": Dims()}
    coeffs = jnp.asarray(NS_COEFFS)
    got = orthogonalize(tree, dims, coeffs)
    for name, x in tree.items():
        np.testing.assert_allclose(got[name], one(x, coeffs, 5, "frobenius", 1e-8, dims[name]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="name 3 matrices for 4 updates"):
        orthogonalize(tree, {**dims, "other": None}, coeffs)


def test_newton_schulz_cut_over_a_process_devices_is_every_devices_whole_batch():
    """Under `split_over` (the replicated step: every device holds the same update), each of 4 devices
    orthogonalises its part of each shape's batch (3 wide matrices, 1 alone, a [d, 3, h, hd] kernel's 3,
    each padded to a multiple of 4) and an all-gather gives every device all: the same on every device,
    and each matrix its own Newton-Schulz's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    from optax.contrib import MuonDimensionNumbers as Dims

    from jaxdp.mesh import make_mesh
    from jaxdp.step.optim import NS_COEFFS, orthogonalize, split_over

    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    tree = {**{f"wide{i}": jax.random.normal(keys[i], (8, 24)) for i in range(3)},
            "alone": jax.random.normal(keys[3], (5, 6)), "qkv": jax.random.normal(keys[4], (8, 3, 2, 4))}
    dims = {**{f"wide{i}": Dims() for i in range(3)}, "alone": Dims(),
            "qkv": Dims(reduction_axis=0, output_axis=(2, 3))}
    coeffs = jnp.asarray(NS_COEFFS)
    mesh = make_mesh(jax.devices()[:4])

    def body(tree):
        with split_over("data", 4):
            return jax.tree.map(lambda x: x[None], orthogonalize(tree, dims, coeffs))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("data"), check_vma=False)
    assert str(jax.make_jaxpr(mapped)(tree)).count("all_gather[") == 2  # the two batches of more than one matrix
    per_device = jax.jit(mapped)(tree)
    whole = orthogonalize(tree, dims, coeffs)
    for name, x in per_device.items():
        assert x.shape == (4, *tree[name].shape)
        for device in range(4):
            np.testing.assert_array_equal(x[device], x[0])  # every device the same update
        np.testing.assert_allclose(x[0], whole[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_muon_trains_the_gpt_and_resumes_bit_identically(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt")

    def run(*more):
        return train(parse_args([*TINY_GPT, "--dataset", str(corpus), *map(str, more)]))

    def losses(path):
        return [(r["step"], r["loss"]) for r in records(path) if "event" not in r]

    run("--steps", 6, "--metrics-file", tmp_path / "whole.jsonl")
    ckpt = ["--checkpoint-dir", tmp_path / "ckpt", "--save-every", 3, "--metrics-file", tmp_path / "cut.jsonl"]
    run(*ckpt, "--steps", 3)
    resumed = run(*ckpt, "--steps", 6)
    assert resumed.history[0]["step"] == 4
    whole = losses(tmp_path / "whole.jsonl")
    assert losses(tmp_path / "cut.jsonl") == whole and len(whole) == 6
    assert whole[-1][1] < whole[0][1]  # it trains


def test_hidden_matrices_are_the_gpt_s_kernels_but_the_head_and_embeddings():
    """--muon-on hidden: Muon for the MLP and attention kernels (q, k, v each its own matrix), Adam
    for the embeddings, the head, biases and LayerNorms."""
    import jax
    import jax.numpy as jnp
    from optax.contrib import MuonDimensionNumbers as Dims

    from jaxdp.models.builtin import GPT
    from jaxdp.step.optim import hidden_matrices

    params = GPT(vocab_size=32, seq_len=8, layers=1, d_model=16, heads=2).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    dims = hidden_matrices(params)
    assert dims["qkv_0"]["kernel"] == Dims(reduction_axis=0, output_axis=(2, 3))
    assert dims["proj_0"]["kernel"] == Dims(reduction_axis=(0, 1), output_axis=2)
    assert dims["fc_0"]["kernel"] == dims["fc_out_0"]["kernel"] == Dims()
    for path in (("embed", "embedding"), ("pos", "embedding"), ("head", "kernel"), ("fc_0", "bias"),
                 ("ln_attn_0", "scale")):
        assert dims[path[0]][path[1]] is None, path


def test_a_checkpoint_of_the_earlier_muon_resumes_with_it():
    """Checkpoints that record no --muon-on / --muon-lr were written when Muon took every 2-D leaf at
    --lr: a resume takes those values, and says so."""
    from jaxdp.checkpoint.resume import with_recorded_defaults

    config = parse_args(["--model", "gpt", "--dataset", "corpus.txt", "--optimizer", "muon"])
    assert (config.muon_on, config.muon_lr) == ("hidden", 0.02)
    resumed, said = with_recorded_defaults(config, {"model": "gpt", "optimizer": "muon", "head_bias": False})
    assert (resumed.muon_on, resumed.muon_lr) == ("all", 0.0) and said == ["--muon-on all", "--muon-lr 0.0"]
    adam = parse_args(["--model", "gpt", "--dataset", "corpus.txt"])  # (another optimizer never reads them)
    assert with_recorded_defaults(adam, {"model": "gpt", "head_bias": False})[1] == []
