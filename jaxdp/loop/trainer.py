"""`jaxdp.fit`: the whole training loop as one call, for your own loss function and data.

    result = jaxdp.fit(loss_fn, params, optax.adam(1e-3), batch_at, steps=1000,
                       strategy="ring", checkpoint_dir="/tmp/run", save_every=100,
                       eval_fn=eval_fn, eval_data=held_out, eval_every=200, metrics_file="run.jsonl")
    result.state.params, result.history, result.summary

It is what `python -m jaxdp.train` runs (the command line builds a built-in or `--model` module,
its dataset and optimizer, then calls this): checkpoints and exact resume, preemption (SIGTERM /
SIGUSR1 save and stop), the NaN / Inf guard, metrics (JSONL, TensorBoard, W&B), a progress bar,
periodic evaluation, and every sync mode: the strategy, compression (its automatic controller
included), local steps, ZeRO-1, gradient accumulation.

Arguments, by what they describe:

* the model: `loss_fn` in either of `make_train_step`'s forms (plain `loss_fn(params, batch)` ->
  loss or (loss, aux); or `stateful=True`: `loss_fn(params, model_state, batch, rng)` ->
  (loss, aux, new_model_state)), and the initial `params` (and `model_state`), host or device values.
* the data: `data(step)` returns the rows of global batch `step` that this process feeds (all of
  them in a one-process run), as a numpy pytree whose leading axis divides over the local devices.
  It must be a pure function of `step` for resume to be exact (the built-in datasets are:
  `jaxdp.data.datasets.Dataset.train_batch`). An iterable of batches works too; a resumed run then skips
  the batches of the steps already trained.
* evaluation: `eval_fn(params, model_state, batch) -> per-device sums` (a dict; padding rows
  carry `batch["mask"] == 0` and must be left out of the sums), `eval_data` (an iterable of host
  batches, or a function returning one; batches that do not divide over the devices are padded
  with masked rows, so every row counts exactly once), and `summarize(totals) -> metrics`
  (default: every total divided by `totals["count"]`, named `eval_<total>`).
* the sync: `strategy`, `compression` (including "auto"), `sync_every` (including "auto"),
  `outer_tx`, `sync_fragments`, `shard_optimizer`, `grad_accum`, as `make_train_step` takes them;
  `sync_seconds` (rounds of wall-clock time, jaxdp/step/rounds.py) and `overlap` (every step's all-reduce
  runs while the next step computes and lands one step late, jaxdp/step/delayed.py; with `sync_every` H:
  each round's average runs while the next round trains, jaxdp/step/rounds.py).
* bookkeeping: `checkpoint_dir`, `save_every` (steps, or "auto": jaxdp/checkpoint/saveplan.py), `keep`; `metrics_file`, `log_dir`,
  `wandb_project`, `log_every`, `eval_every`, `progress`; `schedule` (the learning-rate schedule,
  logged as "lr").

Returns a `Result`: the final state, the logged records, and the final summary.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Iterable

# Steps whose metrics may wait on the devices for the NaN / Inf check: it runs at every log point,
# and at least this often, so a large log_every does not keep every step's metrics alive.
MAX_PENDING_STEPS = 100


@dataclasses.dataclass
class Result:
    state: Any                 # the final TrainState (replicated jax.Arrays)
    history: list[dict]        # every logged step record, as written to the metrics file
    summary: dict[str, Any]    # the final "done" record: eval metrics, ...
    preempted: bool = False    # stopped early by a preemption signal; the checkpoint holds `state`
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # startup_s, compile_s, decided_s


def default_summarize(totals: dict[str, float]) -> dict[str, float]:
    """Every summed metric divided by the row count `totals["count"]` (if there is one)."""
    count = totals.get("count")
    return {f"eval_{k}": (v / count if count else v) for k, v in totals.items() if k != "count"}


def fit(loss_fn: Callable, params: Any, tx: Any, data: Callable[[int], Any] | Iterable[Any], *, steps: int,
        mesh: Any = None, strategy: Any = "psum", stateful: bool = False, model_state: Any = None,
        eval_fn: Callable | None = None, eval_data: Any = None, summarize: Callable | None = None,
        eval_every: int = 0,
        compression: Any = "none", sync_every: int | str = 1, outer_tx: Any = None, sync_fragments: int = 1,
        sync_seconds: Any = None, overlap: bool = False, shard_optimizer: bool = False, grad_accum: int = 1, comm_target: float = 0.25,
        compression_every: int = 500,
        checkpoint_dir: str | None = None, save_every: int | str = 0, keep: int = 3,
        metrics_file: str | None = None, log_dir: str | None = None, wandb_project: str | None = None,
        log_every: int = 10, progress: bool = True, schedule: Callable[[int], Any] | None = None,
        seed: int = 0, prefetch: int = 2, stall_timeout: int = 20,
        config: Any = None, checkpoint_meta: dict | None = None, resume_note: str = "", run_info: dict | None = None,
        shard_params: bool = False,
        watch: Any = None, elastic: Any = None,
        examples_per_step: int | None = None, tokens_per_step: int | None = None,
        flops_per_step: float | None = None, started: float | None = None) -> Result:
    """Train `params` with `loss_fn` on `data` for `steps` steps, data-parallel over `mesh` (default:
    every device of every process). See the module docstring for the arguments.

    The last group of keyword arguments is what the command line passes: `config` (its Config,
    recorded in checkpoints and checked on resume, and written as DIR/config.toml),
    `checkpoint_meta` (more JSON for every checkpoint), `resume_note` (said after the resume
    line), `run_info` (more fields for the "start" record), `watch` (a running
    `jaxdp.cluster.heartbeat` watch to use and stop), the per-step counts for throughput and MFU, and when
    the process `started`.
    """
    import jax

    from jaxdp.checkpoint.checkpointer import Checkpointer
    from jaxdp.cluster import heartbeat, runtime
    from jaxdp.cluster.preemption import Preemption
    from jaxdp.config import config_toml
    from jaxdp.data.prefetch import Prefetcher
    from jaxdp.errors import InputError
    from jaxdp.mesh import make_mesh, pad_batch, shard_batch
    from jaxdp.metrics import Diverged, MetricsWriter, check_finite, peak_tflops, write_text_atomically
    from jaxdp.step import fsdp, local_sgd, rounds as paced, zero
    from jaxdp.step.state import init_state
    from jaxdp.step.train_step import make_elastic_step, make_eval_step, make_train_step
    from jaxdp.sync import controller as controller_lib, exchange, spec as syncspec
    from jaxdp.sync.compression import bytes_sent, uncompressed_bytes
    from jaxdp.sync.controller import GUARD_BATCHES

    started = time.perf_counter() if started is None else started
    mesh = make_mesh() if mesh is None else mesh
    # process 0 (rank 0 of an elastic run) prints and writes logs; all take part in compute
    is_main = jax.process_index() == 0 if elastic is None else elastic.lead
    n_processes = jax.process_count() if elastic is None else elastic.size
    devices = mesh.size * (1 if elastic is None else elastic.size)  # every process's, of the whole run
    model_state = {} if model_state is None else dict(model_state)
    if not isinstance(steps, int) or steps < 0:
        raise InputError(f"fit: steps must be 0 or more, got {steps!r}")
    # Multi-process: stalled peers and stragglers, watched to the end (the command line starts the
    # watch before it loads its data and passes it in; it is stopped here either way).
    beat = heartbeat.for_run(stall_timeout) if watch is None else watch

    sync_auto = sync_every == syncspec.AUTO
    every_step_overlap = overlap and sync_every == 1  # each step's all-reduce one step late (jaxdp/step/delayed.py)
    if overlap:
        # sync_every auto chooses H >= 2 for overlap (below), and with compression auto fixes the
        # pseudo-gradient's codec: checked as such
        rounds_of = 2 if sync_auto else sync_every
        _check_overlap(rounds_of, sync_seconds)
    if overlap and not every_step_overlap:  # rounds of H steps whose average lands one round late (jaxdp/step/rounds.py)
        _check_paced(paced.FixedSteps(rounds_of), data, mesh, strategy,
                     "none" if sync_auto and compression == syncspec.AUTO else compression, 1, sync_fragments,
                     shard_optimizer, what="overlap")
    elif sync_seconds is not None:  # workers at their own pace (jaxdp/step/rounds.py)
        _check_paced(sync_seconds, data, mesh, strategy, compression, sync_every, sync_fragments, shard_optimizer)
    rounds_run = (overlap and not every_step_overlap) or sync_seconds is not None  # host-driven rounds (jaxdp/step/rounds.py)
    if rounds_run:
        outer_tx = local_sgd.default_outer(outer_tx)  # local steps, in rounds
    shard_data = None
    if elastic is not None:  # one process of an elastic run (jaxdp/cluster/elastic.py): data(step, shard)
        _check_elastic(data, mesh, strategy, compression, sync_every, sync_seconds, sync_fragments, shard_optimizer,
                       overlap)
        shard_data, data = data, lambda step: shard_data(step, elastic.rank)
    batch_at = _batch_function(data, mesh)
    cache_hits = runtime.CacheHits()  # compiled programs loaded from JAX's persistent cache

    checkpointer, joined = None, False
    if checkpoint_dir and (elastic is None or is_main):  # an elastic run: rank 0 saves
        checkpointer = Checkpointer(checkpoint_dir, save_every=save_every, keep=keep, config=config)
        checkpointer.extra_meta.update(checkpoint_meta or {})
    try:
        # ---- update step: the sync choices as one value; "auto" ones the controller resolves ----
        requested = syncspec.SyncSpec(strategy=strategy, compression=None if compression == "none" else compression,
                                      sync_every=sync_every, sync_fragments=sync_fragments, outer_tx=outer_tx,
                                      shard_optimizer=shard_optimizer, overlap=every_step_overlap, shard_params=shard_params)
        if shard_params:  # ZeRO-3 / FSDP (jaxdp/step/fsdp.py): its refusals, before anything is built
            fsdp.check_run(requested, mesh, paced=sync_seconds is not None, elastic=elastic is not None)
        if every_step_overlap:
            requested.validate()  # (InputError naming the clash: strategy, shard_optimizer, compression auto)

        def new_state(spec: Any) -> Any:
            made = init_state(params, tx, mesh, model_state=model_state, rng=seed,
                              shard_optimizer=spec.shard_optimizer, compression=spec.compression,
                              sync_every=spec.sync_every, outer_tx=spec.outer_tx, sync_fragments=spec.sync_fragments,
                              shard_params=spec.shard_params)
            if spec.overlap:  # the slot for the gradient in flight (its shapes come from a batch)
                return step_for(spec).prepare(made, batch_at(0))
            if not rounds_run or (overlap and spec.sync_every == 1):  # (sync_every auto's measuring state)
                return made
            rows, shared = paced.init_sync(mesh)
            if overlap:
                rows.update(paced.init_overlap(params, mesh))
            return made.replace(sync=made.sync.replace(per_device={**made.sync.per_device, **rows},
                                                       shared={**made.sync.shared, **shared}))

        steps_by_spec: dict[Any, Any] = {}

        def step_for(spec: Any) -> Any:  # one compiled step per choice (compression "auto" switches)
            if spec not in steps_by_spec and elastic is not None:
                steps_by_spec[spec] = make_elastic_step(loss_fn, tx, mesh, elastic, shard_data, stateful=stateful,
                                                        grad_accum=grad_accum, grad_norm=True)
            if spec not in steps_by_spec:
                steps_by_spec[spec] = make_train_step(
                    loss_fn, tx, mesh, spec.strategy, stateful=stateful, grad_accum=grad_accum, grad_norm=True,
                    shard_optimizer=spec.shard_optimizer, compression=spec.compression, sync_every=spec.sync_every,
                    outer_tx=spec.outer_tx, sync_fragments=spec.sync_fragments, overlap=spec.overlap,
                    shard_params=spec.shard_params)
            return steps_by_spec[spec]

        if (rounds_run and not sync_auto) or elastic is not None:  # nothing "auto" to resolve (_check_paced, ...)
            fixed = requested.replace(compression=None if compression == "none" else exchange.codec(compression))
            begun = controller_lib.Start(fixed, requested, [], None, False, None, False)
        else:
            begun = controller_lib.start(
                requested, mesh, params, make_state=new_state, make_step=step_for,
                batches=lambda k: [batch_at(i) for i in range(k)], target_fraction=comm_target,
                recorded=checkpointer.recorded_meta() if checkpointer and sync_auto else None, overlap=overlap)
        spec, controller, early = begun.spec, begun.controller, begun.records
        if overlap and spec.sync_every == 1:  # sync_every auto chose synchronous training: nothing to overlap
            overlap = rounds_run = False
        state = begun.state if begun.state is not None else new_state(begun.state_spec)
        train_step = step_for(spec)
        requested_config = config  # as given: config.toml says --sync-every auto, so a rerun resumes as this run did
        if sync_auto:
            if config is not None:  # what was chosen: H, the pseudo-gradient's codec, whether rounds overlap
                config = config.replace(sync_every=spec.sync_every, overlap=overlap, **(
                    {"compression": begun.pseudo_gradient} if begun.pseudo_gradient else {}))
            if is_main:
                chosen = dict(early)["local_steps"]
                print(f"jaxdp: --sync-every auto: {spec.sync_every}: {chosen['why']}", file=sys.stderr)
                if chosen.get("propose_overlap"):
                    print(f"jaxdp: --sync-every auto: {chosen['propose_overlap']['why']}", file=sys.stderr)
            if checkpointer:  # checkpoints record the resolved H and codec (config), and that auto chose them
                checkpointer.config = config
                checkpointer.extra_meta["sync_every_auto"] = bool(begun.sync_every_auto)
        # Bytes each device sends per step with plain averaging (a bandwidth-optimal all-reduce).
        plain_comm = {"comm_bytes": bytes_sent(uncompressed_bytes(params), mesh.size), "compression_ratio": 1.0}
        eval_step = make_eval_step(eval_fn, mesh) if eval_fn is not None and (elastic is None or is_main) else None

        if elastic is not None:  # the state of the live processes, or (rank 0, none live) the checkpoint's
            state, joined = _join(elastic, state, checkpointer, train_step, batch_at)
        elif checkpointer:
            state = checkpointer.restore(state)  # the latest complete checkpoint, or `state` if none
            if rounds_run:
                paced.check_state(state, overlap)
            if int(state.step) > steps:
                raise InputError(f"checkpoint directory {checkpointer.directory!r} holds step {int(state.step)}, past "
                                 f"steps={steps}; raise steps to train further or use another checkpoint directory",
                                 argument="directory", setting="steps")
    except BaseException:
        beat.stop()
        if checkpointer:
            checkpointer.close()  # nothing was written: bad input leaves the directory as it was
        if elastic is not None:
            elastic.close()
        raise
    if checkpointer and is_main and requested_config is not None:  # `--config DIR/config.toml` reruns it
        write_text_atomically(os.path.join(checkpointer.directory, "config.toml"), config_toml(
            requested_config, comment=f"--sync-every auto chose {spec.sync_every} (the checkpoints record it)"
            if sync_auto else None))

    def evaluate(state: Any) -> dict[str, float]:
        """Held-out metrics: every eval batch, padded to the device count with masked rows."""
        totals: dict[str, float] = {}
        batches = eval_data() if callable(eval_data) else eval_data
        for batch in batches:
            sums = jax.device_get(eval_step(state, shard_batch(pad_batch(batch, mesh), mesh)))  # host sync point
            totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
        return (summarize or default_summarize)(totals)

    start_step = int(jax.device_get(state.step))  # = the data position: batches are a function of the step

    # ---- the loop ------------------------------------------------------------------------------
    device_kind = mesh.devices.flat[0].device_kind
    memory = fsdp.memory(train_step, state, batch_at(start_step)) if spec.shard_params else {}  # (one more compile)
    if memory and is_main:
        print(fsdp.describe(memory), file=sys.stderr)
    peak = peak_tflops(device_kind, getattr(config, "precision", "fp32"))
    writer = MetricsWriter(
        is_main=is_main, total_steps=steps, start_step=start_step, metrics_file=metrics_file, log_dir=log_dir,
        progress=progress, examples_per_step=examples_per_step, tokens_per_step=tokens_per_step,
        flops_per_step=flops_per_step, peak_flops=peak * 1e12 * mesh.size if peak and flops_per_step else None,
        **({"wandb_project": wandb_project, "wandb_id_dir": checkpoint_dir} if wandb_project else {}))
    startup_s = time.perf_counter() - started
    writer.event("start", start_step, resumed_from=start_step or None,
                 config=config.to_dict() if config is not None else None, processes=n_processes,
                 devices=devices, device_kind=device_kind, jax=jax.__version__,
                 malloc_env=os.environ.get("JAXDP_MALLOC_ENV"), startup_s=startup_s,
                 **(run_info or {}), **{"param_bytes_per_device": zero.bytes_per_device(state.params),
                 "optimizer_bytes_per_device": zero.bytes_per_device((state.opt_state, local_sgd.optimizer_states(state))),
                 **memory}, **({"sync_every_auto": True} if sync_auto else {}))
    for name, record in early:  # --sync-every auto's decisions, taken before the loop
        writer.event(name, start_step, **record)
    if start_step and is_main and joined:
        print(f"jaxdp: rank {elastic.rank} joined the run at step {start_step} with the live processes' state",
              file=sys.stderr)
    elif start_step and is_main:
        print(f"jaxdp: resumed from step {start_step} ({checkpointer.directory}){resume_note}", file=sys.stderr)
    if checkpointer:  # --save-every auto, resumed: decided from the recorded save cost
        checkpointer.report_decision(writer, start_step)
    history, preempted, done = [], False, start_step
    decided_s = sum(sum(r.get("cost_s", {}).values()) for _, r in early)  # the controller's own time
    pending: list[tuple[int, Any]] = []  # (step, metrics) on device, not yet checked for NaN / Inf
    last_checked: dict[str, Any] = {}  # the metrics of the last step checked, on the host

    def checked() -> dict[str, float]:
        """Host sync point: every pending step's metrics come to the host and are checked for
        non-finite values (Diverged names the first bad step); returns the latest step's."""
        host = jax.device_get(pending)
        pending.clear()
        for step, metrics in host:
            check_finite(step, metrics)
        if host:
            last_checked.clear()
            last_checked.update(host[-1][1])
        return dict(last_checked)

    preemption = Preemption() if checkpointer else None  # from here on SIGTERM / SIGUSR1: save and stop
    HubGone = _NeverRaised
    if elastic is not None:  # every rank stops after the same step (the launcher says which)
        preemption = _ElasticStop(preemption or Preemption(), elastic)
        from jaxdp.cluster.elastic import HubGone
    batches = Prefetcher(batch_at, start_step, steps, depth=prefetch) if not rounds_run else None
    summary: dict[str, Any] = {}
    try:
        if rounds_run:
            rounds = paced.Overlapped(train_step.local_grads, tx, mesh, spec.strategy, spec.compression, outer_tx,
                                      spec.sync_every, data, examples_per_step) if overlap else \
                paced.Rounds(train_step.local_grads, tx, mesh, spec.strategy, spec.compression, outer_tx,
                             sync_seconds, data, examples_per_step)
            state, done, preempted = paced.train(
                rounds, state, steps=steps, writer=writer, history=history, beat=beat, checkpointer=checkpointer,
                preemption=preemption, evaluate=evaluate if eval_step is not None else None, eval_every=eval_every,
                is_main=is_main)
        else:
            for step, batch in batches:
                first = step == start_step and not begun.decided  # --sync-every auto decided compression already
                if controller and (first or (step > start_step and compression_every
                                             and step % compression_every == 0)):
                    checked()
                    decision = controller.decide(state, [batch] + [batch_at(step + k) for k in range(1, GUARD_BATCHES)], step)
                    writer.event("compression", step, **decision.record)
                    writer.restart_clock()  # its measurements are neither training nor compilation
                    decided_s += sum(decision.record["cost_s"].values())
                    if is_main:  # one line per decision
                        cost = decision.record["cost_s"]
                        print(f"jaxdp: --compression auto at step {step}: {decision.record['why']} (measuring "
                              f"{cost['measure']:.1f}s, quality guard {cost['quality']:.1f}s)", file=sys.stderr)
                        if decision.record["propose_local_steps"] and spec.sync_every == 1:
                            print(f"jaxdp: --compression auto: {decision.record['propose_local_steps']['why']}", file=sys.stderr)
                    spec = spec.replace(compression=decision.compressor)
                    train_step = step_for(spec)
                dispatch = time.perf_counter()
                try:
                    state, metrics = train_step(state, batch)
                except HubGone as gone:  # an elastic run whose launcher went away: stop with the state held
                    checked()
                    if checkpointer:
                        checkpointer.save(state)  # no-op if this step was just saved
                    if not (is_main and checkpointer):  # (rank 0 says what it saved below)
                        print(f"jaxdp: {gone}: stopping after step {done}, exit code 75", file=sys.stderr)
                    preemption.gone = True
                    preempted = True
                    break
                done = step + 1
                if spec.overlap and done == steps:  # the last step: apply its own gradient too, nothing in flight
                    pending.append((done, metrics))
                    state, metrics = train_step.flush(state)
                beat.dispatched(done, metrics["loss"], waited_s=time.perf_counter() - dispatch)
                pending.append((done, metrics))
                if len(pending) >= MAX_PENDING_STEPS:  # a large log_every: memory stays bounded, the check exact
                    checked()
                if step == start_step:  # the first step compiles: time it apart, then start the clock
                    jax.block_until_ready(metrics)  # host sync point (once)
                    writer.first_step_done(done)  # the progress bar starts at `done`: this step is counted
                else:
                    writer.step()
                if done % log_every == 0 or done == steps:
                    latest = checked()
                    extra = {"lr": float(schedule(done - 1))} if schedule is not None else {}
                    history.append(writer.log(done, latest, {**extra, **beat.stragglers(),
                                                             **({} if "comm_bytes" in latest else plain_comm)}))
                if eval_step is not None and eval_every and done % eval_every == 0 and done < steps:
                    checked()
                    beat.phase(f"the evaluation after step {done}")
                    evaluated = time.perf_counter()
                    writer.eval(done, {**evaluate(state), "eval_s": time.perf_counter() - evaluated})
                if checkpointer:
                    checkpointer.poll()  # a background save that failed stops the run here (exit 73)
                if checkpointer and checkpointer.should_save(done):
                    checked()  # never write a non-finite state over a good checkpoint
                    checkpointer.save(state)
                    checkpointer.report_decision(writer, done)  # --save-every auto: the measuring save chose
                # Multi-process: a tiny all-reduce, so every process stops after the same step.
                if preemption and done < steps and preemption.should_stop(state):
                    checked()
                    if checkpointer:  # (an elastic run's other ranks have none)
                        checkpointer.save(state)  # no-op if this step was just saved
                    preempted = True
                    break
        if not preempted:
            checked()
            beat.phase("the final save and evaluation")
            if checkpointer:  # the final state, before evaluating: bad held-out input loses no training
                checkpointer.save(state)  # (a no-op if the last step was just saved)
            held_out = evaluate(state) if eval_step is not None and eval_data is not None else {}
            summary = {**held_out, "strategy": syncspec.strategy_name(spec.strategy), "devices": devices,
                       "processes": n_processes, "startup_s": startup_s, "compile_s": writer.compile_s,
                       "compile_cache_hits": cache_hits.hits}
            summary = writer.done(done, summary)
    except Diverged as err:  # nothing non-finite was saved: the check runs before every save
        writer.event("diverged", err.step, metric=err.name, value=err.value)
        err.last_checkpoint = checkpointer.latest_step() if checkpointer else None
        err.restored_unverified = checkpointer.restored_unverified if checkpointer else None
        raise
    finally:
        if batches is not None:
            batches.close()
        if rounds_run and overlap and "rounds" in locals():
            rounds.close()
        for made in (steps_by_spec.values() if "steps_by_spec" in locals() else ()):
            made.close()  # (overlap's thread; a no-op for the other steps)
        cache_hits.close()
        beat.stop()
        writer.close()
        if checkpointer:
            checkpointer.close()  # waits for the last save to be written
        if elastic is not None:
            elastic.close(finished=bool(summary) or preempted)
        if preemption and not preempted:
            preemption.close()
        # A preempted process keeps its flag-only handlers until it exits, so a second SIGTERM (srun
        # --kill-on-bad-exit stopping the other tasks, a scheduler's grace-period kill) cannot cut
        # its shutdown short and turn exit code 75 into 143.
    if preempted:
        if is_main and checkpointer:  # only now: the checkpoint is on disk
            from jaxdp.errors import EXIT_PREEMPTED

            print(f"jaxdp: preempted ({preemption.reason}): saved step {done} to {checkpointer.directory}, "
                  f"exit code {EXIT_PREEMPTED}; run the same command to resume", file=sys.stderr)
        return Result(state=state, history=history, summary={"event": "preempted", "step": done}, preempted=True)
    timings = {"startup_s": startup_s, "compile_s": writer.compile_s or 0.0, "decided_s": decided_s}
    return Result(state=state, history=history, summary=summary, timings=timings)


def _check_elastic(data: Any, mesh: Any, strategy: Any, compression: Any, sync_every: Any, sync_seconds: Any,
                   sync_fragments: int, shard_optimizer: bool, overlap: bool = False) -> None:
    """InputError for what an elastic run (jaxdp/cluster/elastic.py) does not do."""
    from jaxdp.errors import InputError
    from jaxdp.sync.collectives import as_collective

    if as_collective(strategy).name != "host":
        raise InputError(f"an elastic run (jaxdp.launch --elastic) sums gradients on the host across processes: use "
                         f"strategy='host', not {as_collective(strategy).name!r}", setting="strategy")
    clash = ("compression", f"compression={compression!r}") if compression not in ("none", None) else \
        ("sync_every", f"sync_every={sync_every!r}") if sync_every != 1 else \
        ("sync_seconds", "sync_seconds") if sync_seconds is not None else \
        ("sync_fragments", f"sync_fragments={sync_fragments}") if sync_fragments != 1 else \
        ("shard_optimizer", "shard_optimizer (ZeRO-1)") if shard_optimizer else \
        ("overlap", "overlap") if overlap else None
    if clash:
        raise InputError(f"an elastic run (jaxdp.launch --elastic) does not combine with {clash[1]}", setting=clash[0])
    if not callable(data):
        raise InputError("an elastic run needs data as a function data(step, shard) (a lost process's shards are "
                         "computed by the others)", argument="data")
    if len({d.process_index for d in mesh.devices.flat}) != 1:
        raise InputError("an elastic run's mesh is this process's devices (each process is its own JAX program)",
                         argument="devices")


def _join(member: Any, state: Any, checkpointer: Any, train_step: Any, batch_at: Callable[[int], Any]
          ) -> tuple[Any, bool]:
    """An elastic run's start in this process: compile, join the launcher's hub, then take the live
    processes' state (or, as the source, the latest checkpoint's or the new one). Returns (state,
    whether it came from a live process)."""
    from jaxdp.cluster import elastic as elastic_lib
    from jaxdp.errors import EXIT_PEER_LOST, EXIT_PREEMPTED
    from jaxdp.step.train_step import state_from_arrays

    train_step.warm_up(state, batch_at(0))  # joining stalls the others until this process's first step
    try:
        source = member.connect()
        received = None if source else member.receive_state()
    except (elastic_lib.Lost, OSError) as err:
        connected = member.sock is not None
        member.close()
        if member.stop or connected:  # told to stop, or the launcher went away while this process waited
            why = "the run stopped" if member.stop else f"the launcher went away ({err})"
            print(f"jaxdp: rank {member.rank}: {why} before this process joined; exit code "
                  f"{EXIT_PREEMPTED}", file=sys.stderr)
            raise SystemExit(EXIT_PREEMPTED) from None
        print(f"jaxdp: error: rank {member.rank} cannot join the launcher at {member.address} ({err}); exit code "
              f"{EXIT_PEER_LOST}", file=sys.stderr)
        raise SystemExit(EXIT_PEER_LOST) from None
    if received is None:
        return (checkpointer.restore(state) if checkpointer else state), False
    return state_from_arrays(state, received[1]), True


class _ElasticStop:
    """An elastic run's preemption: a signal here asks the launcher to stop every rank, and all
    stop after the step whose total says so (rank 0 saves it)."""

    def __init__(self, preemption: Any, member: Any):
        self._preemption, self._member = preemption, member
        self.gone = False  # the launcher (the hub) went away

    def should_stop(self, state: Any) -> bool:
        if self._preemption.signal is not None:
            self._member.ask_stop()
        return self._member.stop

    @property
    def reason(self) -> str:
        if self.gone:
            return "the launcher is gone"
        return self._preemption.reason if self._preemption.signal else "a stop signal to the launcher or another rank"

    def close(self) -> None:
        self._preemption.close()


class _NeverRaised(Exception):
    """(What the loop catches for an elastic run's HubGone in a run that is not elastic.)"""


def _check_overlap(sync_every: Any, sync_seconds: Any) -> None:
    """InputError unless `overlap` has steps (sync_every 1, jaxdp/step/delayed.py) or rounds of H > 1
    steps (jaxdp/step/rounds.py) to overlap."""
    from jaxdp.errors import InputError

    if sync_seconds is not None:
        raise InputError("overlap does not combine with sync_seconds yet: its rounds are H steps (sync_every)",
                         setting="overlap")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise InputError(f"overlap overlaps each step's all-reduce (sync_every 1) or each round's average (sync_every "
                         f"= H of 2 or more) with what comes next; got sync_every={sync_every!r}", setting="sync_every")


def _check_paced(sync_seconds: Any, data: Any, mesh: Any, strategy: Any, compression: Any, sync_every: Any,
                 sync_fragments: int, shard_optimizer: bool, what: str = "sync_seconds") -> None:
    """InputError for what `sync_seconds` or `overlap` (`what`; jaxdp/step/rounds.py) does not combine with."""
    from jaxdp.errors import InputError
    from jaxdp.step import rounds as paced
    from jaxdp.sync.collectives import as_collective

    paced.check(sync_seconds, mesh)
    clash = ("sync_every", f"sync_every={sync_every!r}: the round is sync_seconds long, not H steps") \
        if sync_every != 1 else ("compression", "compression auto: choose one (none, bf16, int8, ...)") \
        if compression == "auto" else ("sync_fragments", f"sync_fragments={sync_fragments}") \
        if sync_fragments != 1 else ("shard_optimizer", "shard_optimizer (ZeRO-1)") if shard_optimizer else None
    if clash:
        raise InputError(f"{what} does not combine with {clash[1]}", setting=clash[0])
    if as_collective(strategy).sum is None:
        raise InputError(f"{what} needs an in-graph strategy (psum or ring), not {as_collective(strategy).name}",
                         setting="strategy")
    if not callable(data):
        raise InputError(f"{what} needs data as a function data(step) (each process reads its own positions)",
                         argument="data")


def _batch_function(data: Any, mesh: Any) -> Callable[[int], Any]:
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
