"""ring_allreduce against jax.lax.psum, and every strategy's structure/dtype contract."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp.mesh import DATA_AXIS, make_mesh, shard_batch


def awkward_tree(n: int, rng: np.random.Generator, integer_valued: bool) -> dict:
    """Per-device inputs (leading axis n): scalars, odd sizes, sizes < n, mixed float dtypes."""
    def values(shape, dtype):
        x = rng.integers(-8, 9, size=(n, *shape)) if integer_valued else rng.standard_normal((n, *shape))
        return jnp.asarray(x, dtype)
    return {
        "scalar": values((), jnp.float32),
        "one": values((1,), jnp.float32),
        "odd": values((7, 13), jnp.float32),
        "bias": {"b": values((3,), jnp.float32), "w": values((5, 11, 2), jnp.float32)},
        "bf16": [values((37,), jnp.bfloat16), values((2, 3), jnp.bfloat16)],
        "f16": values((101,), jnp.float16),
    }


def per_device(fn, mesh):
    """Run fn on each device's row of a stacked tree; return the stacked per-device results."""
    def body(tree):
        out = fn(jax.tree.map(lambda x: x[0], tree))
        return jax.tree.map(lambda x: x[None], out)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS), check_vma=False))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8])
def test_ring_allreduce_equals_psum_exactly_on_integer_valued_inputs(devices, n):
    # Small integers sum exactly in any order, even in bf16/f16: the ring must match psum bit for bit.
    mesh = make_mesh(devices[:n])
    tree = shard_batch(awkward_tree(n, np.random.default_rng(n), integer_valued=True), mesh)
    ring = per_device(lambda t: jaxdp.ring_allreduce(t, DATA_AXIS), mesh)(tree)
    psum = per_device(lambda t: jax.lax.psum(t, DATA_AXIS), mesh)(tree)
    assert jax.tree.structure(ring) == jax.tree.structure(psum)
    for r, p in zip(jax.tree.leaves(ring), jax.tree.leaves(psum)):
        assert r.dtype == p.dtype and r.shape == p.shape
        np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(p, np.float32))


@pytest.mark.parametrize("n", [3, 8])
def test_ring_allreduce_close_to_psum_on_random_floats_and_identical_on_every_device(devices, n):
    mesh = make_mesh(devices[:n])
    tree = shard_batch(awkward_tree(n, np.random.default_rng(0), integer_valued=False), mesh)
    ring = per_device(lambda t: jaxdp.ring_allreduce(t, DATA_AXIS), mesh)(tree)
    psum = per_device(lambda t: jax.lax.psum(t, DATA_AXIS), mesh)(tree)
    for r, p in zip(jax.tree.leaves(ring), jax.tree.leaves(psum)):
        r32, p32 = np.asarray(r, np.float32), np.asarray(p, np.float32)
        tol = {jnp.float32: 1e-5, jnp.float16: 1e-2, jnp.bfloat16: 5e-2}[r.dtype.type]
        np.testing.assert_allclose(r32, p32, rtol=tol, atol=tol)
        # Each chunk is reduced once and then copied around the ring: all replicas agree exactly.
        assert (r32 == r32[:1]).all()


def test_ring_allreduce_under_pmap(devices):
    x = jnp.arange(8 * 10, dtype=jnp.float32).reshape(8, 10)
    out = jax.pmap(lambda v: jaxdp.ring_allreduce({"v": v}, "i")["v"], axis_name="i")(x)
    np.testing.assert_array_equal(out, np.broadcast_to(x.sum(0), (8, 10)))


@pytest.mark.parametrize("n", [2, 5, 8])
def test_ring_is_a_ring_of_ppermutes_with_one_message_per_hop(devices, n):
    # 2 (n - 1) neighbour exchanges, each carrying every dtype's fused buffer (f32, bf16, f16), and
    # no all-reduce hiding in it.
    mesh = make_mesh(devices[:n])
    tree = shard_batch(awkward_tree(n, np.random.default_rng(0), integer_valued=True), mesh)
    text = per_device(lambda t: jaxdp.ring_allreduce(t, DATA_AXIS), mesh).lower(tree).as_text()
    assert text.count("collective_permute") == 2 * (n - 1)
    assert "all_reduce" not in text


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_ring_copies_no_whole_buffer(devices, padded):
    # The ring's cost is its hops and adds; XLA's copy insertion must not add whole-buffer copies
    # around them (an earlier layout compiled to three, about a third of the ring's time).
    size = 8 * 1024 + (5 if padded else 0)
    mesh = make_mesh(devices)
    compiled = per_device(lambda x: jaxdp.ring_mean({"g": x}, DATA_AXIS)["g"], mesh).lower(
        jax.ShapeDtypeStruct((8, size), jnp.float32, sharding=jax.NamedSharding(mesh, P(DATA_AXIS)))).compile()
    entry = compiled.as_text().split("ENTRY", 1)[1]
    assert entry.count("collective-permute(") == 2 * 7
    assert " copy(" not in entry, entry


def test_a_16_bit_ring_sends_16_bits_on_the_wire(devices):
    # XLA's CPU compiler widens a bf16 / fp16 collective-permute to f32; the ring must send the bits
    # as bytes, or --compression bf16 sends as many bytes as no compression (found on the testbed).
    mesh = make_mesh(devices[:4])
    tree = shard_batch(awkward_tree(4, np.random.default_rng(0), integer_valued=True), mesh)
    alone = per_device(lambda t: jaxdp.ring_allreduce(t, DATA_AXIS), mesh).lower(tree["bf16"]).compile().as_text()
    permutes = re.findall(r"= (\w+)\[\d*\]\S* collective-permute(?:-start)?\(", alone.split("ENTRY", 1)[1])
    assert len(permutes) == 2 * 3 and set(permutes) == {"u16"}, permutes
    # Several dtypes share one ring: one message per hop, each dtype's chunk in it at its own width.
    mixed = {"bf16": tree["bf16"], "f16": tree["f16"], "f32": tree["odd"]}
    entry = per_device(lambda t: jaxdp.ring_allreduce(t, DATA_AXIS), mesh).lower(mixed).compile().as_text()
    sent = re.findall(r"= (\w+)\[(\d*)\]\S* collective-permute(?:-start)?\(", entry.split("ENTRY", 1)[1])
    # per device: 37 + 6 bf16, 101 f16, 7 x 13 f32 values; chunks of ceil(values / 4)
    assert sent == [("u8", str(11 * 2 + 26 * 2 + 23 * 4))] * (2 * 3), sent


def test_ring_rejects_integer_leaves(devices):
    mesh = make_mesh(devices[:2])
    with pytest.raises(TypeError, match="floating-point"):
        per_device(lambda t: jaxdp.ring_allreduce(t, DATA_AXIS), mesh)(shard_batch(np.zeros((2, 3), np.int32), mesh))


@pytest.mark.parametrize("name", sorted(jaxdp.STRATEGIES))
def test_every_strategy_returns_the_mean_with_same_structure_and_dtypes(devices, name):
    mesh = make_mesh(devices)
    host = awkward_tree(8, np.random.default_rng(1), integer_valued=True)
    expected = jax.tree.map(lambda x: np.asarray(x, np.float32).mean(0), host)
    strategy = jaxdp.STRATEGIES[name]
    if getattr(strategy, "on_host", False):
        rows = [jax.tree.map(lambda x: np.asarray(x[d]), host) for d in range(8)]
        out = strategy(rows)
        stacked = jax.tree.map(lambda x: x[None], out)
    else:
        stacked = per_device(lambda t: strategy(t, DATA_AXIS), mesh)(shard_batch(host, mesh))
    assert jax.tree.structure(stacked) == jax.tree.structure(host)
    for got, want, orig in zip(jax.tree.leaves(stacked), jax.tree.leaves(expected), jax.tree.leaves(host)):
        assert got.dtype == orig.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32)[0], want, rtol=1e-2, atol=1e-2)


def test_across_processes_on_cpu_one_all_reduce_carries_every_dtype(devices):
    # What psum does across processes (process_count() > 1, not testable in one process as is): on
    # CPU one buffer of the widest dtype, one all-reduce, each leaf back in its own dtype.
    from jaxdp.sync.collectives import _across_processes

    mesh = make_mesh(devices[:4])
    tree = shard_batch(awkward_tree(4, np.random.default_rng(0), integer_valued=True), mesh)
    fn = per_device(lambda t: _across_processes(lambda flat: jax.lax.psum(flat, DATA_AXIS), t), mesh)
    text = fn.lower(tree).as_text()
    assert text.count("all_reduce") == 1, text.count("all_reduce")
    got, want = fn(tree), per_device(lambda t: jax.lax.psum(t, DATA_AXIS), mesh)(tree)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))  # small integers: exact
