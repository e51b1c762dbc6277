"""What the launcher and the workers of an elastic run on torchft share, without JAX: the variables the
launcher sets, torchft's import with its one-line error, the Lighthouse, and which rank computes which
shard. The workers' side (the engine, the member) is jaxdp/elastic/ft.py.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from jaxdp.errors import InputError

ENV_LIGHTHOUSE = "JAXDP_FT_LIGHTHOUSE"      # http://HOST:PORT of the run's Lighthouse; set: this process is a worker
ENV_RANK = "JAXDP_ELASTIC_RANK"              # (the same names as the hub's)
ENV_SIZE = "JAXDP_ELASTIC_SIZE"
ENV_MIN = "JAXDP_FT_MIN_WORKERS"
ENV_QUORUM_TIMEOUT = "JAXDP_FT_QUORUM_TIMEOUT"
ENV_RESTART = "JAXDP_FT_RESTART"             # set: a restarted worker (its engine starts once it has compiled)
ENV_LIGHTHOUSE_HERE = "JAXDP_FT_LIGHTHOUSE_HERE"  # set: this worker's launcher hosts the Lighthouse (jaxdp/elastic/ft.py, `leave`)
INSTALL = "an elastic run on torchft needs torchft: pip install 'jaxdp-trainer[elastic]'"


def require_torchft() -> Any:
    """The torchft module, or InputError saying how to install it."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Lighthouse and Manager log every quorum at "info"
    try:
        import torchft  # noqa: F401
        import torchft.coordination
        import torchft.manager
        import torchft.process_group
    except ImportError:
        raise InputError(INSTALL) from None
    logging.getLogger("torchft").setLevel(logging.CRITICAL)  # (a lost peer is one jaxdp line, not a traceback)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # (torch's, reading a healed state)
    return torchft


def start_lighthouse(host: str, port: int, min_workers: int, heartbeat_timeout_s: float, join_timeout_s: float) -> Any:
    """A Lighthouse listening on HOST:PORT only (PORT 0: any free one); `.address()` is its URL."""
    torchft = require_torchft()
    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return torchft.coordination.LighthouseServer(bind=bind, min_replicas=min_workers,
                                                 join_timeout_ms=int(join_timeout_s * 1000), quorum_tick_ms=20,
                                                 heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


def assign(live: list[int], size: int) -> dict[int, int]:
    """shard -> the rank that computes it: its own rank if live, else the live rank with the fewest
    shards so far (the lowest of those): what every worker computes alike from the same `live`."""
    owner = {s: s for s in range(size) if s in live}
    for shard in range(size):
        if shard not in owner:
            counts = {r: sum(1 for o in owner.values() if o == r) for r in live}
            owner[shard] = min(live, key=lambda r: (counts[r], r))
    return owner
