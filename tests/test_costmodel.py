"""jaxdp/costmodel.py: predictions and decisions from measured figures, as pure functions (the
all-reduce time line, the compression ladder and plan, the quality guard, the local-steps H rule)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdp import compression as C, costmodel
from jaxdp.costmodel import CommModel


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
    assert names == ["none", "bf16", "powersgd:32", "powersgd:16", "powersgd:8", "powersgd:4", "powersgd:2", "powersgd:1"]
    payloads = [c.payload_bytes(big_params()) for c in costmodel.ladder(big_params())]
    assert payloads == sorted(payloads, reverse=True)
    assert [c.name for c in costmodel.ladder({"w": jax.ShapeDtypeStruct((24, 16), jnp.float32)})] == ["none", "bf16", "powersgd:4",
                                                                                              "powersgd:2", "powersgd:1"]


def test_plan_picks_none_when_compute_dominates_and_strong_compression_when_comm_does():
    params, compute = big_params(), 0.010
    fast = costmodel.CommModel(latency_s=20e-6, seconds_per_byte=1 / 100e9)  # 4 MB in 42 µs
    choice, reasons = costmodel.plan(compute, fast, params)
    assert choice.name == "none" and reasons["fits"] and reasons["chosen"] == "none"

    slow = costmodel.CommModel(latency_s=1e-3, seconds_per_byte=1 / 10e6)   # 10 MB/s: even rank 1 takes > 2.5 ms
    choice, reasons = costmodel.plan(compute, slow, params)
    assert choice.name == "powersgd:1" and not reasons["fits"] and "no candidate fits" in reasons["why"]

    # A link where bf16's halving is not enough but a moderate rank is.
    middle = costmodel.CommModel(latency_s=50e-6, seconds_per_byte=1 / 500e6)
    choice, reasons = costmodel.plan(compute, middle, params)
    assert isinstance(choice, C.PowerSGD) and reasons["fits"]
    assert reasons["predicted_s"]["bf16"] > reasons["target_s"] >= reasons["predicted_s"][choice.name]
    assert choice.rank == max(c.rank for c in costmodel.ladder(params)[2:]
                              if middle.seconds(c.payload_bytes(params), 2) <= costmodel.TARGET_COMM_FRACTION * compute)


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
