"""The device mesh: one axis (default `DATA_AXIS`, "data") over every device of every process.

Parameters and optimizer state are replicated (`replicated_sharding(mesh)`); batches are split
along their leading axis (`batch_sharding(mesh)`). `shard_batch` is the one host -> device
transfer of the input pipeline: each process hands over only its own slice of the global batch.

The axis name is the mesh's: code ported from `pmap` whose modules name their axis (Flax's
ImageNet example uses `BatchNorm(axis_name="batch")`) builds `make_mesh(axis_name="batch")`, and
the step synchronises over that name.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(devices: Sequence[jax.Device] | None = None, axis_name: str = DATA_AXIS) -> Mesh:
    """A 1-D mesh named `axis_name` over `devices` (default: every device of every process).

    Devices are ordered by (process, local id), so process p owns a contiguous block of the mesh
    and therefore a contiguous block of every global batch.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"make_mesh: axis_name must be a non-empty string, got {axis_name!r}")
    devices.sort(key=lambda d: (d.process_index, d.id))
    if len(devices) == 1 and devices[0].platform == "cpu":
        _warn_one_cpu_device()
    return Mesh(np.array(devices), (axis_name,))


@functools.cache
def _warn_one_cpu_device() -> None:
    """Once per process: a 1-device CPU mesh runs every strategy as a no-op, which surprises."""
    warnings.warn("jaxdp.make_mesh: JAX sees one CPU device, so there is nothing to synchronise and every "
                  "strategy trains like one device; to simulate 8, run jax.config.update('jax_num_cpu_devices', 8) "
                  "before anything touches JAX's devices (or restart the kernel and do it first)", stacklevel=3)


def axis_name(mesh: Mesh) -> str:
    """The name of the mesh's one axis, the one the step synchronises over."""
    if len(mesh.axis_names) != 1:
        raise ValueError(f"jaxdp needs a 1-D mesh (make_mesh), got axes {mesh.axis_names}")
    return mesh.axis_names[0]


def replicated_sharding(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Split along the leading axis over the mesh's devices."""
    return NamedSharding(mesh, P(axis_name(mesh)))


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
