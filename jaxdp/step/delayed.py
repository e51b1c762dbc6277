"""Every-step overlap (`overlap=True` with `sync_every=1`): the gradient all-reduce of step k runs
while step k + 1's gradients are computed, and its average is applied one step late.

    step = jaxdp.make_train_step(loss_fn, tx, mesh, "ring", overlap=True)
    state, metrics = step(state, batch)       # metrics: the step before's (its average landed now)
    state, metrics = step.flush(state)        # the end of training: apply the gradient in flight

The update rule, with w_k the parameters before step k and g_k^d device d's gradient on its slice
of batch k:

    g_k^d   = grad L(w_k; batch_k^d)                    (no collective)
    w_{k+1} = w_k - update(mean_d g_{k-1}^d)            (step 0 applies nothing)

The gradient is one step stale, the same stale gradient on every device, so the replicas stay
identical with any optax transformation (Adam's moments are those of the averaged gradients, as
in synchronous training) and nothing needs correcting afterwards: PipeSGD's one-step pipeline
(Li et al., 2018) and the D = 1 case of delayed gradient averaging (Zhu et al., 2021), whose
correction term exists only because each replica there applies its own gradient before the
average lands. `flush` applies the last gradient at the end, so K steps and a flush apply K
updates. A delay of one step costs little where the learning rate is sized for the run (the
delay's effect is of order lr^2); tests/test_delayed.py checks the rule against a single-device
reference loop.

Why it overlaps on CPU: one step is two programs. The gradient program (`grads`) runs no collective;
the collective program (`reduce_apply`: the exchange of the gradient held from the step before,
through the strategy and codec, then the optax update) is dispatched from a thread of its own. On
JAX's CPU client a program runs on the thread that dispatches it, so from the training thread it
would wait for the gradient program (and it for it); from a second thread the two run at once,
given two CPU worker threads (a one-core process: jaxdp.cluster.runtime.two_cpu_workers). The collective
mostly waits on the other process; the gradient program computes meanwhile. Only one collective
program is ever in flight, and every process dispatches them in the same order. On GPU, XLA's
latency-hiding scheduler already overlaps a synchronous step's all-reduce with the backward pass
inside one program; `overlap` there adds what no schedule within a step can: the all-reduce of the
last layers' gradients and the optimizer update also hide behind the next step's forward pass.

State (`state.sync.per_device["delayed"]`, checkpointed with the rest, so a run stopped mid-way
resumes bit-identically): the gradient in flight and its metrics, one row per device, and "held"
(1 once a gradient is held). The slot's shapes come from the loss function, so the step adds it
(`TrainStep.prepare(state, batch)`, or on the first call); `jaxdp.fit` does so before it restores.

Metrics: the step's metrics are those of the gradient it applied, the step before's (the loss is
averaged in the same exchange); the first call's are zeros (nothing was applied: `jaxdp.fit` logs
none for it). A checkpoint holds the gradient in flight too: `check_in_flight` before every save. Scope: an in-graph strategy (psum,
ring) with any fixed compression; no local steps (those overlap their rounds: jaxdp/step/rounds.py), no
ZeRO-1, no float model state (BatchNorm statistics would be one step stale and per device).
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.mesh import data_axes, state_specs
from jaxdp.sync.exchange import float_leaves, make_exchange, non_finite

DELAYED_NAME = "delayed"  # per_device[DELAYED_NAME] = {"grads": params rows, "metrics": rows, "held": int32 rows}


def is_delayed(state: Any) -> bool:
    return DELAYED_NAME in state.sync.per_device


def _without_slot(sync: Any) -> Any:
    return sync.replace(per_device={k: v for k, v in sync.per_device.items() if k != DELAYED_NAME})


def check_in_flight(state: Any, step: int) -> None:
    """Raise jaxdp.metrics.Diverged if the gradient in flight (or its loss) is NaN or infinite.

    The NaN guard checks the gradient a step applied; a checkpoint also holds the one in flight, and
    a resume would apply it at once. So before every save (a host sync point; with several
    processes, every process calls it at the same steps)."""
    from jaxdp.metrics import Diverged

    held = state.sync.per_device[DELAYED_NAME]
    value = float(jax.device_get(non_finite((held["grads"], held["metrics"]))))  # host sync point
    if value:
        raise Diverged(step, "the gradient in flight", value)


class Delayed:
    """`(state, batch) -> (state, metrics)` of the every-step overlap (module docstring)."""

    def __init__(self, local_grads: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: Any,
                 grad_norm: bool):
        axis, n = data_axes(mesh), mesh.size
        self.mesh, self.axis, self.spec = mesh, axis, spec
        exchange = make_exchange(spec.collective, axis, n, spec.codec)

        def device_grads(view: Any, batch: Any) -> tuple[dict, Any]:
            metrics, model_state, grads = local_grads(view, batch)
            held = {"grads": grads, "metrics": metrics, "held": jnp.int32(1)}  # the slot's entries
            return jax.tree.map(lambda x: x[None], held), model_state

        def grads(view: Any, batch: Any) -> tuple[dict, Any]:
            return jax.shard_map(device_grads, mesh=mesh, in_specs=(state_specs(view, axis), P(axis)),
                                 out_specs=(P(axis), P()), check_vma=False)(view, batch)

        def device_apply(state: Any, held: dict) -> tuple[Any, dict]:
            on = held["held"][0] > 0
            grads, metrics = jax.tree.map(lambda x: x[0], (held["grads"], held["metrics"]))
            mean, metrics, _, sync, extra = exchange.mean(grads, metrics, {}, state.sync, state.step - 1)
            metrics = {**metrics, **extra}
            if grad_norm:
                metrics = {**metrics, "grad_norm": optax.tree.norm(mean)}
            updates, opt_state = tx.update(mean, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            new = jax.tree.map(lambda a, b: jnp.where(on, a, b), (params, opt_state, sync),
                               (state.params, state.opt_state, state.sync))
            return state.replace(step=state.step + 1, params=new[0], opt_state=new[1], sync=new[2]), metrics

        def reduce_apply(state: Any, held: dict) -> tuple[Any, dict]:
            specs = state_specs(state, axis)
            return jax.shard_map(device_apply, mesh=mesh, in_specs=(specs, P(axis)), out_specs=(specs, P()),
                                 check_vma=False)(state, held)

        self.grads = jax.jit(grads)
        # The gradient program reads the parameters and the step while this runs: only the held
        # gradient is donated.
        self.reduce_apply = jax.jit(reduce_apply, donate_argnums=1)
        self._nothing_held = jax.jit(lambda held: jax.tree.map(jnp.zeros_like, held))  # (flush)
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    @staticmethod
    def _view(state: Any) -> Any:
        """What the gradient program reads: params, model state, rng and step, no sync or optimizer."""
        return state.replace(opt_state=(), sync=state.sync.replace(per_device={}, shared={}))

    def lower(self, state: Any, batch: Any) -> Any:
        """JAX's `Lowered` of the gradient program (the step's compute; the collective is the other)."""
        return self.grads.lower(self._view(self.prepare(state, batch)), batch)

    def prepare(self, state: Any, batch: Any) -> Any:
        """`state` with the slot (nothing held: zeros of the gradient program's shapes), if it has none."""
        if is_delayed(state):
            return state
        self.spec.validate(float_state=bool(float_leaves(state.model_state)[0]))  # (jaxdp/sync/rules.py)
        shapes, _ = jax.eval_shape(self.grads, self._view(state), batch)
        rows = NamedSharding(self.mesh, P(self.axis))

        def zeros(shape: tuple, dtype: Any) -> jax.Array:
            host = np.zeros(shape, dtype)
            return jax.make_array_from_callback(host.shape, rows, lambda index: host[index])

        slot = jax.tree.map(lambda s: zeros(s.shape, s.dtype), shapes)  # nothing held: "held" 0
        return state.replace(sync=state.sync.replace(per_device={**state.sync.per_device, DELAYED_NAME: slot}))

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict]:
        state = self.prepare(state, batch)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdp-overlap")
        held = state.sync.per_device[DELAYED_NAME]
        rest = state.replace(sync=_without_slot(state.sync))

        def average() -> tuple[Any, dict]:
            return jax.block_until_ready(self.reduce_apply(rest, held))

        landing = self._thread.submit(average)
        try:
            slot, model_state = self.grads(self._view(state), batch)
        finally:
            state, metrics = landing.result()  # (waited for even if the gradient program failed)
        sync = state.sync.replace(per_device={**state.sync.per_device, DELAYED_NAME: slot})
        return state.replace(model_state=model_state, sync=sync), metrics

    def flush(self, state: Any) -> tuple[Any, dict]:
        """Apply the gradient in flight, if any, with no new one: nothing is held afterwards. The
        step count stays (the step that computed it counted already)."""
        held = state.sync.per_device[DELAYED_NAME]
        rest = state.replace(sync=_without_slot(state.sync))
        step = state.step
        flushed = self._nothing_held(held)  # (before the donating call)
        state, metrics = self.reduce_apply(rest, held)
        sync = state.sync.replace(per_device={**state.sync.per_device, DELAYED_NAME: flushed})
        return state.replace(step=step, sync=sync), metrics

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
