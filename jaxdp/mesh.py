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
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


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
    return Mesh(np.array(devices).reshape(shape), names)


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


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place a pytree of host values (identical on every process) on every device of the mesh."""
    sharding = replicated_sharding(mesh)

    def put(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, tree)
