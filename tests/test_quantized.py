"""--compression int8 / int4: the quantized ring (requantized at every hop, error feedback) against
a numpy reference and its bound; training, local steps, exact resume and the psum refusal."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxdp
from helpers import ROOT, cli_env, mlp_batches, mlp_problem, stop_at_4_then_resume_to_8
from jaxdp.errors import InputError
from jaxdp.mesh import DATA_AXIS, make_mesh, shard_batch
from jaxdp.sync import codecs as C
from jaxdp.sync.collectives import ring_coded_allreduce

CODECS = ["int8", "int4"]


def quantize_reference(v, comp, block):
    """numpy: one encoding and decoding of a chunk, blocks of `block` values, float32 throughout."""
    b = v.reshape(-1, block)
    scale = (np.abs(b).max(axis=1) / np.float32(comp.qmax)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    q = np.where(scale[:, None] > 0, np.clip(np.round(b / safe[:, None]), -comp.qmax, comp.qmax), 0)
    return (q.astype(np.float32) * scale[:, None]).ravel()


def ring_reference(x, comp, chunk, block):
    """numpy: the ring's sum of x (n, n * chunk): chunk c starts on device c + 1, each device adds its
    own copy to the decoded message and encodes again, the owner c encodes the finished chunk once."""
    n = x.shape[0]
    out = np.empty(x.shape[1], np.float32)
    for c in range(n):
        part = slice(c * chunk, (c + 1) * chunk)
        acc = x[(c + 1) % n, part]
        for k in range(2, n + 1):
            acc = x[(c + k) % n, part] + quantize_reference(acc, comp, block)
        out[part] = quantize_reference(acc, comp, block)
    return out


@pytest.mark.parametrize("name", CODECS)
def test_ring_sum_matches_the_numpy_reference_within_the_bound_and_is_identical_everywhere(devices, name):
    n, comp = 8, C.parse(name)
    assert comp.name == name and C.parse(comp.name) == comp and comp.needs == C.row(name).needs == "coded_sum"
    chunk, block = comp.chunking(3000, n)
    mesh = make_mesh(devices[:n])
    wire = comp.wire(chunk, block)

    def body(x, riders):
        total, residual, exact = ring_coded_allreduce(x[0], DATA_AXIS, wire, riders[0])
        return total[None], residual[None], exact[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS), check_vma=False))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, n * chunk)).astype(np.float32)
    x[rng.integers(0, n, 40), rng.integers(0, n * chunk, 40)] *= 1e3  # outliers
    riders = rng.standard_normal((n, 3)).astype(np.float32)
    args = shard_batch(x, mesh), shard_batch(riders, mesh)
    total, residual, exact = jax.device_get(fn(*args))
    assert fn.lower(*args).as_text().count("collective_permute") == 2 * (n - 1)  # one message per hop, riders in it

    assert all(np.array_equal(total[d], total[0]) for d in range(n))  # bit-identical on every device
    np.testing.assert_allclose(exact[0], riders.sum(0), rtol=1e-6, atol=1e-6)  # the riders are not quantized
    true = x.astype(np.float64).sum(0)
    # The bound: N encodings per value, each off by at most amax / (2 qmax) of its block, and every
    # block max at most A (the block's largest sum of |x| over devices) plus the errors before it.
    a = np.repeat(np.abs(x).astype(np.float64).sum(0).reshape(-1, block).max(axis=1), block)
    bound = ((1 + 1 / (2 * comp.qmax)) ** n - 1) * a
    err = np.abs(total[0] - true)
    assert (err <= bound * (1 + 1e-5) + 1e-4).all() and err.max() > 0
    # Each device encoded every position once; the residuals telescope to the whole error.
    np.testing.assert_allclose(true - residual.astype(np.float64).sum(0), total[0], atol=1e-5 * a.max())
    np.testing.assert_allclose(total[0], ring_reference(x, comp, chunk, block), rtol=1e-6, atol=1e-6 * a.max())


def test_payload_counts_the_values_and_scales_sent(devices):
    params = {"w": jax.ShapeDtypeStruct((100, 64), jnp.float32), "b": jax.ShapeDtypeStruct((64,), jnp.float32)}
    size = 100 * 64 + 64
    for name, bits in (("int8", 8), ("int4", 4)):
        comp = C.parse(name)
        chunk, block = comp.chunking(size, 8)
        assert chunk * 8 >= size and chunk % block == 0 and block <= C.QUANT_BLOCK and block % 2 == 0
        assert comp.payload_bytes(params, 8) == 8 * (chunk // block * 4 + chunk * bits // 8)
        assert comp.payload_bytes(params) == size * bits // 8 + -(-size // C.QUANT_BLOCK) * 4
    assert C.uncompressed_bytes(params) / C.parse("int8").payload_bytes(params) > 3.9


def run_steps(mesh, compression, steps=30, **local):
    params, loss_fn = mlp_problem()
    tx = optax.sgd(0.1, momentum=0.9)
    state = jaxdp.init_state(params, tx, mesh, compression=compression, **local)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy="ring", compression=compression, **local)
    history = []
    for batch in mlp_batches(steps):
        state, metrics = step(state, jaxdp.shard_batch(batch, mesh))
        history.append(jax.device_get(metrics))
    return state, history


@pytest.mark.parametrize("name", CODECS)
def test_training_through_the_quantized_ring_tracks_uncompressed_and_replicas_agree(devices, name):
    mesh = make_mesh(devices)
    plain_state, plain = run_steps(mesh, None)
    state, history = run_steps(mesh, name)
    losses, plain_losses = [float(m["loss"]) for m in history], [float(m["loss"]) for m in plain]
    assert losses[-1] < 0.6 * losses[0]
    assert abs(np.mean(losses[-5:]) - np.mean(plain_losses[-5:])) < (0.01 if name == "int8" else 0.03) * np.mean(plain_losses[-5:])
    ratio = float(history[-1]["compression_ratio"])
    assert ratio > (3 if name == "int8" else 5), ratio
    for leaf in jax.tree.leaves(state.params):  # every device holds the same bits
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert all(np.array_equal(s, shards[0]) for s in shards)
    errors = jax.tree.leaves(state.sync.per_device["compression"])
    assert errors and all(e.shape[0] == 8 for e in errors)  # error feedback, one row per device


def test_local_steps_average_pseudo_gradients_through_int8(devices):
    mesh = make_mesh(devices)
    local = dict(sync_every=4, outer_tx=optax.sgd(0.7, momentum=0.9, nesterov=True))
    state, history = run_steps(mesh, "int8", steps=12, **local)
    assert all(np.isfinite(float(m["loss"])) for m in history)
    assert [float(m["synced"]) for m in history][3::4] == [1, 1, 1]
    assert float(history[3]["compression_ratio"]) > 3
    replicas = state.sync.per_device["local_sgd"]["params"]  # after a sync every replica is the global params
    jax.tree.map(lambda r, g: np.testing.assert_array_equal(np.asarray(r), np.broadcast_to(np.asarray(g), r.shape)),
                 replicas, state.params)


def test_psum_refuses_quantized_compression(devices):
    with pytest.raises(InputError, match="needs strategy='ring'.*requantizes at every hop"):
        jaxdp.make_train_step(mlp_problem()[1], optax.sgd(0.1), make_mesh(devices), strategy="psum", compression="int8")
    probe = "import sys; from jaxdp.train import main; code = main(sys.argv[1:]); print('jax' in sys.modules); sys.exit(code)"
    proc = subprocess.run([sys.executable, "-c", probe, "--strategy", "psum", "--compression", "int4", "--steps", "1",
                           "--no-progress"], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "needs --strategy ring" in err[0], err
    assert proc.stdout.strip() == "False"  # JAX never imported


@pytest.mark.slow  # over 4 s on 2 cores
def test_stop_at_4_then_resume_to_8_is_bit_identical(tmp_path):
    stop_at_4_then_resume_to_8(tmp_path, ["--compression", "int8", "--strategy", "ring"])


def test_a_state_without_error_feedback_is_refused_with_the_codec_to_make_it_for(devices):
    mesh = make_mesh(devices)
    params, loss_fn = mlp_problem()
    tx = optax.sgd(0.1)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, strategy="ring", compression="int4")
    with pytest.raises(Exception, match=r"compression='int4'"):
        step(jaxdp.init_state(params, tx, mesh), jaxdp.shard_batch(next(mlp_batches(1)), mesh))


@pytest.mark.parametrize("bits", [8, 4])
def test_host_rows_code_a_workers_sum_once_with_error_feedback_per_shard(bits):
    """jaxdp.elastic.rows.RowCoder (an elastic run on torchft codes each worker's sum once): against the
    block quantizer written out here, and its feedback kept per key only when asked."""
    from jaxdp.sync import codecs
    from jaxdp.elastic.rows import RowCoder

    size, qmax = 1500, 2 ** (bits - 1) - 1  # 1500 values: 3 blocks of 500 (the ring's even blocks of <= 512)
    x = np.random.default_rng(bits).normal(size=size).astype(np.float32)

    def reference(v):
        blocks = v.reshape(3, 500)
        scale = np.abs(blocks).max(axis=1) / np.float32(qmax)
        q = np.clip(np.round(blocks / scale[:, None]), -qmax, qmax)
        return (q * scale[:, None]).astype(np.float32).ravel()

    coder = RowCoder(codecs.parse(f"int{bits}"), size)
    message, feedback = coder.encode(x, key=1)
    assert len(message) == coder.nbytes == 3 * 4 + size * bits // 8
    np.testing.assert_allclose(coder.decode(message), reference(x), rtol=0, atol=1e-6)
    np.testing.assert_allclose(feedback, x - reference(x), rtol=0, atol=1e-6)
    again, _ = coder.encode(x, key=1)  # nothing kept yet: the same message
    assert again == message
    coder.keep(1, feedback)
    owed, _ = coder.encode(x, key=1)  # key 1 now adds what its last message left out
    np.testing.assert_allclose(coder.decode(owed), reference(x + feedback), rtol=0, atol=1e-6)
    assert coder.encode(x, key=0)[0] == message  # another key (shard) owes nothing
    rows = np.stack([np.frombuffer(m, np.uint8) for m in (message, owed)])  # every row in one program: the same
    np.testing.assert_array_equal(coder.decode_rows(rows), np.stack([coder.decode(message), coder.decode(owed)]))


def test_host_rows_settle_keeps_only_the_feedback_of_the_exchange_just_made_and_finite():
    """After an exchange the feedback owed is that of the keys coded in it with finite values, and no
    other: a shard coded again later (a lost worker's shard once more, a worker's own after it
    healed) starts at zero, and a shard whose sums were not finite does not carry the NaN on."""
    from jaxdp.sync import codecs
    from jaxdp.elastic.rows import RowCoder

    coder = RowCoder(codecs.parse("int8"), 1000)
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    fresh, left = coder.encode(x, key=1)
    coder.settle({0: left, 1: left})  # this worker coded shards 0 and 1 (1 was a lost worker's)
    assert sorted(coder.feedback) == [0, 1] and coder.encode(x, key=1)[0] != fresh
    coder.settle({0: left})  # shard 1's worker is back: this worker coded shard 0 alone
    assert sorted(coder.feedback) == [0] and coder.encode(x, key=1)[0] == fresh  # lost again: shard 1 from zero
    _, poisoned = coder.encode(x * np.float32(np.nan), key=0)
    coder.settle({0: poisoned}, left_out=[0])  # shard 0's sums were not finite: left out, its feedback too
    assert coder.feedback == {} and np.isfinite(coder.decode(coder.encode(x, key=0)[0])).all()
    coder.settle({})  # a step this worker only listened to (it healed): nothing owed
    assert coder.feedback == {}
    bf16 = RowCoder(codecs.parse("bf16"), 1000)  # (no feedback to keep)
    bf16.settle({0: None})
    assert bf16.feedback == {}


def test_host_rows_in_bf16_are_the_cast_and_other_codecs_are_refused():
    import ml_dtypes

    from jaxdp.sync import codecs
    from jaxdp.elastic.rows import RowCoder

    x = np.random.default_rng(0).normal(size=101).astype(np.float32)
    coder = RowCoder(codecs.parse("bf16"), x.size)
    message, feedback = coder.encode(x, key=0)
    assert feedback is None and len(message) == coder.nbytes == 202
    np.testing.assert_array_equal(coder.decode(message), x.astype(ml_dtypes.bfloat16).astype(np.float32))
    rows = np.stack([np.frombuffer(message, np.uint8)] * 2)
    np.testing.assert_array_equal(coder.decode_rows(rows), np.stack([coder.decode(message)] * 2))
    with pytest.raises(ValueError, match="codes only bf16, int8, int4, not 'powersgd"):
        RowCoder(codecs.parse("powersgd:2"), x.size)
