"""Generation: the GPT's key/value cache gives the full forward pass's logits, cached and uncached
generation agree, sampling options are checked; and `python -m jaxdp.sample` end to end (with a
stand-in for `jaxdp.checkpoint.artifacts.load_model`, so no training run is needed).

Tiny models (2 layers, width 32): every test takes a few seconds on 2 cores, mostly compilation.
"""

from __future__ import annotations

import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from helpers import commands, jax_cache_env, readme_blocks, run_shell, sandbox, write_corpus
import jaxdp
from jaxdp import sample
from jaxdp.errors import InputError
from jaxdp.models.builtin import GPT
from jaxdp.models.generate import generate

TINY = dict(vocab_size=50, seq_len=16, layers=2, d_model=32, heads=4)


@pytest.fixture(scope="module")
def gpt():
    module = GPT(**TINY)
    params = module.init(jax.random.PRNGKey(0), np.zeros((1, 16), np.int32))["params"]
    return module, jax.device_get(params)


def ids(shape, vocab=50, seed=1):
    return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


# ---- the key/value cache -------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, dict(tie_embeddings=True, head_bias=False, max_positions=24, ln_epsilon=1e-5)],
                         ids=["jaxdp", "gpt2-options"])
def test_cached_logits_equal_the_full_forward_pass_at_every_position(options):
    module = GPT(**TINY, **options)
    tokens = ids((2, 16))
    params = module.init(jax.random.PRNGKey(0), tokens)["params"]
    full = np.asarray(module.apply({"params": params}, tokens))
    step = jax.jit(lambda p, t, c: module.apply({"params": p}, t, c))
    logits, cache = step(params, tokens[:, :5], module.init_cache(2))  # a prompt of 5, then one at a time
    pieces = [logits]
    for t in range(5, 16):
        logits, cache = step(params, tokens[:, t:t + 1], cache)
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)
    assert int(cache.length) == 16


def test_greedy_generation_with_the_cache_equals_full_recomputation(gpt):
    module, params = gpt
    prompt = ids((2, 5))
    # 20 new tokens: 12 fill the cache's 16 positions, the 8 after slide the window (full passes).
    cached = generate(module, params, prompt, 20, temperature=0)
    recomputed = generate(module, params, prompt, 20, temperature=0, use_cache=False)
    assert cached.shape == (2, 20) and cached.dtype == np.int32
    np.testing.assert_array_equal(cached, recomputed)


@pytest.mark.slow  # over 5 s on 2 cores
def test_any_causal_module_generates_by_full_forward_passes(gpt):
    """A user's module (not jaxdp's GPT: no cache) gives what the cached GPT gives."""
    module, params = gpt

    class MyLM(nn.Module):
        seq_len: int = 16

        @nn.compact
        def __call__(self, tokens):
            return GPT(**TINY, name="gpt")(tokens)

    prompt = ids((7,))
    mine = generate(MyLM(), {"gpt": params}, prompt, 6, temperature=0.7, top_k=5, seed=3)
    assert mine.shape == (6,)
    np.testing.assert_array_equal(mine, generate(module, params, prompt, 6, temperature=0.7, top_k=5, seed=3))


@pytest.mark.slow  # over 5 s on 2 cores
def test_sampling_follows_the_seed_and_top_k_1_is_greedy(gpt):
    module, params = gpt
    prompt = ids((3,))
    one = generate(module, params, prompt, 8, seed=5)
    np.testing.assert_array_equal(one, generate(module, params, prompt, 8, seed=5))
    assert any((generate(module, params, prompt, 8, seed=s) != one).any() for s in (6, 7, 8))
    np.testing.assert_array_equal(generate(module, params, prompt, 8, top_k=1, seed=9),
                                  generate(module, params, prompt, 8, temperature=0))


def test_a_prompt_longer_than_the_context_keeps_its_last_tokens(gpt):
    module, params = gpt
    prompt = ids((40,))
    np.testing.assert_array_equal(generate(module, params, prompt, 4, temperature=0),
                                  generate(module, params, prompt[-16:], 4, temperature=0))
    assert generate(module, params, prompt, 0).shape == (0,)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
    (dict(prompt_ids=[]), "prompt_ids must be a non-empty sequence"),
    (dict(prompt_ids=[3, 50]), "prompt_ids must be token ids between 0 and 49"),
    (dict(seed=-1), "seed must be an integer between 0 and"),
])
def test_bad_arguments_are_one_sentence(gpt, kwargs, needle):
    module, params = gpt
    arguments = dict(prompt_ids=[1, 2], max_new_tokens=3) | kwargs
    with pytest.raises(InputError, match=needle) as err:
        generate(module, params, **arguments)
    assert "\n" not in str(err.value)


# ---- python -m jaxdp.sample ---------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run directory with a config.toml, and a stand-in for jaxdp.checkpoint.artifacts.load_model that returns
    a tiny byte-level GPT (`write(dataset=..., tokenizer=...)` sets the config)."""
    module = GPT(**{**TINY, "vocab_size": 256})
    params = jax.device_get(module.init(jax.random.PRNGKey(0), np.zeros((1, 16), np.int32))["params"])
    monkeypatch.setattr(sample, "_load_model", lambda directory, step: (module, params))

    def write(**config):
        lines = [f'{key} = "{value}"' for key, value in config.items()]
        (tmp_path / "config.toml").write_text("\n".join(lines) + "\n")
        return str(tmp_path), module, params
    return write


def test_sample_continues_a_text_prompt_as_bytes(run_dir, capsys):
    directory, module, params = run_dir(dataset="/data/corpus.txt")
    code = sample.main(["--checkpoint-dir", directory, "--prompt", "hé", "--max-new-tokens", "6", "--temperature", "0"])
    out = capsys.readouterr()
    assert code == 0, out.err
    want = generate(module, params, list("hé".encode()), 6, temperature=0)
    assert out.out == bytes(want.tolist()).decode("utf-8", errors="replace") + "\n"


def test_a_run_on_token_ids_without_a_tokenizer_takes_prompt_ids(run_dir, capsys):
    directory, module, params = run_dir(dataset="/data/tokens.bin")
    assert sample.main(["--checkpoint-dir", directory, "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdp: error: --prompt: the run trained on token ids") and "no tokenizer" in err
    assert err.count("\n") == 1
    code = sample.main(["--checkpoint-dir", directory, "--prompt-ids", "5, 7,9", "--max-new-tokens", "3", "--top-k", "4"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.split() == [str(i) for i in generate(module, params, [5, 7, 9], 3, top_k=4)]


def test_a_run_with_a_tokenizer_encodes_with_it(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    encode, decode = sample.codec_for({"dataset": "/data/hamlet.txt", "tokenizer": str(tmp_path / "tok.json")})
    assert encode("to be or not to be") == [1, 2, 3, 4, 1, 2]
    assert decode([2, 3]) == "be or"
    encode, decode = sample.codec_for({"dataset": "/data/hamlet.txt"})  # no tokenizer: bytes
    assert encode("to") == [116, 111] and decode([116, 111, 300]) == "to\ufffd"


@pytest.mark.parametrize("argv, needle", [
    (["--prompt", "x", "--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--prompt", "x", "--top-k", "0"], "--top-k must be a positive integer"),
    (["--prompt", "x", "--prompt-ids", "1"], "not allowed with argument"),
    (["--prompt-ids", "1,a"], "--prompt-ids must be comma-separated token ids"),
    (["--prompt", ""], "--prompt is empty"),
])
def test_sample_refuses_bad_flags_in_one_line(run_dir, capsys, argv, needle):
    directory, _, _ = run_dir(dataset="/data/corpus.txt")
    assert sample.main(["--checkpoint-dir", directory, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdp: error: ") and needle in err and err.count("\n") == 1, err


def test_sample_needs_a_run_directory(tmp_path, capsys):
    assert sample.main(["--checkpoint-dir", str(tmp_path), "--prompt", "x"]) == 2
    assert "has no config.toml" in capsys.readouterr().err
    assert sample.main(["--checkpoint-dir", str(tmp_path / "nowhere"), "--prompt", "x", "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err  # --debug shows it


def test_load_model_keeps_the_runs_sequence_length(tmp_path, monkeypatch):
    """A GPT trained with --seq-len 24 comes back from load_model with seq_len 24 and a position
    table of 24 rows (a new user reported it forgotten; the generation context depends on it)."""
    from jaxdp import train

    monkeypatch.chdir(tmp_path)
    corpus = write_corpus(tmp_path / "corpus.txt", sentences=200)
    code = train.main(["--model", "gpt", "--dataset", str(corpus), "--layers", "1", "--d-model", "32", "--heads", "2",
                       "--seq-len", "24", "--batch-size", "8", "--steps", "1", "--eval-batches", "1", "--devices", "1",
                       "--no-progress", "--checkpoint-dir", "lm"])
    assert code == 0
    module, params = jaxdp.load_model("lm")
    assert module.seq_len == 24 and module.context == 24 and params["pos"]["embedding"].shape == (24, 32)


# ---- the commands of docs/models.md --------------------------------------------------------------


@pytest.mark.slow
def test_docs_sampling_commands(tmp_path):
    """docs/models.md "Sampling": train a tiny GPT on text, sample from it (CLI and Python)."""
    if "load_model" not in jaxdp.__all__:
        pytest.skip("jaxdp.load_model (jaxdp/checkpoint/artifacts.py) is not in this tree yet")
    env = sandbox(tmp_path)
    for block in readme_blocks("tests/test_generate.py::test_docs_sampling_commands"):
        if block.lang == "python":
            proc = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env={**env, **jax_cache_env()},
                                  capture_output=True, text=True, timeout=240)  # (a rerun loads generate's program)
            assert proc.returncode == 0 and proc.stdout.strip(), proc.stdout + proc.stderr
            continue
        for command in commands(block):
            proc = run_shell(command, tmp_path, env)
            if "jaxdp.sample" in command:
                assert len(proc.stdout) > 10, proc.stdout + proc.stderr  # about 100 bytes of text
