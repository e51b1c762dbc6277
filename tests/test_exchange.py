"""jaxdp/sync/exchange.py through the step: training through a codec against plain averaging and across
resume, the bytes it reports, the guard's replay, a mesh of two data axes, and the CLI's
--compression with the adaptive controller's choice on a fast link."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import records, run_cli
from jaxdp.errors import InputError
from jaxdp.models.builtin import MLP
from jaxdp.sync import codecs as compression, costmodel

MODEL = MLP(hidden=(24, 16))
PARAMS = MODEL.init(jax.random.PRNGKey(0), jnp.zeros((1, 13)))["params"]


def loss_fn(params, batch):
    logits = MODEL.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def data(n_steps, batch=48, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((batch, 13)).astype(np.float32),
             "y": rng.integers(0, 10, batch).astype(np.int32)} for _ in range(n_steps)]


def train(mesh, tx, strategy, spec, batches, state=None, state_spec=None):
    state = state or jaxdp.init_state(PARAMS, tx, mesh, compression=spec if state_spec is None else state_spec)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy, compression=spec)
    history = []
    for batch in batches:
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        history.append(jax.device_get(metrics))
    return state, history


def max_relative(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("strategy", ["psum", "ring"])
@pytest.mark.slow  # over 3 s on 2 cores
def test_full_rank_powersgd_trains_like_uncompressed(devices, strategy):
    """At rank = min(n, m) for every matrix (and min_rate=0, so every matrix is compressed) the
    projection is the identity: the same parameters as plain averaging after 15 steps."""
    mesh, tx = jaxdp.make_mesh(devices), optax.sgd(0.1, momentum=0.9)
    batches = data(15)
    plain, _ = train(mesh, tx, strategy, None, batches)
    full, history = train(mesh, tx, strategy, "powersgd:24:min_rate=0", batches)
    assert max_relative(full.params, plain.params) <= 1e-5
    assert history[-1]["compressed"] == 1.0
    low, low_history = train(mesh, tx, strategy, "powersgd:1", batches)
    assert max_relative(low.params, plain.params) > 1e-3  # rank 1 is an approximation: the test has teeth
    assert low_history[-1]["compression_ratio"] > 1.5 and low_history[-1]["comm_bytes"] > 0


def test_compressed_mean_is_the_same_through_psum_and_the_ring(devices):
    mesh, tx = jaxdp.make_mesh(devices[:3]), optax.sgd(0.1)
    batches = data(6, batch=48)
    for spec in ("bf16", "powersgd:2"):
        via_psum, _ = train(mesh, tx, "psum", spec, batches)
        via_ring, _ = train(mesh, tx, "ring", spec, batches)
        assert max_relative(via_ring.params, via_psum.params) <= (1e-2 if spec == "bf16" else 1e-5), spec


def test_metrics_report_bytes_sent_and_the_ratio(devices):
    mesh, tx = jaxdp.make_mesh(devices), optax.adam(1e-3)
    _, history = train(mesh, tx, "ring", "bf16", data(2))
    plain_bytes = compression.uncompressed_bytes(PARAMS)
    assert history[-1]["compression_ratio"] == pytest.approx(2.0)
    assert history[-1]["comm_bytes"] == pytest.approx(plain_bytes / 2 * 2 * 7 / 8)  # bf16, 2 (N-1)/N per device


@pytest.mark.slow  # over 4 s on 2 cores
def test_error_feedback_survives_checkpoint_and_resume_bit_identically(devices, tmp_path):
    mesh, tx = jaxdp.make_mesh(devices), optax.adam(3e-3)
    batches = data(12)
    uninterrupted, _ = train(mesh, tx, "ring", "powersgd:2", batches)
    half, _ = train(mesh, tx, "ring", "powersgd:2", batches[:6])
    saved = jax.device_get(half.sync)
    assert max(float(np.max(np.abs(e))) for e in jax.tree.leaves(saved.per_device)) > 0  # the error is live
    with jaxdp.Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(half)
    with jaxdp.Checkpointer(str(tmp_path)) as ckpt:
        restored = ckpt.restore(jaxdp.init_state(PARAMS, tx, mesh, compression="powersgd:2"))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(restored.sync)), strict=True):
        assert np.array_equal(a, b)
    resumed, _ = train(mesh, tx, "ring", "powersgd:2", batches[6:], state=restored)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(uninterrupted), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # On 4 devices: every new device owes the mean of the 8 old errors (jaxdp/checkpoint/checkpointer.py).
    mesh4 = jaxdp.make_mesh(devices[:4])
    with jaxdp.Checkpointer(str(tmp_path)) as ckpt:
        four = ckpt.restore(jaxdp.init_state(PARAMS, tx, mesh4, compression="powersgd:2"))
    for old, new in zip(jax.tree.leaves(saved.per_device), jax.tree.leaves(four.sync.per_device), strict=True):
        new = np.asarray(new)
        assert new.shape[0] == 4
        np.testing.assert_allclose(new, np.broadcast_to(old.mean(axis=0), new.shape), rtol=1e-6, atol=1e-9)
    train(mesh4, tx, "ring", "powersgd:2", batches[6:8], state=four)  # and it trains on


def test_an_auto_state_serves_every_candidate(devices):
    mesh, tx = jaxdp.make_mesh(devices), optax.sgd(0.1, momentum=0.9)
    state = jaxdp.init_state(PARAMS, tx, mesh, compression="auto")
    for spec in (None, "powersgd:4", "powersgd:1"):
        state, history = train(mesh, tx, "psum", spec, data(2), state=state)
        assert np.isfinite(history[-1]["loss"])
    assert int(state.step) == 6


def test_bad_combinations_are_refused(devices):
    mesh, tx = jaxdp.make_mesh(devices), optax.adam(1e-3)
    with pytest.raises(InputError, match=r"compression needs an in-graph strategy .*: strategy='host' does not qualify"):
        jaxdp.make_train_step(loss_fn, tx, mesh, "host", compression="bf16")
    with pytest.raises(InputError, match="compression and shard_optimizer do not combine"):
        jaxdp.make_train_step(loss_fn, tx, mesh, "psum", compression="powersgd:2", shard_optimizer=True)
    with pytest.raises(ValueError, match="decided while training"):
        jaxdp.make_train_step(loss_fn, tx, mesh, "psum", compression="auto")
    with pytest.raises(ValueError, match="compression 'randk:3': unknown kind"):
        jaxdp.make_train_step(loss_fn, tx, mesh, "psum", compression="randk:3")
    step = jaxdp.make_train_step(loss_fn, tx, mesh, "psum", compression="powersgd:2")
    with pytest.raises(ValueError, match=r"init_state\(..., compression='powersgd:2'\)"):
        step(jaxdp.init_state(PARAMS, tx, mesh), jaxdp.shard_batch(data(1)[0], mesh))


@pytest.mark.slow
def test_cli_compression_runs_and_auto_picks_none_on_a_fast_link(tmp_path):
    run = ["--steps", "12", "--batch-size", "64", "--log-every", "4", "--no-progress"]
    low = run_cli(*run, "--compression", "powersgd:2", "--strategy", "ring", "--metrics-file", str(tmp_path / "p.jsonl"))
    assert low.returncode == 0, low.stderr
    steps = [r for r in records(tmp_path / "p.jsonl") if "event" not in r]
    assert all(r["compression_ratio"] > 1.5 and r["compressed"] == 1.0 for r in steps)
    # 8 simulated devices in one process: an all-reduce costs latency, not bandwidth.
    auto = run_cli(*run, "--compression", "auto", "--compression-every", "6", "--metrics-file", str(tmp_path / "a.jsonl"))
    assert auto.returncode == 0, auto.stderr
    decisions = [r for r in records(tmp_path / "a.jsonl") if r.get("event") == "compression"]
    assert [d["step"] for d in decisions] == [0, 6]
    assert all(d["choice"] == "none" for d in decisions), [d["why"] for d in decisions]
    said = [line for line in auto.stderr.splitlines() if line.startswith("jaxdp: --compression auto at step")]
    assert [line.split(":")[1].split()[-1] for line in said] == ["0", "6"], auto.stderr  # one line per decision
    assert all("quality guard" in line and "none" in line for line in said)
    assert "--compression/--sync-every auto" in auto.stdout  # its cost, apart from compilation
    assert all(d["compute_s"] > 0 and d["comm_full_s"] > 0 and d["predicted_s"]["none"] > 0 for d in decisions)
    steps = [r for r in records(tmp_path / "a.jsonl") if "event" not in r]
    assert all(r["compression_ratio"] == 1.0 for r in steps)
    bad = run_cli(*run, "--compression", "powersgd:0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("jaxdp: error: --compression='powersgd:0' is not none, bf16")


@pytest.mark.slow  # 14-21 s each on 2 cores: a distributed window per candidate, compiled
@pytest.mark.parametrize("strategy", ["psum", "ring"])
def test_the_guard_replays_compression_on_the_mean_exactly(devices, strategy):
    """The guard (Controller.truth, then .replay per candidate) checks candidates on the true means with no collective (PowerSGD through
    an all-reduce is linear in its input). It must equal compressing every device's own gradient
    through the strategy's real all-reduce, per-device error feedback threaded, from a state whose
    error rows differ between devices (a few compressed steps in)."""
    from jax.sharding import PartitionSpec as P

    from jaxdp.step.train_step import state_specs
    from jaxdp.sync.controller import GUARD_BATCHES, Controller
    from jaxdp.sync.codecs.base import SLOT as STATE_NAME

    mesh, tx = jaxdp.make_mesh(devices), optax.sgd(0.1, momentum=0.9)
    state, _ = train(mesh, tx, strategy, "powersgd:2", data(3), state_spec="auto")
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy)
    controller = Controller(step.local_grads, mesh, step.strategy, PARAMS)
    batches = [jaxdp.shard_batch(b, mesh) for b in data(GUARD_BATCHES, seed=1)]
    ranks = [c for c in costmodel.ladder(PARAMS) if isinstance(c, compression.PowerSGD)]  # (a ring's controller keeps fewer)
    candidates = [ranks[0], ranks[-1]]  # the highest rank and the lowest
    assert candidates[0] != candidates[1]
    truth = controller.truth(state, batches)
    replayed = {c.name: controller.replay(c, truth) for c in candidates}

    axis, n, total = jaxdp.mesh.axis_name(mesh), mesh.size, step.strategy.sum

    def window(state, batches, compressor):  # the distributed way, the old guard's program
        def per_device(state, batch, rows):
            _, _, grads = step.local_grads(state, batch)
            stored = compression.CompressionState(error=jax.tree.map(lambda x: x[0], rows),
                                                  q=state.sync.shared[STATE_NAME])
            mean, new, _ = compressor.mean(grads, compressor.read(stored, grads),
                                           lambda t: total(t, axis), n, 0)
            true = total(jax.tree.map(lambda g: g / n, grads), axis)
            return (mean, true), jax.tree.map(lambda x: x[None], compressor.write(stored, new).error)

        fn = jax.jit(lambda state, batch, rows: jax.shard_map(
            per_device, mesh=mesh, in_specs=(state_specs(state, axis), P(axis), P(axis)),
            out_specs=((P(), P()), P(axis)), check_vma=False)(state, batch, rows))
        rows, sums = state.sync.per_device[STATE_NAME], None
        for batch in batches:
            out, rows = fn(state.replace(opt_state=None), batch, rows)
            # One window in flight: queued programs with XLA's in-process CPU collectives can
            # deadlock until the rendezvous timeout aborts the process (jaxdp/step/train_step.py, `_bounded`).
            jax.block_until_ready(rows)
            sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
        return float(costmodel.relative_error(*sums))

    for candidate in candidates:
        assert replayed[candidate.name] == pytest.approx(window(state, batches, candidate), rel=1e-4, abs=1e-6)
    assert len({round(e, 6) for e in replayed.values()}) == len(candidates) and min(replayed.values()) > 0


def test_before_its_start_step_a_codec_reports_the_bytes_it_really_sends(devices):
    """powersgd:2:start=2 sends the whole gradient at steps 0 and 1: comm_bytes and the ratio say so."""
    mesh, tx = jaxdp.make_mesh(devices), optax.sgd(0.1)
    _, history = train(mesh, tx, "ring", "powersgd:2:start=2", data(4))
    plain = compression.bytes_sent(compression.uncompressed_bytes(PARAMS), mesh.size)
    compressed = compression.bytes_sent(compression.parse("powersgd:2").payload_bytes(PARAMS), mesh.size)
    assert [float(h["comm_bytes"]) for h in history] == pytest.approx([plain, plain, compressed, compressed], rel=1e-6)
    assert [float(h["compression_ratio"]) for h in history][:2] == [1.0, 1.0] and history[-1]["compression_ratio"] > 1.5
    assert [float(h["compressed"]) for h in history] == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("strategy, spec, shard", [("ring", "powersgd:2", False), ("ring", None, True)])
def test_a_mesh_of_two_data_axes_trains_like_the_flat_mesh(devices, strategy, spec, shard):
    """make_mesh(axis_name=("hosts", "local")): every collective runs over both axes together, so
    training equals the 1-D mesh's (the groundwork of a hierarchical exchange)."""
    tx = optax.sgd(0.1, momentum=0.9)
    results = []
    for mesh in (jaxdp.make_mesh(devices), jaxdp.make_mesh(devices, axis_name=("hosts", "local"), shape=(2, 4))):
        state = jaxdp.init_state(PARAMS, tx, mesh, compression=spec, shard_optimizer=shard)
        step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy, compression=spec, shard_optimizer=shard)
        for batch in data(3):
            state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        results.append((jax.device_get(state.params), float(metrics["loss"])))
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-6)
    assert max_relative(results[1][0], results[0][0]) <= 1e-6
