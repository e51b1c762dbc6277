"""jaxdp.sync.codecs: the codecs (none, bf16, PowerSGD) against exact averaging."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxdp.mesh import DATA_AXIS, make_mesh, shard_batch
from jaxdp.sync import codecs as C, costmodel
from jaxdp.sync.collectives import ring_allreduce

REDUCE = {"psum": lambda t: jax.lax.psum(t, DATA_AXIS), "ring": lambda t: ring_allreduce(t, DATA_AXIS)}

# Matrices that compress (Dense- and conv-shaped), one too small to gain, a vector and a scalar.
SHAPES = {"dense": {"kernel": (24, 16), "bias": (16,)}, "conv": (3, 3, 4, 8), "tiny": (3, 2), "scale": ()}


def params_like(dtype=jnp.float32):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def random_grads(n, rng, dtype=np.float32):
    return jax.tree.map(lambda s: rng.standard_normal((n, *s)).astype(dtype), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))


def stacked(state, n):
    """One device's CompressionState -> a copy per device on a leading axis."""
    return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))).copy(), state)


def runner(devices, comp, n, reduce="psum", steps=1):
    """(stacked grads, stacked state, first step) -> stacked (outputs per step, state, scalars per step).

    `steps` > 1 applies the same per-device gradients `steps` times in one call (a scan), carrying
    the state: what a training loop with a constant gradient does, without a dispatch per step.
    """
    mesh = make_mesh(devices[:n])

    def body(args):
        grads, state, step = jax.tree.map(lambda x: x[0], args)

        def one(state, i):
            out, state, scalars = comp.mean(grads, state, REDUCE[reduce], n, step + i)
            return state, (out, scalars)

        state, (outs, scalars) = jax.lax.scan(one, state, jnp.arange(steps, dtype=jnp.int32))
        return jax.tree.map(lambda x: x[None], (outs, state, scalars))

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS), check_vma=False))

    def run(grads, state, step=0):
        args = shard_batch((grads, state, np.full((n,), step, np.int32)), mesh)
        return jax.device_get(jax.block_until_ready(fn(args)))  # block: 2-4 CPU devices can stall otherwise

    return run


def rel(a, b):
    return float(costmodel.relative_error(a, b))


def test_powersgd_at_full_rank_equals_uncompressed_averaging_over_steps(devices):
    n, comp = 4, C.parse("powersgd:64:min_rate=0")
    assert set(comp.layout(params_like())) == {"['conv']", "['dense']['kernel']", "['tiny']"}
    run = runner(devices, comp, n)
    state, rng = stacked(comp.init(params_like()), n), np.random.default_rng(0)
    for step in range(3):  # warm start and error feedback carried from step to step
        grads = random_grads(n, rng)
        outs, state, scalars = run(grads, state, step)
        mean = jax.tree.map(lambda g: g.mean(0), grads)
        for d in range(n):
            assert rel(jax.tree.map(lambda x: x[d, 0], outs), mean) <= 1e-5
        # Each device keeps g_i + e_i - mean, which differs per device; their mean (what the next
        # step adds) is what full rank leaves out: nothing.
        assert max(float(np.abs(e.mean(0)).max()) for e in jax.tree.leaves(state.error)) < 1e-4
        assert scalars["compressed"][0, 0] == 1


@pytest.mark.slow  # 13 s for 8 devices on 2 cores
@pytest.mark.parametrize("n", [2, 3, 8])
def test_low_rank_through_the_ring_equals_psum_and_compressing_the_mean_on_one_device(devices, n):
    comp = C.parse("powersgd:2")
    init = stacked(comp.init(params_like()), n)
    results = {}
    for reduce in ("psum", "ring"):
        run, state = runner(devices, comp, n, reduce), init
        results[reduce] = []
        for step in range(2):
            outs, state, scalars = run(random_grads(n, np.random.default_rng(step)), state, step)
            results[reduce].append((outs, state))
    for (o_p, s_p), (o_r, s_r) in zip(results["psum"], results["ring"]):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), (o_p, s_p), (o_r, s_r))

    # Sum of compressed = compressed of sum: one device compressing the mean gradient (plus the
    # devices' mean error) with the same Q gives the same mean, and the mean of the new errors.
    one = jax.jit(lambda g, s, step: comp.mean(g, s, lambda t: t, 1, step))
    single_state = comp.init(params_like())
    for step, (outs, state) in enumerate(results["psum"]):
        grads = random_grads(n, np.random.default_rng(step))
        mean, single_state, _ = one(jax.tree.map(lambda g: g.mean(0), grads), single_state, jnp.int32(step))
        chex_close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # noqa: E731
        jax.tree.map(lambda a, b: chex_close(a[0, 0], b), outs, mean)
        jax.tree.map(lambda a, b: chex_close(a.mean(0), b), state.error, single_state.error)
        jax.tree.map(lambda a, b: chex_close(a[0], b), state.q, single_state.q)
        for q in jax.tree.leaves(state.q):  # the warm-start factors agree on every device
            assert (q == q[:1]).all()
    assert rel(jax.tree.map(lambda x: x[0, 0], results["psum"][0][0]),
               jax.tree.map(lambda g: g.mean(0), random_grads(n, np.random.default_rng(0)))) > 0.3  # it did compress


def test_ring_carries_one_fused_buffer_per_phase(devices):
    # Call 1 (P, uncompressed leaves, norms) and call 2 (Q) are one float32 ring each.
    n, comp = 3, C.parse("powersgd:2")
    mesh = make_mesh(devices[:n])

    def body(grads):
        out, _, _ = comp.mean(jax.tree.map(lambda x: x[0], grads), comp.init(params_like()), REDUCE["ring"], n, 0)
        return jax.tree.map(lambda x: x[None], out)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS), check_vma=False))
    text = fn.lower(shard_batch(random_grads(n, np.random.default_rng(0)), mesh)).as_text()
    assert text.count("collective_permute") == 2 * 2 * (n - 1)


@pytest.mark.slow  # about 8 s on 2 cores
def test_error_feedback_running_sum_of_updates_approaches_the_true_sum(devices):
    # A fixed gradient, rank 1: each step's approximation is poor, but what is left out is carried
    # and sent later, so the sum of applied updates converges to the sum of true mean gradients.
    n, steps, comp = 4, 200, C.parse("powersgd:1")
    grads = random_grads(n, np.random.default_rng(1))
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    init = stacked(comp.init(params_like()), n)
    outs, state, scalars = runner(devices, comp, n, steps=steps)(grads, init)
    applied = jax.tree.map(lambda x: x[0], outs)  # (steps, ...) on device 0; all devices agree

    def sum_error(t):  # relative error of the running sum after t steps
        return rel(jax.tree.map(lambda a: a[:t].sum(0), applied), jax.tree.map(lambda m: t * m, mean))

    per_step = rel(jax.tree.map(lambda a: a[-1], applied), mean)
    assert per_step > 0.3  # each step alone is far from the mean
    assert sum_error(steps) < 0.05 and sum_error(steps) < sum_error(20) / 3
    # Error feedback telescopes: Σ true = Σ applied + (mean error at the end - at the start).
    flat = lambda tree: {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}  # noqa: E731
    applied_sum = flat(jax.tree.map(lambda a: a.sum(0), applied))
    e_end = {k: state.error[k].mean(0) if k in state.error else np.zeros_like(v) for k, v in applied_sum.items()}
    e_start = jax.tree.map(np.zeros_like, e_end)
    true_sum = flat(jax.tree.map(lambda m: steps * m, mean))
    owed = jax.tree.map(lambda a, e1, e0: a + e1 - e0, applied_sum, e_end, e_start)
    assert rel(applied_sum, owed) == pytest.approx(rel(applied_sum, true_sum), abs=1e-4)
    # Without error feedback (the error reset every step) the sum stays as far off as one step.
    no_ef = runner(devices, comp, n)
    total, state = None, init
    for step in range(20):
        outs, state, _ = no_ef(grads, state, step)
        state = state.replace(error=jax.tree.map(np.zeros_like, state.error))
        total = jax.tree.map(lambda x: x[0, 0], outs) if total is None else jax.tree.map(lambda t, x: t + x[0, 0], total, outs)
    assert rel(total, jax.tree.map(lambda m: 20 * m, mean)) > 0.3
    assert np.all(np.isfinite(scalars["error_ratio"])) and scalars["error_ratio"][0, 0] == 0  # no error at step 0


def test_bf16_is_close_to_the_float32_mean_and_keeps_dtypes(devices):
    n, comp = 8, C.parse("bf16")
    rng = np.random.default_rng(0)
    grads = {"f32": rng.standard_normal((n, 33, 5)).astype(np.float32),
             "bf16": jnp.asarray(rng.standard_normal((n, 7)), jnp.bfloat16),
             "f16": rng.standard_normal((n, 9)).astype(np.float16)}
    outs, _, _ = runner(devices, comp, n)(grads, stacked(comp.init(grads), n))
    for k, g in grads.items():
        got = outs[k][:, 0]
        assert got.dtype == g.dtype
        assert (got == got[:1]).all()
        np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(g, np.float32).mean(0), rtol=2e-2, atol=2e-2)
    assert comp.payload_bytes(jax.tree.map(lambda g: g[0], grads)) == (33 * 5 + 7 + 9) * 2  # f32 travels as bf16


def test_the_bf16_kind_all_reduces_bfloat16(devices):
    n, comp = 3, C.parse("bf16")
    mesh = make_mesh(devices[:n])
    fn = jax.jit(jax.shard_map(lambda g: comp.mean(g, C.CompressionState(), REDUCE["psum"], n, 0)[0], mesh=mesh,
                               in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS), check_vma=False))
    text = fn.lower(shard_batch(np.ones((n, 64), np.float32), mesh)).as_text()
    operands = re.findall(r'"stablehlo.all_reduce".*?\}\) : \((.*?)\)', text, re.S)
    assert operands and all("bf16" in o and "f32" not in o for o in operands), operands


@pytest.mark.parametrize("spec", ["none", "bf16", "powersgd:2:min_rate=0"])
def test_fp16_means_of_large_values_do_not_overflow(devices, spec):
    # 8 devices x 60000 overflows fp16's sum (max 65504); pre-scaling by 1/8 keeps it finite.
    n, comp = 8, C.parse(spec)
    grads = {"w": np.full((n, 8, 8), 60000, np.float16), "b": np.full((n, 8), -60000, np.float16)}
    params = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape[1:], g.dtype), grads)
    outs, _, _ = runner(devices, comp, n)(grads, stacked(comp.init(params), n))
    for k, g in grads.items():
        assert outs[k].dtype == np.float16
        np.testing.assert_allclose(np.asarray(outs[k][:, 0], np.float32), np.asarray(g, np.float32), rtol=1e-3)


@pytest.mark.parametrize("reduce", ["psum", "ring"])
@pytest.mark.slow  # over 4 s on 2 cores
def test_before_the_start_step_the_mean_is_exact_and_after_it_compressed(devices, reduce):
    n, comp = 4, C.parse("powersgd:1:start=3")
    run = runner(devices, comp, n, reduce)  # one compiled step: the branch is chosen inside jit
    state = stacked(comp.init(params_like()), n)
    for step in range(5):
        grads = random_grads(n, np.random.default_rng(step))
        mean = jax.tree.map(lambda g: g.mean(0), grads)
        outs, state, scalars = run(grads, state, step)
        got = jax.tree.map(lambda x: x[0, 0], outs)
        errors = max(float(np.abs(e).max()) for e in jax.tree.leaves(state.error))
        if step < 3:
            assert rel(got, mean) < 1e-6 and errors == 0 and scalars["compressed"][0, 0] == 0
        else:
            assert rel(got, mean) > 0.3 and errors > 0 and scalars["compressed"][0, 0] == 1


@pytest.mark.parametrize("spec", ["", "powersgd", "powersgd:0", "powersgd:x", "topk:3", "powersgd:2:start=-1",
                                  "powersgd:2:rank=3", "powersgd:2:start=1:start=2", "bf16:2"])
def test_parse_errors_are_one_line_saying_what_is_accepted(spec):
    with pytest.raises(ValueError) as info:
        C.parse(spec)
    message = str(info.value)
    assert "\n" not in message and "powersgd:RANK" in message and repr(spec) in message


@pytest.mark.parametrize("spec", ["none", "bf16", "powersgd:4", "powersgd:1:start=100", "powersgd:8:min_rate=1.5:seed=2"])
def test_names_parse_back_to_the_same_compressor(spec):
    comp = C.parse(spec)
    assert comp.name == spec and C.parse(comp.name) == comp and isinstance(comp, C.Compressor)


@pytest.mark.parametrize("spec", ["none", "bf16", "powersgd:2", "powersgd:64:min_rate=0"])
def test_payload_bytes_are_the_bytes_given_to_allreduce_sum(spec):
    comp, calls = C.parse(spec), []

    def recording(tree):
        calls.append(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
        return tree

    jax.eval_shape(lambda g, s: comp.mean(g, s, recording, 1, 0), params_like(), comp.init(params_like()))  # traces only
    assert sum(calls) == comp.payload_bytes(params_like()) and len(calls) == comp.collectives
    ratio = comp.payload_bytes(params_like()) / C.uncompressed_bytes(params_like())
    assert ratio < 1 if spec in ("bf16", "powersgd:2") else ratio >= 1


@pytest.mark.slow  # over 3 s on 2 cores
def test_giving_every_new_device_the_old_mean_error_keeps_the_next_step(devices):
    """A checkpoint resumed on another device count gives every new device the mean of the old
    error rows (jaxdp/checkpoint/checkpointer.py). What the next compressed step adds is then unchanged: at full
    rank (exact), 4 devices with their own errors and 2 devices with the mean one, given gradients
    of the same mean, agree."""
    rng = np.random.default_rng(0)
    old = {"['w']": rng.standard_normal((4, 24, 16)).astype(np.float32)}
    redistributed = {k: np.broadcast_to(v.mean(0), (2, *v.shape[1:])).copy() for k, v in old.items()}
    comp = C.parse("powersgd:64:min_rate=0")
    params = {"w": jax.ShapeDtypeStruct((24, 16), jnp.float32)}
    state4 = stacked(comp.init(params), 4).replace(error=old)
    g4 = {"w": rng.standard_normal((4, 24, 16)).astype(np.float32)}
    m, d = g4["w"].mean(0), rng.standard_normal((24, 16)).astype(np.float32)
    g2 = {"w": np.stack([m + d, m - d])}
    state2 = stacked(comp.init(params), 2).replace(error=redistributed)
    out4, _, _ = runner(devices, comp, 4)(g4, state4)
    out2, _, _ = runner(devices, comp, 2)(g2, state2)
    np.testing.assert_allclose(out2["w"][0, 0], out4["w"][0, 0], rtol=1e-4, atol=1e-5)


def test_orthonormalize_keeps_zero_columns_zero_and_makes_the_rest_orthonormal():
    assert not np.any(C.orthonormalize(jnp.zeros((6, 3))))
    # Rank 1 in 2 columns: the second is rounding noise (here parallel to the first) and becomes 0.
    q = np.asarray(C.orthonormalize(jnp.full((8, 2), 7.0)))
    np.testing.assert_allclose(q[:, 0], np.full(8, 8 ** -0.5), rtol=1e-6)
    assert not np.any(q[:, 1])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((50, 4)).astype(np.float32)
    a[:, 2] = a[:, 0] + 1e-3 * a[:, 2]  # almost dependent: Gram-Schmidt twice keeps it orthogonal
    a[:, 3] = a[:, 1] + 1e-7 * a[:, 3]  # dependent to float32 precision: 0, or orthonormal
    q = np.asarray(C.orthonormalize(jnp.asarray(a)))
    kept = np.diag(np.any(q != 0, axis=0).astype(np.float32))
    assert kept[2, 2] == 1
    np.testing.assert_allclose(q.T @ q, kept, atol=1e-5)
