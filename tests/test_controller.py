"""jaxdp/sync/controller.py: `--sync-every auto` and `--compression auto` at a run's start (`start`,
`decide_sync_every`), the flags, and CLI runs where the decision is forced by --comm-target (a real
measurement against a target nothing meets, or one everything meets). The H rule itself, a pure
function of measured figures: tests/test_costmodel.py."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdp
import jaxdp.sync.collectives
from jaxdp.errors import InputError
from helpers import records, step_records
from jaxdp.config import ConfigError, config_toml, parse_args, read_config_file
from jaxdp.sync.rules import check_config
from jaxdp.models.builtin import MLP
from jaxdp.sync import codecs as compression, costmodel
from jaxdp.sync.controller import Controller
from jaxdp.train import train

# ---- the measurement ----------------------------------------------------------------------------


@pytest.mark.slow  # over 3 s on 2 cores
def test_a_fixed_compressor_sizes_h_for_its_payload(devices, monkeypatch):
    mesh = jaxdp.make_mesh(devices[:4])
    params = MLP(hidden=(64,)).init(jax.random.PRNGKey(0), jnp.zeros((1, 32)))["params"]
    grad_bytes = compression.uncompressed_bytes(params)
    controller = Controller(lambda state, batch: None, mesh, jaxdp.sync.collectives.psum_mean, params)
    # An all-reduce of the whole gradient takes 10x the compute: plain needs H = 40 (capped), bf16 H = 20
    figures = {"compute_s": 1.0, "comm_small_s": 0.0, "comm_full_s": 10.0, "comm_sizes": [0, grad_bytes]}
    monkeypatch.setattr(Controller, "measure", lambda self, state, batch: figures)
    _, plain = controller.decide_sync_every(None, [None], 0)
    _, half = controller.decide_sync_every(None, [None], 0, compression.Bf16())
    assert (plain["pseudo_gradient"], plain["payload_bytes"], plain["uncapped_sync_every"]) == ("none", grad_bytes, 40)
    assert (half["pseudo_gradient"], half["payload_bytes"], half["uncapped_sync_every"]) == ("bf16", grad_bytes // 2, 20)
    assert plain["sync_every"] == half["sync_every"] == 16
    figures["comm_full_s"] = 0.2  # the link keeps up: synchronous
    assert controller.decide_sync_every(None, [None], 0)[1]["sync_every"] == 1


def bandwidth_bound(compute_s: float = 0.001):
    """A `Controller.measure` whose figures say: bandwidth-bound, an all-reduce of the whole
    gradient takes 1 s (1/16 of it 1/16 s, no latency), against `compute_s` of compute (by
    default 1000x less: far too slow, no candidate fits and PowerSGD predicts the shortest step)."""
    def measure(self, state, batch):
        return {"compute_s": compute_s, "comm_small_s": 1.0 / 16, "comm_full_s": 1.0,
                "comm_sizes": [self.grad_bytes // 16, self.grad_bytes]}

    return measure


def far_too_slow_a_link(devices, monkeypatch, *, count=4, strategy=jaxdp.sync.collectives.psum_mean, compute_s=0.001) -> Controller:
    """A controller on `count` devices whose measurements are `bandwidth_bound(compute_s)`."""
    mesh = jaxdp.make_mesh(devices[:count])
    params = MLP(hidden=(256,)).init(jax.random.PRNGKey(0), jnp.zeros((1, 256)))["params"]
    monkeypatch.setattr(Controller, "measure", bandwidth_bound(compute_s))
    return Controller(lambda state, batch: None, mesh, strategy, params)


@pytest.mark.slow  # over 4 s on 2 cores
def test_a_compression_that_misses_the_target_is_not_guarded_when_local_steps_replace_it(devices, monkeypatch):
    """With --sync-every auto a plan that misses the target means local steps with a plain
    pseudo-gradient: checking PowerSGD's quality then only costs time (on the 10 Mbit/s testbed,
    compiling a replay per rank took most of a 2.5-minute start). Plain `decide` still guards."""
    controller = far_too_slow_a_link(devices, monkeypatch)
    guarded = []
    monkeypatch.setattr(Controller, "truth", lambda self, state, batches: guarded.append(1) or ([], {}, {}))
    monkeypatch.setattr(Controller, "replay", lambda self, candidate, truth: 0.0)
    decision, record = controller.decide_sync_every(None, [None], 0, auto_compression=True)
    assert isinstance(compression.parse(decision.record["choice"]), compression.TopK) and not decision.record["fits"]
    assert record["sync_every"] == 16 and decision.record["quality_checks"] == [] and not guarded
    assert controller.decide(None, [None], 0).record["quality_checks"] and guarded  # without local steps: guarded


def test_a_choice_the_guard_raised_is_the_one_the_record_explains(devices, monkeypatch):
    """The record's "why" names the final choice (it named the plan's rank while the guard had
    raised it), and "planned" keeps the plan's."""
    controller = far_too_slow_a_link(devices, monkeypatch)
    monkeypatch.setattr(Controller, "truth", lambda self, state, batches: ([], {}, {}))
    monkeypatch.setattr(Controller, "replay",  # top-k refused, PowerSGD from rank 16 passes
                        lambda self, candidate, truth: 0.0 if getattr(candidate, "rank", 0) >= 16 else 2.0)
    record = controller.decide(None, [None], 0).record
    assert record["planned"] != record["choice"] and record["choice"].startswith("powersgd:16"), record["why"]
    assert record["why"].startswith(f"{record['choice']}: the quality guard stepped back from {record['planned']}")


def test_a_guard_that_steps_back_past_the_target_leads_to_local_steps(devices, monkeypatch):
    """The plan's PowerSGD fits the target, the guard refuses every rank and steps back to a codec
    that does not fit: the record says it misses (it said "fits", the plan's), so --sync-every
    auto chooses local steps instead of a synchronous step that the link cannot keep up with."""
    # bandwidth-bound: int4 (1/8 of the bytes) predicts 1/8 s against a target of 0.25 x 0.1 s
    controller = far_too_slow_a_link(devices, monkeypatch, count=2, strategy=jaxdp.sync.collectives.ring_mean, compute_s=0.1)
    monkeypatch.setattr(Controller, "truth", lambda self, state, batches: ([], {}, {}))
    # every rank refused, and every top-k pseudo-gradient (0.7 against PSEUDO_GUARD_THRESHOLD)
    monkeypatch.setattr(Controller, "replay", lambda self, candidate, truth: 0.7 if candidate.name.startswith("topk") else 0.5)
    decision, record = controller.decide_sync_every(None, [None], 0, auto_compression=True)
    assert decision.record["planned"].startswith("powersgd") and decision.record["choice"] == "int4"
    assert not decision.record["fits"] and record["sync_every"] > 1 and record["pseudo_gradient"] in ("int8", "int4")
    assert [c["candidate"] for c in record["quality_checks"]] and "kept none of them" in record["why"]


def test_local_steps_choose_a_top_k_pseudo_gradient_the_guard_keeps(devices, monkeypatch):
    """A slow link, local steps, an outer optimizer without momentum: a top-k pseudo-gradient (2 bits,
    error feedback decayed) needs the fewest local steps. The link here lets topk:0.01 average every
    2 steps and topk:0.03 every 8 (int4 only every 16): the choice is 0.01 (the densest at H = 2);
    the guard refuses it (0.7 above PSEUDO_GUARD_THRESHOLD), with it every sparser one, and the
    choice made again is 0.03 at H = 8, which passes. With DiLoCo's Nesterov outer optimizer top-k
    is not offered."""
    controller = far_too_slow_a_link(devices, monkeypatch, count=2, strategy=jaxdp.sync.collectives.ring_mean)
    by_name = {c.name: c for c in controller.pseudo_topk}
    assert list(by_name)[:2] == ["topk:0.03:2:gather:decay=0.98", "topk:0.01:2:gather:decay=0.98"]  # 2 devices: gathered
    dense, sparse = (by_name[n].payload_bytes(controller.abstract) / controller.grad_bytes for n in list(by_name)[:2])
    compute_s = sparse / (0.25 * 1.5)  # bandwidth-bound, 1 s for the whole gradient: 0.01 needs H = 2
    assert 4 < dense / (0.25 * compute_s) <= 8  # ... and 0.03 H = 8
    monkeypatch.setattr(Controller, "measure", bandwidth_bound(compute_s))
    truths = []
    monkeypatch.setattr(Controller, "truth", lambda self, state, batches: truths.append(1) or ([], {}, {}))
    monkeypatch.setattr(Controller, "replay", lambda self, candidate, truth: (
        0.5 if candidate.name in ("topk:0.03:2:gather:decay=0.98", "int4") else 0.7))
    _, record = controller.decide_sync_every(None, [None], 0, auto_compression=True)
    assert [c["candidate"] for c in record["quality_checks"]] == list(by_name)[1::-1] and len(truths) == 1
    assert (record["pseudo_gradient"], record["sync_every"]) == ("topk:0.03:2:gather:decay=0.98", 8)
    assert "kept topk:0.03:2:gather:decay=0.98" in record["why"]
    assert record["options"]["int4"]["sync_every"] == 16 and "topk:0.01:2:gather:decay=0.98" not in record["options"]

    import optax
    _, nesterov = controller.decide_sync_every(None, [None], 0, auto_compression=True, outer_momentum_free=False)
    assert not nesterov["pseudo_gradient"].startswith("topk") and "top-k pseudo-gradients were not offered" in nesterov["why"]
    from jaxdp.sync.controller import momentum_free
    from jaxdp.step.optim import make_outer_optimizer
    assert momentum_free(None) and momentum_free(make_outer_optimizer("sgd", 1.0, 0.0)) and momentum_free(optax.sgd(0.7))
    assert not momentum_free(make_outer_optimizer("nesterov", 0.7, 0.9)) and not momentum_free(optax.adam(1e-3))


def test_the_guard_steps_back_through_denser_topk_then_powersgd_s_ranks(devices, monkeypatch):
    """Far too slow a link: the plan takes the sparsest top-k. The guard checks it, then each denser
    one, then (every density refused) PowerSGD's ranks from the lowest up, against one threshold."""
    controller = far_too_slow_a_link(devices, monkeypatch, count=2)
    monkeypatch.setattr(Controller, "truth", lambda self, state, batches: ([], {}, {}))
    threshold = costmodel.GUARD_THRESHOLD
    sparse = [c.name for c in controller.candidates if c.name.startswith("topk")][::-1]  # sparsest first
    ranks = [c.name for c in controller.candidates if c.name.startswith("powersgd")][::-1]  # lowest first
    assert len(sparse) >= 2 and len(ranks) >= 2 and all(n.endswith(":gather") for n in sparse)  # (2 devices)
    errors = {sparse[0]: threshold + 0.01, sparse[1]: threshold}
    monkeypatch.setattr(Controller, "replay", lambda self, candidate, truth: errors[candidate.name])
    record = controller.decide(None, [None], 0).record
    assert (record["planned"], record["choice"]) == (sparse[0], sparse[1]), record["why"]
    assert record["quality_checks"] == [{"candidate": name, "relative_error": errors[name]} for name in sparse[:2]]
    assert record["why"].startswith(f"{sparse[1]}: the quality guard stepped back from {sparse[0]}")
    errors = {**{name: 2.0 for name in sparse + ranks[:-1]}, ranks[-1]: threshold}
    record = controller.decide(None, [None], 0).record
    assert record["choice"] == ranks[-1], record["why"]  # every density refused, every rank but the highest
    assert [c["candidate"] for c in record["quality_checks"]] == sparse + ranks


def test_the_guard_replays_topk_as_one_device_holding_the_mean(devices):
    """Top-k's replay, written out: over the window, x = mean + what is owed; the k largest |x| cross,
    the rest is owed; the error is that of the summed applied means against the summed means."""
    mesh = jaxdp.make_mesh(devices[:2])
    params = {"w": jnp.zeros((40, 25), jnp.float32)}  # 1,000 values: one chunk, k = 10 at density 0.01
    controller = Controller(lambda state, batch: None, mesh, jaxdp.sync.collectives.psum_mean, params)
    rng = np.random.default_rng(0)
    means = [rng.standard_normal((40, 25)).astype(np.float32) for _ in range(4)]
    owed0 = rng.standard_normal((40, 25)).astype(np.float32)
    owed, applied = owed0.ravel().copy(), []
    for mean in means:
        x = mean.ravel() + owed
        kept = np.zeros_like(x)
        top = np.argsort(-np.abs(x))[:10]
        kept[top] = x[top]
        owed = x - kept
        applied.append(kept)
    want = np.linalg.norm(sum(applied) - sum(m.ravel() for m in means)) / np.linalg.norm(sum(m.ravel() for m in means))
    got = controller.replay(compression.parse("topk:0.01:sum"), ([{"w": jnp.asarray(m)} for m in means],
                                                                   {"w": jnp.asarray(owed0)}, {}))
    assert got == pytest.approx(want, rel=1e-5) and 0.5 < got < 1  # (what top-k leaves waits: a large error)


# ---- the flags -----------------------------------------------------------------------------------

def test_flags_accept_auto_and_refuse_the_rest_in_one_line(tmp_path):
    assert parse_args(["--sync-every", "auto"]).sync_every == "auto"
    assert parse_args(["--sync-every", "AUTO"]).sync_every == "auto"
    assert parse_args(["--sync-every", "4"]).sync_every == 4
    bad = {("--sync-every", "0"): "--sync-every must be a positive integer (1: synchronous training), got 0",
           ("--sync-every", "fast"): "--sync-every must be a positive integer (1: synchronous training) or auto, got 'fast'",
           ("--sync-every", "2.5"): "or auto, got '2.5'",
           ("--sync-every", "auto", "--sync-fragments", "2"): "--sync-fragments=2 needs a fixed --sync-every",
           ("--sync-every", "auto", "--strategy", "host"): "--sync-every needs an in-graph strategy",
           ("--sync-every", "auto", "--shard-optimizer"): "--sync-every and --shard-optimizer do not combine",
           ("--sync-every", "auto", "--outer-lr", "0"): "--outer-lr must be a positive number"}
    for argv, needle in bad.items():
        with pytest.raises(ConfigError) as err:
            check_config(parse_args(list(argv)))  # per flag, then the sync rules (jaxdp/sync/rules.py)
        assert needle in str(err.value) and "\n" not in str(err.value), (argv, str(err.value))
    path = tmp_path / "run.toml"
    path.write_text(config_toml(parse_args(["--sync-every", "auto"]), comment="a note"))
    assert read_config_file(str(path))["sync_every"] == "auto" and "# a note\n" in path.read_text()
    assert parse_args(["--config", str(path)]).sync_every == "auto"


# ---- the command line ----------------------------------------------------------------------------

PLAIN = ["--outer-optimizer", "sgd", "--outer-lr", "1", "--outer-momentum", "0"]


def run(*flags):
    return train(parse_args(["--batch-size", "64", "--log-every", "1", "--no-progress", *map(str, flags)]))


def decisions(path, name="local_steps"):
    return [r for r in records(path) if r.get("event") == name]


def losses(path):
    return [(r["step"], r["loss"], r.get("synced")) for r in step_records(path)]


def test_auto_applies_h_and_trains_like_the_explicit_h(tmp_path):
    # A target no link meets (1e-9 x compute): a real measurement, then local steps at the cap.
    flags = ["--devices", 4, "--steps", 17, *PLAIN, "--comm-target", 1e-9]
    run(*flags, "--sync-every", "auto", "--metrics-file", tmp_path / "auto.jsonl")
    run(*flags, "--sync-every", 16, "--metrics-file", tmp_path / "h16.jsonl")
    [record] = decisions(tmp_path / "auto.jsonl")
    assert record["step"] == 0 and record["sync_every"] == 16 and record["uncapped_sync_every"] > 16
    assert record["compute_s"] > 0 and record["comm_full_s"] > 0 and record["target_fraction"] == 1e-9
    assert record["payload_bytes"] > 0 and record["predicted_comm_s"] == record["comm_per_sync_s"] / 16
    assert "MAX_AUTO_SYNC_EVERY" in record["why"]
    start = records(tmp_path / "auto.jsonl")[0]
    assert start["config"]["sync_every"] == 16 and start["sync_every_auto"] is True
    assert [s for s, _, synced in losses(tmp_path / "auto.jsonl") if synced] == [16]
    assert losses(tmp_path / "auto.jsonl") == losses(tmp_path / "h16.jsonl")


def test_auto_with_auto_compression_that_fits_stays_synchronous(tmp_path):
    # Everything fits 1e6 x compute: --compression auto chooses none, once, and H = 1.
    run("--devices", 4, "--steps", 3, "--sync-every", "auto", "--compression", "auto", "--compression-every", 2,
        "--comm-target", 1e6, "--metrics-file", tmp_path / "m.jsonl")
    [record] = decisions(tmp_path / "m.jsonl")
    assert record["sync_every"] == 1 and record["fits"] and record["why"].startswith("synchronous: --compression auto")
    assert [(d["step"], d["choice"]) for d in decisions(tmp_path / "m.jsonl", "compression")] == [(0, "none"), (2, "none")]
    assert all("synced" not in r for r in step_records(tmp_path / "m.jsonl"))


@pytest.mark.slow
def test_auto_with_auto_compression_that_does_not_fit_sends_the_pseudo_gradient_plain(tmp_path):
    run("--devices", 4, "--steps", 3, "--sync-every", "auto", "--compression", "auto", "--compression-every", 2,
        "--comm-target", 1e-9, *PLAIN, "--metrics-file", tmp_path / "m.jsonl")
    [record] = decisions(tmp_path / "m.jsonl")
    [compressed] = decisions(tmp_path / "m.jsonl", "compression")  # no re-decision at step 2
    # psum: none and bf16 are the options; on simulated devices the all-reduce is latency, so bf16
    # predicts no real gain and the pseudo-gradient goes uncompressed
    assert record["sync_every"] == 16 and record["pseudo_gradient"] == "none"
    assert "the pseudo-gradient goes none" in record["why"] and set(record["options"]) == {"none", "bf16"}
    assert compressed["step"] == 0 and compressed["applied"] is False and not compressed["fits"]
    assert record["payload_bytes"] == compressed["uncompressed_bytes"]
    assert [r["synced"] for r in step_records(tmp_path / "m.jsonl")] == [0, 0, 0]


def test_local_steps_chosen_over_an_unguarded_plan_send_their_own_codec(tmp_path, monkeypatch):
    """On a slow link the plan's best is top-k (before it joined the ladder: PowerSGD), missing the
    target: local steps replace it, the pseudo-gradient goes through the codec chosen with H (bf16
    with psum: half the bytes, a step predicted 49 % shorter), and the step must not be built for
    that unguarded plan (it was: the run stopped with "the state has no compression state for
    powersgd:1")."""
    monkeypatch.setattr(Controller, "measure", bandwidth_bound())  # top-k predicts the shortest step
    run("--devices", 4, "--steps", 3, "--sync-every", "auto", "--compression", "auto", *PLAIN,
        "--metrics-file", tmp_path / "m.jsonl")
    [record], [compressed] = decisions(tmp_path / "m.jsonl"), decisions(tmp_path / "m.jsonl", "compression")
    assert compressed["choice"].startswith("topk") and compressed["applied"] is False
    # the two records agree: the compression one says local steps replaced it, and proposes no H of its own
    assert compressed["propose_local_steps"] is None and compressed["why"].startswith("not applied: --sync-every auto")
    assert compressed["superseded_by"] == {"event": "local_steps", "sync_every": 16, "pseudo_gradient": "bf16"}
    assert compressed["quality_checks"] == [] and record["sync_every"] == 16 and record["pseudo_gradient"] == "bf16"
    assert record["payload_bytes"] == compressed["uncompressed_bytes"] // 2
    assert [r["comm_bytes_per_step"] for r in step_records(tmp_path / "m.jsonl")] == [record["payload_bytes"] * 2 * 3 / 4 / 16] * 3


@pytest.mark.slow  # about 6 s on 2 cores
def test_auto_takes_topk_through_the_command_line_and_resumes_bit_identically(tmp_path, monkeypatch):
    """Far too slow a link: auto plans the sparsest top-k; the guard replays it for real (here made
    to keep it, so the test reaches the step); the step trains through it from the auto slot, and a
    resumed run decides the same and continues bit for bit."""
    monkeypatch.setattr(Controller, "measure", bandwidth_bound())
    monkeypatch.setattr(costmodel, "guard", lambda choice, *args, **kwargs: choice)
    flags = ["--devices", 2, "--compression", "auto", "--compression-every", 0, "--optimizer", "momentum"]
    whole = run(*flags, "--steps", 6, "--metrics-file", tmp_path / "whole.jsonl")
    [decision] = decisions(tmp_path / "whole.jsonl", "compression")
    assert decision["choice"].startswith("topk:") and decision["choice"].endswith(":gather"), decision["why"]
    assert decision["quality_checks"][0]["candidate"] == decision["choice"]
    assert 0.5 < decision["quality_checks"][0]["relative_error"] < 1.5  # the real replay's error
    steps = step_records(tmp_path / "whole.jsonl")
    assert all(r["compression_ratio"] > 50 for r in steps), steps  # (0.1 % of the values: the loss barely moves)
    ckpt = ["--checkpoint-dir", tmp_path / "ckpt", "--save-every", 3, "--metrics-file", tmp_path / "m.jsonl"]
    run(*flags, *ckpt, "--steps", 3)
    resumed = run(*flags, *ckpt, "--steps", 6)
    assert [d["choice"] for d in decisions(tmp_path / "m.jsonl", "compression")] == [decision["choice"]] * 2
    assert [(s, loss) for s, loss, _ in losses(tmp_path / "m.jsonl")] == [(s, loss) for s, loss, _ in
                                                                          losses(tmp_path / "whole.jsonl")]
    jax.tree.map(lambda x, y: jnp.array_equal(x, y) or pytest.fail("state differs"), resumed.state, whole.state)


def test_one_device_means_synchronous_recorded(tmp_path):
    run("--devices", 1, "--steps", 2, "--sync-every", "auto", "--comm-target", 1e-9, "--metrics-file", tmp_path / "m.jsonl")
    [record] = decisions(tmp_path / "m.jsonl")
    assert record["sync_every"] == 1 and "one device" in record["why"]
    assert records(tmp_path / "m.jsonl")[0]["config"]["sync_every"] == 1


@pytest.mark.slow
def test_resume_keeps_the_recorded_h_and_is_bit_identical(tmp_path):
    flags = ["--devices", 4, "--sync-every", "auto", *PLAIN, "--comm-target", 1e-9]
    whole = run(*flags, "--steps", 17, "--metrics-file", tmp_path / "whole.jsonl")
    ckpt = ["--checkpoint-dir", tmp_path / "ckpt", "--save-every", 5, "--metrics-file", tmp_path / "m.jsonl"]
    run(*flags, *ckpt, "--steps", 5)
    # Resumed with a target everything meets: a new measurement would choose 1; the checkpoint's H wins.
    resumed = run(*flags[:-1], 1e6, *ckpt, "--steps", 17)
    assert [r["step"] for r in resumed.history] == list(range(6, 18))
    fresh, again = decisions(tmp_path / "m.jsonl")
    assert fresh["sync_every"] == again["sync_every"] == 16 and "resumed from the checkpoint of step 5" in again["why"]
    assert "compute_s" not in again  # no new measurement
    assert losses(tmp_path / "m.jsonl") == losses(tmp_path / "whole.jsonl")
    jax.tree.map(lambda x, y: jnp.array_equal(x, y) or pytest.fail("state differs"), resumed.state, whole.state)
    toml = (tmp_path / "ckpt" / "config.toml").read_text()
    assert 'sync-every = "auto"' in toml and "# --sync-every auto chose 16" in toml


def test_a_synchronous_checkpoint_refuses_local_steps_in_one_line(tmp_path):
    ckpt = ["--devices", 2, "--checkpoint-dir", tmp_path / "ckpt"]
    run(*ckpt, "--steps", 1, "--sync-every", 1)
    with pytest.raises(InputError, match="made with sync_every=1, but this run has sync_every=4"):
        run(*ckpt, "--steps", 2, "--sync-every", 4)


def test_outer_optimizer_defaults_are_unchanged():
    config = parse_args(["--sync-every", "auto"])
    assert (config.outer_optimizer, config.outer_lr, config.outer_momentum) == ("nesterov", 0.7, 0.9)


def test_a_bench_variant_that_names_its_own_sync_every_keeps_it():
    from jaxdp.bench.localsgd import variant_run

    plain = "--outer-optimizer sgd --outer-lr 1 --outer-momentum 0"
    assert variant_run(16, plain) == (f"H=16 {plain}", ["--sync-every", "16", *plain.split()])
    assert variant_run(16, f"--sync-every auto {plain}") == (f"--sync-every auto {plain}", ["--sync-every", "auto",
                                                                                              *plain.split()])
    assert variant_run(16, "--sync-every=8")[1] == ["--sync-every=8"]
    assert variant_run(16, "") == ("H=16", ["--sync-every", "16"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_take_the_same_decision_and_train_like_one(tmp_path):
    from helpers import two_processes_and_one

    two_processes_and_one(tmp_path, ["--steps", "17", "--batch-size", "64", "--log-every", "1", "--no-progress",
                                     "--sync-every", "auto", "--comm-target", "1e-9", *PLAIN])
    [record] = decisions(tmp_path / "two.0.jsonl")
    assert record["sync_every"] == 16 and decisions(tmp_path / "one.jsonl")[0]["sync_every"] == 16
    two, ref = losses(tmp_path / "two.0.jsonl"), losses(tmp_path / "one.jsonl")
    assert [s for s, _, synced in two if synced] == [16]
    assert [s for s, _, _ in two] == [s for s, _, _ in ref]
    assert [loss for _, loss, _ in two] == pytest.approx([loss for _, loss, _ in ref], rel=1e-5)


@pytest.mark.slow
def test_overlap_with_auto_chooses_h_and_a_quantized_pseudo_gradient_and_resumes_bit_identically(tmp_path, monkeypatch):
    """--sync-every auto --compression auto --overlap on a ring: H and int4 chosen from the
    measurement, trained exactly as the explicit --sync-every 16 --compression int4 --overlap;
    resumed with a measurement that would choose otherwise, the checkpoint's choice wins and the
    run ends bit-identical."""
    # on a 4-device ring every codec's H is the cap, and int4 predicts the shortest step (int8 more than 20 % longer)
    monkeypatch.setattr(Controller, "measure", bandwidth_bound())
    flags = ["--devices", 4, "--strategy", "ring", "--overlap", *PLAIN, "--steps", 20]
    auto = ["--sync-every", "auto", "--compression", "auto", "--checkpoint-dir", tmp_path / "ckpt", "--save-every", 8]
    whole = run(*flags, *auto, "--metrics-file", tmp_path / "auto.jsonl")
    run(*flags, "--sync-every", 16, "--compression", "int4", "--metrics-file", tmp_path / "fixed.jsonl")
    [record] = decisions(tmp_path / "auto.jsonl")
    assert (record["sync_every"], record["pseudo_gradient"], record["overlap"]) == (16, "int4", True)
    assert "--overlap" in record["why"] and record["propose_overlap"] is None
    assert losses(tmp_path / "auto.jsonl") == losses(tmp_path / "fixed.jsonl")

    shutil.rmtree(tmp_path / "ckpt" / "20")  # back to step 16, its round's average in flight
    monkeypatch.setattr(Controller, "measure", lambda self, state, batch: pytest.fail("a resumed run measured"))
    resumed = run(*flags, *auto, "--metrics-file", tmp_path / "resumed.jsonl")
    [again] = decisions(tmp_path / "resumed.jsonl")
    assert (again["sync_every"], again["pseudo_gradient"]) == (16, "int4") and "resumed from" in again["why"]
    jax.tree.map(lambda x, y: jnp.array_equal(x, y) or pytest.fail("state differs"), resumed.state, whole.state)


@pytest.mark.slow
def test_auto_chooses_a_top_k_pseudo_gradient_trains_like_it_and_resumes_bit_identically(tmp_path, monkeypatch):
    """--sync-every auto --compression auto with SparseLoCo's outer settings on a slow link: local
    steps with a top-k pseudo-gradient the guard replayed (its real replay on the MLP; the threshold
    raised, as the MLP is not what it was calibrated on), trained exactly as the explicit flags; a
    resume keeps the checkpoint's choice, measures nothing and ends bit-identical."""
    monkeypatch.setattr(Controller, "measure", bandwidth_bound(0.01))
    monkeypatch.setattr(costmodel, "PSEUDO_GUARD_THRESHOLD", 1.0)
    flags = ["--devices", 2, *PLAIN, "--steps", 16]
    auto = ["--sync-every", "auto", "--compression", "auto", "--checkpoint-dir", tmp_path / "ckpt", "--save-every", 8]
    whole = run(*flags, *auto, "--metrics-file", tmp_path / "auto.jsonl")
    [record] = decisions(tmp_path / "auto.jsonl")
    chosen, h = record["pseudo_gradient"], record["sync_every"]
    assert chosen.startswith("topk:") and chosen.endswith(":2:gather:decay=0.98") and 8 % h == 0 and h >= 2
    assert record["quality_checks"][-1]["candidate"] == chosen and f"kept {chosen}" in record["why"]
    run(*flags, "--sync-every", h, "--compression", chosen, "--metrics-file", tmp_path / "fixed.jsonl")
    assert losses(tmp_path / "auto.jsonl") == losses(tmp_path / "fixed.jsonl")

    shutil.rmtree(tmp_path / "ckpt" / "16")
    monkeypatch.setattr(Controller, "measure", lambda self, state, batch: pytest.fail("a resumed run measured"))
    resumed = run(*flags, *auto, "--metrics-file", tmp_path / "resumed.jsonl")
    [again] = decisions(tmp_path / "resumed.jsonl")
    assert (again["sync_every"], again["pseudo_gradient"]) == (h, chosen) and "resumed from" in again["why"]
    jax.tree.map(lambda x, y: jnp.array_equal(x, y) or pytest.fail("state differs"), resumed.state, whole.state)


def test_overlap_with_auto_on_a_link_that_keeps_up_trains_synchronously(tmp_path):
    run("--devices", 2, "--steps", 3, "--sync-every", "auto", "--overlap", "--comm-target", 1e6,
        "--metrics-file", tmp_path / "m.jsonl")
    [record] = decisions(tmp_path / "m.jsonl")
    assert record["sync_every"] == 1 and record["overlap"] is False
    assert all("synced" not in r for r in step_records(tmp_path / "m.jsonl"))
