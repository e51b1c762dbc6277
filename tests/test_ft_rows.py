"""jaxdp/elastic/rows.py: an elastic exchange's rows made and read on the devices, against the host
path written out here (each device's sums to numpy, added in device order; the rows added in shard
order, the counted ones; divided by the devices counted), bit for bit where no codec rounds. The
programs are built with an update that returns what it is given (grads, model state), so `apply`
hands back the mean itself; the real update is tested through whole runs (tests/test_elastic_ft.py:
a run ends with a one-process run's parameters, bit for bit)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from helpers import mlp_batches, mlp_problem
from jaxdp.mesh import data_axes, make_mesh, shard_batch
from jaxdp.elastic.rows import RowCoder, RowPrograms
from jaxdp.step.train_step import _host_programs, _local_grads_fn
from jaxdp.sync import codecs, host
from jaxdp.sync.spec import SyncSpec


def problem(devices, strategy, compression=None, workers=2):
    params, loss_fn = mlp_problem()
    tx = optax.adam(1e-2)
    mesh = make_mesh(devices[:2])
    state = jaxdp.init_state(params, tx, mesh)
    local_grads = _local_grads_fn(loss_fn, False, data_axes(mesh))
    _, update, to_host = _host_programs(local_grads, tx, mesh)
    spec = SyncSpec(strategy=strategy, compression=compression).validate(elastic=True)
    codec = spec.codec
    programs = RowPrograms(local_grads, mesh, spec, lambda n: RowCoder(codec, n) if codec else None, False,
                           workers, lambda state, grads, model_state: (grads, model_state))
    batches = [shard_batch(b, mesh) for b in mlp_batches(workers, batch=32)]
    return state, programs, to_host, update, batches


def mean_of(programs, state, rows, counted, count):
    """(metrics, model state, grads): the mean `apply` gives the update (on a copy: it donates the state)."""
    (grads, model_state), metrics = programs.apply(jax.tree.map(jnp.copy, state), rows, np.array(counted), count)
    return metrics, model_state, grads


def host_sums(to_host, state, batch):
    """One shard's (metrics, model state, grads) leaves: each device's on the host, added in device order."""
    return host.device_sum(to_host(state, batch))[1]


def host_mean(shards, counted, count):
    """The host path's mean of the counted shards' leaves: zeros, plus each in shard order, / count."""
    totals = [np.zeros_like(a) for a in shards[0]]
    for sums, keep in zip(shards, counted):
        if keep:
            for acc, part in zip(totals, sums):
                acc += part
    return [(t / count).astype(t.dtype) for t in totals]


@pytest.mark.parametrize("strategy", ["host", "psum", "ring"])
def test_rows_are_the_sums_bytes_and_their_mean_is_the_host_paths_bit_for_bit(devices, strategy):
    state, programs, to_host, _, batches = problem(devices, strategy)
    shards = [host_sums(to_host, state, b) for b in batches]
    rows = []
    for batch, sums in zip(batches, shards):
        payload, finite, feedback = programs.send(state, batch)
        assert finite and feedback is None
        assert payload.tobytes() == b"".join(np.ascontiguousarray(a).tobytes() for a in sums)  # (2 devices: any order)
        rows.append(payload)
    rows = np.stack(rows)
    for counted, count in (([True, True], 4), ([False, True], 2)):  # a shard left out (not finite): 2 devices counted
        metrics, model_state, grads = mean_of(programs, state, rows, counted, count)
        got = jax.tree.leaves((metrics, model_state, grads))
        want = host_mean(shards, counted, count)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)
    metrics, _, grads = mean_of(programs, state, rows, [False, False], 0)  # none counted: NaN, as the host path
    assert np.isnan(metrics["loss"]) and all(np.isnan(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_a_sum_that_is_not_finite_is_said_so(devices):
    state, programs, _, _, batches = problem(devices, "psum")
    bad = {**batches[0], "x": batches[0]["x"] * np.float32(np.inf)}
    assert not programs.send(state, bad)[1]
    assert programs.send(state, batches[0])[1]


@pytest.mark.parametrize("name", ["int8", "int4", "bf16"])
def test_coded_rows_are_the_row_coders_messages_and_decode_to_its_mean(devices, name):
    """Against RowCoder on the host sums: the same message (int8 / int4: with error feedback
    kept per shard, as the host path threads it), and the mean of the decoded rows within float32
    rounding (a fused multiply-add may round the dequantized sum once where numpy rounds twice)."""
    state, programs, to_host, _, batches = problem(devices, "ring", codecs.parse(name))
    shards = [host_sums(to_host, state, b) for b in batches]
    exact = len(shards[0]) - len(jax.tree.leaves(state.params))
    reference = RowCoder(codecs.parse(name), sum(a.size for a in shards[0][exact:]))
    owed = {}
    for _ in range(2):  # the second time round each shard adds what its first message left out
        rows, decoded = [], []
        for shard, (batch, sums) in enumerate(zip(batches, shards)):
            payload, _, feedback = programs.send(state, batch, owed.get(shard))
            message, kept = reference.encode(np.concatenate([a.ravel() for a in sums[exact:]]), shard)
            head = sum(a.nbytes for a in sums[:exact])
            assert payload[:head].tobytes() == b"".join(a.tobytes() for a in sums[:exact])
            np.testing.assert_array_equal(reference.decode(payload[head:].tobytes()), reference.decode(message))
            if name == "bf16":
                assert feedback is None and kept is None
            else:
                np.testing.assert_allclose(np.asarray(feedback), kept, rtol=0, atol=1e-6)
                owed[shard] = feedback
                reference.keep(shard, kept)
            rows.append(payload)
            decoded.append(sums[:exact] + [reference.decode(message)])
        metrics, model_state, grads = mean_of(programs, state, np.stack(rows), [True, True], 4)
        got = jax.tree.leaves((metrics, model_state)) + [np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])]
        for g, w in zip(got, host_mean(decoded, [True, True], 4)):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", [None, "int8"])
def test_warm_up_compiles_every_program_the_steps_call_once(devices, name):
    """After `warm_up`, steps compile nothing more: a shard's first row (no feedback yet) and its later
    ones (the feedback `send` returned) are one program. A second one, compiled at a joiner's second
    step, kept the other workers waiting in the exchange (a kill cost int8 runs more than psum runs)."""
    state, programs, _, update, batches = problem(devices, "ring", codecs.parse(name) if name else None)
    programs.update = update  # (the real update, which donates the state)
    programs.warm_up(state, batches[0])
    compiled = lambda: (programs._send._cache_size(), programs._mean._cache_size(), update._cache_size())  # noqa: E731
    assert compiled() == (1, 1, 1)
    owed = {}
    for _ in range(3):
        rows = np.zeros((2, programs.nbytes), np.uint8)
        for shard in range(2):
            rows[shard], _, owed[shard] = programs.send(state, batches[shard], owed.get(shard))
        state, _ = programs.apply(state, rows, np.array([True, True]), 4)
    assert compiled() == (1, 1, 1)


def test_warm_up_compiles_both_programs_and_leaves_the_state_as_it_was(devices):
    state, programs, _, _, batches = problem(devices, "host")
    before = jax.tree.map(np.asarray, state.params)
    programs.warm_up(state, batches[0])
    assert programs.nbytes > 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.params), before)


def test_a_row_that_takes_no_part_says_whose_it_is_and_its_rank_is_healing_not_left_out(capsys):
    """A worker healed in this exchange's quorum sends a row that takes no part: the line names it as
    healing, and only a rank with no row at all as left out."""
    from types import SimpleNamespace

    from jaxdp.elastic import every_step as elastic_ft

    said = []
    member = SimpleNamespace(rank=0, live=[0, 1, 2], stop_asked=False, fresh=False, lead=True, say=said.append)
    rows = [(1, elastic_ft.flags_of(member, True)),
            (0, elastic_ft.flags_of(SimpleNamespace(rank=1, stop_asked=False, fresh=False, lead=False), False))]
    assert elastic_ft.live_of(rows) == [0] and elastic_ft.present_of(rows) == [0, 1]
    assert elastic_ft.lead_of(rows, None) == 0
    elastic_ft.say_live(member, 7, elastic_ft.live_of(rows), present=elastic_ft.present_of(rows))
    assert said == ["step 7: live ranks [0]; left out [2] (lost, or stalled past --stall-timeout); healing [1] (it took "
                    "a live worker's state: it takes part from the next exchange)"], said
