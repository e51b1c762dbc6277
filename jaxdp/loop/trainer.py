"""`jaxdp.fit`: the whole training loop as one call, for your own loss function and data.

    result = jaxdp.fit(loss_fn, params, optax.adam(1e-3), batch_at, steps=1000,
                       sync=jaxdp.SyncOptions(strategy="ring"),
                       checkpoint=jaxdp.CheckpointOptions(directory="/tmp/run", save_every=100),
                       evaluation=jaxdp.EvalOptions(fn=eval_fn, data=held_out, every=200),
                       logging=jaxdp.LogOptions(metrics_file="run.jsonl"))
    result.state.params, result.history, result.summary

It is what `python -m jaxdp.train` runs (the command line builds a built-in or `--model` module,
its dataset and optimizer, then calls this): checkpoints and exact resume, preemption (SIGTERM /
SIGUSR1 save and stop), the NaN / Inf guard, metrics (JSONL, TensorBoard, W&B), a progress bar,
periodic evaluation, and every sync mode: the strategy, compression (its automatic controller
included), local steps, ZeRO-1, gradient accumulation, rounds of wall-clock time, overlap.

Arguments, by what they describe:

* the model: `loss_fn` in either of `make_train_step`'s forms (plain `loss_fn(params, batch)` ->
  loss or (loss, aux); or `stateful=True`: `loss_fn(params, model_state, batch, rng)` ->
  (loss, aux, new_model_state)), and the initial `params` (and `model_state`), host or device values.
* the data: `data(step)` returns the rows of global batch `step` that this process feeds (all of
  them in a one-process run), as a numpy pytree whose leading axis divides over the local devices.
  It must be a pure function of `step` for resume to be exact (the built-in datasets are:
  `jaxdp.data.datasets.Dataset.train_batch`). An iterable of batches works too; a resumed run then skips
  the batches of the steps already trained.
* the rest, in groups (jaxdp/loop/options.py, each field with its default and meaning):
  `sync=SyncOptions(...)` (strategy, compression, sync_every, sync_seconds, overlap, ...),
  `evaluation=EvalOptions(fn, data, summarize, every)` (`fn(params, model_state, batch) -> per-device
  sums`; batches that do not divide over the devices are padded with rows of `batch["mask"] == 0`),
  `checkpoint=CheckpointOptions(directory, save_every, keep, meta)`, `logging=LogOptions(every,
  metrics_file, log_dir, wandb_project, progress, schedule)`, and `run=RunOptions(...)`: what the
  command line passes (its Config, the heartbeat watch, an elastic member, per-step counts).
  The flat keywords of before (`strategy=`, `checkpoint_dir=`, `eval_every=`, ...) still work for
  one release, with a DeprecationWarning naming the new spelling.

The stages, top to bottom: resolve (jaxdp/loop/resolve.py: the arguments checked and turned into a
Plan), restore (a checkpoint, or an elastic run's live state), run (jaxdp/loop/steps.py or
jaxdp/loop/rounds.py, with the periodic work as hooks: jaxdp/loop/hooks.py), finish (the final
save, the held-out metrics, the "done" record). Returns a `Result`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Iterable

from jaxdp.loop.hooks import MAX_PENDING_STEPS, ElasticStop, Loop
from jaxdp.loop.options import CheckpointOptions, EvalOptions, LogOptions, RunOptions, SyncOptions, grouped
from jaxdp.loop.resolve import Plan, default_summarize, resolve

__all__ = ["MAX_PENDING_STEPS", "Result", "default_summarize", "fit"]


@dataclasses.dataclass
class Result:
    state: Any                 # the final TrainState (replicated jax.Arrays)
    history: list[dict]        # every logged step record, as written to the metrics file
    summary: dict[str, Any]    # the final "done" record: eval metrics, ...
    preempted: bool = False    # stopped early by a preemption signal; the checkpoint holds `state`
    timings: dict[str, float] = dataclasses.field(default_factory=dict)  # startup_s, compile_s, decided_s


def fit(loss_fn: Callable, params: Any, tx: Any, data: Callable[[int], Any] | Iterable[Any], *, steps: int,
        mesh: Any = None, stateful: bool = False, model_state: Any = None, seed: int = 0,
        sync: SyncOptions | None = None, evaluation: EvalOptions | None = None,
        checkpoint: CheckpointOptions | None = None, logging: LogOptions | None = None, run: RunOptions | None = None,
        **flat: Any) -> Result:
    """Train `params` with `loss_fn` on `data` for `steps` steps, data-parallel over `mesh` (default:
    every device of every process). See the module docstring for the arguments; `flat`: the
    deprecated flat keywords (jaxdp.loop.options.FLAT)."""
    from jaxdp.loop.rounds import run_rounds
    from jaxdp.loop.steps import run_steps
    from jaxdp.metrics import Diverged

    options = grouped(flat, sync=sync, evaluation=evaluation, checkpoint=checkpoint, logging=logging, run=run)
    # ---- resolve: the arguments checked, the sync choices resolved, the new state ----
    plan = resolve(loss_fn, params, tx, data, steps=steps, mesh=mesh, stateful=stateful, model_state=model_state,
                   seed=seed, sync=options["sync"], evaluation=options["evaluation"],
                   checkpoint=options["checkpoint"], run=options["run"])
    # ---- restore: the latest checkpoint, or an elastic run's live state ----
    try:
        joined = restore(plan)
    except BaseException:
        plan.abandon()
        raise
    loop = begin(plan, options, joined)
    # ---- run: steps or rounds, the periodic work as hooks (jaxdp/loop/hooks.py) ----
    summary: dict[str, Any] = {}
    try:
        (run_rounds if plan.rounds_run else run_steps)(loop)
        if not loop.stop:
            summary = finish(loop, options["evaluation"])
    except Diverged as err:  # nothing non-finite was saved: the check runs before every save
        loop.writer.event("diverged", err.step, metric=err.name, value=err.value)
        err.last_checkpoint = plan.checkpointer.latest_step() if plan.checkpointer else None
        err.restored_unverified = plan.checkpointer.restored_unverified if plan.checkpointer else None
        raise
    finally:
        close(loop, finished=bool(summary))
    # ---- the result (a stopped run's checkpoint is on disk only now) ----
    if loop.stop:
        return stopped(loop)
    timings = {"startup_s": loop.startup_s, "compile_s": loop.writer.compile_s or 0.0, "decided_s": loop.decided_s}
    return Result(state=loop.state, history=loop.history, summary=summary, timings=timings)


def restore(plan: Plan) -> bool:
    """`plan.state` from the latest checkpoint (or as it is, with none), or an elastic run's from the
    live processes; then DIR/config.toml. Returns whether the state came from a live process."""
    from jaxdp.config import config_toml
    from jaxdp.errors import InputError
    from jaxdp.metrics import write_text_atomically

    joined, checkpointer = False, plan.checkpointer
    if plan.elastic is not None:  # the state of the live processes, or (rank 0, none live) the checkpoint's
        from jaxdp.cluster.preemption import Preemption

        plan.preemption = Preemption()  # a SIGTERM while joining (compiling can take a minute) stops it with 75
        plan.state, joined = _join(plan.elastic, plan.state, checkpointer, plan.step_for(plan.spec), plan.batch_at,
                                   plan.preemption)
        if plan.elastic.alone:  # a restarted rank 0 with no live worker (jaxdp/loop/lead.py)
            from jaxdp.loop import lead

            lead.alone(plan)
            checkpointer = plan.checkpointer
    elif checkpointer:
        plan.state = checkpointer.restore(plan.state)  # the latest complete checkpoint, or `state` if none
        if int(plan.state.step) > plan.steps:
            raise InputError(f"checkpoint directory {checkpointer.directory!r} holds step {int(plan.state.step)}, "
                             f"past steps={plan.steps}; raise steps to train further or use another checkpoint "
                             f"directory", argument="directory", setting="steps")
    if checkpointer and plan.is_main and plan.requested_config is not None:  # `--config DIR/config.toml` reruns it
        write_text_atomically(os.path.join(checkpointer.directory, "config.toml"), config_toml(
            plan.requested_config, comment=f"--sync-every auto chose {plan.spec.sync_every} (the checkpoints record "
            f"it)" if plan.sync_auto else None))
    return joined


def begin(plan: Plan, options: dict[str, Any], joined: bool) -> Loop:
    """The metrics writer, the "start" record, the resume line, and the stop signals: the Loop."""
    import jax

    from jaxdp.cluster.preemption import Preemption
    from jaxdp.metrics import MetricsWriter, peak_tflops
    from jaxdp.step import local_sgd, zero

    logging, run, mesh, state = options["logging"], options["run"], plan.mesh, plan.state
    start_step = int(jax.device_get(state.step))  # = the data position: batches are a function of the step
    device_kind = mesh.devices.flat[0].device_kind
    peak = peak_tflops(device_kind, getattr(plan.config, "precision", "fp32"))
    writer = MetricsWriter(
        is_main=plan.is_main, total_steps=plan.steps, start_step=start_step, metrics_file=logging.metrics_file,
        log_dir=logging.log_dir, progress=logging.progress, examples_per_step=run.examples_per_step,
        tokens_per_step=run.tokens_per_step, flops_per_step=run.flops_per_step,
        peak_flops=peak * 1e12 * mesh.size if peak and run.flops_per_step else None,
        **({"wandb_project": logging.wandb_project, "wandb_id_dir": options["checkpoint"].directory}
           if logging.wandb_project else {}))
    memory = {}
    if plan.spec.shard_params:  # bytes per device and XLA's compiled peak (one more compile: jaxdp/step/fsdp.py)
        from jaxdp.step import fsdp

        memory = fsdp.memory(plan.step_for(plan.spec), state, plan.batch_at(start_step))
        if plan.is_main:
            print(fsdp.describe(memory), file=sys.stderr)
    startup_s = time.perf_counter() - plan.started
    writer.restart_clock()  # the first step's compile time counts from here, not from when the writer opened
    early = plan.begun.records
    writer.event("start", start_step, resumed_from=start_step or None,
                 config=plan.config.to_dict() if plan.config is not None else None, processes=plan.n_processes,
                 devices=plan.devices, device_kind=device_kind, jax=jax.__version__,
                 malloc_env=os.environ.get("JAXDP_MALLOC_ENV"), startup_s=startup_s,
                 **(run.run_info or {}), **{"param_bytes_per_device": zero.bytes_per_device(state.params),
                 "optimizer_bytes_per_device": zero.bytes_per_device((state.opt_state, local_sgd.optimizer_states(state))),
                 **memory},
                 **({"sync_every_auto": True} if plan.sync_auto else {}))
    for name, record in early:  # --sync-every auto's decisions, taken before the loop
        writer.event(name, start_step, **record)
    codec = plan.spec.codec if plan.spec.codec_name() not in (None, "auto") else None
    note = codec and codec.settled_note(state.params, mesh.size, plan.spec.local)
    if note:  # a choice the codec's spec left to the run (top-k's form)
        settled = codec.settled(state.params, mesh.size, plan.spec.local)
        writer.decision("compression_form", start_step, note, compression=codec.name, chosen=settled.name)
    if start_step and plan.is_main and joined:
        print(f"jaxdp: rank {plan.elastic.rank} joined the run at step {start_step} with the live processes' state",
              file=sys.stderr)
    elif start_step and plan.is_main:
        print(f"jaxdp: resumed from step {start_step} ({plan.checkpointer.directory}){run.resume_note}",
              file=sys.stderr)
    if plan.elastic is not None:  # every rank stops after the same step (the launcher says which)
        preemption = ElasticStop(plan.preemption, plan.elastic)  # (caught since before it joined: restore())
    else:
        preemption = Preemption() if plan.checkpointer else None  # from here on SIGTERM / SIGUSR1: save and stop
    loop = Loop(plan=plan, writer=writer, state=state, start=start_step, preemption=preemption, options=options,
                done=start_step, before=start_step, spec=plan.spec, startup_s=startup_s,
                decided_s=sum(sum(r.get("cost_s", {}).values()) for _, r in early))  # the controller's own time
    return loop


def finish(loop: Loop, evaluation: EvalOptions) -> dict[str, Any]:
    """The final save, then the held-out metrics and the "done" record (returned)."""
    from jaxdp.sync import spec as syncspec

    plan = loop.plan
    loop.saveable()
    plan.beat.phase("the final save and evaluation")
    if plan.checkpointer:  # the final state, before evaluating: bad held-out input loses no training
        plan.checkpointer.save(loop.to_save())  # (a no-op if the last step was just saved)
    evaluates = plan.evaluate is not None and evaluation.data is not None and plan.evaluates
    held_out = plan.evaluate(loop.state) if evaluates else {}
    summary = {**held_out, "strategy": syncspec.strategy_name(loop.spec.strategy), "devices": plan.devices,
               "processes": plan.n_processes, "startup_s": loop.startup_s, "compile_s": loop.writer.compile_s,
               "compile_cache_hits": plan.cache_hits.hits}
    peak = device_peak_bytes()
    if peak is not None:  # (GPUs: what the allocator saw, beside the compiled estimate of --shard-params' line)
        summary["device_peak_bytes"] = peak
    return loop.writer.done(loop.done, summary)


def device_peak_bytes() -> int | None:
    """The largest peak of bytes in use on this process's devices, where the backend counts it
    (GPUs); None where it does not (CPU)."""
    import jax

    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


def stopped(loop: Loop) -> Result:
    """A run a stop signal ended: one console line (process 0), the Result that says so."""
    plan = loop.plan
    interrupted = getattr(loop.preemption, "interrupted", False)  # Ctrl-C: saved as for SIGTERM, exit code 130
    if plan.is_main and plan.checkpointer:
        from jaxdp.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

        print(f"jaxdp: {'interrupted' if interrupted else 'preempted'} ({loop.preemption.reason}): saved step "
              f"{loop.done} to {plan.checkpointer.directory}, exit code "
              f"{EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED}; run the same command to resume", file=sys.stderr)
    return Result(state=loop.state, history=loop.history, summary={"event": "preempted", "step": loop.done, **(
        {"signal": "SIGINT"} if interrupted else {})}, preempted=True)


def close(loop: Loop, finished: bool) -> None:
    """Everything the run opened, closed, whatever happened."""
    plan = loop.plan
    for made in plan.steps_by_spec.values():
        made.close()  # (overlap's thread; a no-op for the other steps)
    plan.cache_hits.close()
    plan.beat.stop()
    loop.writer.close()
    if plan.checkpointer:
        plan.checkpointer.close()  # waits for the last save to be written
    if plan.elastic is not None:
        plan.elastic.close(finished=finished or loop.stop)
    if loop.preemption and not (loop.stop and plan.exits_after):
        loop.preemption.close()
    # The command line's preempted process keeps its flag-only handlers until it exits, so a second
    # SIGTERM (srun --kill-on-bad-exit stopping the other tasks, a scheduler's grace-period kill)
    # cannot cut its shutdown short and turn exit code 75 into 143. In a notebook the process goes
    # on: the handlers go back, or the kernel's next Ctrl-C or SIGTERM would set a dead run's flag.


def _join(member: Any, state: Any, checkpointer: Any, train_step: Any, batch_at: Callable[[int], Any],
          preemption: Any) -> tuple[Any, bool]:
    """An elastic run's start in this process: compile, join the run's engine, restore the latest
    checkpoint (or keep the new state), then the first quorum, which hands it a live peer's state if
    theirs is further on. Returns (state, whether it came from a live process). A stop signal that
    arrives while it compiles ends it with exit code 75 before it joins (the launcher going away sends
    one: PR_SET_PDEATHSIG)."""
    from jaxdp.cluster.wire import ProtocolError as Lost
    from jaxdp.errors import EXIT_PEER_LOST, EXIT_PREEMPTED

    train_step.warm_up(state, batch_at(0))  # joining stalls the others until this process's first step
    if preemption.signal is not None:
        member.close()
        print(f"jaxdp: rank {member.rank}: {preemption.reason} before this process joined; exit code "
              f"{EXIT_PREEMPTED}", file=sys.stderr)
        raise SystemExit(EXIT_PREEMPTED)
    try:
        member.connect()
    except (Lost, OSError) as err:
        member.close()
        if preemption.signal is not None:  # the launcher went away (PR_SET_PDEATHSIG)
            print(f"jaxdp: rank {member.rank}: {preemption.reason}, and the launcher is gone ({err}) before this "
                  f"process joined; exit code {EXIT_PREEMPTED}", file=sys.stderr)
            raise SystemExit(EXIT_PREEMPTED) from None
        print(f"jaxdp: error: rank {member.rank} cannot join the launcher at {member.address} ({err}); exit code "
              f"{EXIT_PEER_LOST}", file=sys.stderr)
        raise SystemExit(EXIT_PEER_LOST) from None
    state = checkpointer.restore(state) if checkpointer else state
    return member.settle(state)  # its first quorum, which may hand it a live peer's state
