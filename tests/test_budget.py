"""--byte-budget: its grammar, the rule that it needs both autos, and what jaxdp.sync.budget.choose
picks for given shapes (a pure function: no run, no timing); the budget bench at tiny size."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import run_cli
from jaxdp.config import ConfigError, parse_args
from jaxdp.inputs import parse_byte_budget
from jaxdp.sync import budget, rules
from jaxdp.sync.codecs import parse
from jaxdp.sync.codecs.base import bytes_sent

# About the laptop GPT's 137 K float32 values, in three leaves.
PARAMS = {"embed": jax.ShapeDtypeStruct((256, 64), np.float32), "blocks": jax.ShapeDtypeStruct((114688,), np.float32),
          "head": jax.ShapeDtypeStruct((64, 64), np.float32)}
PSUM, RING = rules.abilities("psum"), rules.abilities("ring")


@pytest.mark.parametrize("text, value", [("0.001", 0.001), ("1000x", 0.001), ("1000X", 0.001), (" 0.5 ", 0.5),
                                          ("1", 1.0), ("1x", 1.0), ("2.5e-4", 2.5e-4)])
def test_the_budget_is_a_fraction_or_nnn_fold(text, value):
    assert parse_byte_budget(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["0", "2", "-0.1", "0x", "0.5x", "x", "abc", "nan", "inf", "1e-400x", ""])
def test_a_bad_budget_is_one_line_naming_the_grammar(text):
    with pytest.raises(ConfigError) as err:
        parse_args(["--sync-every", "auto", "--compression", "auto", "--byte-budget", text])
    message = str(err.value)
    assert "\n" not in message and "--byte-budget" in message and "1000x" in message and repr(text) in message


@pytest.mark.parametrize("flags", [["--sync-every", "8", "--compression", "auto"],
                                   ["--sync-every", "auto", "--compression", "topk:0.01"],
                                   ["--sync-every", "auto"]])
def test_the_budget_needs_both_autos(flags):
    config = parse_args([*flags, "--byte-budget", "1000x"])
    with pytest.raises(ConfigError, match=r"^--byte-budget chooses H and the codec: it needs --sync-every auto and "
                                          r"--compression auto"):
        rules.check_config(config)
    assert rules.check_config(parse_args(["--sync-every", "auto", "--compression", "auto", "--byte-budget", "1000x",
                                          "--metrics-at-sync"]))  # a budget's H is at least 2 with --metrics-at-sync


def _fits(record, budget_fraction):
    return record["bytes_per_step"] <= budget_fraction * record["ring_bytes_per_step"]


def test_the_ring_reference_is_float32_every_step():
    n_values = 256 * 64 + 114688 + 64 * 64
    assert budget.ring_bytes(PARAMS, 2) == bytes_sent(4 * n_values, 2) == 4 * n_values


@pytest.mark.parametrize("fraction", [0.5, 0.1, 0.01, 0.001, 0.0005, 0.0001])
def test_the_choice_fits_and_no_fewer_local_steps_would(fraction):
    record = budget.choose(PARAMS, 2, fraction, PSUM)
    assert _fits(record, fraction) and record["fewer_bytes"] >= 1 / fraction
    h = record["sync_every"]
    for smaller in [2 ** i for i in range(h.bit_length() - 1)]:  # every H below: nothing at MIN_DENSITY or more fits
        for name in ("none", "bf16"):
            assert budget.sent_per_step(parse(name), PARAMS, 2, smaller) > fraction * record["ring_bytes_per_step"]
        if smaller >= 2:
            topk = budget.densest(PARAMS, 2, smaller, fraction * record["ring_bytes_per_step"], PSUM)
            assert topk is None or topk.density < budget.MIN_DENSITY


def test_within_the_fewest_local_steps_the_least_compression():
    record = budget.choose(PARAMS, 2, 0.5, PSUM)
    assert (record["sync_every"], record["pseudo_gradient"]) == (1, "bf16")  # exactly half: bf16 every step
    record = budget.choose(PARAMS, 2, 0.01, PSUM)
    assert record["sync_every"] == 2 and record["pseudo_gradient"].startswith("topk:")
    density = float(record["pseudo_gradient"].split(":")[1])
    assert density >= budget.MIN_DENSITY
    denser = budget.densest(PARAMS, 2, 2, float("inf"), PSUM).__class__(density=round(density + 0.001, 3), bits=2,
                                                                         decay=0.98, form="gather")
    assert budget.sent_per_step(denser, PARAMS, 2, 2) > 0.01 * record["ring_bytes_per_step"]  # the densest that fits


def test_a_density_below_the_floor_waits_for_more_local_steps():
    # At 1/1000, H = 2 and 4 fit top-k only below MIN_DENSITY (about 0.0045, 0.009): H = 8 at about 0.017.
    record = budget.choose(PARAMS, 2, 0.001, PSUM)
    assert record["sync_every"] == 8 and float(record["pseudo_gradient"].split(":")[1]) >= budget.MIN_DENSITY
    floor = budget.MIN_DENSITY
    assert budget.quality_key(8, 4, floor) < budget.quality_key(2, 4, floor * 0.9)  # the floor first
    assert budget.quality_key(4, 4, floor * 0.6) < budget.quality_key(2, 4, floor * 0.3)  # below it, the densest
    assert budget.quality_key(2, 4, floor * 2) < budget.quality_key(4, 4, floor * 4)  # above it, the fewest H
    assert budget.quality_key(4, 0, None) < budget.quality_key(4, 1, None) < budget.quality_key(4, 4, 0.5)
    assert budget.quality_key(256, 3, None) < budget.quality_key(2, 4, floor / 2)  # int4 at any H before sub-floor top-k


def test_with_outer_momentum_only_codecs_that_send_every_value():
    record = budget.choose(PARAMS, 2, 0.001, RING, momentum_free=False)
    assert (record["sync_every"], record["pseudo_gradient"]) == (256, "int8") and _fits(record, 0.001)
    assert "--outer-momentum 0" in record["why"]
    with pytest.raises(ValueError, match="no choice sends at most"):
        budget.choose(PARAMS, 2, 0.001, PSUM, momentum_free=False)  # psum: no int4, and bf16 at H = 256 is 512x


def test_more_devices_without_the_ring_take_the_all_gathered_top_k():
    """From 3 devices the settled form is the ring-summed one, whose 2-bit sums need the ring's coded
    hops: with psum the budget takes the all-gathered form (an all-gather), not a dense codec at a
    far larger H (averaged every 256 steps in bf16 at 1/300), nor no choice at all (1/1000)."""
    for fraction in (1 / 300, 0.001):
        record = budget.choose(PARAMS, 4, fraction, PSUM)
        assert ":gather:" in record["pseudo_gradient"] and record["sync_every"] <= 16 and _fits(record, fraction)
        assert float(record["pseudo_gradient"].split(":")[1]) >= budget.MIN_DENSITY
    assert budget.densest(PARAMS, 4, 8, 0.001 * budget.ring_bytes(PARAMS, 4), {"sum"}) is None  # neither form


def test_more_devices_and_the_least_h():
    record = budget.choose(PARAMS, 4, 0.001, RING)
    assert ":sum:" in record["pseudo_gradient"] and _fits(record, 0.001)  # from 3 devices the ring-summed form
    assert budget.choose(PARAMS, 2, 0.5, PSUM, least_sync_every=2)["sync_every"] == 2
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        budget.choose(PARAMS, 2, 0.0, PSUM)


@pytest.mark.slow  # two jaxdp.train subprocesses: about 40 s on 2 cores
def test_the_budget_bench_writes_both_ratios(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = tmp_path / "b.json"
    proc = run_cli("budget", "--train-args", "--model gpt --layers 1 --d-model 32 --heads 2 --seq-len 16 --batch-size 4 "
                   "--lr 3e-3", "--steps", "8", "--eval-batches", "1", "--budget", "100x", "--dataset", str(corpus),
                   "--json", str(out), module="jaxdp.bench")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    sync, run = data["results"]
    assert sync["variant"] == "synchronous" and sync["sync_every"] is None
    assert run["sync_every"] >= 2 and run["pseudo_gradient"].startswith("topk:") and "--byte-budget 0.01" in run["why"]
    assert "outer step: SGD at lr 2, no momentum" in run["why"]  # the user's path: the budget's own outer step
    assert run["fewer_bytes"] == pytest.approx(sync["comm_bytes_per_step"] / (run["comm_bytes_per_step"]
                                                                             + run["scalar_bytes_per_step"]))
    assert run["fewer_bytes"] >= 90 and run["loss_ratio"] == pytest.approx(run["eval_loss"] / sync["eval_loss"])
    (summary,) = data["summary"]
    assert {"config", "steps", "variant", "seeds", "loss_ratio_mean", "loss_ratio_max", "fewer_bytes_min"} <= set(summary)


def test_fit_takes_the_budget_and_says_in_one_error_when_nothing_fits(devices):
    import optax

    import jaxdp
    from jaxdp.errors import InputError
    from jaxdp.mesh import make_mesh

    rng = np.random.default_rng(0)
    params = {"w": jnp.zeros((64, 40), jnp.float32)}  # 2,560 values
    x = rng.standard_normal((8 * 8, 64)).astype(np.float32)

    def loss_fn(p, batch):
        return jnp.mean(jnp.square(batch["x"] @ p["w"] - 1.0))

    def run(fraction, **sync):
        return jaxdp.fit(loss_fn, params, optax.adam(1e-2), lambda step: {"x": x[step % 8 * 8:(step % 8 + 1) * 8]},
                         steps=8, mesh=make_mesh(devices[:2]), progress=False, log_every=1,
                         sync=jaxdp.SyncOptions(sync_every="auto", compression="auto", byte_budget=fraction,
                                                outer_tx=optax.sgd(1.0), **sync))

    result = run("50x")
    ring = budget.ring_bytes(params, 2)
    chosen = budget.choose(params, 2, 0.02, PSUM)
    sent = [r["comm_bytes_per_step"] for r in result.history if "comm_bytes_per_step" in r]
    assert chosen["sync_every"] >= 2 and sent and max(sent) <= 0.02 * ring  # the codec's own count
    assert max(sent) == pytest.approx(chosen["bytes_per_step"] - budget.bytes_sent(4 * budget.SCALARS, 2)
                                      * (chosen["sync_every"] - 1) / chosen["sync_every"])
    with pytest.raises(InputError, match=r"byte_budget=1e-05: no choice sends at most 1e-05 .*; allow more bytes"):
        run(1e-5)
    with pytest.raises(InputError, match=r"byte_budget must be a fraction"):
        run("2")


def test_the_budget_outer_step_is_sgd_at_lr_2_with_top_k_and_a_resume_keeps_the_one_recorded():
    """No outer optimizer given: SGD without momentum at OUTER_LR_TOPK where the budget chose top-k
    (else plain averaging), in the choice's one line; a resumed run keeps its checkpoint's lr, and one
    whose checkpoint records none (written before the rule) goes on with plain averaging."""
    from jaxdp.mesh import make_mesh
    from jaxdp.sync import autostart
    from jaxdp.sync.spec import SyncSpec

    assert budget.outer_lr("topk:0.017:2:gather:decay=0.98") == budget.OUTER_LR_TOPK == 2.0
    assert budget.outer_lr("int4") == budget.outer_lr(None) == 1.0
    mesh = make_mesh(jax.devices()[:2])
    requested = SyncSpec(compression="auto", sync_every="auto")
    g = {k: jnp.ones(x.shape, x.dtype) for k, x in PARAMS.items()}

    def lr_of(begun):
        from jaxdp.step.local_sgd import default_outer

        tx = default_outer(begun.spec.outer_tx)  # (None: plain averaging)
        return -float(tx.update(g, tx.init(g), g)[0]["head"][0, 0])

    def start(recorded=None, byte_budget=0.001):
        return autostart.start(requested, mesh, PARAMS, make_state=None, make_step=None, batches=None,
                               recorded=recorded, byte_budget=byte_budget)

    begun = start()
    record = dict(begun.records)["local_steps"]
    assert begun.pseudo_gradient.startswith("topk:") and lr_of(begun) == record["outer_lr"] == 2.0
    assert "outer step: SGD at lr 2, no momentum" in record["why"] and "\n" not in record["why"]
    meta = {"step": 16, "config": {"sync_every": 8, "compression": begun.pseudo_gradient}, "sync_every_auto": True}
    assert lr_of(start({**meta, "byte_budget": {"outer_lr": 2.0}})) == 2.0
    assert lr_of(start({**meta, "byte_budget": {"outer_lr": None}})) == 1.0  # (a resume of a run from before)
    assert lr_of(start(meta)) == 1.0
    dense = start(byte_budget=0.3)  # bf16 or int8 every few steps: plain averaging
    assert not dense.pseudo_gradient.startswith("topk") and lr_of(dense) == 1.0, dense.pseudo_gradient


@pytest.mark.slow  # two jaxdp.train subprocesses: about 20 s on 2 cores
def test_the_command_line_budget_takes_its_own_outer_step_unless_an_outer_optimizer_is_given(tmp_path):
    """With the outer flags at their defaults (DiLoCo's Nesterov, which top-k pseudo-gradients cannot
    follow) --byte-budget takes its own outer step (with top-k: SGD at lr 2, no momentum), says so in
    the choice's one line, and chooses top-k; an outer optimizer given keeps it, and the budget then
    chooses without top-k."""
    def chosen(*flags: str) -> tuple[str, dict]:
        metrics = tmp_path / f"m{len(flags)}.jsonl"
        proc = run_cli("--devices", "2", "--steps", "2", "--sync-every", "auto", "--compression", "auto",
                       "--byte-budget", "100x", "--no-progress", "--metrics-file", str(metrics), *flags)
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        return proc.stderr, next(r for r in records if r.get("event") == "local_steps")

    said, record = chosen()
    assert said.count("outer step: SGD at lr 2, no momentum") == 1 and record["outer_lr"] == 2.0, said
    assert record["pseudo_gradient"].startswith("topk:"), record
    said, record = chosen("--outer-optimizer", "nesterov", "--outer-lr", "0.5")
    assert "outer step:" not in said and "outer_lr" not in record, (said, record)
    assert not record["pseudo_gradient"].startswith("topk:"), record
