"""jaxdp/sync/spec.py: the sync choices as one value, resolved once; the one compatibility table
(jaxdp/sync/rules.py), which init_state, make_train_step, fit and the command line all ask; the
state's layout tag."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
import jaxdp.sync.collectives
from jaxdp.config import ConfigError, parse_args
from jaxdp.errors import InputError
from jaxdp.sync.rules import Choices, broken, check_config, elastic_of
from jaxdp.sync.spec import AUTO, StateLayout, SyncSpec, abilities


def clash(strategy="psum", **choices):
    rule = broken(Choices(strategy, abilities(strategy), **choices))
    return rule and rule.name


def test_the_table_names_the_first_clash():
    assert clash(compression="bf16", sync_every=4) is None and clash(shard_optimizer=True) is None
    assert clash("host", compression="bf16") == "compression-strategy"
    assert clash("host", sync_every=2) == "local-strategy"
    assert clash("host", shard_optimizer=True) == "zero-host"
    assert clash(compression="bf16", shard_optimizer=True) == "compression-zero"
    assert clash(sync_every=2, shard_optimizer=True) == "local-zero"
    assert clash("ring", sync_every=2, outer=True, shard_optimizer=True) == "local-zero"
    assert clash(overlap=True, shard_optimizer=True) == "overlap-zero"  # the overlap rule is named before ZeRO-1's own
    assert clash(sync_seconds=1.0, sync_every=4) == "paced-local"
    assert clash("host", elastic=True, overlap=True) == "elastic-overlap"
    # the same rules on either engine: a worker may sum its own devices in-graph; across workers it is the host still
    assert clash("ring", elastic=True) is None
    assert clash("psum", elastic=True, compression="int8") is None  # coded between workers
    # rounds of local steps overlap (jaxdp/elastic/overlap.py), not every step's exchange
    assert clash("psum", elastic=True, sync_every=4, overlap=True) is None
    assert clash("psum", elastic=True, overlap=True) == "elastic-overlap"
    assert clash("psum", elastic=True, sync_seconds=1.0, overlap=True) == "elastic-overlap"
    assert clash("psum", elastic=True, compression="powersgd:4") == "elastic-codec"
    assert elastic_of({"JAXDP_FT_LIGHTHOUSE": "http://127.0.0.1:1"}) == {"elastic": True}
    assert elastic_of({"JAXDP_ELASTIC": "127.0.0.1:1"}) == {"elastic": True}
    assert elastic_of({})["elastic"] is False


def test_abilities_of_builtin_registered_and_bare_strategies():
    assert abilities("psum") == {"sum", "halves"} and abilities("host") == {"host"}
    assert abilities("ring") == abilities(jaxdp.sync.collectives.RING) == {"sum", "halves", "coded_sum"}
    assert abilities(jaxdp.sync.collectives.PSUM) == abilities("psum")
    # int8 / int4 requantize at every hop: the ring has hops, XLA's all-reduce has none.
    assert clash("psum", compression="int8", needs="coded_sum") == "compression-hops"
    assert clash("ring", compression="int8", needs="coded_sum", sync_every=4) is None
    assert abilities(lambda tree, axis: jax.lax.pmean(tree, axis)) == frozenset()  # a bare mean: nothing more


def test_a_spec_resolves_its_names_once():
    spec = SyncSpec(strategy="ring", compression="powersgd:4:start=2")
    assert spec.collective is jaxdp.sync.collectives.RING and spec.collective is spec.collective
    assert spec.codec is spec.codec and spec.codec.name == "powersgd:4:start=2"
    assert SyncSpec().codec is None and SyncSpec(compression="none").codec is None
    with pytest.raises(ValueError, match="decided while training"):
        SyncSpec(compression="auto").codec


def test_rule_and_layout():
    assert SyncSpec().rule == "replicated" and SyncSpec(strategy="host").rule == "host"
    assert SyncSpec(sync_every=4).rule == "local" and SyncSpec(outer_tx=optax.sgd(1.0)).rule == "local"
    assert SyncSpec(sync_every=AUTO).rule == "local" and SyncSpec(shard_optimizer=True).rule == "sharded"
    assert SyncSpec(strategy="host").layout() == StateLayout()
    assert SyncSpec(compression="bf16").layout().compression is None  # bf16 keeps no state
    assert SyncSpec(compression="powersgd:4:start=3").layout().compression == "powersgd:4"
    assert SyncSpec(compression="auto").layout().compression == AUTO
    assert SyncSpec(sync_every=4, sync_fragments=2).layout() == StateLayout("local", 2, None)
    hash(SyncSpec(compression=jaxdp.sync.codecs.parse("powersgd:2"), outer_tx=optax.sgd(1.0)))  # a dict key


def test_a_layout_serves_what_it_was_made_for():
    auto = StateLayout(compression=AUTO)
    assert auto.serves(StateLayout(compression="powersgd:4")) is None and auto.serves(StateLayout()) is None
    assert StateLayout(compression="powersgd:4").serves(StateLayout(compression="powersgd:4")) is None
    assert "no compression state for powersgd:8" in StateLayout(compression="powersgd:4").serves(
        StateLayout(compression="powersgd:8"))
    assert "pass the same shard_optimizer" in StateLayout().serves(StateLayout("sharded"))
    assert "pass the same sync_every and outer_tx" in StateLayout("local").serves(StateLayout())
    assert "sync_fragments=2" in StateLayout("local", 2).serves(StateLayout("local", 1))


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "host", "compression": "bf16"}, r"compression needs an in-graph strategy .*: strategy='host' does not qualify"),
    ({"strategy": "host", "sync_every": 2}, r"sync_every needs an in-graph strategy .*: strategy='host' does not qualify"),
    ({"strategy": "host", "shard_optimizer": True}, r"shard_optimizer needs an in-graph strategy .*: strategy='host' does not qualify"),
    ({"compression": "bf16", "shard_optimizer": True}, "compression and shard_optimizer do not combine"),
])
def test_library_and_command_line_refuse_the_same_combinations(devices, kwargs, match):
    mesh = jaxdp.make_mesh(devices)
    with pytest.raises(InputError, match=match):
        jaxdp.make_train_step(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), mesh, **kwargs)
    flags = {"strategy": "--strategy", "compression": "--compression", "sync_every": "--sync-every",
             "shard_optimizer": "--shard-optimizer"}
    argv = [x for k, v in kwargs.items() for x in (flags[k], str(v).lower())]
    with pytest.raises(ConfigError):
        check_config(parse_args(argv))


def test_validation_needs_no_jax():
    code = ("import sys; from jaxdp.sync.spec import SyncSpec; SyncSpec(strategy='ring', compression='powersgd:4', "
            "sync_every=4).validate(); from jaxdp.config import parse_args; from jaxdp.sync.rules import check_config; "
            "check_config(parse_args(['--strategy', 'ring', '--compression', 'int8'])); "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_state_for_another_layout_is_refused_in_one_line(devices):
    mesh, tx = jaxdp.make_mesh(devices), optax.sgd(0.1)
    params = {"w": np.ones((8, 4), np.float32)}
    loss = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)  # noqa: E731
    batch = jaxdp.shard_batch({"x": np.ones((8, 8), np.float32)}, mesh)
    state = jaxdp.init_state(params, tx, mesh, compression="powersgd:1:min_rate=0")
    assert state.layout == StateLayout(compression="powersgd:1:min_rate=0")
    with pytest.raises(ValueError, match="no compression state for powersgd:2"):
        jaxdp.make_train_step(loss, tx, mesh, compression="powersgd:2:min_rate=0")(state, batch)
    state, _ = jaxdp.make_train_step(loss, tx, mesh, compression="powersgd:1:start=5:min_rate=0")(state, batch)
    state, _ = jaxdp.make_train_step(loss, tx, mesh, compression="bf16")(state, batch)  # needs no state


@pytest.mark.parametrize("module, name, home", [("jaxdp.sync.compression", "plan", "jaxdp.sync.costmodel"),
                                                ("jaxdp.sync.compression", "parse", "jaxdp.sync.codecs"),
                                                ("jaxdp.sync.compression", "PowerSGD", "jaxdp.sync.codecs.powersgd"),
                                                ("jaxdp.sync.compression", "CompressionState", "jaxdp.sync.codecs.base"),
                                                ("jaxdp.sync.compression", "Quantized", "jaxdp.sync.codecs.quantized"),
                                                ("jaxdp.sync.compression", "TARGET_COMM_FRACTION", "jaxdp.sync.costmodel"),
                                                ("jaxdp.step.local_sgd", "auto_sync_every", "jaxdp.sync.costmodel"),
                                                ("jaxdp.step.local_sgd", "check_sync_every", "jaxdp.sync.spec"),
                                                ("jaxdp.step.state", "make_schedule", "jaxdp.step.optim")])
def test_names_that_moved_still_resolve_with_a_warning(module, name, home):
    import importlib

    with pytest.warns(DeprecationWarning, match=f"{home}.{name}"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(home), name)
