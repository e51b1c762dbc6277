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
