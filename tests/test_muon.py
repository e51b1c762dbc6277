"""--optimizer muon (optax.contrib.muon, Adam for the leaves that are not matrices): it trains the GPT,
and its state checkpoints and resumes bit-identically."""

import pytest

from helpers import records, write_corpus
from jaxdp.config import parse_args
from jaxdp.step.optim import make_optimizer
from jaxdp.train import train

TINY_GPT = ["--model", "gpt", "--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32",
            "--batch-size", "16", "--lr", "3e-3", "--no-progress", "--log-every", "1", "--optimizer", "muon"]


def test_muon_is_optax_contrib_muon():
    import jax.numpy as jnp
    import optax

    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    grads = {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.arange(3.0)}
    mine, theirs = make_optimizer("muon", 0.01), optax.contrib.muon(0.01)
    ours, ref = mine.update(grads, mine.init(params), params)[0], theirs.update(grads, theirs.init(params), params)[0]
    assert all((ours[k] == ref[k]).all() for k in params)


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
