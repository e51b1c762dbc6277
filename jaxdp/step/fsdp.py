"""`shard_params=True` (`--shard-params`, ZeRO-3 / FSDP): parameters, gradients and optimizer
state sharded over the worker's devices.

    state = init_state(params, tx, mesh, shard_params=True)
    step = make_train_step(loss_fn, tx, mesh, shard_params=True)

Every leaf of the parameters, of the gradients and of the optimizer state is stored with a
`NamedSharding` that cuts it along its largest dimension divisible by the device count (`spec_for`;
replicated if none divides: biases of odd sizes, scalars such as Adam's count). The optimizer
update runs elementwise on the slices; a global reduction inside it (`clip_by_global_norm`) is an
all-reduce of a scalar. Any optax optimizer works, on the parameter tree itself (no flat buffers as
in ZeRO-1, jaxdp/step/zero.py). The gradient comes one of two ways:

* A model that hands its blocks to the step (jaxdp/models/blocks.py: the built-in GPT does):
  `layered_gradients`, a `shard_map` in which each device gathers the parameters outside the
  blocks once and runs the blocks in a `lax.scan` whose rematerialised body gathers one block's
  slices (`all_gather`); the backward pass gathers it again, and the gather's transpose leaves that
  block's gradient summed into the device's slice. The peak holds one block's whole parameters.
* Any other model: one `jax.jit` over global arrays with those shardings as constraints, and XLA's
  SPMD partitioner inserts the collectives: an all-gather of each parameter where the forward pass
  uses it, again in the backward pass (`jax.checkpoint` with a policy that saves everything but the
  gathered copies), and a reduce-scatter of each gradient into its owner's slice. No change to the
  model, at the cost of about one whole copy of the parameters and whole gradients in the peak
  (XLA gathers everything up front; docs/performance.md, "Models bigger than one device", has the
  measurements and the ways that did not gather layer by layer without a scan).

Several processes: on the two-axis mesh `make_mesh(axis_name=("hosts", "local"))` (one row of
devices per process) the leaves are cut over "local" only (`within`), so each process holds a whole
copy of the state cut over its own devices, the gathers stay inside a process, and XLA sums the
gradients across "hosts" with its all-reduce: sharded inside a worker, data-parallel (psum) across.
The ring, a codec or local steps across workers: jaxdp/step/hsdp.py, on `gradients` and
`layered_gradients` below.

Per-device semantics are the replicated step's: the batch is viewed as [devices, rows per device]
and the loss runs under `jax.vmap(..., axis_name=<the mesh's axis>)`, so each row block's loss is
the device's own mean, `jax.lax.axis_index` gives dropout the same per-device key as today
(`fold_in(fold_in(rng, step), device)`), and `nn.BatchNorm(axis_name=<axis>)` averages its
statistics over the global batch. The gradient is that of the mean of the per-device losses
(= the mean of the per-device gradients), metrics and floating model state are averaged over devices.

Checkpoints need nothing special: they hold whole arrays on the host (jaxdp/checkpoint/portable.py),
and a restore places them into the target state's shardings, whatever its device count or mode.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdp.errors import InputError
from jaxdp.models import blocks
from jaxdp.mesh import data_axes

GATHERED = "jaxdp_fsdp_gathered"  # the name of the whole parameters inside the step (not saved for backward)


def within(mesh: Mesh) -> tuple[str, int]:
    """The axis parameters are cut over, and its size: the mesh's one axis, or on the two-axis mesh
    `make_mesh(axis_name=("hosts", "local"))` its last ("local": one process's devices), so that
    each process holds whole copies of the sharded state and processes are data-parallel replicas."""
    axis = mesh.axis_names[-1]
    return axis, mesh.shape[axis]


def cut_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The dimension a leaf of `shape` is cut along over `n` devices: the largest one that `n`
    divides (the first of equals); None for none (a leaf every device holds whole)."""
    dims = [d for d, size in enumerate(shape) if size >= n and size % n == 0]
    if n == 1 or not dims:
        return None
    return max(dims, key=lambda d: (shape[d], -d))


def spec_for(shape: tuple[int, ...], n: int, axis: Any) -> P:
    """Cut along `cut_dim`'s dimension; replicated if none."""
    d = cut_dim(shape, n)
    return P() if d is None else P(*([None] * d), axis)


def shardings(tree: Any, mesh: Mesh) -> Any:
    """A NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs), by `spec_for` over `within`'s axis."""
    axis, n = within(mesh)
    return jax.tree.map(lambda x: NamedSharding(mesh, spec_for(tuple(x.shape), n, axis)), tree)


def place(tree: Any, mesh: Mesh) -> Any:
    """Host values (or whole device values) -> global arrays cut by `shardings`. Every process
    passes the same values; each device receives only its slice."""
    def put(x: Any, sharding: NamedSharding) -> jax.Array:
        host = x if not isinstance(x, jax.Array) or not x.is_fully_addressable else jax.device_get(x)
        if isinstance(host, jax.Array):  # a replicated multi-process array: its local copy is whole
            host = host.addressable_data(0)
        host = jnp.asarray(host) if not hasattr(host, "shape") else host
        return jax.make_array_from_callback(tuple(host.shape), sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings(tree, mesh))


def init_opt_state(params: Any, tx: optax.GradientTransformation, mesh: Mesh) -> Any:
    """`tx.init(params)`, every leaf cut by `spec_for` (moments like their parameters)."""
    return jax.jit(tx.init, out_shardings=shardings(jax.eval_shape(tx.init, params), mesh))(params)


def one_device_loss(loss_fn: Callable, mesh: Mesh, *, stateful: bool, grad_accum: int) -> Callable:
    """`(params, model_state, rows, rng, step, micro) -> (loss, (metrics, model_state))`: one device's
    loss on its rows, as train_step's local_grads, inside a context that binds the mesh's data axes
    (vmap or shard_map): dropout's key is `fold_in(fold_in(rng, step), device)` (and the micro-batch
    with grad_accum), the device being `axis_index` over every data axis."""
    index = data_axes(mesh)

    def device_loss(params: Any, model_state: Any, rows: Any, rng: Any, step: Any, micro: Any) -> tuple[Any, Any]:
        if stateful:
            key = jax.random.fold_in(jax.random.fold_in(rng, step), jax.lax.axis_index(index))
            if grad_accum > 1:  # with grad_accum, every micro-batch draws its own keys (as today)
                key = jax.random.fold_in(key, micro)
            loss, aux, model_state = loss_fn(params, model_state, rows, key)
        else:
            out = loss_fn(params, rows)
            loss, aux = out if isinstance(out, tuple) else (out, {})
        metrics = {name: jnp.asarray(value, jnp.float32) for name, value in {"loss": loss, **aux}.items()}
        return loss, (metrics, model_state)

    return device_loss


def gradients(loss_fn: Callable, mesh: Mesh, names: tuple[str, ...], *, stateful: bool,
              grad_accum: int) -> Callable:
    """One worker's gradients over the devices of the mesh axes `names` (d of them):
    `(params, model_state [d, ...], rows [d, grad_accum, r, ...], rng, step) -> (metrics [d],
    model_state [d, ...], grads)`, the gradient that of the mean of the d devices' losses, cut like
    the parameters. The device index (dropout's key) is `axis_index` over every data axis of the
    mesh, which the caller binds by vmap (`names` here, any others outside: jaxdp/step/hsdp.py)."""
    grid = tuple(mesh.shape[name] for name in names)
    whole = NamedSharding(mesh, P())
    layered = layered_gradients(loss_fn, mesh, stateful=stateful, grad_accum=grad_accum) \
        if tuple(names) == tuple(mesh.axis_names) else None
    device_loss = one_device_loss(loss_fn, mesh, stateful=stateful, grad_accum=grad_accum)

    # One vmap per axis, outermost first: the device index (axis_index over all of them) and
    # BatchNorm's mean over the mesh's axes are the shard_map step's on either mesh.
    per_device = device_loss
    for name in reversed(names):
        per_device = jax.vmap(per_device, in_axes=(None, 0, 0, None, None, None), axis_name=name)

    def objective(params: Any, model_state: Any, rows: Any, rng: Any, step: Any, micro: Any) -> tuple[Any, Any]:
        gathered = checkpoint_name(jax.lax.with_sharding_constraint(params, whole), GATHERED)
        split = lambda x: x.reshape(*grid, *x.shape[1:])  # noqa: E731  [d, ...] -> [hosts, local, ...]
        losses, out = per_device(gathered, jax.tree.map(split, model_state), jax.tree.map(split, rows), rng, step, micro)
        return jnp.mean(losses), jax.tree.map(lambda x: x.reshape(-1, *x.shape[len(grid):]), out)

    objective = jax.checkpoint(objective, policy=jax.checkpoint_policies.save_anything_except_these_names(GATHERED))
    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def run(params: Any, model_state: Any, rows: Any, rng: Any, step: Any) -> tuple[dict, Any, Any]:
        inside = block_names(loss_fn, stateful, params, model_state, rows, names) if layered is not None else None
        if inside is not None:
            return layered(params, model_state, rows, rng, step, inside)
        param_shardings = shardings(params, mesh)
        if grad_accum == 1:
            (_, (metrics, model_state)), grads = grad_fn(params, model_state, jax.tree.map(lambda x: x[:, 0], rows),
                                                         rng, step, jnp.int32(0))
            return metrics, model_state, jax.lax.with_sharding_constraint(grads, param_shardings)

        def body(carry: Any, i: Any) -> tuple[Any, None]:
            (metric_sum, grad_sum), model_state = carry
            micro = jax.tree.map(lambda x: x[:, i], rows)
            (_, (metrics, model_state)), grads = grad_fn(params, model_state, micro, rng, step, i)
            grads = jax.lax.with_sharding_constraint(grads, param_shardings)
            return (jax.tree.map(jnp.add, (metric_sum, grad_sum), (metrics, grads)), model_state), None

        first = jax.tree.map(lambda x: x[:, 0], rows)
        (_, (metrics, _)), grads = jax.eval_shape(grad_fn, params, model_state, first, rng, step, jnp.int32(0))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (metrics, grads))
        zeros = (zeros[0], jax.lax.with_sharding_constraint(zeros[1], param_shardings))
        ((metric_sum, grad_sum), model_state), _ = jax.lax.scan(body, (zeros, model_state), jnp.arange(grad_accum))
        metrics, grads = jax.tree.map(lambda total: total / grad_accum, (metric_sum, grad_sum))
        return metrics, model_state, jax.lax.with_sharding_constraint(grads, param_shardings)

    return run


class _Blocks(Exception):
    """Raised by the probe's runner: the model hands these blocks to the step."""


def block_names(loss_fn: Callable, stateful: bool, params: Any, model_state: Any, rows: Any,
                names: tuple[str, ...] = ()) -> set[str] | None:
    """The top-level parameter names of the blocks the model hands to `jaxdp.models.blocks.run`
    (tracing one device's loss abstractly, stopped at the call), or None if it does not call it.
    `rows`: [devices, grad_accum, r, ...] as `gradients` takes them; `names`: the mesh's axes, bound
    (size 1) for a model that reduces over them (BatchNorm)."""
    def stop(x: Any, layers: list[dict[str, str]], block: Callable) -> Any:
        raise _Blocks({name for layer in layers for name in layer.values()})

    def one_device(model_state: Any, rows: Any) -> Any:
        with blocks.running(stop):
            if stateful:
                return loss_fn(params, model_state, rows, jax.random.key(0))
            return loss_fn(params, rows)

    for name in names:
        one_device = jax.vmap(one_device, axis_name=name)
    ones = [1] * len(names)
    try:  # one device's model state and rows, a size-1 dimension per bound axis
        jax.eval_shape(one_device, jax.tree.map(lambda x: x[0].reshape(*ones, *x.shape[1:]), model_state),
                       jax.tree.map(lambda x: x[0, 0].reshape(*ones, *x.shape[2:]), rows))
    except _Blocks as found:
        return found.args[0]
    return None


def layered_gradients(loss_fn: Callable, mesh: Mesh, *, stateful: bool, grad_accum: int,
                      workers: bool = False) -> Callable:
    """`gradients` for a model that hands its blocks to the step (jaxdp/models/blocks.py), as a
    `shard_map` over the whole mesh: each device keeps its slices, gathers the parameters outside the
    blocks once, and runs the blocks in a `lax.scan` whose body gathers one block's slices
    (`all_gather` over the worker's devices) and is rematerialised, so the backward pass gathers
    that block again and its gradient leaves the body already reduce-scattered (the gather's
    transpose). The step's peak holds one block's whole parameters and gradients, not the model's.

    `run(params, model_state [d, ...], rows [d, grad_accum, r, ...], rng, step, inside)` with
    `inside` = `block_names(...)`. Without `workers`: `gradients`' results and per-device semantics
    (dropout's keys, metrics), the mean over every device of the mesh. With `workers`
    (jaxdp/step/hsdp.py): each worker's own mean over its devices, as `[workers, *leaf]` rows cut
    over (the axis across workers, the leaf's cut); `params` either the shared parameters or such
    rows (each worker's replica, local steps: `replicas=True`)."""
    axis, local = within(mesh)
    names = tuple(mesh.axis_names)
    across = tuple(name for name in names if name != axis)  # ("hosts",) on the two-axis mesh
    device_loss = one_device_loss(loss_fn, mesh, stateful=stateful, grad_accum=grad_accum)
    is_spec = lambda v: isinstance(v, P)  # noqa: E731

    def gather(x: Any, spec: P) -> Any:
        dims = [d for d, name in enumerate(spec) if name == axis]
        return jax.lax.all_gather(x, axis, axis=dims[0], tiled=True) if dims else x

    def mean(g: Any, spec: P) -> Any:
        """A device's gradient -> its slice of the mean: a cut leaf's is already summed over `axis`
        (the gather's transpose), the others are summed here; across workers too unless `workers`."""
        over = (() if axis in spec else (axis,)) + (() if workers else across)
        return (jax.lax.psum(g, over) if over else g) / (local if workers else mesh.size)

    def device(specs: Any, inside: set[str], params: Any, model_state: Any, rows: Any, rng: Any,
               step: Any) -> tuple[Any, Any, Any]:
        model_state = jax.tree.map(lambda x: x[0], model_state)
        rows = jax.tree.map(lambda x: x[0], rows)  # [grad_accum, r, ...]

        def runner(x: Any, layers: list[dict[str, str]], block: Callable, params: Any) -> Any:
            stacked = {part: jax.tree.map(lambda *xs: jnp.stack(xs), *[params[layer[part]] for layer in layers])
                       for part in layers[0]}
            part_specs = {part: specs[name] for part, name in layers[0].items()}

            def body(x: Any, p: Any) -> tuple[Any, None]:
                return block(jax.tree.map(gather, p, part_specs, is_leaf=is_spec), x), None

            # Rematerialised whole: saving the block's activations instead (checkpoint_policies.dots_saveable)
            # was no faster on CPU at a higher peak (docs/performance.md, "Behind the defaults").
            return jax.lax.scan(jax.checkpoint(body), x, stacked)[0]

        def loss(params: Any, model_state: Any, micro_rows: Any, micro: Any) -> tuple[Any, Any]:
            outer = {k: v if k in inside else jax.tree.map(gather, v, specs[k], is_leaf=is_spec)
                     for k, v in params.items()}
            with blocks.running(lambda x, layers, block: runner(x, layers, block, params)):
                return device_loss(outer, model_state, micro_rows, rng, step, micro)

        grad_fn = jax.value_and_grad(loss, has_aux=True)

        def micro_step(carry: Any, micro: Any) -> tuple[Any, None]:
            totals, model_state = carry
            (_, (metrics, model_state)), grads = grad_fn(params, model_state,
                                                         jax.tree.map(lambda x: x[micro], rows), micro)
            return (jax.tree.map(jnp.add, totals, (metrics, grads)), model_state), None

        first = jax.eval_shape(grad_fn, params, model_state, jax.tree.map(lambda x: x[0], rows), jnp.int32(0))
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), (first[0][1][0], first[1]))
        (totals, model_state), _ = jax.lax.scan(micro_step, (zeros, model_state), jnp.arange(grad_accum))
        metrics, grads = jax.tree.map(lambda total: total / grad_accum, totals)
        grads = jax.tree.map(mean, grads, specs, is_leaf=is_spec)
        if workers:
            grads = jax.tree.map(lambda g: g[None], grads)
        return (jax.tree.map(lambda x: x[None], metrics), jax.tree.map(lambda x: x[None], model_state), grads)

    def run(params: Any, model_state: Any, rows: Any, rng: Any, step: Any, inside: set[str],
            replicas: bool = False) -> tuple[dict, Any, Any]:
        """`replicas` (with `workers`): `params` are `[workers, *leaf]` rows, each worker's own."""
        leaf_rows = workers and replicas
        specs = jax.tree.map(lambda x: spec_for(tuple(x.shape[1:] if leaf_rows else x.shape), local, axis), params)
        worker_axis = across[0] if across else None
        rows_of = lambda tree: jax.tree.map(lambda spec: P(worker_axis, *spec), tree, is_leaf=is_spec)  # noqa: E731
        per_device = P(names)

        def mapped(params: Any, *rest: Any) -> tuple[Any, Any, Any]:
            return device(specs, inside, jax.tree.map(lambda x: x[0], params) if leaf_rows else params, *rest)

        return jax.shard_map(mapped, mesh=mesh,
                             in_specs=(rows_of(specs) if leaf_rows else specs, per_device, per_device, P(), P()),
                             out_specs=(per_device, per_device, rows_of(specs) if workers else specs),
                             check_vma=False)(params, model_state, rows, rng, step)

    return run


def device_rows(batch: Any, mesh: Mesh, grad_accum: int) -> Any:
    """The global batch as [devices, grad_accum, rows per micro-batch, ...], cut over the devices."""
    n = mesh.size
    rows = jax.tree.map(lambda x: x.reshape(n, grad_accum, x.shape[0] // (n * grad_accum), *x.shape[1:]), batch)
    return jax.lax.with_sharding_constraint(rows, jax.tree.map(lambda _: NamedSharding(mesh, P(data_axes(mesh))), rows))


def mean_model_state(model_state: Any) -> Any:
    """Per-device model state [devices, ...] -> one: float leaves averaged (BatchNorm statistics),
    the others (counters) the first device's."""
    return jax.tree.map(lambda x: jnp.mean(x, axis=0, dtype=x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact)
                        else x[0], model_state)


def make_step(loss_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh, *, stateful: bool,
              grad_accum: int, grad_norm: bool) -> Callable:
    """The jitted step `(state, batch) -> (state, metrics)` (the old state donated): one gradient
    over every device of the mesh, XLA's all-reduce across "hosts" if there are several."""
    per_device = _per_device(loss_fn, mesh, stateful=stateful, grad_accum=grad_accum)

    def step(state: Any, batch: Any) -> tuple[Any, dict]:
        metrics, model_state, grads = per_device(state, batch)
        metrics = jax.tree.map(lambda x: jnp.mean(x, axis=0), metrics)
        model_state = mean_model_state(model_state)
        if grad_norm:
            metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        return _updated(tx, mesh, state, grads, model_state), metrics

    return jax.jit(step, donate_argnums=0)


def worker_sums(loss_fn: Callable, mesh: Mesh, *, stateful: bool, grad_accum: int) -> Callable:
    """`(state, batch) -> (metrics, model_state, grads)` summed over this worker's devices, the
    parameters and the gradient cut over them: what an elastic worker sends the others (its row,
    jaxdp/elastic/rows.py), as the replicated path sends its devices' sum. The gradient is the
    mean's times the device count."""
    per_device, n = _per_device(loss_fn, mesh, stateful=stateful, grad_accum=grad_accum), mesh.size

    def run(state: Any, batch: Any) -> tuple[dict, Any, Any]:
        metrics, model_state, grads = per_device(state, batch)
        total = lambda x: jnp.sum(x, axis=0, dtype=x.dtype)  # noqa: E731
        return jax.tree.map(total, metrics), jax.tree.map(total, model_state), jax.tree.map(lambda g: g * n, grads)

    return run


def make_update(tx: optax.GradientTransformation, mesh: Mesh) -> Callable:
    """`(state, grads, model_state) -> state`, jitted, the old state donated: `make_step`'s update, for
    gradients that arrive in any sharding (an elastic worker's mean of the workers' rows)."""

    def update(state: Any, grads: Any, model_state: Any) -> Any:
        grads = jax.lax.with_sharding_constraint(grads, shardings(state.params, mesh))
        return _updated(tx, mesh, state, grads, model_state)

    return jax.jit(update, donate_argnums=0)


def _per_device(loss_fn: Callable, mesh: Mesh, *, stateful: bool, grad_accum: int) -> Callable:
    """`(state, batch) -> (metrics [d], model state [d, ...], grads)` over the mesh's d devices, the
    gradient that of their losses' mean, cut like the parameters (`gradients`)."""
    check_mesh(mesh)
    n = mesh.size
    grads_of = gradients(loss_fn, mesh, tuple(mesh.axis_names), stateful=stateful, grad_accum=grad_accum)

    def run(state: Any, batch: Any) -> tuple[dict, Any, Any]:
        per_device_state = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), state.model_state)
        return grads_of(state.params, per_device_state, device_rows(batch, mesh, grad_accum), state.rng, state.step)

    return run


def _updated(tx: optax.GradientTransformation, mesh: Mesh, state: Any, grads: Any, model_state: Any) -> Any:
    """`state` after the optax update with `grads`, cut as `init_state(..., shard_params=True)` cuts it."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = jax.lax.with_sharding_constraint(optax.apply_updates(state.params, updates), shardings(state.params, mesh))
    opt_state = jax.lax.with_sharding_constraint(opt_state, shardings(opt_state, mesh))
    model_state = jax.lax.with_sharding_constraint(model_state, jax.tree.map(lambda _: NamedSharding(mesh, P()),
                                                                            model_state))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)


def check_mesh(mesh: Mesh) -> None:
    """InputError unless the parameters would be cut over one process's devices: a one-axis mesh of
    one process, or the two-axis mesh `make_mesh(axis_name=("hosts", "local"))` whose "local" row is
    each process's devices (data-parallel across processes: XLA's all-reduce over "hosts")."""
    if len(mesh.axis_names) == 1:
        if len({d.process_index for d in mesh.devices.flat}) > 1:
            raise InputError("shard_params cuts parameters over one process's devices, not across processes: with "
                             "several processes use the mesh make_mesh(axis_name=('hosts', 'local'))", argument="mesh")
        return
    rows = mesh.devices.reshape(-1, mesh.devices.shape[-1])
    if len(mesh.axis_names) != 2 or any(len({d.process_index for d in row}) != 1 for row in rows):
        raise InputError(f"shard_params needs a one-axis mesh or the two-axis mesh make_mesh(axis_name=('hosts', "
                         f"'local')) whose last axis is one process's devices; got axes {tuple(mesh.axis_names)} of "
                         f"shape {tuple(mesh.devices.shape)}", argument="mesh")


def check_run(spec: Any, mesh: Mesh, *, paced: bool, elastic: bool) -> None:
    """fit's refusals for shard_params: the sync spec's table, then what only fit knows."""
    spec.validate(sync_seconds=1.0 if paced else None, elastic=elastic)  # (the one table: jaxdp/sync/rules.py)
    check_mesh(mesh)


def memory(step: Any, state: Any, batch: Any) -> dict[str, int]:
    """Bytes per device (the first local one) of the parameters, the gradients (shaped and cut like
    them), the optimizer state, and XLA's compiled peak of the step (arguments + outputs - donated
    + temporaries; one extra compile)."""
    from jaxdp.step import local_sgd, zero

    params = zero.bytes_per_device(state.params)
    stats = step.lower(state, batch).compile().memory_analysis()
    peak = None if stats is None else int(stats.argument_size_in_bytes + stats.output_size_in_bytes
                                           - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    return {"param_bytes_per_device": params, "grad_bytes_per_device": params,
            "optimizer_bytes_per_device": zero.bytes_per_device((state.opt_state, local_sgd.optimizer_states(state))),
            "compiled_peak_bytes_per_device": peak}


def describe(memory: dict[str, Any]) -> str:
    """The console line of `memory`'s figures."""
    mib = lambda key: "?" if memory.get(key) is None else f"{memory[key] / 2**20:.1f} MiB"  # noqa: E731
    return (f"jaxdp: --shard-params: per device {mib('param_bytes_per_device')} of parameters, "
            f"{mib('grad_bytes_per_device')} of gradients, {mib('optimizer_bytes_per_device')} of optimizer state; "
            f"XLA's compiled peak {mib('compiled_peak_bytes_per_device')}")
