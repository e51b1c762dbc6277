"""Elastic runs: workers that come and go while the others train on (`jaxdp.launch --elastic`).

Who averages across workers when the population changes is one seam, the engine (engine.Engine): a quorum (who
takes part; a worker behind gets a live peer's state), an all-gather of one byte piece per worker,
and a commit (whether the quorum's exchanges went through). Two implement it:

* the launcher's hub (`hub.HubEngine`; `--elastic-engine hub`, the default): one node, no torch;
  the launcher forms the quorums and relays the pieces (jaxdp/launcher/hub.py).
* torchft (`ft.TorchftEngine`; `--elastic-engine torchft`): a Lighthouse quorum across nodes, gloo's
  all-gather, a lost worker healed over torchft's checkpoint transport.

The update rules are written once against it: every step (every_step.py, byte rows made on the
devices by rows.py), H local steps (rounds.py), timed rounds (timed.py) and overlapped rounds
(overlap.py). So every rule runs on either engine.

This package is behind a one-way wall: nothing else in jaxdp imports it but the entry points
(`jaxdp.train` builds the worker with `from_env`, `jaxdp.launch` runs the hub), the launcher and
the benchmarks. The training loop (jaxdp/loop/) sees a worker (workers.py) only through these:

    member.rank, member.size, member.lead         # who this worker is, and whether it leads now
    member.Gone                                   # its "peers gone" error (the lead moves: loop/lead.py)
    member.make_step(loss_fn, tx, mesh, spec, shard_data, stateful=..., grad_accum=..., rounds=..., pace=...)
                                                  # the update rule the run's one SyncSpec names, across its workers
    member.connect(), member.settle(state)        # join; the state to start from (a live peer's, if further on)
    member.ask_stop(), member.leaves(orphaned), member.close(finished)
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
