"""JAX's coordination service, as jaxdp uses it: the client, agreed key namespaces, and
"publish mine, read everyone's".

Every multi-process feature that exchanges small values outside XLA (the start-up agreement, the
directory lock's shared check, the heartbeat, the host strategy's transport, the peer watch) goes
through the key-value store of the coordination service that `jax.distributed.initialize` starts.
Their keys live under one root, one namespace per feature, so two features never collide:

    from jaxdp.cluster import coordination
    keys = coordination.namespace("agreement")          # "jaxdp/agreement/"
    values = coordination.gather_strings(keys, mine)      # every process's string, in process order
"""

from __future__ import annotations

from typing import Any

ROOT = "jaxdp/"


def client() -> Any:
    """JAX's coordination-service client, set up by `jax.distributed.initialize` (private API:
    orbax reaches it the same way). Raises if this process is not part of a distributed run."""
    from jax._src import distributed as jax_distributed

    found = jax_distributed.global_state.client
    if found is None:
        raise RuntimeError("this process has several processes' devices but no coordination client; "
                           "call jax.distributed.initialize() (or jaxdp.initialize()) first")
    return found


def namespace(feature: str) -> str:
    """The key prefix of one feature ("agreement" -> "jaxdp/agreement/")."""
    if not feature or "/" in feature:
        raise ValueError(f"a coordination namespace is one non-empty word, got {feature!r}")
    return f"{ROOT}{feature}/"


def gather_strings(prefix: str, mine: str, *, process: int | None = None, count: int | None = None,
                   timeout_s: float = 60.0, store: Any = None) -> list[str]:
    """Publish `mine` under `prefix + str(process)` and return every process's value, in process
    order (this process's own without a round trip). Blocks up to `timeout_s` per peer."""
    import jax

    store = client() if store is None else store
    process = jax.process_index() if process is None else process
    count = jax.process_count() if count is None else count
    store.key_value_set(f"{prefix}{process}", mine)
    timeout_ms = int(timeout_s * 1000)
    return [mine if p == process else store.blocking_key_value_get(f"{prefix}{p}", timeout_ms) for p in range(count)]
