"""`python -m jaxdp.train` as a real trainer: a GPT on a text file, schedules, gradient accumulation
with one all-reduce per step, periodic evaluation, the NaN guard, config files."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jaxdp
from helpers import ROOT, cli_env, free_port, records, run_cli, saved, spawn_cli, step_records, write_corpus
from jaxdp.config import parse_args
from jaxdp.data.tokens import load_tokens, unigram_entropy
from jaxdp.errors import EXIT_DIVERGED
from jaxdp.models.builtin import MLP
from jaxdp.train import main, train

TINY_GPT = ["--model", "gpt", "--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32",
            "--batch-size", "16", "--lr", "3e-3", "--no-progress"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("text") / "corpus.txt")


def tree_allclose(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


# ---- a GPT on the user's text ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gpt_on_text_two_processes_equal_one_and_it_learns(tmp_path, corpus):
    flags = [*TINY_GPT, "--dataset", str(corpus), "--steps", "40", "--log-every", "1", "--schedule", "warmup-cosine",
             "--warmup-steps", "5"]
    port = free_port()
    logs = [tmp_path / f"two.{i}.log" for i in range(2)]
    procs = [spawn_cli(*flags, "--devices", "2", "--metrics-file", str(tmp_path / "two.jsonl"), "--coordinator-address",
                       f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i), stdout=logs[i], stderr=logs[i])
             for i in range(2)]
    try:
        one = run_cli(*flags, "--devices", "4", "--metrics-file", str(tmp_path / "one.jsonl"), timeout=400)
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert one.returncode == 0, one.stderr[-3000:]
    assert codes == [0, 0], logs[0].read_text()[-3000:]
    two, reference = step_records(tmp_path / "two.jsonl"), step_records(tmp_path / "one.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in reference] == list(range(1, 41))
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in reference], rtol=1e-5)
    assert two[0]["tokens_per_sec"] is None  # logged right after the compiling first step: no rate yet
    assert all(r["tokens_per_sec"] > 0 and r["lr"] >= 0 for r in two[1:])
    # It learns: the held-out loss ends below the unigram entropy of the text (the best loss of a
    # model that ignores context).
    done = records(tmp_path / "two.jsonl")[-1]
    entropy = unigram_entropy(load_tokens(str(corpus), 32).tokens, 256)
    assert done["event"] == "done" and done["processes"] == 2
    assert done["eval_loss"] < entropy, (done["eval_loss"], entropy)
    assert done["eval_perplexity"] == pytest.approx(np.exp(done["eval_loss"]))


def test_token_files_bin_and_npy_read_only_their_windows(tmp_path):
    ids = (np.arange(4000) * 7919 % 1000).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.uint32))
    a, b = load_tokens(str(tmp_path / "t.bin"), 16, 1000), load_tokens(str(tmp_path / "t.npy"), 16, 1000)
    assert isinstance(a.tokens, np.memmap) and isinstance(b.tokens, np.memmap)  # mapped, never read whole
    batch = a.train_batch(8, step=3, seed=1)
    np.testing.assert_array_equal(batch["x"], b.train_batch(8, step=3, seed=1)["x"])
    np.testing.assert_array_equal(batch["x"][:, 1:], batch["y"][:, :-1])  # targets are inputs shifted by one
    halves = [a.train_batch(8, 3, 1, process_index=p, process_count=2)["x"] for p in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), batch["x"])  # each process: its own slice
    assert a.n_train_tokens == 3600  # the last 10 % is held out


@pytest.mark.parametrize("flags, needle", [
    (["--dataset", "corpus.bin"], "--vocab-size: dataset file 'corpus.bin' holds raw token ids: give its vocabulary size"),
    (["--dataset", "tiny.txt"], "too few for windows"),
    (["--dataset", "digits"], "--model=gpt trains on a token stream"),
    (["--dataset", "ids.npy", "--vocab-size", "10"], "outside the vocabulary of 10"),
])
def test_bad_token_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys, flags, needle):
    monkeypatch.chdir(tmp_path)
    np.arange(100, dtype=np.uint16).tofile("corpus.bin")
    (tmp_path / "tiny.txt").write_text("too short")
    np.save("ids.npy", np.arange(2000, dtype=np.int64) % 50)
    assert main([*TINY_GPT, "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


# ---- gradient accumulation ------------------------------------------------------------------------


@pytest.mark.slow
def test_grad_accum_4_by_64_equals_batch_256_with_one_all_reduce(tmp_path):
    common = ["--steps", "5", "--optimizer", "momentum", "--lr", "0.05", "--no-progress", "--log-every", "1"]
    accumulated = train(parse_args([*common, "--grad-accum", "4", "--batch-size", "64"]))
    whole = train(parse_args([*common, "--batch-size", "256"]))
    tree_allclose(accumulated.state.params, whole.state.params, rtol=1e-5)
    np.testing.assert_allclose([r["loss"] for r in accumulated.history], [r["loss"] for r in whole.history], rtol=1e-5)
    assert accumulated.history[-1]["examples_per_sec"] > 0

    # The compiled program of the accumulating step: one all-reduce per step, not one per micro-batch.
    mesh = jaxdp.make_mesh()
    model = MLP(hidden=(16,), num_classes=3)
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, 5), np.float32))["params"]
    loss_fn = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, b["x"]), b["y"]).mean()  # noqa: E731
    tx = optax.sgd(0.1)
    batch = jaxdp.shard_batch({"x": np.ones((64, 5), np.float32), "y": np.zeros(64, np.int32)}, mesh)
    for k in (1, 4):
        step = jaxdp.make_train_step(loss_fn, tx, mesh, "psum", grad_accum=k)
        hlo = step.lower(jaxdp.init_state(params, tx, mesh), batch).compile().as_text()
        assert len(re.findall(r" all-reduce(?:-start)?\(", hlo)) == 1, k
    ring = jaxdp.make_train_step(loss_fn, tx, mesh, "ring", grad_accum=4)
    hlo = ring.lower(jaxdp.init_state(params, tx, mesh), batch).compile().as_text()
    assert len(re.findall(r" collective-permute(?:-start)?\(", hlo)) == 2 * (mesh.size - 1)
    assert " all-reduce(" not in hlo


# ---- the NaN guard ------------------------------------------------------------------------------


@pytest.mark.slow
def test_divergence_exits_with_its_code_keeps_the_last_good_checkpoint_and_writes_valid_json(tmp_path, capsys):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    flags = ["--checkpoint-dir", str(ckpt), "--metrics-file", str(metrics), "--save-every", "5", "--no-progress",
             "--optimizer", "sgd"]
    assert main([*flags, "--steps", "5", "--lr", "0.01"]) == 0  # a good checkpoint at step 5
    good = saved(ckpt)
    assert main([*flags, "--steps", "40", "--lr", "1e9", "--log-every", "10"]) == EXIT_DIVERGED
    resumed_line, *err = capsys.readouterr().err.strip().splitlines()
    assert resumed_line.startswith("jaxdp: resumed from step 5")
    assert len(err) == 1 and re.match(r"jaxdp: error: training diverged: \w+ became \w+ at step \d+", err[0]), err
    assert "the last checkpoint (step 5) is intact" in err[0]
    assert saved(ckpt) == good  # nothing non-finite was saved over it
    lines = records(metrics)  # strict JSON, line by line
    diverged = lines[-1]
    assert diverged["event"] == "diverged" and diverged["value"] in ("NaN", "Infinity", "-Infinity")
    assert 5 < diverged["step"] <= 10  # reported at the first log point after the step that diverged
    resumed = train(parse_args([*flags, "--steps", "6", "--lr", "0.01"]))  # restorable, and trains on
    assert np.isfinite(resumed.summary["eval_loss"])


# ---- config files, evaluation, schedules --------------------------------------------------------


def test_config_file_with_overrides_and_periodic_eval(tmp_path):
    (tmp_path / "run.toml").write_text('steps = 20\nbatch-size = 64\nlr = 0.01\nschedule = "warmup-cosine"\n'
                                       'warmup-steps = 5\neval_every = 10\nlog-every = 5\n')
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    result = train(parse_args(["--config", str(tmp_path / "run.toml"), "--lr", "0.02", "--no-progress",
                               "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt)]))
    start, *rest = records(metrics)
    assert start["event"] == "start" and start["config"]["lr"] == 0.02 and start["config"]["batch_size"] == 64
    assert start["config"]["schedule"] == "warmup-cosine"
    evals = [r for r in rest if r.get("event") == "eval"]
    assert [r["step"] for r in evals] == [10] and np.isfinite(evals[0]["eval_loss"])  # the end has "done"
    lrs = [r["lr"] for r in step_records(metrics)]
    assert lrs[0] == pytest.approx(0.02 * 4 / 5) and lrs[-1] < lrs[1]  # warm-up, then cosine decay
    # The effective config is saved beside the checkpoint, and reruns the same run.
    saved = parse_args(["--config", str(ckpt / "config.toml")])
    assert saved == parse_args(["--config", str(tmp_path / "run.toml"), "--lr", "0.02", "--no-progress",
                                "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt)])
    assert result.summary["eval_accuracy"] > 0.5


@pytest.mark.parametrize("text, needle", [
    ("stepz = 3\n", "unknown key 'stepz'"),
    ('steps = "ten"\n', "steps = 'ten' should be int"),
    ("steps = [\n", "not a readable TOML file"),
])
def test_bad_config_files_exit_2(tmp_path, capsys, text, needle):
    (tmp_path / "bad.toml").write_text(text)
    assert main(["--config", str(tmp_path / "bad.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


@pytest.mark.slow
def test_first_record_time_and_resume_message(tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    flags = ["--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt), "--no-progress", "--log-every", "2"]
    proc = subprocess.run([sys.executable, "-m", "jaxdp.train", *flags, "--steps", "4"], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"time=[\d.]+s \(start-up [\d.]+s, first step with compilation [\d.]+s\)", proc.stdout)
    proc = subprocess.run([sys.executable, "-m", "jaxdp.train", *flags, "--steps", "6"], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=240)
    assert "jaxdp: resumed from step 4" in proc.stderr
    starts = [r for r in records(metrics) if r.get("event") == "start"]
    assert [s["resumed_from"] for s in starts] == [None, 4]
    assert starts[0]["malloc_env"] == "1"  # `python -m jaxdp.train` re-executed itself with the malloc tuning
    assert all(s["startup_s"] > 0 for s in starts)
    done = records(metrics)[-1]
    assert done["compile_s"] > 0
    steps = [r for r in step_records(metrics)]
    assert [r["step"] for r in steps] == [2, 4, 6] and all(r["steps_per_sec"] > 0 for r in steps)
    assert json.dumps(records(metrics))  # round-trips


@pytest.mark.slow
def test_readme_gpt_commands(tmp_path):
    """The README's "Train a GPT on your text" commands, shrunk to a few steps of a tiny model."""
    import shlex

    from helpers import commands, readme_blocks, run_shell, sandbox

    (block,) = readme_blocks("tests/test_train_lm.py::test_readme_gpt_commands")
    shown = commands(block)
    assert shown[0].startswith("cat ") and len(shown) == 3
    env = sandbox(tmp_path)
    run_shell(shown[0], tmp_path, env)
    (np.frombuffer((tmp_path / "corpus.txt").read_bytes(), np.uint8).astype(np.uint16) * 7).tofile(tmp_path / "train.bin")
    shrink = ["--steps", "6", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "8",
              "--warmup-steps", "2", "--eval-every", "3", "--eval-batches", "2", "--no-progress", "--devices", "2"]
    for command in shown[1:]:
        run_shell(shlex.join([*shlex.split(command), *shrink]), tmp_path, env)
    done = records(tmp_path / "gpt.jsonl")[-1]
    assert done["event"] == "done" and np.isfinite(done["eval_loss"]) and (tmp_path / "gpt-ckpt" / "config.toml").exists()

