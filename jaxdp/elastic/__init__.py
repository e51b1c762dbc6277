"""Elastic runs: workers that come and go while the others train on (`jaxdp.launch --elastic`).

Two engines decide who averages across workers when the population changes:

* the launcher's hub (`hub.Member`; `--elastic-engine hub`, the default): one node, no torch; the
  launcher sums every shard's gradients and hands a joiner the state.
* torchft (`ft.FtMember`; `--elastic-engine torchft`): a Lighthouse quorum across nodes, a lost worker
  healed from a live peer's state, the lead agreed in each exchange.

This package is behind a one-way wall: nothing else in jaxdp imports it but the entry points
(`jaxdp.train` builds the member with `from_env`, `jaxdp.launch` runs the hub) and the benchmarks.
The training loop (jaxdp/loop/) sees a member only through the attributes and methods both engines
have, so an engine is a parameter of the loop, not a program beside it:

    member.rank, member.size, member.lead         # who this worker is, and whether it leads now
    member.kind, member.lead_moves, member.Gone   # the engine's name, whether the lead can move, its "peers gone" error
    member.make_step(loss_fn, tx, mesh, spec, shard_data, stateful=..., grad_accum=..., rounds=..., pace=...)
                                                  # the update rule the run's one SyncSpec names, across its workers
    member.connect(), member.receive_state()      # join; a live peer's state, if one is handed over
    member.settle(state), member.state_from(template, payload)   # the state to start from
    member.ask_stop(), member.leaves(orphaned), member.close(finished)

The transports are hub.py and ft.py (no JAX: the launcher imports them; network.py is what a torchft
worker shows the network); workers.py puts the update rules on top of them. The update rules behind
`make_step`: every step (every_step.py: the host path, the hub's sum or torchft's rows, rows.py, coded
by RowCoder there), H local steps (rounds.py), timed rounds (timed.py) and overlapped rounds
(overlap.py).
"""

from __future__ import annotations

from typing import Any


def from_env(environ: dict | None = None, flags: str = "") -> Any:
    """This process's member of an elastic run, as `jaxdp.launch --elastic` set it up in the environment
    (a torchft worker, or a member of the launcher's hub), or None for a run that is not elastic.
    `flags`: the prints of the run's config (jaxdp.cluster.agreement.prints), which torchft workers
    compare at their quorums."""
    from jaxdp.elastic import workers

    return workers.from_env(environ, flags)
