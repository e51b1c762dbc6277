"""topk:DENSITY[:BITS] (jaxdp/sync/codecs/topk.py): the leader's index set, the same on every device,
its values summed, the rest in error feedback; against select-sum-scatter written out in numpy."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import mlp_batches, mlp_problem, stop_at_4_then_resume_to_8
from jaxdp.config import ConfigError, parse_args
from jaxdp.sync import codecs, rules
from jaxdp.sync.codecs.topk import CHUNK, TopK, lead

N = 8
SHAPE = (64, 100)  # 6400 values: a chunk of CHUNK and a padded one


def linear_problem(mesh, compression, strategy, steps, seed=0):
    """sum(w * x): device d's gradient is its row x_d, integers (so every sum of them / 8 is exact)."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(SHAPE))
    grads = np.stack([(rng.permutation(size) + 1) * rng.choice([-1, 1], size) for _ in range(N)]).astype(np.float32)
    grads = grads.reshape(N, *SHAPE)
    tx = optax.sgd(1.0)
    state = jaxdp.init_state({"w": np.zeros(SHAPE, np.float32)}, tx, mesh, compression=compression)
    step = jaxdp.make_train_step(lambda p, b: jnp.sum(p["w"] * b["x"][0]), tx, mesh, strategy=strategy, compression=compression)
    history = []
    for _ in range(steps):
        state, metrics = step(state, jaxdp.shard_batch({"x": grads}, mesh))
        history.append(metrics)
    return grads, state, history


def leader(step, n):
    """The sum of step's base-n digits, mod n."""
    digits = 0
    while step and n > 1:
        digits, step = digits + step % n, step // n
    return digits % n


def test_every_device_leads_in_turn_also_when_syncing_every_h_steps():
    for n in (1, 2, 3, 4, 8):
        for steps in ([*range(5 * n)], [*range(3, 200, 4)], [*range(15, 2000, 16)], [*range(7, 500, 8)]):
            got = [int(lead(s, n)) for s in steps]
            assert got == [leader(s, n) for s in steps]
            assert set(got) == set(range(n)), (n, steps[:3])
        assert all(sorted(int(lead(s, n)) for s in range(b * n, b * n + n)) == [*range(n)] for b in range(20))
    assert int(lead(jnp.int32(2 ** 31 - 1), 8)) == leader(2 ** 31 - 1, 8)


def reference(grads, density, steps, chunk=CHUNK):
    """numpy: x_d = (g_d + e_d) / N in chunks of CHUNK; the leader (step mod N) picks each chunk's k
    largest |x|; the mean is the sum of every device's x there, scattered; e_d = N * (x_d off the set)."""
    n, size = grads.shape[0], grads[0].size
    chunk = min(chunk, size)
    chunks, k = -(-size // chunk), max(1, round(density * chunk))
    errors = np.zeros((n, chunks * chunk), np.float32)
    w = np.zeros(chunks * chunk, np.float32)
    picked = []
    for s in range(steps):
        x = (np.pad(grads.reshape(n, size), ((0, 0), (0, chunks * chunk - size))) + errors) * np.float32(1 / n)
        x = x.reshape(n, chunks, chunk)
        index = np.argsort(-np.abs(x[leader(s, n)]), axis=1, kind="stable")[:, :k]
        rows = np.arange(chunks)[:, None]
        mean = np.zeros((chunks, chunk), np.float32)
        mean[rows, index] = x[:, rows, index].sum(0)
        w = w - mean.ravel()
        rest = x.copy()
        rest[:, rows, index] = 0
        errors = rest.reshape(n, -1) * np.float32(n)
        picked.append(index)
    return w[:size].reshape(grads.shape[1:]), errors[:, :size].reshape(grads.shape), picked


@pytest.mark.parametrize("strategy", ["psum", "ring"])
def test_the_exchange_is_select_sum_scatter_exactly_with_one_index_set_everywhere(devices, strategy):
    mesh = jaxdp.make_mesh(devices)
    grads, state, history = linear_problem(mesh, "topk:0.05", strategy, steps=3)
    w, errors, picked = reference(grads, 0.05, 3)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), w)
    got = np.asarray(state.sync.per_device["compression"]["w"])
    np.testing.assert_array_equal(got, errors)
    # every device left out exactly the last leader's set (its gradient is nonzero everywhere)
    sent = (got == 0).reshape(N, -1)
    assert all(np.array_equal(sent[d], sent[0]) for d in range(N))
    assert sent[0].sum() == picked[-1].size - (picked[-1][-1] >= 6400 - CHUNK).sum()  # the pad's picks are not values
    k = round(0.05 * CHUNK)  # 2 chunks: k indices (two per float32) and k float32 values each
    assert float(history[-1]["comm_bytes"]) == pytest.approx(2 * k * (2 + 4) * 2 * (N - 1) / N)


@pytest.mark.parametrize("spec", ["topk:0.05", "topk:0.05:8", "topk:0.05:4", "topk:0.05:2", "topk:0.05:gather",
                                  "topk:0.05:8:gather", "topk:0.05:2:gather"])
def test_error_feedback_conserves_the_gradient(devices, spec):
    """sum over devices of (g + e_old) / N == mean + sum of e_new / N, to float32 rounding; over two
    steps with decay=0.5, (g + 0.5 e_old) in place of (g + e_old)."""
    mesh = jaxdp.make_mesh(devices)
    grads, state, _ = linear_problem(mesh, spec, "ring", steps=1)
    mean = -np.asarray(state.params["w"])
    errors = np.asarray(state.sync.per_device["compression"]["w"])
    np.testing.assert_allclose(mean + errors.sum(0) / N, grads.sum(0) / N, rtol=0, atol=1e-6 * np.abs(grads).max())
    gathered = spec.endswith("gather")  # each device's own k per chunk: up to N times as many positions
    assert np.count_nonzero(mean) <= 2 * round(0.05 * CHUNK) * (N if gathered else 1)
    if spec not in ("topk:0.05:2", "topk:0.05:2:gather"):
        return
    grads, state, _ = linear_problem(mesh, spec + ":decay=0.5", "ring", steps=2)
    first = errors  # the same first step: the decay applies to what was owed before it
    mean = -np.asarray(state.params["w"]) - mean
    errors = np.asarray(state.sync.per_device["compression"]["w"])
    np.testing.assert_allclose(mean + errors.sum(0) / N, (grads + 0.5 * first).sum(0) / N, rtol=0,
                               atol=2e-6 * np.abs(grads).max())


def test_specs_parse_round_trip_and_bad_ones_are_one_line():
    assert codecs.parse("topk:0.01") == TopK(0.01) and codecs.parse("topk:.01:8") == TopK(0.01, 8)
    assert codecs.parse("topk:0.01:2:gather:decay=0.9") == TopK(0.01, 2, form="gather", decay=0.9)
    assert codecs.parse("topk:0.01:2:gather:chunk=16384") == TopK(0.01, 2, form="gather", chunk=16384)
    for c in (TopK(0.01), TopK(0.5, 4), TopK(1.0, 2), TopK(0.01, 32), TopK(0.01, 2, "gather"), TopK(0.01, 8, "sum"),
              TopK(0.02, 32, "gather", 0.95), TopK(0.01, 4, decay=0.5), TopK(0.01, 2, "gather", 0.98, 65536)):
        assert codecs.parse(c.name) == c
    assert codecs.needs("topk:0.01") == "sum" and codecs.needs("topk:0.01:8") == "coded_sum"
    assert codecs.needs("topk:0.01:2:gather") == codecs.needs("topk:0.01:gather") == "halves"
    rules.check_config(parse_args(["--compression", "topk:0.1:2:gather", "--strategy", "psum"]))  # psum gathers too
    for bad in ("topk:0", "topk:1.5", "topk:0.1:16", "topk:3", "topk:0.1:gather:sum", "topk:0.1:decay=0",
                "topk:0.1:decay=1.5", "topk:0.1:2:gather:8"):
        with pytest.raises(ConfigError) as err:
            rules.check_config(parse_args(["--compression", bad]))
        assert "\n" not in str(err.value) and "topk:DENSITY[:BITS]" in str(err.value)
    with pytest.raises(ConfigError, match="needs --strategy ring"):
        rules.check_config(parse_args(["--compression", "topk:0.1:8", "--strategy", "psum"]))


@pytest.mark.parametrize("bad, says", [
    ("topk:2", "DENSITY '2' is not a decimal in (0, 1]"),
    ("topk:0.01:3", "BITS '3' is not 32, 8, 4 or 2"),
    ("topk:0.01:gather:decay=2", "decay=2: B is not in (0, 1]"),
    ("topk:0.01:foo", "'foo' is not BITS (32, 8, 4, 2), sum, gather, decay=B or chunk=C"),
    ("topk:0.01:chunk=1000", "chunk=1000: C is not a power of 2 up to 65536"),
    ("topk:0.01:chunk=8192:2", "'2' after 'chunk=8192': BITS comes before chunk=C"),
    ("topk:0.1:gather:sum", "'sum' after 'gather': name sum or gather once"),
    ("topk:0.1:gather:8", "'8' after 'gather': BITS comes before sum or gather"),
    ("topk", "DENSITY is missing"),
])
def test_a_bad_topk_spec_names_its_wrong_part_in_one_short_line(bad, says):
    with pytest.raises(ConfigError) as err:
        rules.check_config(parse_args(["--compression", bad]))
    line = str(err.value)
    assert line.startswith(f"--compression={bad!r}: {says}") and "\n" not in line, line
    assert line.endswith(" (topk:DENSITY[:BITS][:sum|:gather][:decay=B][:chunk=C], or auto)") and len(line) <= 160, line
    with pytest.raises(ValueError, match=f"compression {bad!r}: {re.escape(says)}"):  # the library's parse too
        codecs.parse(bad)


def test_the_part_by_part_check_takes_exactly_the_specs_the_table_takes():
    parts = ["32", "8", "4", "2", "3", "sum", "gather", "auto", "decay=0.9", "decay=1", "decay=0", "chunk=8192",
             "chunk=3", "chunk=131072", "foo", ""]
    specs = [f"topk:{d}" for d in ("0.01", ".5", "1", "1.0", "0", "2", "x", "")]
    specs += [f"topk:0.1:{a}" for a in parts] + [f"topk:0.1:{a}:{b}" for a in parts for b in parts]
    specs += [f"topk:0.1:{a}:{b}:{c}" for a in parts[:7] for b in parts[5:9] for c in parts[7:10]]
    for spec in specs:
        taken = any(re.fullmatch(r.grammar, spec) for r in codecs.TABLE)
        assert (codecs.topk_fault(spec) is None) == taken, spec


def run_mlp(mesh, compression, steps=60):
    params, loss_fn = mlp_problem()
    tx = optax.sgd(0.1)  # with momentum 0.9 the delayed values come back in bursts it amplifies (docs/slow-links.md)
    state = jaxdp.init_state(params, tx, mesh, compression=compression)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy="ring", compression=compression)
    losses = []
    for batch in mlp_batches(steps):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        losses.append(float(metrics["loss"]))
    return state, losses, metrics


@pytest.mark.slow
def test_training_with_topk_tracks_dense(devices):
    """Measured: the last 10 of 60 steps' mean loss 1.575 (topk:0.1) against 1.539 (dense), 2.3 % apart."""
    mesh = jaxdp.make_mesh(devices)
    _, dense, _ = run_mlp(mesh, None)
    state, sparse, metrics = run_mlp(mesh, "topk:0.1")
    assert sparse[-1] < 0.8 * sparse[0]
    assert np.mean(sparse[-10:]) < 1.05 * np.mean(dense[-10:]), (np.mean(sparse[-10:]), np.mean(dense[-10:]))
    assert float(metrics["compression_ratio"]) == pytest.approx(4 / 6 / 0.1, rel=0.05)
    for leaf in jax.tree.leaves(state.params):  # every device holds the same bits
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards)


@pytest.mark.slow
def test_stop_at_4_then_resume_to_8_is_bit_identical(tmp_path):
    stop_at_4_then_resume_to_8(tmp_path, ["--compression", "topk:0.1"])


def test_local_steps_send_their_pseudo_gradient_through_topk(devices):
    """--sync-every 4 --compression topk:0.1: the every-step form on the pseudo-gradient (docs/slow-links.md)."""
    mesh = jaxdp.make_mesh(devices)
    params, loss_fn = mlp_problem()
    local = dict(sync_every=4, outer_tx=optax.sgd(0.7, momentum=0.9, nesterov=True))
    tx = optax.sgd(0.1)
    state = jaxdp.init_state(params, tx, mesh, compression="topk:0.1", **local)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy="psum", compression="topk:0.1", **local)
    history = []
    for batch in mlp_batches(8):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        history.append(jax.device_get(metrics))
    assert [float(m["synced"]) for m in history][3::4] == [1, 1]
    assert float(history[3]["compression_ratio"]) == pytest.approx(4 / 6 / 0.1, rel=0.05)  # the ring-summed form at 8
    errors = jax.tree.leaves(state.sync.per_device["compression"])
    assert all(e.shape[0] == 8 for e in errors) and any(np.any(np.asarray(e) != 0) for e in errors)
    replicas = state.sync.per_device["local_sgd"]["params"]  # after a sync every replica is the global params
    jax.tree.map(lambda r, g: np.testing.assert_array_equal(np.asarray(r), np.broadcast_to(np.asarray(g), r.shape)),
                 replicas, state.params)


def test_payload_counts_indices_values_and_scales():
    params = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32)}
    k = round(0.05 * CHUNK)  # 205 a chunk, 2 chunks: 410 values, 205 float32 of two indices each
    assert 2 * k == 410
    assert TopK(0.05).payload_bytes(params, 8) == TopK(0.05).payload_bytes(params) == 205 * 4 + 410 * 4
    # ring: the 205 index pairs padded to 8 chunks of 26 (float32), 8 messages of one block of 52 int8 and its scale
    assert TopK(0.05, 8).payload_bytes(params, 8) == 208 * 4 + 8 * (4 + 52)
    assert TopK(0.05, 2).payload_bytes(params, 8) == 208 * 4 + 8 * (4 + 52 // 4)
    assert TopK(0.05, 4).payload_bytes(params) == 205 * 4 + 205 + 4
    # all-gathered: each device's own 410 indices in 615 bytes, its values float32 or one block of 2-bit
    assert TopK(0.05, 32, "gather").sent_bytes(6400, 8) == 7 * (615 + 410 * 4)
    assert TopK(0.05, 2, "gather").sent_bytes(6400, 2) == 1 * (615 + 4 + 412 // 4)
    assert TopK(0.05, 2, "gather").payload_bytes(params, 2) == 615 + 4 + 103  # an all-reduce sending as much


def gather_reference(grads, density, steps, decay=1.0, chunk=CHUNK):
    """numpy, SparseLoCo's form: x_d = (g_d + decay e_d) / N in chunks of CHUNK; each device its own
    k largest |x_d| per chunk; the mean adds every device's values at its own positions, device by
    device; e_d = N * (x_d off its own set)."""
    n, size = grads.shape[0], grads[0].size
    chunk = min(chunk, size)
    chunks, k = -(-size // chunk), max(1, round(density * chunk))
    errors = np.zeros((n, chunks * chunk), np.float32)
    w = np.zeros(chunks * chunk, np.float32)
    rows = np.arange(chunks)[:, None]
    for _ in range(steps):
        x = (np.pad(grads.reshape(n, size), ((0, 0), (0, chunks * chunk - size))) + np.float32(decay) * errors)
        x = (x * np.float32(1 / n)).reshape(n, chunks, chunk)
        mean = np.zeros((chunks, chunk), np.float32)
        rest = x.copy()
        for d in range(n):
            index = np.argsort(-np.abs(x[d]), axis=1, kind="stable")[:, :k]
            np.add.at(mean, (np.broadcast_to(rows, index.shape), index), x[d][rows, index])
            rest[d][rows, index] = 0
        w = w - mean.ravel()
        errors = rest.reshape(n, -1) * np.float32(n)
    return w[:size].reshape(grads.shape[1:]), errors[:, :size].reshape(grads.shape)


@pytest.mark.parametrize("strategy,decay", [("psum", 1.0), ("ring", 1.0), ("ring", 0.5)])
def test_the_all_gathered_form_is_each_devices_own_topk_added_exactly(devices, strategy, decay):
    """topk:0.05:gather against its reference written out above: the same bits, every step."""
    mesh = jaxdp.make_mesh(devices)
    spec = "topk:0.05:gather" + ("" if decay == 1.0 else f":decay={decay}")
    grads, state, history = linear_problem(mesh, spec, strategy, steps=3)
    w, errors = gather_reference(grads, 0.05, 3, decay)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), w)
    np.testing.assert_array_equal(np.asarray(state.sync.per_device["compression"]["w"]), errors)
    assert float(history[-1]["comm_bytes"]) == (N - 1) * (615 + 410 * 4)  # its own k to each of the others
    for shard in state.params["w"].addressable_shards:  # every device added the same sets in the same order
        np.testing.assert_array_equal(np.asarray(shard.data), w)


@pytest.mark.parametrize("form,strategy", [("sum", "psum"), ("sum", "ring"), ("gather", "psum")])
def test_a_chunk_above_4096_sends_16_bit_indices_and_is_its_reference_exactly(devices, form, strategy):
    """:chunk=8192 on 6,400 values: one chunk, indices up to 6,399 (above 12 bits): one index per
    float32 in the ring-summed form's all-reduce, two bytes each in an all-gathered message."""
    mesh = jaxdp.make_mesh(devices)
    spec = "topk:0.05:gather:chunk=8192" if form == "gather" else "topk:0.05:chunk=8192"
    grads, state, history = linear_problem(mesh, spec, strategy, steps=3)
    w, errors = (gather_reference(grads, 0.05, 3, chunk=8192) if form == "gather"
                 else reference(grads, 0.05, 3, chunk=8192)[:2])
    np.testing.assert_array_equal(np.asarray(state.params["w"]), w)
    np.testing.assert_array_equal(np.asarray(state.sync.per_device["compression"]["w"]), errors)
    k = round(0.05 * 6400)  # 320 of the one chunk
    sent = (N - 1) * (2 * k + 4 * k) if form == "gather" else (4 * k + 4 * k) * 2 * (N - 1) / N
    assert float(history[-1]["comm_bytes"]) == pytest.approx(sent)
    assert TopK(0.05, 2, "gather", chunk=8192).shape(6400) == (1, 6400, 320)


def test_gradients_and_local_steps_take_the_form_that_sends_fewer_bytes():
    params = {"w": jax.ShapeDtypeStruct((100_000,), jnp.float32)}
    auto = TopK(0.01, 2)
    for pseudo_gradient in (True, False):
        assert auto.settled(params, 2, pseudo_gradient).form == "gather"  # 1 x its own, against indices + values
        assert auto.settled(params, 3, pseudo_gradient).form == "sum"     # 2 x its own grows past the all-reduce
        assert auto.settled(params, 8, pseudo_gradient).form == "sum"
        assert auto.settled(params, 1, pseudo_gradient).form == "sum"     # (nothing crosses)
    assert TopK(0.01, 2, "sum").settled(params, 2, True).form == "sum"     # a form the spec names stays
    assert TopK(0.01, 32).settled(params, 2, False).form == "gather"       # (float32 values too)
    # what local steps report (comm_bytes_per_step) is what a device sends: 7 x its own message at 8 devices
    from jaxdp.sync.codecs.base import bytes_sent
    from jaxdp.sync.collectives import RING
    from jaxdp.sync.exchange import make_exchange

    gather = make_exchange(RING, "data", 8, TopK(0.01, 2, "gather"), pseudo_gradient=True)
    assert bytes_sent(gather.payload_bytes(params), 8) == pytest.approx(TopK(0.01, 2, "gather").sent_bytes(100_000, 8),
                                                                      rel=1e-3)
    note = auto.settled_note(params, 2, True)
    assert "all-gathered" in note and "--compression topk:0.01:2:sum" in note and "\n" not in note
    note = auto.settled_note(params, 8, False)
    assert note.startswith("--compression topk:0.01:2: every step's gradients go ring-summed") and "\n" not in note
    assert auto.settled_note(params, 1, False) is None


def test_cli_local_steps_say_which_form_they_took(tmp_path, capsys):
    import json

    from jaxdp.train import train

    metrics = tmp_path / "m.jsonl"
    train(parse_args(["--steps", "8", "--sync-every", "4", "--compression", "topk:0.05:2", "--strategy", "ring",
                      "--devices", "2", "--no-progress", "--log-every", "4", "--metrics-file", str(metrics)]))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "topk:0.05:2" in line]
    assert len(lines) == 1 and lines[0].startswith("jaxdp: --compression topk:0.05:2: local steps' pseudo-gradients "
                                                   "go all-gathered"), err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (event,) = [r for r in records if r.get("event") == "compression_form"]
    assert event["chosen"] == "topk:0.05:2:gather"
    synced = [r for r in records if r.get("synced")]  # 1.5 bytes of index and 0.25 of value (and scales) for 4
    assert len(synced) == 2 and all(4 / (0.05 * 1.76) > r["compression_ratio"] > 4 / (0.05 * 1.9) for r in synced)


@pytest.mark.slow
def test_the_all_gathered_form_stops_at_4_and_resumes_to_8_bit_identically(tmp_path):
    stop_at_4_then_resume_to_8(tmp_path, ["--compression", "topk:0.1:2:gather:decay=0.9", "--sync-every", "2",
                                          "--strategy", "psum"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_with_the_all_gathered_form_train_like_one_process(tmp_path):
    """2 processes x 2 devices (--hierarchy auto: the hierarchical collective's all-gather, through
    gloo) against 1 process x 4 devices, local steps with topk:0.05:2:gather: the same losses."""
    from helpers import records, step_records, two_processes_and_one

    two_processes_and_one(tmp_path, ["--steps", "8", "--batch-size", "64", "--log-every", "4", "--no-progress",
                                     "--sync-every", "4", "--compression", "topk:0.05:2:gather", "--strategy", "ring"])
    ref, two = step_records(tmp_path / "one.jsonl"), step_records(tmp_path / "two.0.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in ref] == [4, 8]
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in ref], rtol=1e-5)
    np.testing.assert_allclose(records(tmp_path / "two.0.jsonl")[-1]["eval_loss"],
                               records(tmp_path / "one.jsonl")[-1]["eval_loss"], rtol=1e-5)


@pytest.mark.parametrize("strategy", ["psum", "ring"])
def test_the_all_gathered_form_carries_the_riders_in_its_one_all_gather(devices, strategy):
    """The scalar metrics and float model state ride in the all-gathered message (no collective of
    their own): every device gets their mean over the devices, summed in device order; integer
    model state is left as it is. The program holds the one all-gather and nothing else that
    crosses between devices."""
    from jax.sharding import PartitionSpec as P

    from jaxdp.sync.collectives import as_collective
    from jaxdp.sync.exchange import make_exchange
    from jaxdp.step.state import SyncState

    mesh = jaxdp.make_mesh(devices)
    codec = TopK(0.05, 32, "gather")
    exchange = make_exchange(as_collective(strategy), "data", N, codec)
    slot = codec.slot({"w": jax.ShapeDtypeStruct((64,), jnp.float32)})

    def device(grads, index):
        sync = SyncState(per_device={"compression": slot.error}, shared={})
        metrics = {"loss": index[0] * 1.5, "aux": jnp.stack([index[0], -index[0]])}
        model_state = {"stat": index[0] * 0.25, "count": jnp.int32(7)}
        _, metrics, model_state, _, _ = exchange.mean({"w": grads[0]}, metrics, model_state, sync, jnp.int32(0))
        return metrics, model_state

    program = jax.jit(jax.shard_map(device, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(),
                                    check_vma=False))
    grads = np.random.default_rng(0).standard_normal((N, 64)).astype(np.float32)
    index = np.arange(N, dtype=np.float32)
    metrics, model_state = program(grads, index)
    assert float(metrics["loss"]) == pytest.approx(1.5 * (N - 1) / 2, rel=1e-6)
    np.testing.assert_allclose(np.asarray(metrics["aux"]), [(N - 1) / 2, -(N - 1) / 2], rtol=1e-6)
    assert float(model_state["stat"]) == pytest.approx(0.25 * (N - 1) / 2, rel=1e-6)
    assert int(model_state["count"]) == 7
    hlo = program.lower(grads, index).as_text()
    crossing = sum(hlo.count(f'"stablehlo.{op}"') for op in ("all_gather", "collective_permute", "all_reduce"))
    assert crossing == (1 if strategy == "psum" else N - 1), crossing  # the ring's all-gather: N - 1 hops


def test_the_all_gathered_form_with_nothing_riding(devices):
    """No metrics and no model state: the all-gather carries the message alone."""
    from jax.sharding import PartitionSpec as P

    from jaxdp.step.state import SyncState
    from jaxdp.sync.collectives import as_collective
    from jaxdp.sync.exchange import make_exchange

    mesh = jaxdp.make_mesh(devices)
    codec = TopK(0.05, 32, "gather")
    exchange = make_exchange(as_collective("ring"), "data", N, codec)
    slot = codec.slot({"w": jax.ShapeDtypeStruct((64,), jnp.float32)})

    def device(grads):
        sync = SyncState(per_device={"compression": slot.error}, shared={})
        mean, metrics, model_state, _, _ = exchange.mean({"w": grads[0]}, {}, {}, sync, jnp.int32(0))
        return mean, metrics, model_state

    grads = np.zeros((N, 64), np.float32)
    grads[:, 3] = np.arange(N)
    mean, metrics, model_state = jax.jit(jax.shard_map(device, mesh=mesh, in_specs=P("data"), out_specs=P(),
                                                       check_vma=False))(grads)
    assert metrics == {} and model_state == {}
    assert float(mean["w"][3]) == pytest.approx((N - 1) / 2) and float(jnp.abs(mean["w"]).sum()) == pytest.approx((N - 1) / 2)
