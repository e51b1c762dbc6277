"""What `topk:DENSITY` (no BITS, no form) settles to (jaxdp/sync/codecs/topk.py, TopK.settled): of the
forms and precisions, the one that fits the most values per chunk into the bytes DENSITY float32
values send; the byte counts written out here by hand."""

import json

import jax
import jax.numpy as jnp

from jaxdp.config import parse_args
from jaxdp.sync import codecs
from jaxdp.sync.codecs.topk import TopK

# the default digits MLP: 64 -> 256 -> 256 -> 10, 85,002 values: 21 chunks of 4096 (the last padded)
MLP = {"Dense_0": {"kernel": jax.ShapeDtypeStruct((64, 256), jnp.float32), "bias": jax.ShapeDtypeStruct((256,), jnp.float32)},
       "Dense_1": {"kernel": jax.ShapeDtypeStruct((256, 256), jnp.float32), "bias": jax.ShapeDtypeStruct((256,), jnp.float32)},
       "Dense_2": {"kernel": jax.ShapeDtypeStruct((256, 10), jnp.float32), "bias": jax.ShapeDtypeStruct((10,), jnp.float32)}}
SIZE, CHUNKS = 85_002, 21


def gather_bytes(k: int, bits: int, n: int) -> int:
    """What one device sends in the all-gathered form: its message to each of the n - 1 others, two
    12-bit indices in 3 bytes, then the values: 4 bytes each, or 2 bits each (4 a byte) and one float32
    scale per block of at most 512."""
    values = CHUNKS * k
    indices = -(-values // 2) * 3
    if bits == 32:
        return (n - 1) * (indices + 4 * values)
    blocks = -(-values // 512)
    block = 4 * -(-values // (4 * blocks))  # blocks of equal length, a multiple of 4 values
    return (n - 1) * (indices + blocks * block // 4 + 4 * blocks)


def sum_bytes(k: int, n: int) -> int:
    """The ring-summed form with float32 values: an all-reduce of the indices (two in a float32, padded
    to an even count) and of the values, each device sending 2 (n - 1) / n of it."""
    values = CHUNKS * k
    return (-(-values // 2) * 4 + 4 * values) * 2 * (n - 1) // n


def test_at_two_devices_the_float32_bytes_carry_2_bit_values_at_3_times_the_density():
    k = round(0.01 * 4096)  # 41
    budget = gather_bytes(k, 32, 2)
    assert budget == 4737 and budget < sum_bytes(k, 2) == 5168  # float32: the all-gathered form sends fewer
    chosen = codecs.parse("topk:0.01").settled(MLP, 2, False)
    assert chosen == TopK(0.0312, 2, "gather")
    assert chosen.shape(SIZE) == (CHUNKS, 4096, 128) and chosen.sent_bytes(SIZE, 2) == gather_bytes(128, 2, 2) == 4728
    assert gather_bytes(129, 2, 2) > budget  # the densest that fits: one more value per chunk does not
    assert codecs.parse("topk:0.01:decay=0.9").settled(MLP, 2, True) == TopK(0.0312, 2, "gather", 0.9)


def test_from_three_devices_the_all_gather_grows_and_at_eight_float32_ring_sums_win():
    k = 41
    assert sum_bytes(k, 3) == 6890 < gather_bytes(k, 32, 3)
    # 3 devices: 2-bit gathered values fit 93 a chunk into 6,890 bytes, float32 ring-summed ones 41
    assert codecs.parse("topk:0.01").settled(MLP, 3, False) == TopK(0.0227, 2, "gather")
    assert gather_bytes(93, 2, 3) <= 6890 < gather_bytes(94, 2, 3)
    # 8 devices: each 2-bit value goes to 7 others (7 x 1.75 bytes), a ring-summed float32 one costs ~10.5
    assert codecs.parse("topk:0.01").settled(MLP, 8, False) == TopK(0.01, 0, "sum")
    assert gather_bytes(34, 2, 8) <= sum_bytes(k, 8) == 9044 < gather_bytes(35, 2, 8)  # 34 < 41
    assert codecs.parse("topk:0.01").settled(MLP, 1, False) == TopK(0.01, 0, "sum")  # (nothing crosses)


def test_a_spec_that_names_bits_or_a_form_keeps_its_density():
    assert codecs.parse("topk:0.01:gather").settled(MLP, 2, False) == TopK(0.01, 0, "gather")
    assert codecs.parse("topk:0.01:sum").settled(MLP, 2, False) == TopK(0.01, 0, "sum")
    assert codecs.parse("topk:0.01:32").settled(MLP, 2, False) == TopK(0.01, 32, "gather")  # fewer bytes at 2
    assert codecs.parse("topk:0.01:32").settled(MLP, 8, False) == TopK(0.01, 32, "sum")
    assert codecs.parse("topk:0.01:8").settled(MLP, 2, False) == TopK(0.01, 8, "gather")
    assert codecs.parse("topk:0.01:32").name == "topk:0.01:32" != codecs.parse("topk:0.01").name


def test_the_note_says_what_it_chose_and_why_in_one_line():
    note = codecs.parse("topk:0.01").settled_note(MLP, 2, False)
    assert note.startswith("--compression topk:0.01: every step's gradients go all-gathered") and "\n" not in note
    assert "as --compression topk:0.0312:2:gather, 4,728 bytes" in note
    assert "3.1x the values of topk:0.01:gather in its bytes: quality follows how many values cross" in note
    assert "--compression topk:0.01:gather keeps the density" in note
    note = codecs.parse("topk:0.01").settled_note(MLP, 8, False)
    assert "as --compression topk:0.01:sum, 9,044 bytes" in note and "no other form or precision fits more" in note
    assert codecs.parse("topk:0.01:gather").settled_note(MLP, 2, False) is None
    assert codecs.parse("topk:0.01").settled_note(MLP, 1, False) is None


def test_cli_topk_without_bits_or_form_says_its_choice_and_runs_it(tmp_path, capsys):
    from jaxdp.train import train

    metrics = tmp_path / "m.jsonl"
    train(parse_args(["--steps", "4", "--compression", "topk:0.01", "--strategy", "ring", "--devices", "2",
                      "--no-progress", "--log-every", "2", "--metrics-file", str(metrics)]))
    lines = [line for line in capsys.readouterr().err.splitlines() if "--compression topk:0.01:" in line]
    assert len(lines) == 1 and "as --compression topk:0.0312:2:gather" in lines[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (event,) = [r for r in records if r.get("event") == "compression_form"]
    assert event["chosen"] == "topk:0.0312:2:gather"
    logged = [r["comm_bytes"] for r in records if r.get("comm_bytes") is not None]
    assert logged and logged[-1] == 4728  # what the chosen codec sends, within float32's 4,737
