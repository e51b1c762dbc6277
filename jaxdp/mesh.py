"""The device mesh: one axis, `DATA_AXIS`, over every device of every process.

Parameters and optimizer state are replicated (`replicated(mesh)`); batches are split along their
leading axis (`batch_sharding(mesh)`). `shard_batch` is the one host -> device transfer of the
input pipeline: each process hands over only its own slice of the global batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def make_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh named `DATA_AXIS` over `devices` (default: every device of every process).

    Devices are ordered by (process, local id), so process p owns a contiguous block of the mesh
    and therefore a contiguous block of every global batch.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("make_mesh needs at least one device")
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(DATA_AXIS))


def local_batch_size(global_batch_size: int, mesh: Mesh) -> int:
    """Rows of each global batch that this process loads; raises if it does not split evenly."""
    n_devices, n_processes = mesh.size, jax.process_count()
    if global_batch_size % n_devices:
        raise ValueError(f"batch size {global_batch_size} must be divisible by the number of devices ({n_devices})")
    return global_batch_size // n_processes


def shard_batch(host_batch: Any, mesh: Mesh) -> Any:
    """Host-local numpy pytree -> global jax.Arrays split along axis 0 over `DATA_AXIS`.

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
    sharding = replicated(mesh)

    def put(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, tree)
