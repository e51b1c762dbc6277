"""Your own model through the whole machinery (`--model MODULE:ATTR`), `jaxdp.fit` as a library
call, and what comes out of a run (`load_params`, `load_model`, `pad_batch` for evaluation).

The runs call `jaxdp.train.train` in this process (8 simulated devices, a few seconds each); the
user's modules are real files in a temporary working directory, imported as the CLI imports them.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import records
from jaxdp.config import parse_args
from jaxdp.train import main, train

FAST = ["--log-every", "1", "--no-progress"]

USER_MODELS = '''
import flax.linen as nn
from flax import nnx
import jax.numpy as jnp

from jaxdp.models.builtin import MLP


class Bigram{tag}(nn.Module):
    """An LM that sees one token: enough for a periodic text whose characters are all different."""
    vocab_size: int = 256

    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(self.vocab_size)(nn.Embed(self.vocab_size, 32)(tokens))


class Classifier{tag}(nn.Module):
    """BatchNorm (model state) and dropout (the "dropout" rng, train=True/False)."""
    num_classes: int = 10
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(64)(x.reshape((x.shape[0], -1)))
        x = nn.BatchNorm(use_running_average=not train, axis_name=self.axis_name)(x)
        x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
        return nn.Dense(self.num_classes)(x)


class Nnx{tag}(nnx.Module):
    def __init__(self, num_classes: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.out = nnx.Linear(32, num_classes, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x.reshape((x.shape[0], -1)))))


class NnxDropout{tag}(nnx.Module):
    """Dropout the usual nnx way: nnx.Dropout(rate, rngs=rngs), called with deterministic=not train."""
    RATE = 0.5

    def __init__(self, num_classes: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.drop = nnx.Dropout(self.RATE, rngs=rngs)
        self.out = nnx.Linear(32, num_classes, rngs=rngs)

    def __call__(self, x, train: bool = False):
        return self.out(self.drop(nnx.relu(self.hidden(x.reshape((x.shape[0], -1)))), deterministic=not train))


class NnxNoDropout{tag}(NnxDropout{tag}):
    RATE = 0.0


def mlp{tag}(config, num_outputs):
    return MLP(num_classes=num_outputs)


class Flat{tag}(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x.reshape((x.shape[0], -1)))[:, 0]
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch, request):
    """A user's models file in the working directory; its module name is unique per test."""
    name = f"my_models_{request.node.name.split('[')[0][5:]}"
    (tmp_path / f"{name}.py").write_text(USER_MODELS.format(tag=""))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def losses(path):
    return [r["loss"] for r in records(path) if "event" not in r]


def test_own_lm_trains_resumes_exactly_and_samples_the_period(user_models, tmp_path, capsys):
    text = tmp_path / "periodic.txt"
    text.write_bytes(b"abcdefgh" * 400)
    flags = [*FAST, "--model", f"{user_models}:Bigram", "--dataset", str(text), "--seq-len", "16",
             "--batch-size", "16", "--lr", "0.03"]
    whole = train(parse_args([*flags, "--steps", "40", "--metrics-file", str(tmp_path / "whole.jsonl")]))
    ckpt = tmp_path / "ckpt"
    train(parse_args([*flags, "--steps", "20", "--checkpoint-dir", str(ckpt)]))
    resumed = train(parse_args([*flags, "--steps", "40", "--checkpoint-dir", str(ckpt),
                                "--metrics-file", str(tmp_path / "resumed.jsonl")]))
    capsys.readouterr()
    assert losses(tmp_path / "resumed.jsonl") == losses(tmp_path / "whole.jsonl")[20:]
    assert resumed.summary["eval_loss"] == whole.summary["eval_loss"] < 0.1

    module, params = jaxdp.load_model(ckpt)
    jax.tree.map(np.testing.assert_array_equal, params, jax.device_get(resumed.state.params))
    from jaxdp import sample

    # Greedy sampling from the command line continues the period exactly (the Bigram has no
    # seq_len field: the run's --seq-len is its context).
    assert sample.main(["--checkpoint-dir", str(ckpt), "--prompt", "cde", "--max-new-tokens", "12",
                        "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() == "fghabcdefgha"


@pytest.mark.slow  # over 4 s on 2 cores
def test_a_rerun_resume_and_load_from_another_directory_find_the_users_module(user_models, tmp_path, capsys):
    """config.toml and the checkpoint record where MODULE:ATTR was imported from (--model-path, by
    default the current directory): `--config DIR/config.toml` resumes, and `load_model` loads, from
    another directory, where `my_models` is not importable."""
    ckpt = tmp_path / "ckpt"
    assert main([*FAST, "--model", f"{user_models}:Classifier", "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    capsys.readouterr()
    assert f'model-path = "{tmp_path}"' in (ckpt / "config.toml").read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = ("import sys, jaxdp; from jaxdp.train import main; "
              f"assert main(['--config', {str(ckpt / 'config.toml')!r}, '--steps', '4', '--no-progress']) == 0; "
              f"module, params = jaxdp.load_model({str(ckpt)!r}); print(type(module).__name__)")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.split()[-1] == "Classifier", done.stderr[-3000:]
    assert f"resumed from step 2 ({ckpt})" in done.stderr and (ckpt / "4").is_dir(), done.stderr
    # a --model-path that does not hold the module: one line naming both places searched
    assert main([*FAST, "--model", "no_such_models:Net", "--model-path", str(elsewhere), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"no module named 'no_such_models' in --model-path ({elsewhere}), the current directory" in err, err
    assert main([*FAST, "--model-path", str(elsewhere), "--steps", "1"]) == 2
    assert "--model=mlp is built in: drop --model-path" in capsys.readouterr().err


@pytest.mark.slow  # over 5 s on 2 cores
def test_own_classifier_with_batchnorm_and_dropout_through_ring_and_powersgd(user_models, tmp_path):
    result = train(parse_args([*FAST, "--model", f"{user_models}:Classifier", "--strategy", "ring",
                               "--compression", "powersgd:2", "--steps", "30", "--lr", "0.01",
                               "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file", str(tmp_path / "m.jsonl")]))
    history = losses(tmp_path / "m.jsonl")
    assert history[-1] < history[0] / 2 and result.summary["eval_accuracy"] > 0.8
    assert "batch_stats" in result.state.model_state  # BatchNorm's statistics trained as model state
    module, variables = jaxdp.load_variables(tmp_path / "ckpt")
    x = np.zeros((4, 8, 8), np.float32)
    assert module.apply(variables, x, train=False).shape == (4, 10)


def test_a_factory_trains_exactly_like_the_built_in_model(user_models, tmp_path):
    for model, name in ((f"{user_models}:mlp", "own"), ("mlp", "builtin")):
        train(parse_args([*FAST, "--model", model, "--steps", "8", "--metrics-file", str(tmp_path / f"{name}.jsonl")]))
    assert losses(tmp_path / "own.jsonl") == losses(tmp_path / "builtin.jsonl")


@pytest.mark.slow  # over 5 s on 2 cores
def test_an_nnx_module_trains_and_loads(user_models, tmp_path):
    result = train(parse_args([*FAST, "--model", f"{user_models}:Nnx", "--steps", "20", "--lr", "0.01",
                               "--checkpoint-dir", str(tmp_path / "ckpt")]))
    assert result.summary["eval_accuracy"] > 0.7
    module, params = jaxdp.load_model(tmp_path / "ckpt")
    x = np.zeros((3, 8, 8), np.float32)
    np.testing.assert_allclose(module.apply({"params": params}, x),
                               module.apply({"params": jax.device_get(result.state.params)}, x))


def test_an_nnx_module_with_dropout_trains_through_the_cli_deterministically_per_seed(user_models, tmp_path, capsys):
    """nnx.Dropout(rate, rngs=rngs) takes the "dropout" stream when the module is made: it was a KeyError
    (exit 1). Two runs of one seed log the same numbers; a rate of 0 (the same initial parameters: the
    dropout stream is not the params stream) logs another loss at the first step: the units were dropped."""
    def run(attr, name):
        assert main([*FAST, "--model", f"{user_models}:{attr}", "--steps", "6", "--lr", "0.01",
                     "--eval-every", "3", "--metrics-file", str(tmp_path / f"{name}.jsonl")]) == 0, capsys.readouterr().err
        return [r for r in records(tmp_path / f"{name}.jsonl") if "event" not in r]

    first, again = run("NnxDropout", "first"), run("NnxDropout", "again")
    assert [r["loss"] for r in first] == [r["loss"] for r in again] and len(first) >= 6
    assert [r.get("eval_loss") for r in first] == [r.get("eval_loss") for r in again]
    off = run("NnxNoDropout", "off")
    assert first[0]["loss"] != off[0]["loss"]  # the first step's forward pass dropped units


@pytest.mark.parametrize("attr, needle", [
    ("Flat", "returned (1,) for an input of shape (1, 8, 8, 1); the dataset needs logits [batch, classes] = (1, 10)"),
    ("Missing", "has no attribute 'Missing'"),
])
def test_a_wrong_model_is_one_line(user_models, tmp_path, capsys, attr, needle):
    assert main([*FAST, "--model", f"{user_models}:{attr}", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_models.py").write_text("import flax.linen as nn\nraise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    assert main([*FAST, "--model", "broken_models:Net", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "importing broken_models raised RuntimeError: no GPU here" in err[0], err


# -- load_params -------------------------------------------------------------------------------


@pytest.mark.slow  # over 5 s on 2 cores
def test_load_params_is_the_run_s_params_in_every_mode(tmp_path):
    """Plain, ZeRO-1 and local steps: what load_params reads is the final state's params exactly, and
    ZeRO-1's equal the plain run's."""
    loaded = {}
    for name, flags in {"plain": ["--strategy", "ring"], "zero1": ["--strategy", "ring", "--shard-optimizer"],
                        "local": ["--sync-every", "4"]}.items():
        result = train(parse_args([*FAST, *flags, "--steps", "8", "--checkpoint-dir", str(tmp_path / name)]))
        loaded[name] = jaxdp.load_params(tmp_path / name)
        jax.tree.map(np.testing.assert_array_equal, loaded[name], jax.device_get(result.state.params))
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(loaded[name]))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), loaded["zero1"], loaded["plain"])


def test_load_params_of_a_notebook_checkpoint_with_any_optimizer(tmp_path, devices):
    mesh = jaxdp.make_mesh()
    params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))  # not the CLI's chain: no template needed
    state = jaxdp.init_state(params, tx, mesh)
    step = jaxdp.make_train_step(lambda p, batch: jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2), tx, mesh)
    state, _ = step(state, jaxdp.shard_batch({"x": np.ones((8, 3), np.float32)}, mesh))
    with jaxdp.Checkpointer(str(tmp_path / "nb")) as ckpt:
        ckpt.save(state)
    jax.tree.map(np.testing.assert_array_equal, jaxdp.load_params(tmp_path / "nb"), jax.device_get(state.params))
    with pytest.raises(jaxdp.InputError, match="written by a notebook"):
        jaxdp.load_model(tmp_path / "nb")
    with pytest.raises(jaxdp.InputError, match="has no checkpoint of step 7; it has steps 1"):
        jaxdp.load_params(tmp_path / "nb", step=7)
    with pytest.raises(jaxdp.InputError, match="does not exist"):
        jaxdp.load_params(tmp_path / "nowhere")


def test_load_params_refuses_a_damaged_array(tmp_path):
    train(parse_args([*FAST, "--steps", "2", "--checkpoint-dir", str(tmp_path / "c")]))
    sums = tmp_path / "c" / "2" / "jaxdp_checksums.json"
    text = sums.read_text()
    key = next(line for line in text.splitlines() if "params/Dense_0/kernel" in line)
    sums.write_text(text.replace(key, key.split(":")[0] + ': "' + "0" * 64 + '",'))
    with pytest.raises(jaxdp.InputError, match="does not match the checksum"):
        jaxdp.load_params(tmp_path / "c")


# -- jaxdp.fit ---------------------------------------------------------------------------------


def test_fit_with_a_notebook_loss_equals_the_cli(tmp_path, devices):
    """A notebook user's plain loss_fn, data function and eval through jaxdp.fit: the CLI's per-step
    losses and held-out metrics."""
    from jaxdp.data import datasets as data
    from jaxdp.models import builtin as models

    cli = train(parse_args([*FAST, "--strategy", "ring", "--steps", "12", "--compression", "bf16",
                            "--metrics-file", str(tmp_path / "cli.jsonl")]))
    dataset = data.load_dataset("digits")
    model = models.MLP(num_classes=10)
    params = model.init(jax.random.PRNGKey(0), dataset.example())["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

    def eval_fn(params, model_state, batch):
        logits = model.apply({"params": params}, batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return {"loss": jnp.sum(losses * batch["mask"]),
                "accuracy": jnp.sum((jnp.argmax(logits, -1) == batch["y"]) * batch["mask"]),
                "count": jnp.sum(batch["mask"])}

    held_out = [{"x": dataset.x_test[i:i + 100], "y": dataset.y_test[i:i + 100]}  # 100 rows: padded to 104
                for i in range(0, len(dataset.x_test), 100)]
    result = jaxdp.fit(loss_fn, params, optax.adam(1e-3), lambda step: dataset.train_batch(128, step, 0), steps=12,
                       strategy="ring", compression="bf16", eval_fn=eval_fn, eval_data=held_out, log_every=1,
                       progress=False, metrics_file=str(tmp_path / "fit.jsonl"))
    np.testing.assert_allclose(losses(tmp_path / "fit.jsonl"), losses(tmp_path / "cli.jsonl"), rtol=0, atol=1e-6)
    np.testing.assert_allclose(result.summary["eval_loss"], cli.summary["eval_loss"], atol=1e-6)
    np.testing.assert_allclose(result.summary["eval_accuracy"], cli.summary["eval_accuracy"], atol=1e-9)


@pytest.mark.slow  # over 5 s on 2 cores
def test_docs_fit_example(devices, capsys):
    """docs/models.md's jaxdp.fit example, as shown, in this process."""
    from helpers import readme_blocks

    fit_block, eval_block = readme_blocks("tests/test_usermodel.py::test_docs_fit_example")
    scope = {}
    exec(compile(fit_block.code, "docs/models.md", "exec"), scope)  # noqa: S102 - the page's own code
    assert scope["result"].summary["eval_accuracy"] > 0.85 and len(scope["result"].history) == 5
    exec(compile(eval_block.code, "docs/models.md", "exec"), scope)  # noqa: S102
    dataset = scope["dataset"]
    assert scope["totals"]["count"] == len(dataset.x_test)
    np.testing.assert_allclose(scope["totals"]["accuracy"] / scope["totals"]["count"],
                               scope["result"].summary["eval_accuracy"], rtol=1e-6)


def test_pad_batch_evaluates_a_short_batch_exactly(devices):
    mesh = jaxdp.make_mesh()
    x = np.random.default_rng(0).normal(size=(13, 3)).astype(np.float32)
    params = {"w": np.ones(3, np.float32)}
    state = jaxdp.init_state(params, optax.sgd(0.1), mesh)
    eval_step = jaxdp.make_eval_step(lambda p, _, b: {"sum": jnp.sum((b["x"] @ p["w"]) * b["mask"]),
                                                       "count": jnp.sum(b["mask"])}, mesh)
    padded = jaxdp.pad_batch({"x": x}, mesh)
    assert padded["x"].shape == (16, 3) and padded["mask"].tolist() == [1.0] * 13 + [0.0] * 3
    sums = jax.device_get(eval_step(state, jaxdp.shard_batch(padded, mesh)))
    assert sums["count"] == 13
    np.testing.assert_allclose(sums["sum"], np.sum(x @ params["w"]), rtol=1e-6)


def test_make_train_step_reports_the_learning_rate(devices):
    mesh = jaxdp.make_mesh()
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    tx = optax.sgd(schedule)
    state = jaxdp.init_state({"w": np.zeros(2, np.float32)}, tx, mesh)
    step = jaxdp.make_train_step(lambda p, b: jnp.sum(p["w"] * b["x"].mean(0)), tx, mesh, schedule=schedule)
    batch = jaxdp.shard_batch({"x": np.ones((8, 2), np.float32)}, mesh)
    lrs = []
    for _ in range(3):
        state, metrics = step(state, batch)
        lrs.append(float(metrics["lr"]))
    np.testing.assert_allclose(lrs, [1.0, 0.9, 0.8])


# -- the schedule's horizon on resume ---------------------------------------------------------------


@pytest.mark.slow  # over 4 s on 2 cores
def test_raising_steps_on_resume_keeps_the_schedule_unless_asked(tmp_path, capsys):
    flags = [*FAST, "--schedule", "cosine", "--lr", "0.01", "--final-lr-fraction", "0.1"]
    train(parse_args([*flags, "--steps", "10", "--checkpoint-dir", str(tmp_path / "kept")]))
    train(parse_args([*flags, "--steps", "14", "--checkpoint-dir", str(tmp_path / "kept"),
                      "--metrics-file", str(tmp_path / "kept.jsonl")]))
    assert "the lr schedule keeps the 10 steps it started with" in capsys.readouterr().err
    kept = [r["lr"] for r in records(tmp_path / "kept.jsonl") if "event" not in r]
    np.testing.assert_allclose(kept, [0.001] * 4, rtol=1e-6)  # past the horizon: the final rate

    train(parse_args([*flags, "--steps", "10", "--checkpoint-dir", str(tmp_path / "new")]))
    train(parse_args([*flags, "--steps", "14", "--schedule-steps", "14", "--checkpoint-dir", str(tmp_path / "new"),
                      "--metrics-file", str(tmp_path / "new.jsonl")]))
    restretched = [r["lr"] for r in records(tmp_path / "new.jsonl") if "event" not in r]
    expected = [float(optax.cosine_decay_schedule(0.01, 14, 0.1)(s)) for s in range(10, 14)]
    np.testing.assert_allclose(restretched, expected, rtol=1e-6)


@pytest.mark.slow  # about 13 s on 2 cores
def test_the_built_in_gpt_samples_a_periodic_text_greedily_through_its_cache(tmp_path, capsys):
    """jaxdp's GPT trained on a periodic text: greedy sampling (the KV-cache path) continues the
    period exactly, past the training context."""
    text = tmp_path / "periodic.txt"
    text.write_bytes(b"0123456789" * 400)
    train(parse_args([*FAST, "--model", "gpt", "--dataset", str(text), "--layers", "1", "--d-model", "32",
                      "--heads", "2", "--seq-len", "16", "--batch-size", "16", "--steps", "60", "--lr", "0.01",
                      "--checkpoint-dir", str(tmp_path / "gpt")]))
    capsys.readouterr()
    from jaxdp import sample

    assert sample.main(["--checkpoint-dir", str(tmp_path / "gpt"), "--prompt", "456", "--max-new-tokens", "24",
                        "--temperature", "0"]) == 0
    assert capsys.readouterr().out.strip() == "789012345678901234567890"
