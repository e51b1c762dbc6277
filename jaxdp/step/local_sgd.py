"""Local steps with infrequent averaging: Local SGD and DiLoCo (Douillard et al., 2023).

    state = jaxdp.init_state(params, tx, mesh, sync_every=16, outer_tx=optax.sgd(0.7, momentum=0.9, nesterov=True))
    step  = jaxdp.make_train_step(loss_fn, tx, mesh, sync_every=16, outer_tx=<the same outer_tx>)
    state, metrics = step(state, batch)          # metrics["synced"]: 1.0 on a sync step, else 0.0

The replica is the DEVICE: every device of the mesh, in every process, keeps its own copy of the
parameters and of the inner optimizer state (`tx`, e.g. AdamW) and trains it on its own slice of
each global batch with no gradient all-reduce. After every `sync_every` (H) steps, i.e. on the step
with (step + 1) % H == 0, each device computes its pseudo-gradient (global params - its params),
the devices average it through the step's exchange (jaxdp/sync/exchange.py: the strategy's collective,
and the codec if any; the pseudo-gradient is what gets compressed, its state in `state.sync` as
for gradients), and the outer optimizer (`outer_tx`, any optax transformation;
DiLoCo: SGD with Nesterov momentum 0.9, lr 0.7) applies that mean to the shared global
parameters. Every replica then restarts from the new global parameters; the inner optimizer state
stays per device (DiLoCo keeps each worker's AdamW moments).

With H = 1, `outer_tx=optax.sgd(1.0)` and a plain SGD inner optimizer this is exactly synchronous
training (tests/test_local_sgd.py checks it). With Adam as the inner optimizer H = 1 is NOT the
same as synchronous Adam: every device keeps moment estimates of its own gradients, not of the
averaged gradient. `outer_tx=None` with H > 1 means plain model averaging, `optax.sgd(1.0)`
(Local SGD).

Where it lives in the TrainState:

* `state.params`: the global (outer) parameters, replicated; eval and checkpoints read them as
  before. Between syncs they are the parameters of the last sync.
* `state.sync.per_device["local_sgd"]`: {"params", "opt_state"}: each device's replica and inner
  optimizer state, one row per device (leading axis = mesh size, sharded over the data axis).
* `state.sync.shared["outer"]`: the outer optimizer's state, replicated: a tuple with one state
  per fragment (one without `sync_fragments`), each over {leaf name: array} of its fragment.
* `state.opt_state`: `()`; the inner optimizer states are the per-device rows.

What is communicated between syncs: the scalar metrics (loss, aux, the gradient norm) and the float
leaves of the model state (BatchNorm statistics, none for the MLP and GPT) are averaged over the
devices in one tiny all-reduce every step, so the logged loss is the mean of the replicas' losses
on their own slices and every process sees the same values (the NaN guard agrees). On a slow link
that all-reduce is the only traffic between syncs, a round trip and about a kilobyte on the wire
per step (measured: docs/slow-links.md): `metrics_at_sync=True` (`--metrics-at-sync`) averages the
metrics only on sync steps, where they ride in the pseudo-gradient's own collective; between syncs
each device returns its own (a process logs its first device's replica) and the command line's
NaN check waits for the next sync, whose metrics every process shares (a replica that diverged
makes the average, and so that sync's metrics, non-finite). Models with float state are refused. `grad_norm` is
the mean over devices of each replica's own gradient norm. `comm_bytes` is what a device sent for
the pseudo-gradient on this step (0 between syncs) and `comm_bytes_per_step` its average over a
period.

How the step decides: one compiled program with `jax.lax.cond((step + 1) % H == 0, sync, local)`
(with fragments `jax.lax.switch` over local and one branch per fragment) on the replicated step
counter. Every device of every process reads the same counter, so all take
the same branch and the sync branch's collectives run on all devices or none; the decision is a
pure function of `state.step`, which checkpoints hold, so a run resumed in the middle of a period
syncs at the same steps as one that never stopped; and the caller (the CLI loop, a notebook) passes
nothing extra and compiles once. (Two programs chosen on the host would need the step number on the
host: a device read per step for a notebook caller.) Preemption stops every process after the same
step as before (jaxdp/cluster/preemption.py), whichever branch that step took.

A checkpoint restored on another device count gives every new device the mean of the old rows
(jaxdp/checkpoint/checkpointer.py). For the replicas that is a sync without the outer step: the mean replica
is exactly what the next sync would average (uncompressed), so the pseudo-gradient of the next
sync, global - mean(replicas), is unchanged; the inner optimizer states become their mean too.

Fragments (Streaming DiLoCo, Douillard et al., 2025): `sync_fragments=F` cuts the parameter
arrays into F contiguous groups of about equal bytes (`fragments`) and synchronises one of them
every H/F steps, in turn, so each fragment is still averaged every H steps but the link carries
1/F of the model at a time instead of all of it at once. Each fragment has its own outer
optimizer state; the compression state is keyed by leaf, so compression works per fragment too.

`--sync-every auto` chooses H from measured figures: the rule is `jaxdp.sync.costmodel.auto_sync_every`,
the measurement jaxdp/sync/controller.py.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.mesh import data_axes, replicated_sharding
from jaxdp.moved import forwarder
from jaxdp.sync.codecs.base import bytes_sent
from jaxdp.sync.exchange import leaf_names

STATE_NAME = "local_sgd"   # state.sync.per_device[STATE_NAME] = {"params": rows, "opt_state": rows}
OUTER_NAME = "outer"       # state.sync.shared[OUTER_NAME] = the outer optimizer's state


def is_local(state: Any) -> bool:
    """True for a TrainState made with `init_state(..., sync_every=H > 1 or outer_tx=...)`."""
    return STATE_NAME in state.sync.per_device


def optimizer_states(state: Any) -> Any:
    """The inner (per-device rows) and outer optimizer states of a local state; () otherwise."""
    if not is_local(state):
        return ()
    return state.sync.per_device[STATE_NAME]["opt_state"], state.sync.shared[OUTER_NAME]


def default_outer(outer_tx: optax.GradientTransformation | None) -> optax.GradientTransformation:
    """`outer_tx`, or plain model averaging (Local SGD): SGD with lr 1, no momentum."""
    return optax.sgd(1.0) if outer_tx is None else outer_tx


def fragments(params: Any, count: int) -> list[list[int]]:
    """The parameter leaves (in flatten order) cut into `count` contiguous groups of about equal
    bytes, each non-empty: Streaming DiLoCo's fragments. ValueError if there are fewer leaves."""
    sizes = [int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)]
    if count > len(sizes):
        raise ValueError(f"sync_fragments={count} is more than the model's {len(sizes)} parameter arrays")
    cumulative, cuts = np.cumsum(sizes), [0]
    for k in range(1, count):
        target = k * cumulative[-1] / count
        cut = int(np.argmin(np.abs(cumulative - target))) + 1  # the boundary nearest to k/count of the bytes
        cuts.append(min(max(cut, cuts[-1] + 1), len(sizes) - (count - k)))
    cuts.append(len(sizes))
    return [list(range(cuts[k], cuts[k + 1])) for k in range(count)]


def subset(leaves: list, names: list[str], group: list[int]) -> dict:
    """The fragment's leaves as {leaf name: leaf}: the tree its outer optimizer state is over."""
    return {names[i]: leaves[i] for i in group}


def masked(treedef: Any, leaves: list, group: list[int]) -> Any:
    """The fragment's leaves in the parameters' tree, None elsewhere (so the same paths: the codec's
    slot is keyed by them)."""
    return jax.tree.unflatten(treedef, [leaves[i] if i in group else None for i in range(len(leaves))])


def check_fragments(outer_states: tuple, count: int) -> None:
    """ValueError unless the state holds one outer state per fragment of the step's `count`."""
    if len(outer_states) != count:
        raise ValueError(f"this state was made with sync_fragments={len(outer_states)} but the step with "
                         f"sync_fragments={count}; pass the same to init_state and make_train_step")


def fragment_branch(step: Any, every: int, count: int) -> Any:
    """The `lax.switch` branch of step `step` (steps done): 0 between syncs, 1 + f on the steps with
    step % every == 0 where fragment f is synchronised, in turn."""
    return jnp.where(step % every == 0, 1 + (step // every - 1) % count, 0)


def init_sync(params: Any, tx: optax.GradientTransformation, mesh: Mesh,
              outer_tx: optax.GradientTransformation | None, sync_fragments: int = 1) -> tuple[dict, dict]:
    """(per_device, shared) entries of a new TrainState's SyncState: every device's replica = `params`
    with a fresh `tx` state, stacked one row per device and sharded over the data axis; the outer
    optimizer's state replicated, one per fragment (a tuple), each over {leaf name: leaf} of its
    fragment's leaves. `params` are the replicated global parameters."""
    rows = NamedSharding(mesh, P(data_axes(mesh)))
    inner = jax.jit(tx.init, out_shardings=replicated_sharding(mesh))(params)
    stack = jax.jit(lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (mesh.size, *jnp.shape(x))), tree),
                    out_shardings=rows)
    leaves, names = jax.tree.leaves(params), leaf_names(params)
    outer_init = jax.jit(default_outer(outer_tx).init, out_shardings=replicated_sharding(mesh))
    outer = tuple(outer_init(subset(leaves, names, group)) for group in fragments(params, sync_fragments))
    return {STATE_NAME: stack({"params": params, "opt_state": inner})}, {OUTER_NAME: outer}


def check_replicas(state: Any, step: int) -> None:
    """metrics_at_sync: raise jaxdp.metrics.Diverged if any device's replica holds a NaN or an
    infinity. Between syncs a process sees only its own metrics, so before every save (a host sync
    point; every process calls it at the same steps) the replicas a resume would continue from."""
    from jaxdp.metrics import Diverged
    from jaxdp.sync.exchange import non_finite

    value = float(jax.device_get(non_finite(state.sync.per_device[STATE_NAME]["params"])))  # host sync point
    if value:
        raise Diverged(step, "a replica of local steps", value)


def replica_step(local_grads: Callable, tx: optax.GradientTransformation, view: Any, mine: dict, batch: Any,
                 grad_norm: bool = False) -> tuple[dict, dict, Any]:
    """One inner step of a device's replica, with no collective: `mine` is its {"params", "opt_state"},
    `view` the state the loss reads besides the parameters. Returns (the new replica, the metrics,
    the model state); every rule of local steps takes it (these H-step rounds, the timed and
    overlapped ones: jaxdp/step/rounds.py, and across torchft workers: jaxdp/elastic/rounds.py)."""
    metrics, model_state, grads = local_grads(view.replace(params=mine["params"]), batch)
    if grad_norm:
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}  # this replica's own gradient
    updates, opt_state = tx.update(grads, mine["opt_state"], mine["params"])
    return {"params": optax.apply_updates(mine["params"], updates), "opt_state": opt_state}, metrics, model_state


# ---------------------------------------------------------------------------------------------
# The step (built by jaxdp.step.train_step.make_train_step when the state is local)
# ---------------------------------------------------------------------------------------------


def make_device_step(local_grads: Callable, tx: optax.GradientTransformation, outer_tx: optax.GradientTransformation,
                     exchange: Any, sync_every: int, sync_fragments: int, grad_norm: bool,
                     metrics_at_sync: bool = False) -> Callable:
    """`(state, local batch) -> (state, metrics)` on one device, inside `shard_map`: `tx` on this
    device's replica, and every H steps the pseudo-gradient averaged through `exchange`
    (jaxdp/sync/exchange.py) and applied by `outer_tx`. `metrics_at_sync`: between syncs the
    metrics are this device's own (no riders' all-reduce: the model keeps no float state)."""
    outer_tx = default_outer(outer_tx)
    count, every = sync_fragments, sync_every // sync_fragments  # one fragment synchronised every `every` steps

    def device_step(state: Any, batch: Any) -> tuple[Any, dict]:
        mine = jax.tree.map(lambda x: x[0], state.sync.per_device[STATE_NAME])  # this device's replica
        new, metrics, model_state = replica_step(local_grads, tx, state, mine, batch, grad_norm)
        replica, inner = new["params"], new["opt_state"]
        step = state.step + 1
        outer_states = state.sync.shared[OUTER_NAME]
        check_fragments(outer_states, count)
        global_leaves, treedef = jax.tree.flatten(state.params)
        replica_leaves, names = jax.tree.leaves(replica), leaf_names(state.params)
        groups = fragments(state.params, count)
        wire = float(bytes_sent(sum(exchange.payload_bytes(masked(treedef, global_leaves, g)) for g in groups),
                                exchange.n))

        def rows(params: Any, sync_state: Any) -> Any:
            local = {"params": params, "opt_state": inner}
            return sync_state.replace(per_device={**sync_state.per_device, STATE_NAME: jax.tree.map(lambda x: x[None], local)})

        def synced(f: int) -> tuple[Any, dict]:
            group = groups[f]
            # The pseudo-gradient of fragment f: how far this replica moved from the global parameters.
            delta = masked(treedef, [g - r for g, r in zip(global_leaves, replica_leaves)], group)
            mean, out, new_model_state, sync_state, extra = exchange.mean(delta, metrics, model_state, state.sync,
                                                                          state.step)
            out = {**out, **extra}
            before = subset(global_leaves, names, group)
            updates, outer = outer_tx.update(dict(zip(before, jax.tree.leaves(mean))), outer_states[f], before)
            after = optax.apply_updates(before, updates)
            new_global, new_replica = list(global_leaves), list(replica_leaves)
            for i in group:  # the fragment's replicas restart from its new global parameters
                new_global[i] = new_replica[i] = after[names[i]]
            sync_state = rows(jax.tree.unflatten(treedef, new_replica), sync_state)
            shared = tuple(outer if k == f else o for k, o in enumerate(outer_states))
            sync_state = sync_state.replace(shared={**sync_state.shared, OUTER_NAME: shared})
            out = {**out, "synced": jnp.float32(1), "comm_bytes_per_step": jnp.float32(wire / sync_every)}
            return state.replace(step=step, params=jax.tree.unflatten(treedef, new_global),
                                 model_state=new_model_state, sync=sync_state), out

        if sync_every == 1:
            return synced(0)
        shapes = jax.eval_shape(lambda: synced(0))[1]

        def local() -> tuple[Any, dict]:
            # A few scalars (and BatchNorm statistics), so every process logs the same values; with
            # metrics_at_sync, nothing: each device's own (the rules refuse float model state).
            out, new_model_state = (metrics, model_state) if metrics_at_sync else exchange.riders(metrics, model_state)
            out = {**{k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}, **out,
                   "comm_bytes_per_step": jnp.float32(wire / sync_every)}
            return state.replace(step=step, model_state=new_model_state, sync=rows(replica, state.sync)), out

        branch = fragment_branch(step, every, count)  # 0: local; 1 + f: fragment f
        return jax.lax.switch(branch, [local, *(lambda f=f: synced(f) for f in range(count))])

    return device_step


# Names that lived here before the cost model and the sync spec had modules of their own.
__getattr__ = forwarder(__name__, {"choose_sync_every": "jaxdp.sync.costmodel", "auto_sync_every": "jaxdp.sync.costmodel",
                                   "MAX_AUTO_SYNC_EVERY": "jaxdp.sync.costmodel", "AUTO": "jaxdp.sync.spec",
                                   "check_sync_every": "jaxdp.sync.spec"})
