"""`fit`'s first stage: its arguments turned into a `Plan`, the values the loop runs with.

The sync choices are checked and resolved to one `SyncSpec` (the controller resolves "auto" ones,
jaxdp/sync/controller.py), the compiled steps are made on demand (one per spec), the new state is
built, the checkpointer opened (nothing restored yet: that is the next stage, jaxdp/loop/trainer.py).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

from jaxdp.loop.options import CheckpointOptions, EvalOptions, RunOptions, SyncOptions


@dataclasses.dataclass
class Plan:
    """What the loop runs with, after `resolve`."""

    mesh: Any
    steps: int
    is_main: bool                   # process 0 (an elastic run's lead, which may move: jaxdp/loop/lead.py)
    n_processes: int
    devices: int                    # every process's, of the whole run
    started: float
    beat: Any                       # the heartbeat watch (jaxdp/cluster/heartbeat.py)
    data: Any                       # data(step) -> this process's rows (an elastic run: its shard's)
    batch_at: Callable[[int], Any]  # step -> device batch
    cache_hits: Any                 # compiled programs loaded from JAX's persistent cache
    checkpointer: Any = None        # (an elastic run: the lead's only)
    checkpoint: Any = None          # CheckpointOptions
    lead_retry_at: float = 0.0      # a new lead's next try at a directory still locked (jaxdp/loop/lead.py)
    shard_data: Any = None          # an elastic run's data(step, shard)
    sync_auto: bool = False         # sync_every "auto"
    rounds_run: bool = False        # host-driven rounds (jaxdp/step/rounds.py): sync_seconds, or overlap with H >= 2
    overlap: bool = False           # (after sync_every auto: False when it chose synchronous training)
    tx: Any = None                  # the (inner) optimizer
    outer_tx: Any = None
    spec: Any = None                # the sync choices, resolved (compression "auto": the controller's current one)
    begun: Any = None               # the controller's start (jaxdp.sync.autostart.Start)
    state: Any = None               # the new state (the next stage restores into it)
    steps_by_spec: dict = dataclasses.field(default_factory=dict)
    step_for: Callable[[Any], Any] | None = None  # spec -> its compiled step
    config: Any = None              # as resolved: checkpoints record sync_every auto's choices
    requested_config: Any = None    # as given: config.toml says "auto", so a rerun resumes as this run did
    plain_comm: dict = dataclasses.field(default_factory=dict)  # what plain averaging sends per step
    evaluate: Callable | None = None  # state -> held-out metrics (None: no eval_fn, or a rank that never leads)
    elastic: Any = None             # this process's member of an elastic run
    preemption: Any = None          # an elastic run's stop signals, caught from before it joins
    exits_after: bool = False       # the command line: the process ends when fit returns

    @property
    def evaluates(self) -> bool:
        """Whether this process evaluates: every process of a run, one of an elastic run (its lead)."""
        return self.elastic is None or self.is_main

    def open_checkpointer(self) -> Any:
        """The run's Checkpointer on its directory (InputError: in use, or not writable), recording the
        run's config and sync choices."""
        from jaxdp.checkpoint.checkpointer import Checkpointer
        from jaxdp.data import grain as grain_data

        checkpoint = self.checkpoint
        checkpointer = Checkpointer(checkpoint.directory, save_every=checkpoint.save_every, keep=checkpoint.keep,
                                    config=self.config)
        checkpointer.extra_meta.update(checkpoint.meta or {})
        if self.begun is not None:  # (a lead that took over: resolved already)
            checkpointer.extra_meta["sync_every_auto"] = bool(self.begun.sync_every_auto)
        grain_data.attach(self.data, checkpointer)  # a grain iterator's state: saved with each checkpoint, resumed
        return checkpointer

    def abandon(self) -> None:
        """Bad input before the loop: stop the watch, close the checkpointer (nothing was written: the
        directory stays as it was) and the elastic member."""
        self.beat.stop()
        if self.checkpointer:
            self.checkpointer.close()
        if self.elastic is not None:
            self.elastic.close()
        if self.preemption is not None:
            self.preemption.close()


def resolve(loss_fn: Callable, params: Any, tx: Any, data: Any, *, steps: int, mesh: Any, stateful: bool,
            model_state: Any, seed: int, sync: SyncOptions, evaluation: EvalOptions, checkpoint: CheckpointOptions,
            run: RunOptions) -> Plan:
    """The Plan of a run: checks every choice (InputError), resolves the sync choices, builds the state."""
    import jax

    from jaxdp.cluster import heartbeat, runtime
    from jaxdp.data import grain as grain_data
    from jaxdp.errors import InputError
    from jaxdp.loop import lead
    from jaxdp.mesh import make_mesh
    from jaxdp.step import local_sgd
    from jaxdp.sync import exchange, spec as syncspec

    started = time.perf_counter() if run.started is None else run.started
    mesh = make_mesh() if mesh is None else mesh
    elastic = run.elastic
    if not isinstance(steps, int) or steps < 0:
        raise InputError(f"fit: steps must be 0 or more, got {steps!r}")
    # Multi-process: stalled peers and stragglers, watched to the end (the command line starts the
    # watch before it loads its data and passes it in; it is stopped at the end either way).
    beat = heartbeat.for_run(run.stall_timeout) if run.watch is None else run.watch
    data = grain_data.adapt(data)  # a grain MapDataset or iterator as data(step) (jaxdp/data/grain.py)
    sync_every, overlap, compression = sync.sync_every, sync.overlap, sync.compression
    sync_auto = sync_every == "auto"
    every_step_overlap = overlap and sync_every == 1  # each step's all-reduce one step late (jaxdp/step/delayed.py)
    rounds_of = 2 if sync_auto else sync_every  # sync_every auto chooses H >= 2 for overlap (resolve_sync)
    if overlap:
        check_overlap(rounds_of)
    # Every sync choice, fit's own too, against the one table (jaxdp/sync/rules.py): InputError naming the first clash.
    syncspec.SyncSpec(strategy=sync.strategy, compression=None if compression == "none" else compression,
                      sync_every=sync_every, sync_fragments=sync.sync_fragments, shard_optimizer=sync.shard_optimizer,
                      overlap=overlap, shard_params=sync.shard_params, metrics_at_sync=sync.metrics_at_sync,
                      ).validate(sync_seconds=sync.sync_seconds, elastic=elastic is not None,
                                 byte_budget=budget_fraction(sync.byte_budget),
                                 float_state=bool(exchange.float_leaves(model_state or {})[0]))
    if overlap and not every_step_overlap:  # rounds of H steps whose average lands one round late (jaxdp/step/rounds.py)
        check_paced(lambda round_, process: rounds_of, data, mesh, "overlap", flat=not sync.shard_params)
    elif sync.sync_seconds is not None:  # workers at their own pace (jaxdp/step/rounds.py)
        check_paced(sync.sync_seconds, data, mesh)
    rounds_run = (overlap and not every_step_overlap) or sync.sync_seconds is not None
    outer_tx = local_sgd.default_outer(sync.outer_tx) if rounds_run else sync.outer_tx  # local steps, in rounds
    shard_data = None
    if elastic is not None:  # one process of an elastic run (jaxdp/elastic/hub.py): data(step, shard)
        check_elastic(data, mesh)
        shard_data, data = data, lambda step: shard_data(step, elastic.rank)
    plan = Plan(mesh=mesh, steps=steps, is_main=jax.process_index() == 0 if elastic is None else elastic.lead,
                n_processes=jax.process_count() if elastic is None else elastic.size,
                devices=mesh.size * (1 if elastic is None else elastic.size), started=started, beat=beat, data=data,
                batch_at=batch_function(data, mesh), cache_hits=runtime.CacheHits(), shard_data=shard_data,
                sync_auto=sync_auto, rounds_run=rounds_run, overlap=overlap, tx=tx, outer_tx=outer_tx,
                config=run.config, requested_config=run.config, elastic=elastic, exits_after=run.exits_after)
    plan.checkpoint = checkpoint
    if checkpoint.directory and (elastic is None or plan.is_main):  # an elastic run: its lead saves
        plan.checkpointer = plan.open_checkpointer()
    elif checkpoint.directory and lead.follows(plan):  # a worker that does not lead now may later
        lead.prepare(plan)
    try:
        resolve_sync(plan, loss_fn, params, tx, stateful, {} if model_state is None else dict(model_state), seed, sync)
        plan.evaluate = evaluator(plan, evaluation)
    except BaseException:
        plan.abandon()
        raise
    return plan


def resolve_sync(plan: Plan, loss_fn: Callable, params: Any, tx: Any, stateful: bool, model_state: dict, seed: int,
                 sync: SyncOptions) -> None:
    """The sync choices as one value (`plan.spec`), its compiled step and the new state; "auto" ones
    the controller resolves (measuring a few steps: jaxdp/sync/controller.py)."""
    from jaxdp.step import overlap, rounds as paced
    from jaxdp.step.state import init_state
    from jaxdp.step.train_step import make_train_step
    from jaxdp.sync import autostart, exchange, spec as syncspec
    from jaxdp.sync.codecs.base import bytes_sent, uncompressed_bytes

    mesh, elastic, compression, checkpointer = plan.mesh, plan.elastic, sync.compression, plan.checkpointer
    requested = syncspec.SyncSpec(strategy=sync.strategy, compression=None if compression == "none" else compression,
                                  sync_every=sync.sync_every, sync_fragments=sync.sync_fragments,
                                  outer_tx=plan.outer_tx, shard_optimizer=sync.shard_optimizer,
                                  overlap=sync.overlap and sync.sync_every == 1, shard_params=sync.shard_params,
                                  # (local steps across elastic workers share their metrics at rounds' ends only)
                                  metrics_at_sync=sync.metrics_at_sync or (
                                      elastic is not None and sync.sync_every not in (1, "auto")))
    if sync.shard_params:  # ZeRO-3 / FSDP (jaxdp/step/fsdp.py): its refusals, before anything is built
        from jaxdp.step import fsdp

        fsdp.check_run(requested, mesh, paced=sync.sync_seconds is not None, elastic=elastic is not None)

    def new_state(spec: Any) -> Any:
        made = init_state(params, tx, mesh, model_state=model_state, rng=seed, shard_optimizer=spec.shard_optimizer,
                          compression=spec.compression, sync_every=spec.sync_every, outer_tx=spec.outer_tx,
                          sync_fragments=spec.sync_fragments, shard_params=spec.shard_params)
        if spec.overlap:  # the slot for the gradient in flight (its shapes come from a batch)
            return step_for(spec).prepare(made, plan.batch_at(0))
        if not plan.rounds_run or (plan.overlap and spec.sync_every == 1):  # (sync_every auto's measuring state)
            return made
        if elastic is not None:  # rounds across elastic workers: timed (a position per rank's stream) or
            from jaxdp.mesh import replicate  # overlapped (the round; each worker's row in flight is its own)

            shared = replicate(elastic.round_sync(plan.overlap), mesh)
            return made.replace(sync=made.sync.replace(shared={**made.sync.shared, **shared}))
        rows, shared = paced.init_sync(mesh)
        if plan.overlap:  # nothing in flight yet (with shard_params, the delta cut like the replicas)
            rows.update((overlap.Cut if spec.shard_params else overlap.Replicas).init(params, mesh))
        return made.replace(sync=made.sync.replace(per_device={**made.sync.per_device, **rows},
                                                   shared={**made.sync.shared, **shared}))

    def step_for(spec: Any) -> Any:  # one compiled step per choice (compression "auto" switches)
        if spec not in plan.steps_by_spec and elastic is not None:  # the engine's workers (jaxdp/elastic/)
            rounds = ("overlapped" if plan.overlap else "timed") if plan.rounds_run else None
            plan.steps_by_spec[spec] = elastic.make_step(loss_fn, tx, mesh, spec, plan.shard_data, stateful=stateful,
                                                         grad_accum=sync.grad_accum, rounds=rounds,
                                                         pace=sync.sync_seconds)
        if spec not in plan.steps_by_spec:
            plan.steps_by_spec[spec] = make_train_step(
                loss_fn, tx, mesh, spec.strategy, stateful=stateful, grad_accum=sync.grad_accum, grad_norm=True,
                shard_optimizer=spec.shard_optimizer, compression=spec.compression, sync_every=spec.sync_every,
                outer_tx=spec.outer_tx, sync_fragments=spec.sync_fragments, overlap=spec.overlap,
                shard_params=spec.shard_params, metrics_at_sync=spec.metrics_at_sync)
        return plan.steps_by_spec[spec]

    plan.step_for = step_for
    if (plan.rounds_run and not plan.sync_auto) or elastic is not None:  # nothing "auto" to resolve (check_paced, ...)
        fixed = requested.replace(compression=None if compression == "none" else exchange.codec(compression))
        begun = autostart.Start(fixed, requested, [], None, False, None, False)
    else:
        begun = autostart.start(
            requested, mesh, params, make_state=new_state, make_step=step_for,
            batches=lambda k: [plan.batch_at(i) for i in range(k)], target_fraction=sync.comm_target,
            recorded=checkpointer.recorded_meta() if checkpointer and plan.sync_auto else None, overlap=sync.overlap,
            byte_budget=budget_fraction(sync.byte_budget))
    plan.begun, plan.spec = begun, begun.spec
    if plan.overlap and plan.spec.sync_every == 1:  # sync_every auto chose synchronous training: nothing to overlap
        plan.overlap = plan.rounds_run = False
    plan.state = begun.state if begun.state is not None else new_state(begun.state_spec)
    step_for(plan.spec)
    if plan.sync_auto:
        if plan.config is not None:  # what was chosen: H, the pseudo-gradient's codec, whether rounds overlap
            plan.config = plan.config.replace(sync_every=plan.spec.sync_every, overlap=plan.overlap, **(
                {"compression": begun.pseudo_gradient} if begun.pseudo_gradient else {}))
        if plan.is_main:
            chosen = dict(begun.records)["local_steps"]
            print(f"jaxdp: --sync-every auto: {plan.spec.sync_every}: {chosen['why']}", file=sys.stderr)
            if chosen.get("propose_overlap"):
                print(f"jaxdp: --sync-every auto: {chosen['propose_overlap']['why']}", file=sys.stderr)
        if checkpointer:  # checkpoints record the resolved H and codec (config), and that auto chose them
            checkpointer.config = plan.config
            checkpointer.extra_meta["sync_every_auto"] = bool(begun.sync_every_auto)
            if sync.byte_budget is not None:  # what the budget chose, beside the config's H and codec
                chosen = dict(begun.records)["local_steps"]
                checkpointer.extra_meta["byte_budget"] = {k: chosen.get(k) for k in (
                    "byte_budget", "sync_every", "pseudo_gradient", "bytes_per_step", "fewer_bytes", "outer_lr", "why")}
    # Bytes each device sends per step with plain averaging (a bandwidth-optimal all-reduce over every
    # device of the run: an elastic run's too, whose mesh is one worker's devices).
    plan.plain_comm = {"comm_bytes": bytes_sent(uncompressed_bytes(params), plan.devices), "compression_ratio": 1.0}


def budget_fraction(value: Any) -> float | None:
    """SyncOptions.byte_budget as a fraction (jaxdp.inputs.parse_byte_budget's grammar), or InputError."""
    from jaxdp.errors import ConfigError, InputError
    from jaxdp.inputs import parse_byte_budget

    if value is None:
        return None
    try:
        return parse_byte_budget(value)
    except ConfigError as err:
        raise InputError(str(err).replace("--byte-budget", "byte_budget"), setting="byte_budget") from None


def default_summarize(totals: dict[str, float]) -> dict[str, float]:
    """Every summed metric divided by the row count `totals["count"]` (if there is one)."""
    count = totals.get("count")
    return {f"eval_{k}": (v / count if count else v) for k, v in totals.items() if k != "count"}


def evaluator(plan: Plan, evaluation: EvalOptions) -> Callable | None:
    """`evaluate(state) -> held-out metrics` over every eval batch, padded to the device count with
    masked rows; None without an eval_fn (or on a hub-elastic run's other ranks: rank 0 leads there)."""
    import jax

    from jaxdp.mesh import pad_batch, shard_batch
    from jaxdp.step.train_step import make_eval_step

    from jaxdp.loop import lead

    if evaluation.fn is None or not (plan.elastic is None or plan.is_main or lead.follows(plan)):
        return None
    eval_step, mesh = make_eval_step(evaluation.fn, plan.mesh), plan.mesh

    def evaluate(state: Any) -> dict[str, float]:
        totals: dict[str, float] = {}
        batches = evaluation.data() if callable(evaluation.data) else evaluation.data
        for batch in batches:
            sums = jax.device_get(eval_step(state, shard_batch(pad_batch(batch, mesh), mesh)))  # host sync point
            totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
        return (evaluation.summarize or default_summarize)(totals)

    return evaluate


# ---- checks: what each mode does not combine with ---------------------------------------------


def check_elastic(data: Any, mesh: Any) -> None:
    """InputError for the data and mesh an elastic run (jaxdp/elastic/hub.py) cannot use (its sync
    choices: jaxdp/sync/rules.py)."""
    from jaxdp.errors import InputError

    if not callable(data):
        raise InputError("an elastic run needs data as a function data(step, shard) (a lost process's shards are "
                         "computed by the others)", argument="data")
    if len({d.process_index for d in mesh.devices.flat}) != 1:
        raise InputError("an elastic run's mesh is this process's devices (each process is its own JAX program)",
                         argument="devices")


def check_overlap(sync_every: Any) -> None:
    """InputError unless `overlap` has steps (sync_every 1, jaxdp/step/delayed.py) or rounds of H > 1
    steps (jaxdp/step/rounds.py) to overlap (what it combines with: jaxdp/sync/rules.py)."""
    from jaxdp.errors import InputError

    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise InputError(f"overlap overlaps each step's all-reduce (sync_every 1) or each round's average (sync_every "
                         f"= H of 2 or more) with what comes next; got sync_every={sync_every!r}", setting="sync_every")


def check_paced(pace: Any, data: Any, mesh: Any, what: str = "sync_seconds", flat: bool = True) -> None:
    """InputError for the pace, data or mesh `sync_seconds` or `overlap` (`what`; jaxdp/step/rounds.py)
    cannot use (what they combine with: jaxdp/sync/rules.py). `flat`: a one-axis mesh is needed
    (not by overlap with shard_params: jaxdp/step/overlap.py, `Cut`, on hsdp.py's meshes)."""
    from jaxdp.errors import InputError
    from jaxdp.step import rounds as paced

    paced.check(pace, None if not flat else mesh)
    if not callable(data):
        raise InputError(f"{what} needs data as a function data(step) (each process reads its own positions)",
                         argument="data")


def batch_function(data: Any, mesh: Any) -> Callable[[int], Any]:
    """`data` as `batch_at(step) -> device batch`: a function of the step, or an iterable read in
    order (a resumed run skips what the steps before it consumed)."""
    from jaxdp.mesh import shard_batch

    if callable(data):
        return lambda step: shard_batch(data(step), mesh)
    iterator, position, cache = iter(data), [0], {}

    def from_iterable(step: int) -> Any:
        from jaxdp.errors import InputError

        while position[0] <= step:
            try:
                cache[position[0]] = next(iterator)
            except StopIteration:
                raise InputError(f"fit: data ran out at step {position[0]}; give at least `steps` batches, or a "
                                 f"function data(step)") from None
            position[0] += 1
            for old in [s for s in cache if s < position[0] - 16]:  # the controller looks a few steps ahead
                del cache[old]
        if step not in cache:
            raise InputError(f"fit: data is an iterable, which cannot go back to step {step}; give a function "
                             f"data(step)")
        return shard_batch(cache[step], mesh)

    return from_iterable
