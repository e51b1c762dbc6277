"""fit's periodic work as hooks (jaxdp/loop/hooks.py) and its grouped options (jaxdp/loop/options.py):
`every=` counts steps, so a round that passes a multiple fires once; events run their hooks in
order, and a hook that stops the loop skips the rest; the flat keywords of before warn with the new
spelling and train exactly as the grouped ones."""

import signal
import types
import warnings

import jax
import numpy as np
import optax
import pytest
from helpers import mlp_batches, mlp_problem

import jaxdp
from jaxdp.loop.hooks import Hooks


def _ticks(hooks, spans, *events):
    """Run `hooks` after each (before, done) span; returns the loop."""
    loop = types.SimpleNamespace(stop=False, before=0, done=0, ran=[])
    for before, done in spans:
        loop.before, loop.done = before, done
        hooks.run(loop, *events)
    return loop


def test_every_fires_at_each_step_or_round_that_reaches_or_passes_a_multiple():
    hooks = Hooks()
    hooks.add(lambda loop: loop.ran.append(("every 3", loop.done)), every=3)
    hooks.add(lambda loop: loop.ran.append(("each", loop.done)), at=("round",))
    loop = _ticks(hooks, [(0, 2), (2, 5), (5, 6), (6, 13), (13, 14)], "round")
    assert loop.ran == [("each", 2), ("every 3", 5), ("each", 5), ("every 3", 6), ("each", 6),
                        ("every 3", 13), ("each", 13), ("each", 14)]
    steps = _ticks(hooks, [(k, k + 1) for k in range(7)], "step")  # the step loop: multiples of 3 only
    assert steps.ran == [("every 3", 3), ("every 3", 6)]


def test_events_run_only_their_hooks_and_a_stop_skips_the_rest_of_the_tick():
    hooks = Hooks()
    hooks.add(lambda loop: loop.ran.append("log"), every=10, at=("last",))
    hooks.add(lambda loop: setattr(loop, "stop", loop.done == 4), at=("step",))
    hooks.add(lambda loop: loop.ran.append(f"after {loop.done}"), at=("step",))
    hooks.add(lambda loop: loop.ran.append("save"), at=("stop",))
    assert _ticks(hooks, [(4, 5)], "step", "last").ran == ["log", "after 5"]
    stopped = _ticks(hooks, [(3, 4)], "step")
    assert stopped.stop and stopped.ran == []
    hooks.run(stopped, "stop")
    assert stopped.ran == ["save"]


def test_flat_keywords_warn_with_the_new_spelling_and_train_the_same(devices, tmp_path):
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(6))
    tx = optax.adam(1e-2)
    with pytest.warns(DeprecationWarning) as caught:
        flat = jaxdp.fit(loss_fn, params, tx, lambda k: data[k], steps=6, strategy="ring", log_every=2,
                         checkpoint_dir=str(tmp_path / "flat"), progress=False)
    message = str(caught[0].message)
    assert "fit(strategy=..., log_every=..., checkpoint_dir=..., progress=...) is deprecated" in message
    assert ("use fit(..., sync=SyncOptions(strategy=...), checkpoint=CheckpointOptions(directory=...), "
            "logging=LogOptions(every=..., progress=...))") in message
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", DeprecationWarning)
        grouped = jaxdp.fit(loss_fn, params, tx, lambda k: data[k], steps=6, sync=jaxdp.SyncOptions(strategy="ring"),
                            checkpoint=jaxdp.CheckpointOptions(directory=str(tmp_path / "grouped")),
                            logging=jaxdp.LogOptions(every=2, progress=False))
    assert not [w for w in seen if "fit(" in str(w.message)]  # the grouped spelling does not warn
    assert [r["step"] for r in flat.history] == [r["step"] for r in grouped.history] == [2, 4, 6]
    assert [r["loss"] for r in flat.history] == [r["loss"] for r in grouped.history]
    for a, b in zip(jax.tree.leaves(flat.state.params), jax.tree.leaves(grouped.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sorted(p.name for p in (tmp_path / "grouped").iterdir() if p.name.isdigit()) == ["6"]


def test_a_keyword_fit_never_took_is_a_type_error(devices):
    params, loss_fn = mlp_problem()
    with pytest.raises(TypeError, match="unexpected keyword argument 'eval_evry'"):
        jaxdp.fit(loss_fn, params, optax.sgd(0.1), lambda k: None, steps=1, eval_evry=2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_preempted_fit_in_a_notebook_gives_the_stop_signals_back(devices, tmp_path, signum):
    """fit with a checkpoint directory catches SIGTERM, SIGUSR1 and SIGINT to save and stop. A
    notebook's process goes on after a preempted fit, so the handlers must be the notebook's again:
    its next Ctrl-C interrupts, a SIGTERM ends it (the command line keeps them until it exits)."""
    params, loss_fn = mlp_problem()
    data = list(mlp_batches(8))

    def batch(step):
        if step == 3:
            signal.raise_signal(signum)  # (from the prefetching thread: the main thread's handler sets the flag)
        return data[step]

    stop_signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    before = {s: signal.getsignal(s) for s in stop_signals}
    result = jaxdp.fit(loss_fn, params, optax.sgd(0.1), batch, steps=8,
                       checkpoint=jaxdp.CheckpointOptions(directory=str(tmp_path / "ckpt")),
                       logging=jaxdp.LogOptions(progress=False))
    assert result.preempted and result.summary["step"] < 8, result.summary
    assert {s: signal.getsignal(s) for s in stop_signals} == before


def test_with_metrics_at_sync_the_stop_check_waits_for_a_sync_step():
    """The stop check is a collective: with --metrics-at-sync it runs only after sync steps (every
    H / F), and on every step otherwise."""
    from jaxdp.loop.hooks import stop_on_signal
    from jaxdp.sync.spec import SyncSpec

    for spec, asked in ((SyncSpec(sync_every=8, sync_fragments=2, metrics_at_sync=True), [4, 8, 12]),
                        (SyncSpec(sync_every=8), list(range(1, 13)))):
        calls = []
        preemption = types.SimpleNamespace(should_stop=lambda state: calls.append(loop.done) or False)
        loop = types.SimpleNamespace(spec=spec, steps=100, state=None, preemption=preemption, stop=False, done=0)
        for done in range(1, 13):
            loop.done = done
            stop_on_signal(loop)
        assert calls == asked and not loop.stop
