"""Checkpoints: exact resume, preemption by a real signal, damaged and mismatched checkpoints.

Real orbax checkpoints on disk and real processes and signals throughout. Most runs call
`jaxdp.train.train` in this process (8 simulated devices, about a second each); the preemption
and kill -9 tests start real subprocesses.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxdp
from helpers import ROOT, cli_env, records, saved
from jaxdp.config import parse_args
from jaxdp.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED
from jaxdp.models.builtin import MLP
from jaxdp.train import main, train

FAST = ["--log-every", "1", "--no-progress"]


def run(*flags: str):
    return train(parse_args([*FAST, *map(str, flags)]))


def step_records(path: Path) -> list[dict]:
    """The per-step records, without timings (which differ between runs)."""
    timing = ("steps_per_sec", "examples_per_sec", "elapsed_s")
    return [{k: v for k, v in r.items() if k not in timing} for r in records(path) if "event" not in r]


def assert_same_state(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def tree_digest(directory: Path) -> dict[str, str]:
    """Every file under `directory` with a hash of its bytes: equal digests = untouched directory."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*"))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """30 steps without checkpoints, per strategy and model: what a resumed run must reproduce exactly."""
    cache = {}

    def get(strategy: str, model: str = "mlp"):
        if (strategy, model) not in cache:
            metrics = tmp_path_factory.mktemp(strategy) / "m.jsonl"
            result = run("--strategy", strategy, "--model", model, "--steps", 30, "--metrics-file", metrics)
            cache[strategy, model] = (step_records(metrics), result.state)
        return cache[strategy, model]

    return get


# ---- exact resume ----------------------------------------------------------------------------


# The CNN has BatchNorm statistics (model_state); the host strategy takes another code path.
@pytest.mark.slow
@pytest.mark.parametrize("strategy, model", [("psum", "mlp"), ("ring", "mlp"), ("host", "cnn")])
def test_stop_at_15_then_resume_to_30_is_bit_identical(tmp_path, uninterrupted, strategy, model):
    flags = ["--strategy", strategy, "--model", model, "--checkpoint-dir", tmp_path / "ckpt", "--save-every", 5,
             "--metrics-file", tmp_path / "m.jsonl"]
    first = run(*flags, "--steps", 15)
    assert sorted(map(int, saved(tmp_path / "ckpt"))) == [5, 10, 15]
    resumed = run(*flags, "--steps", 30)

    assert [r["step"] for r in resumed.history] == list(range(16, 31))  # ran 16..30 only
    expected_records, expected_state = uninterrupted(strategy, model)
    assert step_records(tmp_path / "m.jsonl") == expected_records  # losses of steps 1..30, once each
    assert [r.get("event") for r in records(tmp_path / "m.jsonl")].count("done") == 1
    # The first run's held-out metrics stay, as an eval record at its last step.
    first_done = [r for r in records(tmp_path / "m.jsonl") if r.get("finished")]
    assert len(first_done) == 1 and first_done[0]["event"] == "eval" and first_done[0]["step"] == 15
    assert first_done[0]["eval_loss"] == first.summary["eval_loss"]
    assert int(first.state.step) == 15 and int(resumed.state.step) == 30
    assert_same_state(resumed.state, expected_state)  # params, optimizer and model state, rng, step
    assert bool(jax.tree.leaves(resumed.state.model_state)) == (model == "cnn")


def test_metadata_records_config_and_data_position(tmp_path):
    run("--steps", 4, "--checkpoint-dir", tmp_path)
    meta = json.loads((tmp_path / "4" / "meta" / "metadata").read_text())
    assert meta["step"] == meta["data_position"] == 4
    assert meta["config"]["seed"] == 0 and meta["config"]["model"] == "mlp" and meta["devices"] == 8


# ---- damaged checkpoints ---------------------------------------------------------------------


def tear_latest_save(ckpt: Path, step: int) -> None:
    """Turn finished checkpoint `step` into what a process killed during that save leaves behind.

    Orbax writes a step into `<step>.orbax-checkpoint-tmp/` (items in `<item>.orbax-checkpoint-tmp/`)
    and renames it to `<step>/` only once every item is written and committed. A save killed midway
    (see test_kill_9_during_a_real_save) leaves the step's `_CHECKPOINT_METADATA`, partial array
    data under `state.orbax-checkpoint-tmp/ocdbt.process_0/`, `meta.orbax-checkpoint-tmp/`, and no
    `commit_success.txt`, `_METADATA` or manifest at the top of the item.
    """
    done, torn = ckpt / str(step), ckpt / f"{step}.orbax-checkpoint-tmp"
    torn.mkdir()
    (done / "_CHECKPOINT_METADATA").rename(torn / "_CHECKPOINT_METADATA")
    (torn / "state.orbax-checkpoint-tmp").mkdir()
    (done / "state" / "ocdbt.process_0").rename(torn / "state.orbax-checkpoint-tmp" / "ocdbt.process_0")
    (done / "meta").rename(torn / "meta.orbax-checkpoint-tmp")
    (torn / "meta.orbax-checkpoint-tmp" / "commit_success.txt").unlink()
    data = sorted((torn / "state.orbax-checkpoint-tmp" / "ocdbt.process_0" / "d").iterdir())
    with open(data[0], "r+b") as f:  # the file being written when the process died
        f.truncate(f.seek(0, os.SEEK_END) // 2)
    subprocess.run(["rm", "-r", str(done)], check=True)


@pytest.mark.slow  # over 3 s on 2 cores
def test_save_killed_midway_resumes_from_the_previous_checkpoint(tmp_path, uninterrupted, caplog):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    flags = ["--checkpoint-dir", ckpt, "--save-every", 5, "--metrics-file", metrics]
    run(*flags, "--steps", 20)
    tear_latest_save(ckpt, 20)
    # The killed run had logged steps 16..20, never "done", and was cut off mid-line.
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:-1]) + '{"step": 21, "lo')

    resumed = run(*flags, "--steps", 30)

    warnings = [r.getMessage() for r in caplog.records if "jaxdp: warning" in r.getMessage()]
    assert len(warnings) == 1 and "20.orbax-checkpoint-tmp" in warnings[0] and "step 15" in warnings[0]
    assert resumed.history[0]["step"] == 16
    expected_records, expected_state = uninterrupted("psum")
    assert step_records(metrics) == expected_records  # 16..20 not duplicated, torn line gone
    assert_same_state(resumed.state, expected_state)
    assert saved(ckpt) == ["20", "25", "30"]  # orbax replaced the torn save


@pytest.mark.slow  # over 3 s on 2 cores
def test_corrupted_latest_checkpoint_falls_back_and_is_kept_aside(tmp_path, uninterrupted, caplog):
    ckpt = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", ckpt, "--save-every", 5, "--keep", 5]
    run(*flags, "--steps", 15)
    for blob in (ckpt / "15" / "state").rglob("d/*"):  # damage every array file of the latest step
        with open(blob, "r+b") as f:
            f.truncate(7)

    resumed = run(*flags, "--steps", 30)

    warnings = [r.getMessage() for r in caplog.records if "jaxdp: warning" in r.getMessage()]
    assert len(warnings) == 1 and "could not be read" in warnings[0] and "resuming from step 10" in warnings[0]
    assert resumed.history[0]["step"] == 11
    assert_same_state(resumed.state, uninterrupted("psum")[1])
    assert (ckpt / "15.unreadable" / "state").is_dir()  # kept for inspection, never deleted
    assert {"15", "30"} <= {p.name for p in ckpt.iterdir()}  # step 15 saved again, readable


# ---- bad input: exit 2, one line, nothing changed ---------------------------------------------


def test_checkpoint_of_another_config_or_shape_exits_2_and_changes_nothing(tmp_path, capsys):
    data = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 5)), rng.integers(0, 3, 64)
    np.savez(data, x=x, y=y)
    ckpt = tmp_path / "ckpt"
    base = ["--dataset", str(data), "--batch-size", "16", "--steps", "3", "--checkpoint-dir", str(ckpt), *FAST]
    assert main(base) == 0
    before = tree_digest(ckpt)
    capsys.readouterr()

    assert main([*base, "--seed", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "made with --seed=0, but this run has --seed=1; use the same --seed" in err[0], err

    np.savez(data, x=rng.standard_normal((64, 7)), y=y)  # same flags, wider rows: other parameter shapes
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "params/Dense_0/kernel is float32[5, 256]" in err[0] and "float32[7, 256]" in err[0], err

    np.savez(data, x=x, y=y)
    assert main([*base, "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds step 3, past --steps=2" in err[0], err
    assert tree_digest(ckpt) == before


def read_only_dir(tmp_path: Path) -> Path:
    """An existing directory this process cannot write to (root ignores file modes: use /sys)."""
    if os.geteuid() == 0:
        return Path("/sys")
    (tmp_path / "ro").mkdir(mode=0o555)
    return tmp_path / "ro"


@pytest.mark.parametrize("where", ["path under a file", "read-only directory"])
def test_unwritable_checkpoint_dir_exits_2_before_training(tmp_path, capsys, where):
    (tmp_path / "file").write_text("x")
    directory = tmp_path / "file" / "ckpt" if where == "path under a file" else read_only_dir(tmp_path)
    metrics = tmp_path / "m.jsonl"
    assert main(["--checkpoint-dir", str(directory), "--metrics-file", str(metrics), "--steps", "5", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a writable directory" in err[0], err
    assert not metrics.exists()  # stopped before the first step


# ---- another device count, and the notebook API ----------------------------------------------


def test_restore_on_fewer_devices_and_from_a_notebook(tmp_path):
    model, tx = MLP(hidden=(16,), num_classes=3), optax.adam(1e-2)
    params = model.init(jax.random.PRNGKey(1), np.zeros((1, 4), np.float32))["params"]
    eight, four = jaxdp.make_mesh(jax.devices()), jaxdp.make_mesh(jax.devices()[:4])
    state = jaxdp.init_state(params, tx, eight, rng=3)
    step = jaxdp.make_train_step(lambda p, b: ((model.apply({"params": p}, b["x"]) - b["y"]) ** 2).mean(), tx, eight)
    batch = jaxdp.shard_batch({"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 3), np.float32)}, eight)
    state, _ = step(state, batch)

    with jaxdp.Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state) is state  # nothing saved yet
        assert ckpt.save(state) and not ckpt.save(state)  # a step is saved once
    template = jaxdp.init_state(params, tx, four, rng=0)
    with jaxdp.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(template)

    assert_same_state(restored, state)
    assert all(leaf.sharding.mesh.size == 4 and leaf.sharding.is_fully_replicated
               for leaf in jax.tree.leaves(restored))


def test_an_auto_checkpoint_without_every_leafs_error_feedback_resumes_with_zeros_there(tmp_path):
    """A --compression auto checkpoint from before int8 / int4 joined the ladder kept error
    feedback for PowerSGD's matrices only; the slot now holds every leaf's. The rest start at
    zero; what was saved comes back as saved."""
    from jaxdp.sync.exchange import STATE_NAME

    model, tx = MLP(hidden=(16,), num_classes=3), optax.sgd(0.1)
    params = model.init(jax.random.PRNGKey(1), np.zeros((1, 4), np.float32))["params"]
    mesh = jaxdp.make_mesh(jax.devices()[:2])
    state = jaxdp.init_state(params, tx, mesh, compression="auto")
    slot = state.sync.per_device[STATE_NAME]
    assert {"Dense_0.bias", "Dense_0.kernel"} <= set(slot)
    old = {k: v + 1.0 for k, v in slot.items() if k.endswith("kernel")}  # the old layout, something owed
    with jaxdp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state.replace(sync=state.sync.replace(per_device={**state.sync.per_device, STATE_NAME: old})))
    with jaxdp.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(state).sync.per_device[STATE_NAME]
    assert set(restored) == set(slot)
    for k, v in restored.items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(old[k]) if k in old else np.zeros(v.shape))


# ---- preemption: real processes, real signals ------------------------------------------------


def start_cli(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxdp.train", *map(str, flags)], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_records(metrics: Path, proc: subprocess.Popen, n: int = 1, timeout: float = 120) -> None:
    """Until `metrics` holds `n` step records, i.e. training is under way (compile done)."""
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and sum('"event"' not in line for line in metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_exits_75_then_resume_continues(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    flags = ["--checkpoint-dir", ckpt, "--metrics-file", metrics, *FAST]
    proc = start_cli(*flags, "--steps", 100_000, "--devices", 8)  # the in-process runs' 8 (tests/conftest.py)
    wait_for_records(metrics, proc, n=3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)  # a hang guard, not a timing

    assert proc.returncode == EXIT_PREEMPTED == 75, stderr
    stopped = records(metrics)[-1]["step"]  # the step in progress when the signal came, finished
    assert saved(ckpt) == [str(stopped)]
    assert f"preempted (SIGTERM): saved step {stopped}" in stderr.strip().splitlines()[-1]

    resumed = run(*flags, "--steps", stopped + 3)
    assert [r["step"] for r in resumed.history] == [stopped + 1, stopped + 2, stopped + 3]
    never_stopped = tmp_path / "reference.jsonl"
    run("--steps", stopped + 3, "--metrics-file", never_stopped)
    assert step_records(metrics) == step_records(never_stopped)  # every step once, bit-identical losses


@pytest.mark.slow  # over 3 s on 2 cores
def test_a_first_ctrl_c_saves_and_exits_130_a_second_aborts_at_once(tmp_path):
    """--save-every defaults to saving only at the end: Ctrl-C lost the whole run (exit 130, nothing saved)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = start_cli("--checkpoint-dir", ckpt, "--metrics-file", metrics, "--log-every", "1", "--no-progress",
                     "--steps", 100_000)
    wait_for_records(metrics, proc, n=3)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)  # a hang guard, not a timing
    assert proc.returncode == EXIT_INTERRUPTED == 130, stderr
    stopped = records(metrics)[-1]["step"]
    assert saved(ckpt) == [str(stopped)]
    assert f"interrupted (SIGINT): saved step {stopped}" in stderr.strip().splitlines()[-1]


def test_a_second_ctrl_c_interrupts_at_once():
    """After the first SIGINT the next one is Python's own KeyboardInterrupt (a stuck save can be aborted)."""
    from jaxdp.cluster.preemption import Preemption

    # raise_signal: to this (the main) thread, so the handler runs before the next line. os.kill may
    # land on one of JAX's threads, and the main thread then runs the handler at a later point.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (whatever the worker had)
    stop = Preemption()
    try:
        signal.raise_signal(signal.SIGINT)
        assert stop.should_stop(None) and stop.interrupted and stop.reason == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.close()
        after = signal.signal(signal.SIGINT, before)
    assert after is signal.default_int_handler


def test_a_signal_after_the_parent_died_is_told_apart_from_one_the_parent_sent(tmp_path):
    """Preemption.orphaned: a worker's SIGTERM from PR_SET_PDEATHSIG (its launcher is gone) against a
    signal while the launcher lives (a forwarded stop). An elastic run on torchft tells them apart:
    an orphaned worker whose launcher did not host the Lighthouse leaves alone (jaxdp/elastic/ft.py)."""
    worker = """if True:
        import ctypes, pathlib, signal, sys, time
        from jaxdp.cluster.preemption import Preemption
        stop = Preemption()
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        print("ready", flush=True)
        while stop.signal is None:
            time.sleep(0.01)
        pathlib.Path(sys.argv[1]).write_text("orphaned" if stop.orphaned else "parent alive")
    """
    parent = f"""if True:
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", {worker!r}, sys.argv[1]], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        if sys.argv[2] == "signal":  # a stop while the parent lives; else the parent ends
            child.terminate()
            child.wait()
    """
    for how, said in (("signal", "parent alive"), ("die", "orphaned")):
        verdict = tmp_path / how
        proc = subprocess.run([sys.executable, "-c", parent, str(verdict), how], cwd=ROOT, env=cli_env(),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        deadline = time.monotonic() + 30  # (a hang guard: the orphan writes after its parent's end)
        while not (verdict.exists() and verdict.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert verdict.read_text() == said, how


@pytest.mark.slow
def test_kill_9_during_a_real_save_leaves_the_previous_checkpoint(tmp_path, caplog):
    """A 512 MiB state takes about a second to write: kill -9 lands while orbax is writing it."""
    script = """if True:
        import sys, jax, numpy as np, optax, jaxdp
        mesh = jaxdp.make_mesh(jax.devices()[:1])
        params = {"w": np.random.default_rng(0).random((512, 256 * 1024), np.float32)}  # incompressible
        state = jaxdp.init_state(params, optax.sgd(0.1), mesh)
        ckpt = jaxdp.Checkpointer(sys.argv[1])
        ckpt.save(state.replace(step=jax.numpy.int32(1)))
        ckpt.wait()
        ckpt.save(state.replace(step=jax.numpy.int32(2)))  # returns once the state is on the host
        print("writing step 2", flush=True)
        ckpt.wait()
    """
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, env=cli_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "writing step 2\n"
    proc.kill()
    proc.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.orbax-checkpoint-tmp"]

    template = jaxdp.init_state({"w": np.zeros((512, 256 * 1024), np.float32)}, optax.sgd(0.1),
                                jaxdp.make_mesh(jax.devices()[:1]))
    with jaxdp.Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(template)
    assert int(restored.step) == 1
    assert np.asarray(restored.params["w"][0, :4]).tolist() == np.random.default_rng(0).random(4, np.float32).tolist()
    assert any("2.orbax-checkpoint-tmp" in r.getMessage() for r in caplog.records)


# ---- the README's examples -------------------------------------------------------------------


def test_readme_commands(tmp_path, monkeypatch):
    """The README's stop-and-resume commands, run in this process from a scratch directory."""
    from helpers import commands, readme_blocks

    monkeypatch.chdir(tmp_path)
    (block,) = readme_blocks("tests/test_checkpoint.py::test_readme_commands")
    shown = commands(block)
    assert len(shown) == 2 and all(c.startswith("python -m jaxdp.train ") for c in shown)
    for command in shown:
        assert main([*command.split()[3:], "--no-progress"]) == 0, command
    logged = records(tmp_path / "run.jsonl")
    assert [r["step"] for r in logged if "event" not in r] == [10, 15, 20, 30]  # 16..30 after resuming
    assert logged[-1]["event"] == "done" and saved(tmp_path / "ckpt") == ["20", "25", "30"]


@pytest.mark.slow
def test_readme_notebook_block(tmp_path, monkeypatch):
    """The README's notebook snippet after its flax.linen example (100 steps), twice: the first run
    trains on to 300 saving every 50; the second restores step 300 and has nothing left to do."""
    from helpers import readme_blocks

    monkeypatch.chdir(tmp_path)
    linen = next(b for b in readme_blocks("tests/test_readme.py::test_python_blocks") if "flax.linen" in b.code)
    (snippet,) = readme_blocks("tests/test_checkpoint.py::test_readme_notebook_block")
    namespace = {}
    exec(linen.code + snippet.code, namespace)
    trained = namespace["state"]
    assert int(trained.step) == 300 and sorted(os.listdir("ckpt")) == ["200", "250", "300"]

    namespace["state"] = jaxdp.init_state(namespace["params"], namespace["tx"], namespace["mesh"])
    exec(snippet.code, namespace)
    assert_same_state(namespace["state"], trained)
