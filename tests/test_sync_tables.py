"""The two tables of the sync middle, tested row by row: the codec table (jaxdp/sync/codecs/__init__.py)
and the rules of which sync choices combine (jaxdp/sync/rules.py). A new codec or a new rule is
covered here by being in its table (a rule also needs its example below)."""

import dataclasses
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxdp.config import ConfigError, parse_args
from jaxdp.config import build_parser as config_parser
from jaxdp.launch import build_parser as launch_parser
from jaxdp.errors import InputError
from jaxdp.sync import codecs, costmodel, rules
from jaxdp.sync.collectives import Collective
from jaxdp.sync.spec import SyncSpec

ROWS = {row.name: row for row in codecs.TABLE}
PARAMS = {"dense": {"kernel": jax.ShapeDtypeStruct((64, 48), np.float32), "bias": jax.ShapeDtypeStruct((48,), np.float32)},
          "conv": jax.ShapeDtypeStruct((3, 3, 8, 16), np.float32)}


@pytest.mark.parametrize("name", ROWS)
def test_every_codec_parses_to_its_row_and_back(name):
    row = ROWS[name]
    codec = codecs.parse(row.example)
    assert type(codec) is row.load() and codecs.row(codec.name) is row  # the class the row names
    assert codec.name == row.example and codecs.parse(codec.name) == codec
    assert codec.needs == row.needs == codecs.needs(row.example)
    assert (codec.state_name is not None) == row.keeps_state == bool(codec.slot(PARAMS).error)
    if row.bytes_per_value is not None:  # the cost model's per-value figure, against the codec's own count
        big = {"x": jax.ShapeDtypeStruct((1 << 20,), np.float32)}
        assert codec.payload_bytes(big) / (1 << 20) == pytest.approx(row.bytes_per_value, rel=1e-3)


@pytest.mark.parametrize("name", ROWS)
def test_every_codec_round_trips_through_its_slot(name):
    codec = codecs.parse(ROWS[name].example)
    rng = np.random.default_rng(0)
    slot = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), codec.slot(PARAMS))
    grads = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), PARAMS)
    read = codec.read(slot, grads)
    back = codec.write(slot, read)
    jax.tree.map(np.testing.assert_array_equal, back, slot)
    assert jax.tree.leaves(read) or not ROWS[name].keeps_state  # a codec that keeps state reads some
    if ROWS[name].ladder is not None:  # auto's slot serves every codec of the ladder
        codec.read(costmodel.auto_slot(PARAMS), grads)


@pytest.mark.parametrize("name", [n for n in ROWS if n != "none"])
def test_every_codec_is_refused_where_the_table_says(name):
    row = ROWS[name]
    with pytest.raises(InputError, match=r"compression needs an in-graph strategy .*: strategy='host' does not qualify"):
        SyncSpec(strategy="host", compression=row.example).validate()
    with pytest.raises(ConfigError, match="^--compression needs an in-graph strategy"):
        rules.check_config(parse_args(["--strategy", "host", "--compression", row.example]))
    for strategy in ("psum", "ring"):
        wanted = row.needs in rules.abilities(strategy)
        spec = SyncSpec(strategy=strategy, compression=row.example)
        flags = parse_args(["--strategy", strategy, "--compression", row.example])
        if wanted:
            spec.validate()
            rules.check_config(flags)
            continue
        with pytest.raises(InputError, match="needs strategy='ring'.*requantizes at every hop"):
            spec.validate()
        with pytest.raises(ConfigError, match=f"^--compression={row.example} needs --strategy ring"):
            rules.check_config(flags)


def test_a_spec_outside_the_table_is_refused_in_one_line_naming_what_is_accepted():
    for bad in ("topk:3", "powersgd:0", "int16"):
        with pytest.raises(ValueError) as err:
            codecs.parse(bad)
        # every codec's first usage (a family's later rows spell out one of its cases)
        usages = {r.name: r.usage for r in reversed(codecs.TABLE)}
        assert repr(bad) in str(err.value) and all(usage in str(err.value) for usage in usages.values())
        with pytest.raises(ConfigError) as err:
            rules.check_config(parse_args(["--compression", bad]))
        assert "\n" not in str(err.value) and "auto" in str(err.value)


# One set of choices per rule that breaks it first: a rule without one fails the test below.
EXAMPLES = {
    "elastic-params": dict(strategy="psum", elastic=True, shard_params=True, sync_every=4),
    "elastic-strategy": dict(strategy=Collective("mean_only", mean=lambda tree, axis: tree), elastic=True),
    "elastic-codec": dict(strategy="host", elastic=True, compression="powersgd:4"),
    "elastic-auto": dict(strategy="psum", elastic=True, sync_every="auto"),
    "elastic-local-state": dict(strategy="host", elastic=True, sync_every=4, float_state=True),
    "elastic-fragments": dict(strategy="host", elastic=True, sync_fragments=2),
    "elastic-zero": dict(strategy="host", elastic=True, shard_optimizer=True),
    "elastic-overlap": dict(strategy="host", elastic=True, overlap=True),
    "paced-local": dict(sync_seconds=1.0, sync_every=4),
    "paced-auto": dict(sync_seconds=1.0, compression="auto"),
    "paced-fragments": dict(sync_seconds=1.0, sync_fragments=2),
    "paced-zero": dict(sync_seconds=1.0, shard_optimizer=True),
    "paced-strategy": dict(strategy="host", sync_seconds=1.0),
    "paced-model-state": dict(sync_seconds=1.0, float_state=True),
    "overlap-paced": dict(overlap=True, sync_seconds=1.0),
    "overlap-auto": dict(overlap=True, compression="auto"),
    "overlap-fragments": dict(overlap=True, sync_every=4, sync_fragments=2),
    "overlap-zero": dict(overlap=True, shard_optimizer=True),
    "overlap-strategy": dict(strategy="host", overlap=True),
    "overlap-model-state": dict(overlap=True, float_state=True),
    "compression-strategy": dict(strategy="host", compression="bf16"),
    "topk-hops": dict(strategy="psum", compression="topk:0.01:2", needs="coded_sum"),
    "compression-hops": dict(strategy="psum", compression="int8", needs="coded_sum"),
    "local-strategy": dict(strategy="host", sync_every="auto"),
    "compression-zero": dict(compression="powersgd:4", shard_optimizer=True),
    "local-zero": dict(sync_every=2, shard_optimizer=True),
    "zero-host": dict(strategy="host", shard_optimizer=True),
    "zero-halves": dict(strategy=lambda tree, axis: jax.lax.psum(tree, axis), shard_optimizer=True),
    "params-zero": dict(shard_params=True, shard_optimizer=True),
    "params-strategy": dict(strategy="host", shard_params=True),
    "params-compression": dict(shard_params=True, compression="topk:0.01"),
    "params-paced": dict(shard_params=True, sync_seconds=2.0),
    "params-local": dict(shard_params=True, sync_every="auto"),
    "params-overlap": dict(shard_params=True, overlap=True),
    "budget-auto": dict(byte_budget=0.001, sync_every=8, compression="auto"),
    "metrics-local": dict(metrics_at_sync=True),
    "metrics-others": dict(metrics_at_sync=True, sync_every=4, compression="auto"),
    "metrics-state": dict(metrics_at_sync=True, sync_every=4, float_state=True),
    "fragments-auto": dict(sync_every="auto", sync_fragments=2),
    "fragments-divide": dict(sync_every=4, sync_fragments=3),
}


def choices(strategy="psum", **kwargs):
    return rules.Choices(rules.strategy_name(strategy), rules.abilities(strategy), **kwargs)


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: r.name)
def test_every_rule_is_named_first_by_its_example_in_both_terms(rule):
    example = choices(**EXAMPLES[rule.name])
    assert rules.broken(example) is rule
    with pytest.raises(ConfigError) as flags:
        rules.check(example, flags=True)
    with pytest.raises(InputError) as words:
        rules.check(example)
    assert str(flags.value).startswith("--") or str(flags.value).startswith("an elastic run"), str(flags.value)
    assert "--" not in str(words.value) or "--elastic" in str(words.value), str(words.value)
    assert "\n" not in str(flags.value) + str(words.value)


# The flags a message may name: the command line's, and the launcher's (--elastic-engine).
FLAGS = {o for parser in (config_parser(), launch_parser()) for a in parser._actions for o in a.option_strings}
KEYWORDS = [f.name for f in dataclasses.fields(rules.Choices) if "--" + f.name.replace("_", "-") in FLAGS]


@pytest.mark.parametrize("rule", rules.RULES, ids=lambda r: r.name)
def test_every_rule_is_one_template_said_wholly_in_flag_terms_or_in_keyword_terms(rule):
    named = [m.group(1) for m in rules.PLACEHOLDER.finditer(rule.says)]
    assert named and set(named) <= set(KEYWORDS), named  # each placeholder a choice that has a flag
    example = choices(**EXAMPLES[rule.name])
    flags, words = rules.render(rule.says, example, flags=True), rules.render(rule.says, example)
    assert not re.search(r"[{}]", flags + words), (flags, words)  # every placeholder rendered
    # keyword terms: no flag (an elastic run is named by the launcher's command, the same in both terms)
    assert not re.search(r"--\w", words.replace("(jaxdp.launch --elastic)", "")), words
    # flag terms: no keyword (strategy, compression and overlap are words of the prose too: not as name=value)
    said = re.search(rf"(?<![-\w])({'|'.join(k for k in KEYWORDS if '_' in k)})(?![-\w])"
                     rf"|(?<![-\w])({'|'.join(KEYWORDS)})(=| ')", flags)
    assert said is None, flags
    with pytest.raises(ConfigError, match=f"^{re.escape(flags)}$"):
        rules.check(example, flags=True)
    with pytest.raises(InputError, match=f"^{re.escape(words)}$"):
        rules.check(example)


def test_every_rule_is_named_once_and_has_an_example():
    names = [r.name for r in rules.RULES]
    assert len(set(names)) == len(names) and set(names) == set(EXAMPLES)
    assert rules.broken(choices()) is None and rules.broken(choices("ring", compression="int8", needs="coded_sum",
                                                                    sync_every=4, overlap=True)) is None
    for strategy in ("host", "psum", "ring"):  # in an elastic run a codec codes the exchange between workers, on the host
        assert rules.broken(choices(strategy, elastic=True, compression="int8", needs="coded_sum")) is None


@pytest.mark.parametrize("argv, says", [
    (["--sync-seconds", "1", "--strategy", "host"], "--sync-seconds needs an in-graph strategy"),
    (["--overlap", "--sync-every", "auto", "--compression", "auto"], None),  # auto chooses the pseudo-gradient's codec
    (["--sync-every", "4", "--sync-fragments", "3"], "--sync-fragments=3 must be a positive integer that divides"),
])
def test_the_command_line_asks_the_same_table(argv, says):
    config = parse_args(argv)
    if says is None:
        assert rules.check_config(config) is config
        return
    with pytest.raises(ConfigError, match=says):
        rules.check_config(config)


def test_config_imports_no_sync_code():
    code = ("import sys, jaxdp.config; jaxdp.config.parse_args(['--compression', 'int8', '--strategy', 'psum']); "
            "assert not [m for m in sys.modules if m.startswith('jaxdp.sync')], sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the test of the design: a new codec is one class (a file of its own in jaxdp/sync/codecs/) plus one table line ----

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jaxdp  # noqa: E402
from jaxdp.sync.codecs.base import CompressionState, Compressor, _checkpoint_safe  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
    """topk:K: each device keeps the K largest |values| of each leaf of (g + e) / N, sent dense
    (zeros elsewhere, so the sum carries it), the rest is its error feedback."""

    k: int
    collectives = 1

    @property
    def name(self):
        return f"topk:{self.k}"

    @property
    def state_name(self):
        return "topk"

    @classmethod
    def from_spec(cls, text):
        return cls(k=int(text.split(":")[1]))

    def init(self, params):
        return CompressionState(error={jax.tree_util.keystr(p): jnp.zeros(x.shape, jnp.float32)
                                       for p, x in jax.tree_util.tree_flatten_with_path(params)[0]})

    def read(self, slot, grads):
        keys = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        self._require(slot, keys)
        return CompressionState(error={k: slot.error[_checkpoint_safe(k)] for k in keys})

    def mean(self, grads, state, allreduce_sum, num_devices, step):
        items, treedef = jax.tree_util.tree_flatten_with_path(grads)
        kept, error = [], {}
        for path, g in items:
            key = jax.tree_util.keystr(path)
            x = (g + state.error[key]) / num_devices
            cut = jnp.sort(jnp.abs(x).ravel())[-min(self.k, x.size)]
            kept.append(jnp.where(jnp.abs(x) >= cut, x, 0))
            error[key] = (x - kept[-1]) * num_devices
        return allreduce_sum(jax.tree_util.tree_unflatten(treedef, kept)), CompressionState(error=error), {}

    def payload_bytes(self, params, num_devices=None):
        return sum(min(self.k, int(np.prod(x.shape))) * 8 for x in jax.tree.leaves(params))


def topk_reference(w, rows_by_device, k, steps):
    """One device's numpy: per device x = (g + e) / N, its k largest kept, their sum the mean, SGD(1)."""
    n = len(rows_by_device)
    errors = [np.zeros_like(w) for _ in range(n)]
    for _ in range(steps):
        total = np.zeros_like(w)
        for i, rows in enumerate(rows_by_device):
            x = (rows.mean(0) + errors[i]) / n  # the gradient of sum(w * mean(rows)) is mean(rows)
            cut = np.sort(np.abs(x).ravel())[-k]
            kept = np.where(np.abs(x) >= cut, x, 0)
            errors[i] = (x - kept) * n
            total += kept
        w = w - total
    return w


def test_a_new_codec_is_one_class_and_one_table_line(devices, monkeypatch):
    row = codecs.Row("topk", r"topk:[1-9]\d*", "topk:K", f"{__name__}:TopK", keeps_state=True, example="topk:3")
    monkeypatch.setattr(codecs, "TABLE", (*codecs.TABLE, row))
    assert codecs.parse("topk:3") == TopK(3)
    rules.check_config(parse_args(["--compression", "topk:3", "--strategy", "psum"]))  # the command line knows it
    with pytest.raises(InputError, match="compression and shard_optimizer do not combine"):
        SyncSpec(compression="topk:3", shard_optimizer=True).validate()
    mesh = jaxdp.make_mesh(devices[:4])
    rng = np.random.default_rng(0)
    w, rows = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal((4, 2, 4, 5)).astype(np.float32)
    loss = lambda p, b: jnp.sum(p["w"] * jnp.mean(b["x"], axis=0))  # noqa: E731
    tx = optax.sgd(1.0)
    state = jaxdp.init_state({"w": w}, tx, mesh, compression="topk:3")
    step = jaxdp.make_train_step(loss, tx, mesh, strategy="ring", compression="topk:3")
    batch = jaxdp.shard_batch({"x": rows.reshape(8, 4, 5)}, mesh)
    for _ in range(3):
        state, metrics = step(state, batch)
    np.testing.assert_allclose(np.asarray(state.params["w"]), topk_reference(w, list(rows), 3, 3), rtol=1e-5, atol=1e-6)
    assert float(metrics["comm_bytes"]) == pytest.approx(3 * 8 * 2 * 3 / 4)
