"""`shard_params=True` with jaxdp's own sync across workers (hybrid sharding, HSDP): the state cut
over each worker's devices (jaxdp/step/fsdp.py), and between workers the ring, compression or local
steps, as without `shard_params`.

    mesh = jaxdp.make_mesh(axis_name=("hosts", "local"))            # one row of devices per process
    state = init_state(params, tx, mesh, shard_params=True, compression="int8", sync_every=8)
    step = make_train_step(loss_fn, tx, mesh, "ring", shard_params=True, compression="int8", sync_every=8)

A worker is one process (a "hosts" row of the mesh; one worker on a one-axis mesh). Inside it, the
gradient is fsdp.py's, the mean over the worker's devices reduce-scattered into each device's
slice, and the step computes every worker's gradient at once, a `[workers, *leaf]` row cut over
("hosts", the leaf's local cut): for a model that hands its blocks over, `fsdp.layered_gradients`
(one block gathered at a time, a `shard_map` over the whole mesh); for any other, XLA's gathers in
a `jax.vmap` over "hosts" with `spmd_axis_name="hosts"` (each row of the mesh computes its own
worker's). Across workers it goes through the exchange of the step's strategy and codec
(jaxdp/sync/exchange.py) in a `shard_map` over the whole mesh: device (h, l) holds worker h's slice
l and averages it over "hosts" with the devices (h', l), so the ring's hops, int8's requantization
and error feedback all run on 1/L of the model per device, exactly as they would on a whole
replica. One worker: nothing crosses, the exchange is skipped (the codec too: there is nobody to
send to).

Every step: the mean over workers of their gradients, then the optimizer on each device's slice.
With psum and no codec, fsdp.py's one-program step does the same through XLA's all-reduce (that is
the step used there).

Local steps (DiLoCo): the replica is the worker, not the device. `state.sync.per_device["local_sgd"]`
holds each worker's parameters and inner optimizer state, one row per worker (`[workers, *leaf]`,
cut like the gradients); every `sync_every` steps the pseudo-gradients (global - replica) are
averaged through the exchange and `outer_tx` updates the global parameters, which the replicas
restart from (local_sgd.py's rule, on slices; with `sync_fragments`, one fragment every
sync_every / F steps in turn). The outer state has local_sgd.py's tree (one state per fragment,
over {leaf name: leaf}), cut like the parameters. So a checkpoint moves between this layout and
local_sgd.py's: rows of another count become their mean (jaxdp/checkpoint/portable.py).

Overlapped rounds (`--sync-every H --overlap`) are jaxdp/step/overlap.py's (the `Cut` layout), on these same
pieces (`Workers`) and the same state, with the delta in flight beside it.

With `metrics_at_sync` the logged scalars are averaged across workers on sync steps only; between
them each worker's own mean over its devices is returned (a process reads its own worker's), so
nothing crosses between workers there.

Compression's slot is the same as without `shard_params` but for its rows: one per worker, cut like
the gradients (each device keeps the error feedback of its own slice). The exchange asks the codec
for its form on slices (`Compressor.on_slices`): bf16, int8 and int4 act on each slice as on a whole
leaf; PowerSGD's factors span whole matrices, so its sliced form puts them together inside the
worker (jaxdp/sync/codecs/powersgd.py, `Sliced`). Top-k, which chooses indices over whole leaves,
is refused (jaxdp/sync/rules.py).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.mesh import replicated_sharding
from jaxdp.step import fsdp
from jaxdp.step.local_sgd import OUTER_NAME, STATE_NAME, check_fragments, default_outer, fragment_branch, \
    fragments, masked, subset
from jaxdp.sync.codecs.base import SLOT, bytes_sent, only
from jaxdp.sync.codecs.plain import NoCompression
from jaxdp.sync.exchange import leaf_names, make_exchange, slot_state

WORKERS = "_workers"  # the vmap axis of the workers on a one-axis mesh (one worker; no mesh axis of its own)


def across(mesh: Mesh) -> tuple[str | None, int]:
    """The mesh axis between workers and how many there are: "hosts" of the two-axis mesh, or
    (None, 1) on a one-axis mesh (one worker)."""
    if len(mesh.axis_names) == 1:
        return None, 1
    name = mesh.axis_names[0]
    return name, mesh.shape[name]


def row_spec(shape: tuple[int, ...], mesh: Mesh) -> P:
    """A per-worker row `[workers, *shape]`: over "hosts", then the leaf's own cut (fsdp.spec_for)."""
    name, _ = across(mesh)
    axis, n = fsdp.within(mesh)
    return P(name, *fsdp.spec_for(tuple(shape), n, axis))


def row_shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding per `[workers, *leaf]` row of `tree`."""
    return jax.tree.map(lambda x: NamedSharding(mesh, row_spec(tuple(x.shape[1:]), mesh)), tree)


def rows(tree: Any, mesh: Mesh) -> Any:
    """Every leaf of `tree` (cut by fsdp.shardings) repeated once per worker, cut by `row_shardings`."""
    _, count = across(mesh)
    stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), t)  # noqa: E731
    return jax.jit(stack, out_shardings=row_shardings(jax.eval_shape(stack, tree), mesh))(tree)


def init_slot(compression: Any, params: Any, mesh: Mesh) -> tuple[dict, dict]:
    """(per_device, shared) of a new state's `sync` for `compression`: the codec's error feedback,
    one row per worker cut like the gradients; ({}, {}) for none."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    slot = slot_state(compression, abstract)
    if not slot.error and not slot.q:
        return {}, {}
    error = rows(fsdp.place(jax.tree.map(np.asarray, jax.device_get(slot.error)), mesh), mesh)
    return {SLOT: error}, {SLOT: slot.q}


def init_local(params: Any, tx: optax.GradientTransformation, mesh: Mesh,
               outer_tx: optax.GradientTransformation | None, sync_fragments: int = 1) -> tuple[dict, dict]:
    """(per_device, shared) entries for local steps: every worker's replica = `params` with a fresh
    `tx` state (rows), the outer optimizer's state cut like the parameters, one per fragment, each
    over {leaf name: leaf} of its fragment (local_sgd.py's tree)."""
    inner = fsdp.init_opt_state(params, tx, mesh)
    leaves, names = jax.tree.leaves(params), leaf_names(params)
    outer = tuple(fsdp.init_opt_state(subset(leaves, names, group), default_outer(outer_tx), mesh)
                  for group in fragments(params, sync_fragments))
    return {STATE_NAME: rows({"params": params, "opt_state": inner}, mesh)}, {OUTER_NAME: outer}


def _slice_shapes(params: Any, mesh: Mesh) -> Any:
    """One device's slice of every leaf (what the exchange averages there), as ShapeDtypeStructs."""
    _, n = fsdp.within(mesh)

    def piece(x: Any) -> jax.ShapeDtypeStruct:
        d = fsdp.cut_dim(tuple(x.shape), n)
        return jax.ShapeDtypeStruct(tuple(s // n if i == d else s for i, s in enumerate(x.shape)), x.dtype)

    return jax.tree.map(piece, params)


class Workers:
    """What the steps over `mesh` share, one worker per "hosts" row: each worker's gradient
    (`grads`), the mean of `[workers, *leaf]` rows across workers through the exchange (`mean`),
    the batch and model state laid out per worker (`prepared`) and their means (`finished`). The
    step below uses them on the whole mesh; the overlapped rounds (jaxdp/step/overlap.py, `Cut`) on
    one process's rows too."""

    def __init__(self, loss_fn: Callable, mesh: Mesh, spec: Any, *, stateful: bool, grad_accum: int):
        fsdp.check_mesh(mesh)
        self.mesh, self.spec, self.loss_fn, self.stateful, self.grad_accum = mesh, spec, loss_fn, stateful, grad_accum
        self.hosts, self.count = across(mesh)
        self.inside, self.local = fsdp.within(mesh)
        self.codec = spec.codec if spec.codec is not None else (NoCompression() if spec.local else None)
        self.exchange = make_exchange(spec.collective, self.hosts, self.count, self.codec,
                                      pseudo_gradient=spec.local) if self.count > 1 else None
        self._grads_of = fsdp.gradients(loss_fn, mesh, (self.inside,), stateful=stateful, grad_accum=grad_accum)
        self._layered = fsdp.layered_gradients(loss_fn, mesh, stateful=stateful, grad_accum=grad_accum, workers=True)
        self.whole = replicated_sharding(mesh)

    def per_worker(self, fn: Callable, in_axes: tuple) -> Callable:
        return jax.vmap(fn, in_axes=in_axes, axis_name=self.hosts or WORKERS, spmd_axis_name=self.hosts)

    def exchange_of(self, whole: Any) -> Any:
        """The exchange of slices of `whole`'s leaves: its codec `on_slices` (PowerSGD's sliced form)."""
        if self.exchange is None or self.codec is None:
            return self.exchange
        inside, local = self.inside, self.local
        cuts = tuple((jax.tree_util.keystr(path), tuple(x.shape), fsdp.cut_dim(tuple(x.shape), local))
                     for path, x in jax.tree_util.tree_flatten_with_path(whole)[0])
        return make_exchange(self.spec.collective, self.hosts, self.count, self.codec.on_slices(cuts, inside, local),
                             pseudo_gradient=self.spec.local)

    def grads(self, params: Any, model_state: Any, rows_: Any, rng: Any, step: Any, replicas: bool) -> tuple:
        """Every worker's (metrics [workers, local], model state [workers, local, ...], gradient
        [workers, *leaf]): its blocks gathered one at a time where the model hands them over
        (fsdp.layered_gradients), else fsdp.gradients per worker. `replicas`: `params` are rows."""
        count, local, mesh = self.count, self.local, self.mesh
        flat = lambda t: jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), t)  # noqa: E731 [workers, local] -> [d]
        one = jax.tree.map(lambda x: x[0], params) if replicas else params
        inside = fsdp.block_names(self.loss_fn, self.stateful, one, flat(model_state), flat(rows_),
                                  tuple(mesh.axis_names))
        if inside is None:
            return self.per_worker(self._grads_of, (0 if replicas else None, 0, 0, None, None))(
                params, model_state, rows_, rng, step)
        metrics, model_state, grads = self._layered(params, flat(model_state), flat(rows_), rng, step, inside, replicas)
        grid = lambda t: jax.tree.map(lambda x: x.reshape(count, local, *x.shape[1:]), t)  # noqa: E731
        return grid(metrics), grid(model_state), grads

    def mean(self, tree: Any, slot: Any, step: Any, riders: dict | None = None) -> tuple[Any, Any, dict, dict]:
        """`[workers, *leaf]` rows -> (their mean, cut like the parameters, the codec's slot, the
        exchange's metrics, `riders` averaged): through the exchange (`slot`: the SyncState holding
        the codec's slot alone). `riders`: {name: [workers] float32}, one value per worker, averaged in
        the exchange's first collective."""
        mesh, local, inside = self.mesh, self.local, self.inside
        riders = riders or {}
        if self.exchange is None:
            return jax.tree.map(lambda x: x[0], tree), slot, {}, jax.tree.map(lambda x: x[0], riders)
        sliced = self.exchange_of(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree))
        tree_specs = jax.tree.map(lambda x: row_spec(tuple(x.shape[1:]), mesh), tree)
        mean_specs = jax.tree.map(lambda x: fsdp.spec_for(tuple(x.shape[1:]), local, inside), tree)
        slot_specs = slot.replace(per_device=jax.tree.map(lambda x: row_spec(tuple(x.shape[1:]), mesh), slot.per_device),
                                  shared=jax.tree.map(lambda _: P(), slot.shared))

        def device(tree: Any, slot: Any, step: Any, riders: dict) -> tuple[Any, Any, dict, dict]:
            mean, riders, _, slot, extra = sliced.mean(jax.tree.map(lambda x: x[0], tree),
                                                       jax.tree.map(lambda x: x[0], riders), {}, slot, step)
            return mean, slot, extra, riders

        return jax.shard_map(device, mesh=mesh, in_specs=(tree_specs, slot_specs, P(), P(self.hosts)),
                             out_specs=(mean_specs, slot_specs, P(), P()), check_vma=False)(tree, slot, step, riders)

    def prepared(self, model_state: Any, batch: Any) -> tuple[Any, Any]:
        """The batch as [workers, local devices, grad_accum, r, ...], the model state per device."""
        count, local = self.count, self.local
        rows_ = fsdp.device_rows(batch, self.mesh, self.grad_accum)
        rows_ = jax.tree.map(lambda x: x.reshape(count, local, *x.shape[1:]), rows_)
        return rows_, jax.tree.map(lambda x: jnp.broadcast_to(x, (count, local, *x.shape)), model_state)

    def finished(self, metrics: dict, model_state: Any) -> tuple[dict, Any]:
        """Metrics and model state averaged over every device of every worker."""
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        metrics = jax.tree.map(lambda x: jnp.mean(flat(x), axis=0), metrics)
        model_state = fsdp.mean_model_state(jax.tree.map(flat, model_state))
        return metrics, jax.lax.with_sharding_constraint(model_state, jax.tree.map(lambda _: self.whole, model_state))

    def inner_step(self, tx: optax.GradientTransformation, replica: Any, inner: Any, grads: Any) -> tuple:
        """Every worker's `tx` step on its replica: (replica, inner state, each worker's gradient norm)."""
        def worker(replica: Any, inner: Any, grads: Any) -> tuple:
            updates, inner = tx.update(grads, inner, replica)
            return optax.apply_updates(replica, updates), inner, optax.tree.norm(grads)

        return self.per_worker(worker, (0, 0, 0))(replica, inner, grads)


def make_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, spec: Any, *, stateful: bool,
              grad_accum: int, grad_norm: bool) -> Callable:
    """The jitted step `(state, batch) -> (state, metrics)` (the old state donated) for `spec`
    (a `jaxdp.sync.spec.SyncSpec` with shard_params): every step or local steps, through the
    strategy's collective and the codec across workers."""
    w = Workers(loss_fn, mesh, spec, stateful=stateful, grad_accum=grad_accum)
    hosts, count, inside, local, exchange = w.hosts, w.count, w.inside, w.local, w.exchange
    is_local, metrics_at_sync = spec.local, spec.metrics_at_sync

    def mean_across(tree: Any, slot: Any, step: Any) -> tuple[Any, Any, dict]:
        mean, slot, extra, _ = w.mean(tree, slot, step)
        return mean, slot, extra

    def prepared(state: Any, batch: Any) -> tuple[Any, Any, Any]:
        """The batch as [workers, local devices, grad_accum, r, ...], the model state per device, the codec's slot."""
        return (*w.prepared(state.model_state, batch), only(state.sync))

    finished = w.finished

    def own(per_device: dict) -> dict:
        """[workers, local] metrics -> each worker's own mean over its devices, as a "replicated"
        scalar (nothing crosses between workers: a process reads its own worker's, as local_sgd.py's
        metrics_at_sync has a process read its first device's replica)."""
        return jax.shard_map(lambda m: jax.tree.map(lambda x: jax.lax.pmean(x[0, 0], inside), m), mesh=mesh,
                             in_specs=P(*mesh.axis_names) if hosts else P(None, inside), out_specs=P(),
                             check_vma=False)(per_device)

    def with_slot(sync: Any, slot: Any) -> Any:
        return sync.replace(per_device={**sync.per_device, **slot.per_device}, shared={**sync.shared, **slot.shared})

    def every_step(state: Any, batch: Any) -> tuple[Any, dict]:
        rows_, model_state, slot = prepared(state, batch)
        metrics, model_state, grads = w.grads(state.params, model_state, rows_, state.rng, state.step, False)
        grads, slot, extra = mean_across(grads, slot, state.step)
        metrics, model_state = finished(metrics, model_state)
        metrics = {**metrics, **extra}
        if grad_norm:
            metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = jax.lax.with_sharding_constraint(optax.apply_updates(state.params, updates),
                                                  fsdp.shardings(state.params, mesh))
        opt_state = jax.lax.with_sharding_constraint(opt_state, fsdp.shardings(opt_state, mesh))
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state,
                             sync=with_slot(state.sync, slot)), metrics

    outer_tx = default_outer(spec.outer_tx)
    every, count_fragments = spec.sync_every, spec.sync_fragments
    period = every // count_fragments  # one fragment synchronised every `period` steps (Streaming DiLoCo)

    def local_steps(state: Any, batch: Any) -> tuple[Any, dict]:
        rows_, model_state, slot = prepared(state, batch)
        mine = state.sync.per_device[STATE_NAME]

        metrics, model_state, grads = w.grads(mine["params"], model_state, rows_, state.rng, state.step, True)
        replica, inner, norms = w.inner_step(tx, mine["params"], mine["opt_state"], grads)
        metrics = {**metrics, "grad_norm": jnp.broadcast_to(norms[:, None], (count, local))}
        if not grad_norm:
            metrics.pop("grad_norm")
        per_device = metrics
        _, model_state = finished(metrics, model_state)
        step = state.step + 1
        names = leaf_names(state.params)
        global_leaves, treedef = jax.tree.flatten(state.params)
        replica_leaves = jax.tree.leaves(replica)
        outer_states = state.sync.shared[OUTER_NAME]
        check_fragments(outer_states, count_fragments)
        groups = fragments(state.params, count_fragments)
        slices = jax.tree.leaves(_slice_shapes(state.params, mesh))
        sent = 0.0 if exchange is None else float(sum(bytes_sent(w.exchange_of(masked(treedef, global_leaves, g))
                                                                 .payload_bytes(masked(treedef, slices, g)), count)
                                                      for g in groups))

        def synced(f: int) -> tuple:
            group = groups[f]
            # each worker's pseudo-gradient of fragment f: how far its replica moved from the global parameters
            delta = masked(treedef, [g[None] - r for g, r in zip(global_leaves, replica_leaves)], group)
            mean, new_slot, extra = mean_across(delta, slot, state.step)
            before = subset(global_leaves, names, group)
            updates, outer = outer_tx.update(dict(zip(before, jax.tree.leaves(mean))), outer_states[f], before)
            after = optax.apply_updates(before, updates)
            new_global, new_replica = list(global_leaves), list(replica_leaves)
            for i in group:  # the fragment's replicas restart from its new global parameters
                new_global[i] = jax.lax.with_sharding_constraint(after[names[i]], fsdp.shardings(after[names[i]], mesh))
                new_replica[i] = jax.lax.with_sharding_constraint(
                    jnp.broadcast_to(new_global[i][None], (count, *new_global[i].shape)),
                    row_shardings(replica_leaves[i], mesh))
            outer = jax.lax.with_sharding_constraint(outer, fsdp.shardings(outer, mesh))
            shared = tuple(outer if k == f else o for k, o in enumerate(outer_states))
            return (jax.tree.unflatten(treedef, new_global), jax.tree.unflatten(treedef, new_replica), shared, new_slot,
                    {**extra, "synced": jnp.float32(1)})

        shapes = jax.eval_shape(lambda: synced(0))[4]

        def between() -> tuple:
            return state.params, replica, outer_states, slot, {**{k: jnp.zeros(s.shape, s.dtype) for k, s in
                                                                    shapes.items()}, "synced": jnp.float32(0)}

        def logged(shared: bool) -> Callable:
            """The metrics a branch returns: with metrics_at_sync, between syncs each device's own (a
            process logs its first device's: nothing crosses between workers), at syncs their mean."""
            def branch(f: int | None = None) -> tuple:
                out = between() if f is None else synced(f)
                return (*out, finished(per_device, {})[0] if shared else own(per_device))
            return branch

        branch = fragment_branch(step, period, count_fragments)  # 0: between syncs; 1 + f: fragment f
        params, replica, outer, slot, extra, metrics = jax.lax.switch(
            branch, [logged(not metrics_at_sync), *(lambda f=f: logged(True)(f) for f in range(count_fragments))])
        metrics = {**metrics, **extra, "comm_bytes_per_step": jnp.float32(sent / every)}
        sync = with_slot(state.sync, slot)
        sync = sync.replace(per_device={**sync.per_device, STATE_NAME: {"params": replica, "opt_state": inner}},
                            shared={**sync.shared, OUTER_NAME: outer})
        return state.replace(step=step, params=params, model_state=model_state, sync=sync), metrics

    return jax.jit(local_steps if is_local else every_step, donate_argnums=0)
