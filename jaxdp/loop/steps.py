"""The step loop: one compiled step per global batch, then the hooks (jaxdp/loop/hooks.py).

Every sync mode but the host-driven rounds runs here (those: jaxdp/loop/rounds.py): the strategy,
compression (the controller's re-decisions are a hook), local steps, ZeRO-1, gradient accumulation,
every-step overlap (the last step applies its own gradient too: nothing is left in flight; a step
that applied nothing, the first with no gradient held, is neither logged nor checked; before every
save the gradient in flight is checked too), local steps' metrics averaged only at syncs (the NaN
check at sync steps and, before a save, on the replicas).
"""

from __future__ import annotations

import time

from jaxdp.loop import lead
from jaxdp.loop.hooks import Hook, Loop, log_step, periodic


def run_steps(loop: Loop) -> None:
    """Train from `loop.start` to the plan's `steps`, or until a hook stops the loop."""
    import jax
    import numpy as np

    from jaxdp.data.prefetch import Prefetcher
    from jaxdp.step import delayed, local_sgd

    plan = loop.plan
    # every-step overlap: with no gradient held at the start (a new run, or one extended after its
    # flush), the first step applies nothing and its metrics are zeros: neither logged nor checked
    made_up = loop.spec.overlap and not int(np.asarray(
        loop.state.sync.per_device[delayed.DELAYED_NAME]["held"].addressable_shards[0].data)[0])
    if loop.spec.overlap:
        loop.in_flight = delayed.check_in_flight
    # --metrics-at-sync: between syncs a process's metrics are its own; only sync steps' are checked
    # (every process the same: SyncSpec.metrics_shared), and before a save the replicas themselves.
    if loop.spec.metrics_at_sync:
        loop.in_flight = local_sgd.check_replicas

    hooks = periodic(loop, Hook(log_step, every=loop.options["logging"].every, at=("last",)))
    hooks.run(loop, "start")
    batches = Prefetcher(plan.batch_at, loop.start, plan.steps, depth=loop.options["run"].prefetch)
    hub_gone = lead.gone_error(plan)
    try:
        for step, batch in batches:
            train_step = loop.train_step
            dispatch = time.perf_counter()
            try:
                state, metrics = train_step(loop.state, batch)
            except hub_gone as gone:  # an elastic run whose launcher went away: stop with the state held
                lead.stop_held(loop, hooks, gone)
                return
            done = step + 1
            phantom = made_up and step == loop.start  # (every-step overlap: nothing applied yet)
            if loop.spec.overlap and done == plan.steps:  # the last step: apply its own gradient too, nothing in flight
                if not phantom:
                    loop.window.pending.append((done, metrics))
                state, metrics = train_step.flush(state)
                phantom = False
            plan.beat.dispatched(done, metrics["loss"], waited_s=time.perf_counter() - dispatch)
            if not phantom:
                loop.window.add(done, metrics, checked=loop.spec.metrics_shared(done))
            if step == loop.start:  # the first step compiles: time it apart, then start the clock
                jax.block_until_ready(metrics)  # host sync point (once)
                loop.writer.first_step_done(done)  # the progress bar starts at `done`: this step is counted
            else:
                loop.writer.step()
            loop.state, loop.before, loop.done, loop.where = state, step, done, f"step {done}"
            hooks.run(loop, "step", *(("last",) if done == plan.steps else ()))
            if loop.stop:
                hooks.run(loop, "stop")
                return
        hooks.run(loop, "end")
    finally:
        batches.close()
