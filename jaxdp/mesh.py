"""The device mesh: data axes over every device of every process (default: one, `DATA_AXIS`, "data").

Parameters and optimizer state are replicated (`replicated_sharding(mesh)`); batches are split
along their leading axis (`batch_sharding(mesh)`). `shard_batch` is the one host -> device
transfer of the input pipeline: each process hands over only its own slice of the global batch.

The axis name is the mesh's: code ported from `pmap` whose modules name their axis (Flax's
ImageNet example uses `BatchNorm(axis_name="batch")`) builds `make_mesh(axis_name="batch")`, and
the step synchronises over that name.

A mesh may have several data axes, e.g. `make_mesh(axis_name=("hosts", "local"))`: one row of
devices per process. Every collective of the step then runs over all of them together
(`data_axes(mesh)` is the tuple, which `jax.lax` collectives and `PartitionSpec` accept), and a
hierarchical exchange can sum over "local" first.

Every axis is `AxisType.Auto` (`auto_axes`), given explicitly rather than left to a default
(`jax.make_mesh` makes Explicit axes): the steps map with `shard_map(..., check_vma=False)` and
place values with `with_sharding_constraint` and `out_shardings`, the Auto-axis model, and a
sharding in an array's type (Explicit axes) is not what they expect.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def auto_axes(count: int) -> tuple[AxisType, ...]:
    """The axis types of a mesh of `count` axes built by jaxdp: all Auto (see the module docstring)."""
    return (AxisType.Auto,) * count


def make_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str | tuple[str, ...] = DATA_AXIS,
              shape: Sequence[int] | None = None) -> Mesh:
    """A mesh of data axes over `devices` (default: every device of every process).

    `axis_name` is one name (a 1-D mesh, the default) or a tuple of names; for a tuple, `shape`
    gives each axis's size (default for two names: (processes, devices per process)). Devices
    are ordered by (process, local id), so process p owns a contiguous block of the mesh and
    therefore a contiguous block of every global batch.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"make_mesh: axis_name must be a non-empty string or a tuple of distinct ones, got {axis_name!r}")
    devices.sort(key=lambda d: (d.process_index, d.id))
    if len(devices) == 1 and devices[0].platform == "cpu":
        _warn_one_cpu_device()
    if shape is None:
        processes = len({d.process_index for d in devices})
        shape = {1: (len(devices),), 2: (processes, len(devices) // processes)}.get(len(names))
        if shape is None:
            raise ValueError(f"make_mesh: give the shape of the {len(names)} axes {names}")
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(names) or int(np.prod(shape)) != len(devices):
        raise ValueError(f"make_mesh: shape {shape} does not fit {len(devices)} devices on axes {names}")
    return Mesh(np.array(devices).reshape(shape), names, axis_types=auto_axes(len(names)))


@functools.cache
def _warn_one_cpu_device() -> None:
    """Once per process: a 1-device CPU mesh runs every strategy as a no-op, which surprises."""
    warnings.warn("jaxdp.make_mesh: JAX sees one CPU device, so there is nothing to synchronise and every "
                  "strategy trains like one device; to simulate 8, run jax.config.update('jax_num_cpu_devices', 8) "
                  "before anything touches JAX's devices (or restart the kernel and do it first)", stacklevel=3)


def data_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The axis the step synchronises over: the mesh's one axis name, or the tuple of all its
    axes on a mesh with several data axes (what `jax.lax` collectives and `P(...)` take)."""
    names = tuple(mesh.axis_names)
    return names[0] if len(names) == 1 else names


axis_name = data_axes  # the name older code imports


def inside_a_process(mesh: Mesh) -> tuple[Any, int]:
    """The data axis whose devices all sit in one process, and its size: the mesh's one axis if every
    device is this process's, the last of several (one row per process), else none (size 1). Work cut
    over it crosses no link."""
    names = tuple(mesh.axis_names)
    if len(names) > 1:
        return names[-1], mesh.shape[names[-1]]
    local = all(d.process_index == jax.process_index() for d in mesh.devices.flat)
    return names[0], mesh.size if local else 1


def state_specs(state: Any, axis: Any) -> Any:
    """shard_map specs for a (replicated) TrainState: P() everywhere but for the per-device rows
    of `state.sync`, which are split over `axis`."""
    rows = jax.tree.map(lambda _: P(axis), state.sync.per_device)
    return jax.tree.map(lambda _: P(), state.replace(sync=state.sync.replace(per_device={}))).replace(
        sync=state.sync.replace(per_device=rows, shared=jax.tree.map(lambda _: P(), state.sync.shared)))


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Split along the leading axis over the mesh's devices."""
    return NamedSharding(mesh, P(data_axes(mesh)))


def shard_batch(host_batch: Any, mesh: Mesh) -> Any:
    """Host-local numpy pytree -> global jax.Arrays split along axis 0 over the mesh.

    In a multi-process run each process passes only its own rows; the global batch is their
    concatenation in process order.
    """
    sharding = batch_sharding(mesh)

    def put(x: Any) -> jax.Array:
        x = np.asarray(x)
        global_rows = x.shape[0] * jax.process_count()
        if global_rows % mesh.size:
            raise ValueError(f"batch of {global_rows} rows does not split evenly over {mesh.size} devices")
        return jax.make_array_from_process_local_data(sharding, x, (global_rows, *x.shape[1:]))

    return jax.tree.map(put, host_batch)


def pad_batch(host_batch: Any, mesh: Mesh) -> Any:
    """A host batch (a dict of arrays) whose row count this process's devices may not divide, padded
    with zero rows to the next multiple, with `batch["mask"]` 1 for real rows and 0 for padding
    (an existing mask is padded with 0). So an evaluation's last, short batch counts every row
    exactly once, as long as `eval_fn` weights by the mask. A batch that divides and has a mask
    is returned as it is; one that divides and has none gets a mask of ones."""
    if not isinstance(host_batch, dict):
        rows = np.shape(jax.tree.leaves(host_batch)[0])[0]
        if rows % _local_devices(mesh):
            raise ValueError(f"a batch of {rows} rows does not split over this process's {_local_devices(mesh)} "
                             f"devices; give it as a dict, so that it can be padded with a mask")
        return host_batch
    leaves = [np.asarray(x) for x in host_batch.values()]
    rows = leaves[0].shape[0]
    per = _local_devices(mesh)
    padded_rows = -(-max(rows, 1) // per) * per
    if padded_rows == rows and "mask" in host_batch:
        return host_batch
    out = {}
    for name, x in host_batch.items():
        x = np.asarray(x)
        out[name] = np.concatenate([x, np.zeros((padded_rows - rows, *x.shape[1:]), x.dtype)]) if padded_rows > rows else x
    if "mask" not in host_batch:
        out["mask"] = (np.arange(padded_rows) < rows).astype(np.float32)
    return out


def _local_devices(mesh: Mesh) -> int:
    return max(1, mesh.size // jax.process_count())


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place a pytree of host values (identical on every process) on every device of the mesh."""
    sharding = replicated_sharding(mesh)

    def put(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, tree)
