"""Hugging Face GPT-2 in and out: a tiny random `transformers.GPT2LMHeadModel` read into jaxdp's
GPT gives torch's logits; jaxdp's GPT written out loads in transformers with the same logits; what
GPT-2 cannot express is refused; --init-from's checks; `python -m jaxdp.export`.

transformers and torch are imported once (by the `torch_gpt2` fixture) and only by the tests that
compare with them; without them those tests skip and the rest still run.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import jax
import numpy as np
import pytest

from helpers import commands, readme_blocks, run_shell, sandbox
import jaxdp
from jaxdp import export
from jaxdp.config import ConfigError, parse_args
from jaxdp.errors import InputError
from jaxdp.models import hf
from jaxdp.models.builtin import GPT

SIZES = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=64, bos_token_id=0, eos_token_id=0)
IDS = np.random.RandomState(0).randint(0, 300, (2, 20))
NEEDS_TORCH = "needs torch and transformers: the test extra (pip install -e '.[test]'); test-core leaves them out"


def torch_logits(model, ids=IDS):
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def load_torch(directory):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(directory).eval()


def save_gpt2(directory, **config):
    """A random tiny GPT-2 saved as transformers saves it; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**SIZES, **config})).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def skip_without_torch():
    for name in ("torch", "transformers"):
        pytest.importorskip(name, reason=NEEDS_TORCH)


@pytest.fixture(scope="module")
def torch_gpt2(tmp_path_factory):
    skip_without_torch()
    directory = tmp_path_factory.mktemp("gpt2")
    return directory, save_gpt2(directory)


def jaxdp_logits(kwargs, params, ids=IDS):
    return np.asarray(jax.jit(GPT(**kwargs).apply)({"params": params}, ids))


# ---- in ------------------------------------------------------------------------------------------


def test_read_gpt2_gives_torchs_logits(torch_gpt2):
    directory, model = torch_gpt2
    kwargs, params = hf.read_gpt2(str(directory))
    assert kwargs == dict(vocab_size=300, seq_len=64, layers=2, d_model=32, heads=4, max_positions=64, ln_epsilon=1e-5,
                          tie_embeddings=True, head_bias=False, gelu_approximate=True)
    shapes = jax.eval_shape(GPT(**kwargs).init, jax.random.PRNGKey(0), IDS)["params"]
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
    np.testing.assert_allclose(jaxdp_logits(kwargs, params), torch_logits(model), atol=1e-4, rtol=0)


def test_read_gpt2_without_the_transformer_prefix_untied_and_exact_gelu(torch_gpt2, tmp_path):
    """The hub's own gpt2 files name tensors without "transformer."; an untied GPT-2 has lm_head.weight;
    activation "gelu" is the exact GELU."""
    from safetensors.numpy import load_file, save_file

    model = save_gpt2(tmp_path / "untied", tie_word_embeddings=False, activation_function="gelu")
    tensors = load_file(tmp_path / "untied" / "model.safetensors")
    assert "lm_head.weight" in tensors
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, tmp_path / "untied" / "model.safetensors",
              metadata={"format": "pt"})
    kwargs, params = hf.read_gpt2(str(tmp_path / "untied"))
    assert (kwargs["tie_embeddings"], kwargs["gelu_approximate"], sorted(params["head"])) == (False, False, ["kernel"])
    np.testing.assert_allclose(jaxdp_logits(kwargs, params), torch_logits(model), atol=1e-4, rtol=0)


# ---- out -----------------------------------------------------------------------------------------


def test_write_gpt2_loads_in_transformers_with_the_same_logits(torch_gpt2, tmp_path):
    directory, model = torch_gpt2
    kwargs, params = hf.read_gpt2(str(directory))
    hf.write_gpt2(GPT(**kwargs), params, str(tmp_path / "out"))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    np.testing.assert_allclose(torch_logits(load_torch(tmp_path / "out")), jaxdp_logits(kwargs, params), atol=1e-4,
                               rtol=0)
    again, params_again = hf.read_gpt2(str(tmp_path / "out"))  # and back: the same numbers
    assert again == kwargs
    jax.tree.map(np.testing.assert_array_equal, params_again, params)


@pytest.mark.slow  # over 5 s on 2 cores
def test_an_untied_jaxdp_gpt_round_trips_through_transformers(torch_gpt2, tmp_path):
    """jaxdp's own GPT (untied head, flax's epsilon, no max_positions): its head bias is zero, so
    GPT-2 can express it; a nonzero bias cannot be."""
    kwargs = dict(vocab_size=300, seq_len=20, layers=2, d_model=32, heads=4)
    params = jax.device_get(GPT(**kwargs).init(jax.random.PRNGKey(0), IDS)["params"])
    assert not params["head"]["bias"].any()  # flax initialises biases to zero
    hf.write_gpt2(GPT(**kwargs), params, str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["layer_norm_epsilon"], config["n_positions"]) == (False, 1e-6, 20)
    np.testing.assert_allclose(torch_logits(load_torch(tmp_path / "out")), jaxdp_logits(kwargs, params), atol=1e-4,
                               rtol=0)

    params["head"]["bias"] = params["head"]["bias"] + 0.5
    with pytest.raises(InputError, match="has a bias .*which GPT-2 cannot express"):
        hf.write_gpt2(GPT(**kwargs), params, str(tmp_path / "biased"))
    with pytest.raises(InputError, match="only jaxdp's built-in GPT"):
        hf.write_gpt2(object(), params, str(tmp_path / "other"))


# ---- refusals ------------------------------------------------------------------------------------


def fake_gpt2(tmp_path, weights=True, **config):
    """A GPT-2 directory with config.json (GPT-2 defaults at SIZES, changed by `config`) and, from a
    real tiny model's parameters written by jaxdp, model.safetensors."""
    directory = tmp_path / "fake"
    kwargs = dict(vocab_size=300, seq_len=64, layers=2, d_model=32, heads=4, max_positions=64, ln_epsilon=1e-5,
                  tie_embeddings=True, head_bias=False)
    params = jax.device_get(GPT(**kwargs).init(jax.random.PRNGKey(0), IDS[:, :4])["params"])
    hf.write_gpt2(GPT(**kwargs), params, str(directory))
    if not weights:
        (directory / "model.safetensors").unlink()
    written = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**written, **config}))
    return str(directory)


@pytest.mark.parametrize("config, needle", [
    (dict(model_type="llama"), "model_type is 'llama', not 'gpt2'"),
    (dict(activation_function="relu"), "activation_function is 'relu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx is True"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn is True"),
    (dict(n_inner=100), "n_inner is 100, not 4 \\* n_embd = 128"),
    (dict(n_embd=64), "tensor 'wte.weight' has shape \\[300, 32\\], but config.json's sizes give \\[300, 64\\]"),
    (dict(n_layer=3), "has no tensor 'h.2.ln_1.weight'"),
])
def test_read_gpt2_refuses_what_jaxdp_cannot_express(tmp_path, config, needle):
    with pytest.raises(InputError, match=needle) as err:
        hf.read_gpt2(fake_gpt2(tmp_path, **config))
    assert "\n" not in str(err.value)


def test_read_gpt2_refuses_missing_files(tmp_path):
    with pytest.raises(InputError, match="is not a directory"):
        hf.read_gpt2(str(tmp_path / "nowhere"))
    with pytest.raises(InputError, match="has no config.json"):
        hf.read_gpt2(str(tmp_path))
    with pytest.raises(InputError, match="has no model.safetensors"):
        hf.read_gpt2(fake_gpt2(tmp_path, weights=False))


# ---- --init-from ---------------------------------------------------------------------------------


def test_init_from_sizes_the_model_by_the_directory_and_the_run(tmp_path):
    directory = fake_gpt2(tmp_path)
    text = str(tmp_path / "corpus.txt")
    config = parse_args(["--model", "gpt", "--dataset", text, "--init-from", directory, "--seq-len", "32",
                         "--layers", "9"])
    module, params = hf.init_from(directory, config)
    assert (module.layers, module.d_model, module.seq_len, module.max_positions, module.context) == (2, 32, 32, 64, 64)
    assert params["pos"]["embedding"].shape == (64, 32)
    with pytest.raises(ConfigError, match="--seq-len=128 is longer than --init-from=.* \\(n_positions=64\\)"):
        hf.init_from(directory, config.replace(seq_len=128))
    assert hf.build_gpt(config, 256) == module  # the registry's factory signature, --init-from aware
    assert hf.build_gpt(config.replace(init_from=None), 256).layers == 9
    with pytest.raises(InputError, match="token ids go up to 399"):
        hf.build_gpt(config, 400)
    hf.check_vocab(256, 300)
    with pytest.raises(InputError, match="token ids go up to 399, but the --init-from model's vocabulary has 300"):
        hf.check_vocab(400, 300)


@pytest.mark.parametrize("argv, needle", [
    (["--model", "mlp", "--init-from", "."], "--init-from starts a --model gpt"),
    (["--model", "gpt", "--dataset", "a.txt", "--init-from", "/no/such/dir"], "is not a directory"),
    (["--model", "gpt", "--dataset", "a.txt", "--init-from", "."], "has no config.json"),
])
def test_init_from_flag_is_checked(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_args(argv)


def nan_weights(tmp_path):
    """fake_gpt2 with one NaN in a weight (as a diverged model's save would hold)."""
    from safetensors.numpy import load_file, save_file

    directory = fake_gpt2(tmp_path)
    tensors = load_file(f"{directory}/model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"][3, 5] = np.nan
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("change, words", [
    (dict(n_layer="2"), "config.json: n_layer is \"2\", not a positive integer"),
    (dict(n_positions=-1), "config.json: n_positions is -1, not a positive integer"),
    (dict(n_head=0), "config.json: n_head is 0, not a positive integer"),
    (dict(layer_norm_epsilon="tiny"), "config.json: layer_norm_epsilon is \"tiny\", not a positive number"),
    (dict(tie_word_embeddings="false"), "config.json: tie_word_embeddings is \"false\", not true or false"),
    (dict(activation_function=["gelu"]), "config.json: activation_function is [\"gelu\"], not a string"),
    (dict(model_type="llama"), "jaxdp's GPT cannot express this model: model_type is 'llama'"),
    ("nan", "tensor 'h.1.mlp.c_fc.weight' holds 1 NaN or infinite value: the weights are damaged"),
    ("no weights", "has no model.safetensors"),
])
def test_init_from_errors_name_the_flag_and_what_is_wrong_with_the_file(tmp_path, monkeypatch, capsys, change, words):
    """Each was a traceback (exit 1), "training diverged ... lower --lr", a --seq-len hint of -1, or named
    --checkpoint-dir: through the CLI, one line naming --init-from, exit 2."""
    from jaxdp import train

    directory = nan_weights(tmp_path) if change == "nan" else fake_gpt2(tmp_path, weights=change != "no weights") \
        if isinstance(change, str) else fake_gpt2(tmp_path, **change)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_bytes(b"some text to train on " * 40)
    code = train.main(["--model", "gpt", "--dataset", "corpus.txt", "--init-from", directory, "--seq-len", "16",
                       "--batch-size", "8", "--steps", "2", "--no-progress", "--checkpoint-dir", "ckpt"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("jaxdp: error: --init-from: "), err
    assert words in err and "--checkpoint-dir" not in err, err


# ---- python -m jaxdp.export ----------------------------------------------------------------------


@pytest.mark.slow  # a tiny GPT trained, exported and loaded in torch: about 20 s on 2 cores
def test_docs_a_gpt_trained_from_scratch_exports_and_transformers_agrees(tmp_path, monkeypatch, capsys):
    """docs/models.md's from-scratch block, run in this process: `--model gpt` trains, the export
    loads in transformers, and its logits are jaxdp's to 1e-4. The export refused every such GPT
    ("output layer has a bias"): the built-in GPT trains without one now, and records so."""
    import contextlib
    import io
    import os
    import shlex

    skip_without_torch()
    from jaxdp import train

    (block,) = readme_blocks("tests/test_hf.py::test_docs_a_gpt_trained_from_scratch_exports_and_transformers_agrees")
    env = sandbox(tmp_path)
    monkeypatch.chdir(tmp_path)
    tools = {"jaxdp.train": train.main, "jaxdp.export": export.main}
    for command in commands(block):
        words = shlex.split(command)
        if words[:2] == ["python", "-m"]:
            assert tools[words[2]](words[3:]) == 0, capsys.readouterr().err
        elif words[:2] == ["python", "-c"]:
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                exec(words[2], {})
        else:
            run_shell(command, tmp_path, env)
    assert "head-bias = false" in (tmp_path / "scratch" / "config.toml").read_text()
    module, params = jaxdp.load_model("scratch")
    assert module.head_bias is False and "bias" not in params["head"] and not module.tie_embeddings
    ids = np.frombuffer(b"The trainer averages gradients over devices", np.uint8)[None, :40].astype(np.int32)
    torch_model = load_torch(tmp_path / "scratch-hf")
    assert int(printed.getvalue()) == torch_model.num_parameters() == sum(x.size for x in jax.tree.leaves(params))
    np.testing.assert_allclose(torch_logits(torch_model, ids), np.asarray(module.apply({"params": params}, ids)),
                               atol=1e-4, rtol=0)
    assert sorted(os.listdir("scratch-hf")) == ["config.json", "model.safetensors", "tokenizer.json"]
    # the byte-level run ships its tokenizer: transformers encodes any text to its UTF-8 bytes, and back
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("scratch-hf")
    text = "The trainer's gradients: e\u0301t\u00e9, \u00fcber, \u4e2d\u6587, \U0001f642\n\tend  "
    assert tokenizer.encode(text) == list(text.encode()) and tokenizer.decode(list(text.encode())) == text


def test_a_gpt_checkpoint_of_an_older_jaxdp_loads_with_its_head_bias():
    """The 7a73a05 fixture's GPT (config.toml without head-bias; its head has a bias) loads as it was
    made: the bias is part of its logits (the resume is tests/test_checkpoint_compat.py's gpt mode)."""
    from pathlib import Path

    fixture = Path(__file__).resolve().parent / "fixtures" / "checkpoints_7a73a05" / "gpt" / "ckpt"
    module, params = jaxdp.load_model(fixture)
    assert module.head_bias is True and params["head"]["bias"].shape == (module.vocab_size,)
    ids = np.arange(8, dtype=np.int32)[None]
    without = {**params, "head": {"kernel": params["head"]["kernel"]}}
    no_bias = GPT(**{**{f: getattr(module, f) for f in ("vocab_size", "seq_len", "layers", "d_model", "heads")},
                     "head_bias": False})
    np.testing.assert_allclose(np.asarray(module.apply({"params": params}, ids)),
                               np.asarray(no_bias.apply({"params": without}, ids)) + params["head"]["bias"], atol=1e-5)


def test_export_writes_a_directory_transformers_loads(torch_gpt2, tmp_path, monkeypatch, capsys):
    directory, model = torch_gpt2
    kwargs, params = hf.read_gpt2(str(directory))
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text("{}")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(f'dataset = "/data/x.txt"\ntokenizer = "{tokenizer}"\n')
    monkeypatch.setattr(export, "_load_model", lambda d, step: (GPT(**kwargs), params))  # a stand-in for artifacts
    assert export.main(["--checkpoint-dir", str(run), "--format", "hf", str(tmp_path / "out")]) == 0, \
        capsys.readouterr().err
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}"
    np.testing.assert_allclose(torch_logits(load_torch(tmp_path / "out")), torch_logits(model), atol=1e-4, rtol=0)


def test_export_refuses_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(export, "_load_model", lambda d, step: (object(), {}))
    assert export.main(["--checkpoint-dir", str(tmp_path), "--format", "hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxdp: error: the model of ") and "only jaxdp's built-in GPT" in err and err.count("\n") == 1
    assert export.main(["--checkpoint-dir", str(tmp_path), "--format", "onnx", "out"]) == 2
    assert "invalid choice: 'onnx'" in capsys.readouterr().err
    shutil.copyfile(__file__, tmp_path / "afile")
    assert export.main(["--checkpoint-dir", str(tmp_path), "--format", "hf", str(tmp_path / "afile")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["022", "027"])
def test_export_writes_files_as_open_would_under_the_umask(tmp_path, monkeypatch, capsys, umask, mode):
    """Every file of an export is readable as far as the umask allows (transformers users share
    them), as a plain open() makes it: not only by its owner."""
    kwargs = dict(vocab_size=256, seq_len=8, layers=1, d_model=16, heads=2, head_bias=False)
    params = jax.device_get(GPT(**kwargs).init(jax.random.PRNGKey(0), IDS[:, :8] % 256)["params"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('dataset = "/data/x.txt"\n')  # bytes: the byte-level tokenizer.json too
    monkeypatch.setattr(export, "_load_model", lambda d, step: (GPT(**kwargs), params))
    previous = os.umask(umask)
    try:
        assert export.main(["--checkpoint-dir", str(run), "--format", "hf", str(tmp_path / "out")]) == 0, \
            capsys.readouterr().err
    finally:
        os.umask(previous)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "out").iterdir()}
    assert modes == dict.fromkeys(["config.json", "model.safetensors", "tokenizer.json"], oct(mode))


# ---- the commands of docs/models.md --------------------------------------------------------------


@pytest.mark.slow
def test_docs_init_from_and_export_commands(tmp_path):
    """docs/models.md "Hugging Face GPT-2 in and out": fine-tune a tiny local GPT-2 with --init-from,
    export it, load it in transformers."""
    skip_without_torch()
    if "load_model" not in jaxdp.__all__:
        pytest.skip("jaxdp.load_model (jaxdp/checkpoint/artifacts.py) is not in this tree yet")
    env = sandbox(tmp_path)
    (block,) = readme_blocks("tests/test_hf.py::test_docs_init_from_and_export_commands")
    for command in commands(block):
        proc = run_shell(command, tmp_path, env)
    printed = int(proc.stdout.split()[-1])  # the exported model's parameter count, as transformers reads it
    kwargs, params = hf.read_gpt2(str(tmp_path / "tiny-gpt2"))
    assert printed == sum(x.size for x in jax.tree.leaves(params))
    tuned, tuned_params = hf.read_gpt2(str(tmp_path / "tiny-ft-hf"))
    assert tuned == kwargs and not np.array_equal(tuned_params["embed"]["embedding"], params["embed"]["embedding"])
