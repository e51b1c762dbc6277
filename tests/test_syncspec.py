"""jaxdp/sync/spec.py: the sync choices as one value and the one compatibility table, which
init_state, make_train_step and the command line all ask; the state's layout tag."""

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
from jaxdp.sync.spec import AUTO, StateLayout, SyncSpec, abilities, incompatible


def test_the_table_names_the_first_clash():
    both = frozenset({"sum", "halves"})
    assert incompatible(both, compression=True, local=True, shard_optimizer=False) is None
    assert incompatible(both, compression=False, local=False, shard_optimizer=True) is None
    assert incompatible(frozenset({"host"}), compression=True, local=False, shard_optimizer=False)[:2] == ("compression", "strategy")
    assert incompatible(frozenset({"host"}), compression=False, local=True, shard_optimizer=False)[:2] == ("local", "strategy")
    assert incompatible(frozenset({"host"}), compression=False, local=False, shard_optimizer=True)[:2] == (
        "shard_optimizer", "strategy")
    assert incompatible(both, compression=True, local=False, shard_optimizer=True)[:2] == ("compression", "shard_optimizer")
    assert incompatible(both, compression=False, local=True, shard_optimizer=True)[:2] == ("local", "shard_optimizer")
    assert incompatible(frozenset({"sum"}), compression=False, local=False, shard_optimizer=True)[:2] == (
        "shard_optimizer", "strategy")


def test_abilities_of_builtin_registered_and_bare_strategies():
    assert abilities("psum") == {"sum", "halves"} and abilities("host") == {"host"}
    assert abilities("ring") == abilities(jaxdp.sync.collectives.RING) == {"sum", "halves", "coded_sum"}
    assert abilities(jaxdp.sync.collectives.PSUM) == abilities("psum")
    # int8 / int4 requantize at every hop: the ring has hops, XLA's all-reduce has none.
    assert incompatible(abilities("psum"), compression=True, local=False, shard_optimizer=False,
                        needs="coded_sum")[:2] == ("compression", "strategy")
    assert incompatible(abilities("ring"), compression=True, local=True, shard_optimizer=False, needs="coded_sum") is None
    assert abilities(lambda tree, axis: jax.lax.pmean(tree, axis)) == frozenset()  # a bare mean: nothing more


def test_rule_and_layout():
    assert SyncSpec().rule == "replicated" and SyncSpec(strategy="host").rule == "host"
    assert SyncSpec(sync_every=4).rule == "local" and SyncSpec(outer_tx=optax.sgd(1.0)).rule == "local"
    assert SyncSpec(sync_every=AUTO).rule == "local" and SyncSpec(shard_optimizer=True).rule == "sharded"
    assert SyncSpec(strategy="host").layout() == StateLayout()
    assert SyncSpec(compression="bf16").layout().compression is None  # bf16 keeps no state
    assert SyncSpec(compression="powersgd:4:start=3").layout().compression == "powersgd:4"
    assert SyncSpec(compression="auto").layout().compression == AUTO
    assert SyncSpec(sync_every=4, sync_fragments=2).layout() == StateLayout("local", 2, None)
    hash(SyncSpec(compression=jaxdp.sync.compression.parse("powersgd:2"), outer_tx=optax.sgd(1.0)))  # a dict key


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
    ({"strategy": "host", "compression": "bf16"}, "compression does not apply to strategy 'host'"),
    ({"strategy": "host", "sync_every": 2}, r"local steps \(sync_every\) does not apply to strategy 'host'"),
    ({"strategy": "host", "shard_optimizer": True}, "shard_optimizer does not apply to strategy 'host'"),
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
        parse_args(argv)


def test_validation_needs_no_jax():
    code = ("import sys; from jaxdp.sync.spec import SyncSpec; SyncSpec(strategy='ring', compression='powersgd:4', "
            "sync_every=4).validate(); from jaxdp.config import parse_args; parse_args(['--strategy', 'ring']); "
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
                                                ("jaxdp.sync.compression", "TARGET_COMM_FRACTION", "jaxdp.sync.costmodel"),
                                                ("jaxdp.step.local_sgd", "auto_sync_every", "jaxdp.sync.costmodel"),
                                                ("jaxdp.step.local_sgd", "check_sync_every", "jaxdp.sync.spec"),
                                                ("jaxdp.step.state", "make_schedule", "jaxdp.step.optim")])
def test_names_that_moved_still_resolve_with_a_warning(module, name, home):
    import importlib

    with pytest.warns(DeprecationWarning, match=f"{home}.{name}"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(home), name)
