"""jaxdp/sync/costmodel.py: predictions and decisions from measured figures, as pure functions (the
all-reduce time line, the compression ladder and plan, the quality guard, the local-steps H rule)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp.sync import codecs as C, costmodel, predict
from jaxdp.sync.costmodel import CommModel


# ---- the rule ------------------------------------------------------------------------------------

EXACT = CommModel(latency_s=0.0, seconds_per_byte=2.0 ** -20)  # 2**23 bytes: 8 s per all-reduce, exactly


@pytest.mark.parametrize("compute_s, expected, needed", [
    (32.0, 1, 1),    # target 8 s: one all-reduce per step fits, synchronous
    (16.0, 2, 2),    # target 4 s
    (4.0, 8, 8),     # target 1 s: exactly 8, a power of two already
    (3.0, 16, 11),   # target 0.75 s: 10.67 -> 11 -> 16
    (1.0, 16, 32),   # target 0.25 s: 32, capped at 16
])
def test_h_is_1_when_it_fits_else_the_next_power_of_two_capped_at_16(compute_s, expected, needed):
    choice = costmodel.auto_sync_every(compute_s, EXACT, 2 ** 23, target_fraction=0.25)
    assert (choice["sync_every"], choice["uncapped_sync_every"]) == (expected, needed)
    smallest = costmodel.choose_sync_every(compute_s, EXACT, 2 ** 23, target_fraction=0.25)
    assert choice["sync_every"] == min(smallest, 16) or smallest < choice["sync_every"] < 2 * smallest
    assert choice["comm_per_sync_s"] == 8.0 and choice["predicted_comm_s"] == 8.0 / expected
    assert choice["fits"] == (needed <= costmodel.MAX_AUTO_SYNC_EVERY)
    assert ("the cap" in choice["why"]) == (needed > 16) and ("synchronous" in choice["why"]) == (expected == 1)


def test_latency_and_collectives_count_and_the_default_target():
    model = CommModel(latency_s=0.5, seconds_per_byte=2.0 ** -20)
    # 2 calls x 0.5 s + 8 s = 9 s per average against 0.25 x 4.5 s = 1.125 s: 8 exactly
    assert costmodel.auto_sync_every(4.5, model, 2 ** 23, collectives=2)["sync_every"] == 8
    assert costmodel.auto_sync_every(4.5, model, 2 ** 23, collectives=2, max_sync_every=4)["sync_every"] == 4
    assert costmodel.TARGET_COMM_FRACTION == 0.25 and costmodel.MAX_AUTO_SYNC_EVERY == 16


def test_the_record_is_a_pure_function_of_the_gathered_figures():
    # all-reduce of 4096 bytes: 1.0 s, of 65536 bytes: 2.0 s -> latency 14/15 s, 61440 bytes/s
    figures = {"compute_s": 2.0, "comm_small_s": 1.0, "comm_full_s": 2.0, "comm_sizes": [4096, 65536]}
    record = costmodel.local_steps_record(figures, "none", 65536, 1, 0.25)
    assert record == costmodel.local_steps_record(dict(figures), "none", 65536, 1, 0.25)
    # 2.0 s per average against 0.5 s per step: 4
    assert record["sync_every"] == 4 and record["uncapped_sync_every"] == 4 and record["fits"]
    assert record["comm_per_sync_s"] == pytest.approx(2.0) and record["predicted_comm_s"] == pytest.approx(0.5)
    assert record["bandwidth_bytes_per_s"] == pytest.approx(61440) and record["latency_s"] == pytest.approx(14 / 15)
    assert (record["target_fraction"], record["payload_bytes"], record["max_sync_every"]) == (0.25, 65536, 16)
    assert costmodel.local_steps_record(figures, "bf16", 32768, 1, 0.25)["sync_every"] == 4  # 1.47 s: ceil(2.93) = 3 -> 4
    assert costmodel.local_steps_record({**figures, "compute_s": 100.0}, "none", 65536, 1, 0.25)["sync_every"] == 1


def test_choose_sync_every():
    model = CommModel(latency_s=0.001, seconds_per_byte=1e-6)  # 1 MB/s
    # 1.001 s per sync, compute 0.1 s per step, comm at most 0.25 x compute: H = ceil(1.001 / 0.025) = 41
    assert costmodel.choose_sync_every(0.1, model, 1_000_000) == 41
    assert costmodel.choose_sync_every(100.0, model, 1_000_000) == 1


def test_fit_comm_model_recovers_latency_and_bandwidth():
    model = costmodel.fit_comm_model([1 << 20, 16 << 20], [1e-3 + (1 << 20) / 1e9, 1e-3 + (16 << 20) / 1e9])
    assert model.latency_s == pytest.approx(1e-3) and model.seconds_per_byte == pytest.approx(1e-9)
    assert model.seconds(10 << 20, calls=2) == pytest.approx(2e-3 + (10 << 20) / 1e9)
    with pytest.raises(ValueError):
        costmodel.fit_comm_model([1 << 20], [1e-3])
    with pytest.raises(ValueError):
        costmodel.fit_comm_model([1 << 20, 2 << 20], [2e-3, 1e-3])


def big_params():
    return {"layer": {"kernel": jax.ShapeDtypeStruct((1024, 1024), jnp.float32), "bias": jax.ShapeDtypeStruct((1024,), jnp.float32)},
            "head": {"kernel": jax.ShapeDtypeStruct((1024, 10), jnp.float32)}}


def test_ladder_goes_from_none_to_the_strongest_useful_compression():
    names = [c.name for c in costmodel.ladder(big_params())]
    assert names[:8] == ["none", "bf16", "powersgd:32", "powersgd:16", "powersgd:8", "powersgd:4", "powersgd:2", "powersgd:1"]
    assert names[8:] == ["topk:0.001"]  # the densities that send fewer bytes than rank 1
    payloads = [c.payload_bytes(big_params()) for c in costmodel.ladder(big_params())]
    assert payloads[2:] == sorted(payloads[2:], reverse=True) and len(set(payloads[2:])) == len(payloads[2:])
    assert [c.name for c in costmodel.ladder({"w": jax.ShapeDtypeStruct((24, 16), jnp.float32)})] == [
        "none", "bf16", "powersgd:4", "powersgd:2", "powersgd:1", "topk:0.03", "topk:0.01", "topk:0.003"]  # k >= 1


def test_topk_joins_the_ladder_in_the_form_the_run_s_device_count_takes():
    """At 2 devices each device's own top-k, all-gathered (fewer bytes); from 3 the ring-summed form;
    a strategy without an all-gather keeps only what it can carry."""
    params = big_params()
    at = lambda devices, abilities=None: [c.name for c in costmodel.ladder(  # noqa: E731
        params, devices=devices, abilities=abilities) if c.name.startswith("topk")]
    assert at(2) == ["topk:0.00293:2:gather"] and at(8) == ["topk:0.001:sum"]  # 2: 2-bit values in float32's bytes
    assert at(2, {"sum"}) == [] and at(8, {"sum"}) == at(8)
    assert [c.name for c in costmodel.ladder(params, devices=2, abilities={"sum"})][:8] == [
        c.name for c in costmodel.ladder(params)][:8]
    assert costmodel.weaker(C.parse("topk:0.001")).name == "topk:0.003"
    assert costmodel.weaker(C.parse("topk:0.1")).name == "bf16"


def test_plan_picks_none_when_compute_dominates_and_strong_compression_when_comm_does():
    params, compute = big_params(), 0.010
    fast = costmodel.CommModel(latency_s=20e-6, seconds_per_byte=1 / 100e9)  # 4 MB in 42 µs
    choice, reasons = costmodel.plan(compute, fast, params)
    assert choice.name == "none" and reasons["fits"] and reasons["chosen"] == "none"

    slow = costmodel.CommModel(latency_s=1e-3, seconds_per_byte=1 / 10e6)   # 10 MB/s: even rank 1 takes > 2.5 ms
    choice, reasons = costmodel.plan(compute, slow, params)
    assert choice.name == "topk:0.001" and not reasons["fits"] and "no candidate fits" in reasons["why"]

    # A link where bf16's halving is not enough but a moderate rank is.
    middle = costmodel.CommModel(latency_s=50e-6, seconds_per_byte=1 / 500e6)
    choice, reasons = costmodel.plan(compute, middle, params)
    assert isinstance(choice, C.PowerSGD) and reasons["fits"]
    assert reasons["predicted_s"]["bf16"] > reasons["target_s"] >= reasons["predicted_s"][choice.name]
    assert choice.rank == max(c.rank for c in costmodel.ladder(params)[2:] if isinstance(c, C.PowerSGD)
                              and middle.seconds(c.payload_bytes(params), 2) <= costmodel.TARGET_COMM_FRACTION * compute)


def test_guard_steps_back_to_weaker_compression_above_the_threshold():
    ladder = costmodel.ladder(big_params())
    rank1, rank2 = C.parse("powersgd:1"), C.parse("powersgd:2")
    assert costmodel.guard(rank1, 0.01) == rank1
    assert costmodel.guard(rank1, 0.9) == rank2
    assert costmodel.guard(rank1, 0.9, candidates=ladder) == rank2
    assert costmodel.guard(C.parse("powersgd:32"), 0.9, candidates=ladder).name == "bf16"
    assert costmodel.guard(C.parse("powersgd:4:start=10"), 0.9).name == "powersgd:8:start=10"
    assert costmodel.guard(C.parse("powersgd:32"), 0.9).name == "bf16"
    assert costmodel.guard(C.parse("bf16"), 0.9).name == "none" and costmodel.guard(C.parse("none"), 0.9).name == "none"
    assert costmodel.guard(rank1, float("nan")) == rank2


def test_relative_error_is_global_and_zero_for_zero():
    a = {"x": jnp.ones(3), "y": jnp.zeros(2)}
    assert float(costmodel.relative_error(a, a)) == 0
    assert float(costmodel.relative_error({"x": jnp.zeros(3), "y": jnp.zeros(2)}, {"x": jnp.zeros(3), "y": jnp.zeros(2)})) == 0
    assert float(costmodel.relative_error({"x": jnp.zeros(3), "y": jnp.ones(2)}, a)) == pytest.approx(np.sqrt(5 / 3))
    assert costmodel.relative_error(a, a).dtype == jnp.float32


# ---- local steps: the pseudo-gradient's codec and --overlap ---------------------------------------

MIB_PER_S = {"comm_small_s": 1.0, "comm_full_s": 8.0, "comm_sizes": [2 ** 20, 2 ** 23]}  # 1 s per MiB, no latency
# 1 % under whole MiB, so no H sits on a rounding edge: none 7.92 s per average, bf16 3.96, int8 1.98, int4 0.99
OPTIONS = [(name, int(0.99 * 2 ** k), 1) for name, k in (("none", 23), ("bf16", 22), ("int8", 21), ("int4", 20))]
INT8 = [OPTIONS[2]]


def test_local_steps_take_the_fewest_steps_first():
    # target 0.25 s per step: none H = 32 (capped 16), bf16 16, int8 8, int4 4
    record = costmodel.choose_local_steps({**MIB_PER_S, "compute_s": 1.0}, OPTIONS, 0.25)
    assert (record["pseudo_gradient"], record["sync_every"]) == ("int4", 4)
    assert {n: o["sync_every"] for n, o in record["options"].items()} == {"none": 16, "bf16": 16, "int8": 8, "int4": 4}
    assert record["predicted_step_s"] == pytest.approx(1 + 0.99 / 4) and "the pseudo-gradient goes int4" in record["why"]


def test_a_top_k_pseudo_gradient_takes_at_least_two_local_steps():
    """A top-k pseudo-gradient small enough for every step would, at H = 1, be every step's gradient
    (which `plan` and its guard decide): `local_only` sizes it at H >= 2, and its record says so."""
    sparse = ("topk:0.01:2:gather:decay=0.98", 2 ** 10, 1)  # 1 KiB: 1 ms per average, within the target
    record = costmodel.choose_local_steps({**MIB_PER_S, "compute_s": 1.0}, [*OPTIONS, sparse], 0.25, local_only=[sparse[0]])
    assert (record["pseudo_gradient"], record["sync_every"]) == (sparse[0], 2) and record["fits"]
    assert record["why"].startswith("local steps, averaged every 2 steps, the fewest for a top-k pseudo-gradient")
    assert costmodel.choose_local_steps({**MIB_PER_S, "compute_s": 1.0}, [*OPTIONS, sparse], 0.25)["sync_every"] == 1


def test_top_k_pseudo_gradients_are_2_bit_decayed_and_settled_for_the_devices():
    params = big_params()
    two, three = costmodel.pseudo_topk(params, 2), costmodel.pseudo_topk(params, 3, {"sum", "halves"})
    assert [c.density for c in two] == sorted((c.density for c in two), reverse=True) and len(two) > 1
    assert all((c.bits, c.decay, c.form) == (2, 0.98, "gather") for c in two)
    # from 3 devices the ring-summed form sends fewer bytes, and 2-bit values there need the ring's coded sum
    assert costmodel.pseudo_topk(params, 3) and not three
    rows = predict.predict(predict.Cluster(2, 1, 1e7), 0.01, params)
    assert {r["sync_every"] for r in rows if r["compression"] == two[0].name} == {4, 16}  # local steps only


@pytest.mark.parametrize("compute_s, expected", [
    (0.2, "int8"),   # all capped at 16: int8 0.324 s per step, int4 0.262: int8 within 20 % of int4
    (0.1, "int4"),   # int8 0.224, int4 0.162: int8 is 28 % slower, so int4
])
def test_at_equal_h_compression_is_bought_only_for_a_20_percent_shorter_step(compute_s, expected):
    record = costmodel.choose_local_steps({**MIB_PER_S, "compute_s": compute_s}, OPTIONS, 0.25)
    assert record["sync_every"] == 16 and record["pseudo_gradient"] == expected


def test_overlap_allows_twice_the_link_time_and_is_proposed_where_it_pays():
    figures = {**MIB_PER_S, "compute_s": 1.0}
    plain, hidden = (costmodel.choose_local_steps(figures, INT8, 0.25, overlap) for overlap in (False, True))
    assert (plain["sync_every"], hidden["sync_every"]) == (8, 4)  # 1.98 s per average: 0.25 s, then 0.5 s per step
    assert hidden["overlap"] and not plain["overlap"] and hidden["predicted_step_s"] == 1.0  # max(1.0, 1.98 / 4)
    assert hidden["propose_overlap"] is None and "--overlap" in hidden["why"]
    assert plain["propose_overlap"] is None  # 1.25 s against 1.0 s hidden: under 20 % shorter
    # compute 0.4 s: H = 16 either way; 0.524 s per step against 0.4 s hidden: proposed
    proposal = costmodel.choose_local_steps({**figures, "compute_s": 0.4}, INT8, 0.25)["propose_overlap"]
    assert proposal["sync_every"] == 16 and proposal["predicted_step_s"] == 0.4 and "--overlap" in proposal["why"]
    assert costmodel.choose_local_steps({**figures, "compute_s": 100.0}, INT8, 0.25)["propose_overlap"] is None
    # Overlapped, H is at least 2 (int4's 0.99 s fits 0.5 x 2 s at every step, but only a round overlaps)
    low = costmodel.choose_local_steps({**figures, "compute_s": 2.0}, [OPTIONS[3]], 0.25, overlap=True)
    assert low["sync_every"] == 2 and low["overlap"] and low["predicted_step_s"] == 2.0 and "fewest" in low["why"]


def test_quantized_codecs_join_the_ladder_within_their_error_bound():
    params = big_params()
    names = lambda devices: [c.name for c in costmodel.ladder(params, quantized_devices=devices)]  # noqa: E731
    assert names(2)[:4] == names(4)[:4] == ["none", "bf16", "int8", "int4"]
    assert names(8)[:3] == ["none", "bf16", "int8"] and "int4" not in names(8)  # 74 % > QUANT_BOUND
    assert "int8" not in names(77) and "int8" in names(76)
    int4 = C.parse("int4").payload_bytes(params)
    assert all(c.payload_bytes(params) < int4 for c in costmodel.ladder(params, quantized_devices=2)[4:])
    assert names(None) == [c.name for c in costmodel.ladder(params)] and "int8" not in names(None)
    assert costmodel.weaker(C.parse("int4")).name == "int8" and costmodel.weaker(C.parse("int8")).name == "bf16"


# ---- a described cluster (python -m jaxdp.bench plan) ---------------------------------------------


def test_a_cluster_s_all_reduce_is_a_node_ordered_ring():
    mbit = 1e6
    two = predict.Cluster(nodes=2, devices=1, link_bits_per_s=100 * mbit, latency_s=1e-3)
    # a ring of 2: each link carries the whole buffer each way, in 2 messages
    assert two.allreduce().seconds(12_500_000) == pytest.approx(1.0 + 2e-3)
    flat = predict.Cluster(nodes=2, devices=4, link_bits_per_s=100 * mbit, latency_s=1e-3)
    # flat over 8: 2 x 7 / 8 of the buffer over each node's link, 14 messages; hierarchical: the ring of 2
    assert flat.allreduce().seconds(12_500_000) == pytest.approx(1.75 + 14e-3)
    assert flat.allreduce(hierarchical=True).seconds(12_500_000) == pytest.approx(1.0 + 2e-3)
    inside = predict.Cluster(nodes=1, devices=4, link_bits_per_s=100 * mbit, local_bits_per_s=1000 * mbit)
    assert inside.allreduce().seconds(12_500_000) == pytest.approx(1.5 * 0.1)  # 2 x 3 / 4 at 10x the link


def test_predict_covers_the_ladder_local_steps_overlap_and_hierarchy():
    cluster = predict.Cluster(nodes=2, devices=4, link_bits_per_s=1e8)
    rows = predict.predict(cluster, 0.01, big_params(), strategy="ring", sync_every=(1, 4))
    kinds = {(r["compression"], r["sync_every"], r["overlap"], r["hierarchy"]) for r in rows}
    assert ("int4", 4, True, "auto") in kinds and ("none", 1, False, "flat") in kinds
    assert not any(r["compression"].startswith("powersgd") and r["sync_every"] > 1 for r in rows)
    assert not any(r["compression"] == "int4" and r["hierarchy"] == "flat" for r in rows)  # 8 on the ring: past the bound
    for r in rows:
        share = r["allreduce_s"] / r["sync_every"]
        assert r["step_s"] == pytest.approx(max(0.01, share) if r["overlap"] else 0.01 + share)


def test_the_moved_names_still_resolve_with_a_warning():
    from jaxdp.sync import autostart, controller

    with pytest.warns(DeprecationWarning, match="moved to jaxdp.sync.predict.Cluster"):
        assert costmodel.Cluster is predict.Cluster
    with pytest.warns(DeprecationWarning, match="moved to jaxdp.sync.autostart.start"):
        assert controller.start is autostart.start
