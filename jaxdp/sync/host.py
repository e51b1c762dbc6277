"""The `host` strategy: the naive baseline. Device -> host numpy average -> device, outside jit.

It exists to show what a collective saves: every device's gradients are copied to host memory,
averaged there with numpy, and copied back to every device. Across processes the per-process
sums travel through host memory too, by a `ProcessSum` transport over the key-value store of
JAX's coordination service.

Nothing here is global: `make_train_step(..., strategy="host")` asks `process_sum_for(mesh)` for
the transport of the run it is built in (none in a single process), and hands it to `host_mean`
on every call. So a run started with `jax.distributed.initialize` alone (a notebook, a user's
script) averages over every process exactly like one started by `jaxdp.train`.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxdp.cluster.coordination import client as coordination_client, namespace
from jaxdp.sync.collectives import Collective, on_host

Tree = Any
ProcessSum = Callable[[list[np.ndarray]], list[np.ndarray]]

# How long a process waits for another process's arrays before it gives up. A dead peer is
# normally reported first by the peer watch (jaxdp.cluster.peer_watch); this bounds the rest.
DEFAULT_TIMEOUT_S = 300.0


@on_host
def host_mean(local_trees: Sequence[Tree], *, num_devices: int | None = None,
              process_sum: ProcessSum | None = None) -> Tree:
    """Average per-device trees in host memory.

    `local_trees` holds one numpy pytree per device of this process; `num_devices` is the global
    device count (default: len(local_trees)). In a multi-process run `process_sum` adds the
    per-process partial sums over every process (see `process_sum_for`); without one, only this
    process's devices are summed, which is right for one process only.
    """
    num_devices = len(local_trees) if num_devices is None else num_devices
    treedef, sums = device_sum(local_trees)
    if process_sum is not None:
        sums = process_sum(sums)
    elif len(local_trees) != num_devices:
        raise ValueError(f"host_mean got {len(local_trees)} local trees of {num_devices} devices but no "
                         f"process_sum to add the other processes' (use process_sum_for(mesh))")
    means = [(s / num_devices).astype(s.dtype, copy=False) for s in sums]
    return jax.tree.unflatten(treedef, means)


def device_sum(local_trees: Sequence[Tree]) -> tuple[Any, list[np.ndarray]]:
    """(treedef, the leaves' sums) of one numpy pytree per device, added in device order in place
    (no N-times-larger stack): the same sum wherever it is computed (an elastic run relies on it)."""
    first, *rest = local_trees
    leaves, treedef = jax.tree.flatten(first)
    sums = [np.array(leaf, copy=True) for leaf in leaves]
    for tree in rest:
        for acc, leaf in zip(sums, jax.tree.leaves(tree)):
            acc += leaf
    return treedef, sums


# The strategy registered as "host" (jaxdp.registry.STRATEGIES).
HOST = Collective("host", host=host_mean)


def process_sum_for(mesh: jax.sharding.Mesh, timeout_s: float = DEFAULT_TIMEOUT_S) -> ProcessSum | None:
    """The cross-process transport for a step over `mesh`: None when the mesh is in one process."""
    processes = {d.process_index for d in mesh.devices.flat}
    if len(processes) == 1:
        return None
    if processes != set(range(jax.process_count())):
        raise ValueError(f"the host strategy needs a mesh over every process or over one; this mesh "
                         f"spans processes {sorted(processes)} of {jax.process_count()}")
    return KeyValueSum(coordination_client(), jax.process_index(), jax.process_count(), timeout_s)


# Every process builds its transports in the same order (they build the same steps), so the n-th
# transport of each process shares a key prefix with the others' n-th, and two steps never collide.
_TRANSPORT_IDS = itertools.count()


class KeyValueSum:
    """Sum numpy arrays over processes through the coordination service's key-value store.

    Every call is one round r: each process publishes its arrays as bytes under
    `jaxdp/host_sum/<transport>/<r>/<process>`, reads every other process's, and adds all of them
    in process order, so every process computes bit-identical sums (the replicas must stay
    identical). Cleanup: a process deletes its own key of round r - 2 when it publishes round r.
    That is safe because to publish round r - 1, every process must have finished reading round
    r - 2, and this process read all round r - 1 keys before starting round r.
    """

    def __init__(self, client: Any, process_index: int, process_count: int, timeout_s: float):
        self._client, self._me, self._count = client, process_index, process_count
        self._timeout_ms = int(timeout_s * 1000)
        self._prefix = f"{namespace('host_sum')}{next(_TRANSPORT_IDS)}"
        self._rounds = itertools.count()

    def _key(self, r: int, process: int) -> str:
        return f"{self._prefix}/{r}/{process}"

    def __call__(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        r = next(self._rounds)
        mine = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
        self._client.key_value_set_bytes(self._key(r, self._me), mine)  # host sync point: bytes over the network
        if r >= 2:
            self._client.key_value_delete(self._key(r - 2, self._me))
        totals = None
        for process in range(self._count):
            try:
                payload = mine if process == self._me else self._client.blocking_key_value_get_bytes(
                    self._key(r, process), self._timeout_ms)
            except Exception as err:  # noqa: BLE001 - the peer watch normally ends the process first
                raise RuntimeError(f"host strategy: no gradients from process {process} within "
                                   f"{self._timeout_ms / 1000:g} s ({err})") from None
            parts = _unpack(payload, arrays)
            if totals is None:
                totals = [part.copy() for part in parts]
            else:
                for total, part in zip(totals, parts):
                    total += part
        return totals


def _unpack(payload: bytes, like: list[np.ndarray]) -> list[np.ndarray]:
    out, offset = [], 0
    for a in like:
        out.append(np.frombuffer(payload, a.dtype, a.size, offset).reshape(a.shape))
        offset += a.nbytes
    return out
