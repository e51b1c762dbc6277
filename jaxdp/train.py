"""Train a built-in model data-parallel over every device of every process.

    python -m jaxdp.train                                  # MLP on digits, 8 simulated CPU devices
    python -m jaxdp.train --strategy=ring --steps 500 --metrics-file run.jsonl
    python -m jaxdp.train --model cnn --dataset my_data.npz --batch-size 256
    python -m jaxdp.train --help                           # every flag, grouped, with defaults

Exit codes (jaxdp/errors.py): 0 success, 1 an unexpected error, 2 bad input (one line on stderr;
--debug for the traceback), 69 a peer process died, never arrived or stalled, 73 a checkpoint could
not be written (disk full), 75 preempted (with
--checkpoint-dir, SIGTERM or SIGUSR1 make every process finish its step, save and stop; rerun the
same command to resume), 130 interrupted.

The file reads top to bottom in data-flow order: distribution, mesh, data, model and
optimizer, update step, checkpoint, loop, evaluation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import time
import traceback
from typing import Any, Sequence

STARTED = time.perf_counter()  # this module loads first (before JAX): the run's start-up starts here

from jaxdp.config import Config, ConfigError, config_toml, parse_args  # noqa: E402
from jaxdp.errors import (EXIT_BAD_INPUT, EXIT_CANNOT_SAVE, EXIT_DIVERGED, EXIT_ERROR, EXIT_INTERRUPTED,  # noqa: E402
                          EXIT_OK, EXIT_PREEMPTED, CheckpointWriteError, InputError)
from jaxdp.metrics import Diverged  # noqa: E402

# Steps whose metrics may wait on the devices for the NaN / Inf check: it runs at every log point,
# and at least this often, so a large --log-every does not keep every step's metrics alive.
MAX_PENDING_STEPS = 100

# Which flag fed each library argument that an InputError may name.
FLAG_OF_ARGUMENT = {"directory": "--checkpoint-dir", "dataset": "--dataset", "devices": "--devices",
                    "vocab_size": "--vocab-size", "strategy": "--strategy", "tx": "--optimizer"}


@dataclasses.dataclass
class Result:
    state: Any                 # the final TrainState (replicated jax.Arrays)
    history: list[dict]        # every logged step record, as written to --metrics-file
    summary: dict[str, Any]    # the final "done" record: eval_loss, eval_accuracy or eval_perplexity, ...
    preempted: bool = False    # stopped early by a preemption signal; the checkpoint holds `state`


def train(config: Config) -> Result:
    # JAX is imported here, after the flags are parsed, because distributed.initialize must run
    # before JAX starts its backend.
    from jaxdp import runtime

    runtime.add_gpu_xla_flags()  # before JAX starts its backend; CPUs ignore them
    import jax

    from jaxdp import agreement, compression, controller as controller_lib, data, distributed, heartbeat, local_sgd, \
        models, syncspec, tasks, zero
    from jaxdp.controller import GUARD_BATCHES
    from jaxdp.checkpoint import Checkpointer
    from jaxdp.mesh import axis_name, make_mesh, shard_batch
    from jaxdp.metrics import MetricsWriter, check_finite, peak_tflops, write_text_atomically
    from jaxdp.prefetch import Prefetcher
    from jaxdp.preemption import Preemption
    from jaxdp.optim import make_optimizer, make_outer_optimizer, make_schedule
    from jaxdp.state import init_state
    from jaxdp.step import make_eval_step, make_train_step

    # ---- distribution and mesh ---------------------------------------------------------------
    distributed.initialize(config)
    cache_dir = runtime.enable_compile_cache(config.compile_cache)  # a rerun loads its compiled steps
    cache = runtime.CacheHits()
    mesh = make_mesh(distributed.mesh_devices(config.devices))
    is_main = jax.process_index() == 0  # process 0 prints and writes logs; all take part in compute
    n_processes, process = jax.process_count(), jax.process_index()
    if config.batch_size % mesh.size:
        raise ConfigError(f"--batch-size={config.batch_size} must be divisible by the number of devices "
                          f"({mesh.size}); try {max(mesh.size, config.batch_size // mesh.size * mesh.size)}")

    # Multi-process: stalled peers and stragglers (jaxdp/heartbeat.py), watched from here to the end.
    beat = heartbeat.for_run(config.stall_timeout)

    # ---- input pipeline ----------------------------------------------------------------------
    # Every process checks its own input, then they agree: bad input or different data on any one
    # process stops every process with exit 2 naming it, before the first collective.
    dataset = agreement.load_dataset(lambda: data.load_dataset(config.dataset, seq_len=config.seq_len,
                                                               vocab_size=config.vocab_size), process, n_processes)
    if config.model == "cnn" and dataset.x_train.ndim != 4:
        raise ConfigError(f"--model=cnn needs image data of shape (N, H, W[, C]), got rows of shape "
                          f"{dataset.x_train.shape[1:]}; use --model=mlp")
    rows_per_step = config.batch_size * config.grad_accum  # --grad-accum K: K micro-batches per step

    def batch_at(step: int) -> Any:  # host numpy -> device; the only per-step host->device copy
        return shard_batch(dataset.train_batch(rows_per_step, step, config.seed, process, n_processes), mesh)
    # The loop below takes its batches from a Prefetcher: `--prefetch` batches ahead, made and put
    # on the devices by a background thread while the current step runs.

    # ---- model, loss and optimizer -----------------------------------------------------------
    tokens = dataset.kind == "tokens"
    model = models.build_model(config.model, config, dataset.vocab_size if tokens else dataset.num_classes,
                               axis_name(mesh))
    variables = jax.jit(model.init)(jax.random.PRNGKey(config.seed), dataset.example())
    params = variables.pop("params")
    model_state = dict(variables)  # e.g. {"batch_stats": ...}; {} for the MLP and GPT
    task = tasks.for_dataset(dataset.kind, model)
    schedule = make_schedule(config.schedule, config.lr, config.steps, config.warmup_steps, config.final_lr_fraction)
    tx = make_optimizer(config.optimizer, schedule, config.momentum, config.weight_decay, clip_norm=config.clip_norm)

    # ---- checkpoint (opened before the state: --sync-every auto resumes with the H it recorded) -
    # Every process restores the same checkpoint, and all save together (orbax saves collectively).
    checkpointer = None
    if config.checkpoint_dir:
        checkpointer = Checkpointer(config.checkpoint_dir, save_every=config.save_every, keep=config.keep,
                                    config=config)
    try:
        # ---- update step ---------------------------------------------------------------------
        # The sync choices as one value; "auto" ones are resolved by the controller (jaxdp/controller.py).
        outer_tx = make_outer_optimizer(config.outer_optimizer, config.outer_lr, config.outer_momentum)
        requested = syncspec.from_config(config, outer_tx)

        def new_state(spec: Any) -> Any:
            return init_state(params, tx, mesh, model_state=model_state, rng=config.seed,
                              shard_optimizer=spec.shard_optimizer, compression=spec.compression,
                              sync_every=spec.sync_every, outer_tx=spec.outer_tx, sync_fragments=spec.sync_fragments)

        steps_by_spec: dict[Any, Any] = {}

        def step_for(spec: Any) -> Any:  # one compiled step per choice (--compression auto switches)
            if spec not in steps_by_spec:
                steps_by_spec[spec] = make_train_step(
                    task.loss_fn, tx, mesh, spec.strategy, stateful=True, grad_accum=config.grad_accum, grad_norm=True,
                    shard_optimizer=spec.shard_optimizer, compression=spec.compression, sync_every=spec.sync_every,
                    outer_tx=spec.outer_tx, sync_fragments=spec.sync_fragments)
            return steps_by_spec[spec]

        sync_auto = config.sync_every == syncspec.AUTO
        begun = controller_lib.start(
            requested, mesh, params, make_state=new_state, make_step=step_for,
            batches=lambda k: [batch_at(i) for i in range(k)], target_fraction=config.comm_target,
            recorded=checkpointer.recorded_meta() if checkpointer and sync_auto else None)
        spec, controller, early = begun.spec, begun.controller, begun.records
        state = begun.state if begun.state is not None else new_state(begun.state_spec)
        train_step = step_for(spec)
        requested_config = config  # as given: config.toml says --sync-every auto, so a rerun resumes as this run did
        if sync_auto:
            config = config.replace(sync_every=spec.sync_every)
            if is_main:
                print(f"jaxdp: --sync-every auto: {spec.sync_every}: {dict(early)['local_steps']['why']}", file=sys.stderr)
            if checkpointer:  # checkpoints record the resolved H, and that auto chose it
                checkpointer.config = config
                checkpointer.extra_meta = {"sync_every_auto": bool(begun.sync_every_auto)}
        # Bytes each device sends per step with plain averaging (a bandwidth-optimal all-reduce).
        plain_comm = {"comm_bytes": compression.bytes_sent(compression.uncompressed_bytes(params), mesh.size),
                      "compression_ratio": 1.0}
        eval_step = make_eval_step(task.eval_fn, mesh)

        # ---- checkpoint: restore -------------------------------------------------------------
        if checkpointer:
            state = checkpointer.restore(state)  # the latest complete checkpoint, or `state` if none
            if int(state.step) > config.steps:
                raise ConfigError(f"--checkpoint-dir={config.checkpoint_dir!r} holds step {int(state.step)}, past "
                                  f"--steps={config.steps}; raise --steps to train further or use another --checkpoint-dir")
    except BaseException:
        beat.stop()
        if checkpointer:
            checkpointer.close()  # nothing was written: bad input leaves the directory as it was
        raise
    if checkpointer and is_main:  # the effective config, beside the checkpoints: `--config DIR/config.toml` reruns it
        write_text_atomically(os.path.join(checkpointer.directory, "config.toml"), config_toml(
            requested_config, comment=f"--sync-every auto chose {config.sync_every} (the checkpoints record it)" if sync_auto else None))

    def evaluate(state: Any) -> dict[str, float]:
        """Held-out metrics over the held-out split (at most --eval-batches global batches)."""
        rows = config.batch_size if tokens else mesh.size * max(1, 256 // mesh.size)
        totals: dict[str, float] = {}
        for batch in dataset.eval_batches(rows, process, n_processes, config.eval_batches or None):
            sums = jax.device_get(eval_step(state, shard_batch(batch, mesh)))  # host sync point
            totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
        return task.summarize(totals)

    start_step = int(jax.device_get(state.step))  # = the data position: batches are a function of the step

    # ---- training loop -----------------------------------------------------------------------
    device_kind = mesh.devices.flat[0].device_kind
    tokens_per_step = rows_per_step * config.seq_len if tokens else None
    peak = peak_tflops(device_kind, config.precision)
    writer = MetricsWriter(
        is_main=is_main, total_steps=config.steps, start_step=start_step, metrics_file=config.metrics_file,
        log_dir=config.log_dir, progress=config.progress, examples_per_step=rows_per_step,
        tokens_per_step=tokens_per_step,
        flops_per_step=model.flops_per_token(params) * tokens_per_step if tokens else None,
        peak_flops=peak * 1e12 * mesh.size if peak else None)
    startup_s = time.perf_counter() - STARTED
    writer.event("start", start_step, resumed_from=start_step or None, config=config.to_dict(), processes=n_processes,
                 devices=mesh.size, device_kind=device_kind, jax=jax.__version__, compile_cache=cache_dir,
                 malloc_env=os.environ.get("JAXDP_MALLOC_ENV"), startup_s=startup_s,
                 param_bytes_per_device=zero.bytes_per_device(state.params),
                 optimizer_bytes_per_device=zero.bytes_per_device((state.opt_state, local_sgd.optimizer_states(state))),
                 **({"sync_every_auto": True} if sync_auto else {}))
    for name, record in early:  # --sync-every auto's decisions, taken before the loop
        writer.event(name, start_step, **record)
    if start_step and is_main:
        print(f"jaxdp: resumed from step {start_step} ({checkpointer.directory})", file=sys.stderr)
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
    batches = Prefetcher(batch_at, start_step, config.steps, depth=config.prefetch)
    try:
        for step, batch in batches:
            first = step == start_step and not begun.decided  # --sync-every auto decided compression already
            if controller and (first or (step > start_step and config.compression_every
                                         and step % config.compression_every == 0)):
                checked()
                decision = controller.decide(state, [batch] + [batch_at(step + k) for k in range(1, GUARD_BATCHES)], step)
                writer.event("compression", step, **decision.record)
                writer.restart_clock()  # its measurements are neither training nor compilation
                decided_s += sum(decision.record["cost_s"].values())
                if is_main:  # one line per decision
                    cost = decision.record["cost_s"]
                    print(f"jaxdp: --compression auto at step {step}: {decision.record['why']} (measuring "
                          f"{cost['measure']:.1f}s, quality guard {cost['quality']:.1f}s)", file=sys.stderr)
                    if decision.record["propose_local_steps"] and config.sync_every == 1:
                        print(f"jaxdp: --compression auto: {decision.record['propose_local_steps']['why']}", file=sys.stderr)
                spec = spec.replace(compression=decision.compressor)
                train_step = step_for(spec)
            dispatch = time.perf_counter()
            state, metrics = train_step(state, batch)
            done = step + 1
            beat.dispatched(done, metrics["loss"], waited_s=time.perf_counter() - dispatch)
            pending.append((done, metrics))
            if len(pending) >= MAX_PENDING_STEPS:  # a large --log-every: memory stays bounded, the check exact
                checked()
            if step == start_step:  # the first step compiles: time it apart, then start the clock
                jax.block_until_ready(metrics)  # host sync point (once)
                writer.first_step_done(done)  # the progress bar starts at `done`: this step is counted
            else:
                writer.step()
            if done % config.log_every == 0 or done == config.steps:
                latest = checked()
                history.append(writer.log(done, latest, {"lr": float(schedule(done - 1)), **beat.stragglers(),
                                                         **({} if "comm_bytes" in latest else plain_comm)}))
            if config.eval_every and done % config.eval_every == 0 and done < config.steps:
                checked()
                beat.phase(f"the evaluation after step {done}")
                evaluated = time.perf_counter()
                writer.eval(done, {**evaluate(state), "eval_s": time.perf_counter() - evaluated})
            if checkpointer:
                checkpointer.poll()  # a background save that failed stops the run here (exit 73)
            if checkpointer and checkpointer.should_save(done):
                checked()  # never write a non-finite state over a good checkpoint
                checkpointer.save(state)
            # Multi-process: a tiny all-reduce, so every process stops after the same step.
            if preemption and done < config.steps and preemption.should_stop(state):
                checked()
                checkpointer.save(state)  # no-op if this step was just saved
                preempted = True
                break
        if not preempted:
            # ---- evaluation ----------------------------------------------------------------------
            checked()
            beat.phase("the final save and evaluation")
            if checkpointer:  # the final state, before evaluating: bad held-out input loses no training
                checkpointer.save(state)  # (a no-op if the last step was just saved)
            summary = {**evaluate(state), "strategy": config.strategy, "devices": mesh.size, "processes": n_processes,
                       "startup_s": startup_s, "compile_s": writer.compile_s, "compile_cache_hits": cache.hits}
            summary = writer.done(config.steps, summary)
    except Diverged as err:  # nothing non-finite was saved: the check runs before every save
        writer.event("diverged", err.step, metric=err.name, value=err.value)
        err.last_checkpoint = checkpointer.latest_step() if checkpointer else None
        err.restored_unverified = checkpointer.restored_unverified if checkpointer else None
        raise
    finally:
        batches.close()
        cache.close()
        beat.stop()
        writer.close()
        if checkpointer:
            checkpointer.close()  # waits for the last save to be written
        if preemption and not preempted:
            preemption.close()
        # A preempted process keeps its flag-only handlers until it exits, so a second SIGTERM (srun
        # --kill-on-bad-exit stopping the other tasks, a scheduler's grace-period kill) cannot cut
        # its shutdown short and turn exit code 75 into 143.
    if preempted:
        if is_main:  # only now: the checkpoint is on disk
            print(f"jaxdp: preempted ({preemption.reason}): saved step {done} to {checkpointer.directory}, "
                  f"exit code {EXIT_PREEMPTED}; run the same command to resume", file=sys.stderr)
        return Result(state=state, history=history, summary={"event": "preempted", "step": done}, preempted=True)
    if is_main:
        held_out = " ".join(f"{k}={v:.4f}" for k, v in summary.items() if k.startswith("eval_"))
        print(f"{held_out} steps={config.steps} strategy={config.strategy} devices={mesh.size} "
              f"time={time.perf_counter() - STARTED:.1f}s (start-up {startup_s:.1f}s, "
              f"first step with compilation {writer.compile_s or 0:.1f}s"
              + (f", --compression/--sync-every auto {decided_s:.1f}s" if decided_s else "") + ")")
    return Result(state=state, history=history, summary=summary)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxdp.train ARGS`, returning the exit code (jaxdp/errors.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s",
                        force=True)  # importing orbax already gave the root logger a handler
    try:
        result = train(parse_args(argv))
        return EXIT_PREEMPTED if result.preempted else EXIT_OK
    except InputError as err:
        if debug:
            traceback.print_exc()
        print(f"jaxdp: error: {cli_message(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Diverged as err:
        last, unverified = getattr(err, "last_checkpoint", None), getattr(err, "restored_unverified", None)
        kept = f"; the last checkpoint (step {last}) is intact" if last and last != unverified else ""
        if unverified:  # a damaged checkpoint that restored is a likelier cause than the learning rate
            kept += (f"; this run resumed from checkpoint step {unverified}, which has no checksum record, so it could "
                     f"not be verified: if it is damaged, that is the likely cause")
        print(f"jaxdp: error: training diverged: {err.name} became {err.value} at step {err.step}; lower --lr or "
              f"set --clip-norm{kept} (exit code {EXIT_DIVERGED})", file=sys.stderr)
        return EXIT_DIVERGED
    except CheckpointWriteError as err:
        if debug:
            traceback.print_exc()
        print(f"jaxdp: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_SAVE
    except KeyboardInterrupt:
        print("jaxdp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # anything else is a bug or an environment problem: say so in one line
        from jaxdp.peer_watch import wait_for_verdict

        wait_for_verdict()  # a lost peer is reported as such (exit 69), not as its echo here
        if debug:
            traceback.print_exc()
        else:
            print(f"jaxdp: error: {type(err).__name__}: {err} (rerun with --debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR


def cli_message(err: InputError) -> str:
    """A library's InputError in flag terms: prefixed with the flag that fed its argument, and a
    config setting it names spelled as its flag."""
    if isinstance(err, ConfigError):
        return str(err)
    message = str(err)
    if err.setting:
        flag = "--" + err.setting.replace("_", "-")
        message = re.sub(rf"\b(?<!-){re.escape(err.setting)}\b", flag, message)
    flag = FLAG_OF_ARGUMENT.get(err.argument or "")
    return f"{flag}: {message}" if flag else message


def cli() -> None:
    """The `jaxdp-train` script and `python -m jaxdp.train`: tune malloc first, then run."""
    from jaxdp import malloc_env

    malloc_env.reexec_if_needed()  # before JAX is imported: see jaxdp/malloc_env.py
    sys.exit(main())


if __name__ == "__main__":
    cli()
