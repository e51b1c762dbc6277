"""The CLI's policy for `--compression auto` and `--sync-every auto` at the start of a run: a
resumed run keeps what its checkpoint recorded, one device is synchronous, a fresh run measures once
(jaxdp/sync/controller.py) and decides.

    begun = start(requested_spec, mesh, params, make_state=..., make_step=..., batches=..., recorded=...)
    spec, state_spec = begun.spec, begun.state_spec   # the codec and H to train with, and the state's
    begun.controller                                  # decides --compression auto again while training
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optax
from jax.sharding import Mesh

from jaxdp.errors import InputError
from jaxdp.registry import AUTO
from jaxdp.sync import budget, costmodel
from jaxdp.sync.controller import GUARD_BATCHES, Controller, momentum_free
from jaxdp.sync.exchange import codec as codec_of
from jaxdp.sync.spec import SyncSpec



@dataclasses.dataclass
class Start:
    """What `start` decided for a run.

    spec:       the step's SyncSpec now: compression a codec or None, sync_every an int.
    state_spec: what `init_state` makes: its compression slot stays "auto" where the controller
                may switch codecs later.
    records:    [(event, record)] for the metrics file, in the order they were taken.
    controller: the Controller that decides `--compression auto` again while training (first at
                the run's first step unless `decided`), or None.
    decided:    compression was already decided here (by `--sync-every auto`'s measurement).
    state:      the state measured on, when it can be reused (state_spec's), else None.
    sync_every_auto: whether `--sync-every auto` chose H by measuring (checkpoints record it).
    pseudo_gradient: the codec name local steps chose under `--compression auto` (checkpoints
                record it as their config's compression), else None.
    """

    spec: SyncSpec
    state_spec: SyncSpec
    records: list
    controller: Controller | None = None
    decided: bool = False
    state: Any = None
    sync_every_auto: bool | None = None
    pseudo_gradient: str | None = None


def start(requested: SyncSpec, mesh: Mesh, params: Any, *, make_state: Callable[[SyncSpec], Any],
          make_step: Callable[[SyncSpec], Any], batches: Callable[[int], list], recorded: dict | None,
          target_fraction: float = costmodel.TARGET_COMM_FRACTION, overlap: bool = False,
          byte_budget: float | None = None) -> Start:
    """Resolve the "auto" choices of `requested` (jaxdp.sync.spec.AUTO in compression and/or
    sync_every) for a run's start; `requested.outer_tx` is the outer optimizer local steps use if
    H > 1; `overlap`: local steps will overlap each average with the next round (`--overlap`).

    `--sync-every auto`: a resumed run (`recorded`, the checkpoint's meta) keeps the H and the
    pseudo-gradient codec it recorded and measures nothing; one device is synchronous; otherwise
    measure once on a synchronous state (`Controller.decide_sync_every`). Under `--compression
    auto` too, compression is decided first; if local steps are chosen over it, the
    pseudo-gradient's codec is chosen with H and compression is not decided again.
    `--compression auto` alone is decided at the first step, then every `--compression-every`
    steps, by the returned controller. `byte_budget` (`--byte-budget`, with both auto): H and the
    codec from the budget alone (jaxdp/sync/budget.py), nothing measured, the codec fixed for the run.
    """
    auto = requested.compression == AUTO
    fixed = None if auto else codec_of(requested.compression)
    records: list = []
    state = decided = controller = None
    pseudo, chose = None, None  # pseudo: the codec name local steps chose over --compression auto
    if requested.sync_every == AUTO:
        if recorded is not None:  # resume: the H the checkpoint recorded, never a new measurement
            sync_every, chose = (recorded.get("config") or {}).get("sync_every"), recorded.get("sync_every_auto")
            if isinstance(sync_every, bool) or not isinstance(sync_every, int):
                raise InputError("sync_every auto: the checkpoint records no sync_every to resume with; pass sync_every N",
                                 setting="sync_every")
            # the config records the codec chosen ("auto": from before it was; a budget's at H = 1 too)
            if auto and (sync_every > 1 or byte_budget is not None) and chose:
                pseudo = (recorded.get("config") or {}).get("compression", "auto")
                pseudo = "none" if pseudo == AUTO else pseudo
            record = {"sync_every": sync_every, "pseudo_gradient": pseudo,
                      "why": f"resumed from the checkpoint of step {recorded['step']}, which records sync_every="
                             f"{sync_every}" + (f" and the pseudo-gradient {pseudo}" if pseudo else "") +
                             ": a resumed run keeps its choice (no new measurement)"}
        elif byte_budget is not None and auto and mesh.size > 1:  # the budget decides, from shapes alone
            try:
                record = budget.choose(params, mesh.size, byte_budget, requested.abilities,
                                       momentum_free(requested.outer_tx), 2 if requested.metrics_at_sync else 1)
            except ValueError as err:  # nothing fits: the user's budget is too small for this model
                raise InputError(f"byte_budget={byte_budget:g}: {err}; allow more bytes", setting="byte_budget") from None
            pseudo, chose = record["pseudo_gradient"], True
        elif mesh.size == 1:
            record, chose = {"sync_every": 1, "why": "one device in the mesh: nothing to average, synchronous"}, True
        else:  # a fresh run: measure once, on a synchronous state, and decide (the same on every process)
            synchronous = requested.replace(sync_every=1, outer_tx=None)
            state = make_state(synchronous)
            controller = Controller(make_step(synchronous.replace(compression=fixed)).local_grads, mesh,
                                    requested.strategy, params, target_fraction=target_fraction)
            decided, record = controller.decide_sync_every(state, batches(GUARD_BATCHES if auto else 1), 0, fixed, auto,
                                                           overlap, momentum_free(requested.outer_tx))
            chose = True
            if auto and record["sync_every"] > 1:
                pseudo = record["pseudo_gradient"]
            if decided:
                records.append(("compression", decided.record))
        records.append(("local_steps", record))
        sync_every = record["sync_every"]
    else:
        sync_every = requested.sync_every
    outer_tx = requested.outer_tx
    if byte_budget is not None and outer_tx is None and requested.sync_every == AUTO and sync_every > 1:  # the budget's
        # outer step, no outer optimizer given (a resumed run keeps the lr its checkpoint records; one
        # from before records none: plain averaging)
        lr = budget.outer_lr(pseudo) if recorded is None else (recorded.get("byte_budget") or {}).get("outer_lr") or 1.0
        outer_tx, record["outer_lr"] = (optax.sgd(lr) if lr != 1 else None), lr  # (None: plain averaging, as ever)
        record["why"] += f"; outer step: {budget.outer_words(lr)}"
    resolved = requested.replace(sync_every=sync_every, outer_tx=outer_tx if sync_every > 1 else None)
    # Local steps chosen over compression send the pseudo-gradient through their own choice.
    pseudo_codec = None if pseudo is None else codec_of(pseudo)
    state_spec = resolved.replace(compression=pseudo_codec) if pseudo is not None else resolved
    initial = pseudo_codec if pseudo is not None else decided.compressor if decided else None if auto else fixed
    spec = resolved.replace(compression=initial)
    if state is not None and sync_every > 1:
        state = None  # measured on a synchronous state: local steps need their own
    if not (auto and pseudo is None and mesh.size > 1):
        controller = None
    elif controller is None:  # the one that measured for --sync-every auto serves on: its programs are compiled
        controller = Controller(make_step(spec).local_grads, mesh, requested.strategy, params,
                                target_fraction=target_fraction)
    return Start(spec, state_spec, records, controller, decided is not None, state, chose, pseudo)
