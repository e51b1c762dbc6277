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
import sys
import time
import traceback
from typing import Any, Sequence

from jaxdp.config import Config, ConfigError, parse_args
from jaxdp.errors import (EXIT_BAD_INPUT, EXIT_CANNOT_SAVE, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED,
                          CheckpointWriteError, InputError)

# Which flag fed each library argument that an InputError may name.
FLAG_OF_ARGUMENT = {"directory": "--checkpoint-dir", "dataset": "--dataset", "devices": "--devices"}


@dataclasses.dataclass
class Result:
    state: Any                 # the final TrainState (replicated jax.Arrays)
    history: list[dict]        # every logged record, as written to --metrics-file
    summary: dict[str, Any]    # the final "done" record: eval_loss, eval_accuracy, ...
    preempted: bool = False    # stopped early by a preemption signal; the checkpoint holds `state`


def train(config: Config) -> Result:
    # JAX is imported here, after the flags are parsed, because distributed.initialize must run
    # before JAX starts its backend.
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdp import data, distributed, heartbeat, models
    from jaxdp.checkpoint import Checkpointer
    from jaxdp.mesh import axis_name, make_mesh, shard_batch
    from jaxdp.metrics import MetricsWriter
    from jaxdp.preemption import Preemption
    from jaxdp.state import init_state, make_optimizer
    from jaxdp.step import make_eval_step, make_train_step

    # ---- distribution and mesh ---------------------------------------------------------------
    distributed.initialize(config)
    mesh = make_mesh(distributed.mesh_devices(config.devices))
    is_main = jax.process_index() == 0  # process 0 prints and writes logs; all take part in compute
    n_processes, process = jax.process_count(), jax.process_index()
    if config.batch_size % mesh.size:
        raise ConfigError(f"--batch-size={config.batch_size} must be divisible by the number of devices "
                          f"({mesh.size}); try {max(mesh.size, config.batch_size // mesh.size * mesh.size)}")

    # ---- input pipeline ----------------------------------------------------------------------
    dataset = data.load_dataset(config.dataset)
    if config.model == "cnn" and dataset.x_train.ndim != 4:
        raise ConfigError(f"--model=cnn needs image data of shape (N, H, W[, C]), got rows of shape "
                          f"{dataset.x_train.shape[1:]}; use --model=mlp")

    def batch_at(step: int) -> Any:  # host numpy -> device; the only per-step host->device copy
        local = data.local_batch(dataset.x_train, dataset.y_train, config.batch_size, step, config.seed,
                                 process, n_processes)
        return shard_batch(local, mesh)

    # ---- model and optimizer -----------------------------------------------------------------
    model = models.build_model(config.model, dataset.num_classes, axis_name=axis_name(mesh))
    variables = model.init(jax.random.PRNGKey(config.seed), dataset.x_train[:1])
    params = variables.pop("params")
    model_state = dict(variables)  # e.g. {"batch_stats": ...}; {} for the MLP
    tx = make_optimizer(config.optimizer, config.lr, config.momentum, config.weight_decay)

    def loss_fn(params, model_state, batch, rng):
        logits, new_model_state = model.apply({"params": params, **model_state}, batch["x"], train=True,
                                              rngs={"dropout": rng}, mutable=list(model_state))
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss, {"accuracy": accuracy}, new_model_state

    def eval_fn(params, model_state, batch):  # per-device sums, psum'd by make_eval_step
        logits = model.apply({"params": params, **model_state}, batch["x"], train=False)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = jnp.argmax(logits, -1) == batch["y"]
        return {"loss": jnp.sum(losses * batch["mask"]), "correct": jnp.sum(correct * batch["mask"]),
                "count": jnp.sum(batch["mask"])}

    # ---- update step -------------------------------------------------------------------------
    state = init_state(params, tx, mesh, model_state=model_state, rng=config.seed)
    train_step = make_train_step(loss_fn, tx, mesh, config.strategy, stateful=True)
    eval_step = make_eval_step(eval_fn, mesh)

    # ---- checkpoint --------------------------------------------------------------------------
    # Every process restores the same checkpoint, and all save together (orbax saves collectively).
    checkpointer = None
    if config.checkpoint_dir:
        checkpointer = Checkpointer(config.checkpoint_dir, save_every=config.save_every, keep=config.keep,
                                    config=config)
        try:
            state = checkpointer.restore(state)  # the latest complete checkpoint, or `state` if none
            if int(state.step) > config.steps:
                raise ConfigError(f"--checkpoint-dir={config.checkpoint_dir!r} holds step {int(state.step)}, past "
                                  f"--steps={config.steps}; raise --steps to train further or use another --checkpoint-dir")
        except InputError:
            checkpointer.close()  # nothing was written: bad input leaves the directory as it was
            raise
    start_step = int(jax.device_get(state.step))  # = the data position: batches are a function of the step

    # ---- training loop -----------------------------------------------------------------------
    writer = MetricsWriter(is_main=is_main, total_steps=config.steps, start_step=start_step,
                           metrics_file=config.metrics_file, log_dir=config.log_dir, progress=config.progress)
    history, preempted = [], False
    preemption = Preemption() if checkpointer else None  # from here on SIGTERM / SIGUSR1: save and stop
    # Multi-process: stalled peers and stragglers (jaxdp/heartbeat.py); threads, no host sync here.
    beat = heartbeat.for_run(config.stall_timeout)
    try:
        for step in range(start_step, config.steps):
            batch = batch_at(step)
            dispatch = time.perf_counter()
            state, metrics = train_step(state, batch)
            done = step + 1
            beat.dispatched(done, metrics["loss"], waited_s=time.perf_counter() - dispatch)
            writer.step()
            if done % config.log_every == 0 or done == config.steps:
                history.append(writer.log(done, jax.device_get(metrics), config.batch_size,  # host sync point
                                          extra=beat.stragglers()))
            if checkpointer:
                checkpointer.poll()  # a background save that failed stops the run here (exit 73)
            if checkpointer and checkpointer.should_save(done):
                checkpointer.save(state)
            # Multi-process: a tiny all-reduce, so every process stops after the same step.
            if preemption and done < config.steps and preemption.should_stop(state):
                checkpointer.save(state)  # no-op if this step was just saved
                preempted = True
                break
        beat.stop()
        if not preempted:
            # ---- evaluation ----------------------------------------------------------------------
            eval_batch = mesh.size * max(1, 256 // mesh.size)
            totals = {"loss": 0.0, "correct": 0.0, "count": 0.0}
            for batch in data.eval_batches(dataset.x_test, dataset.y_test, eval_batch, process, n_processes):
                sums = jax.device_get(eval_step(state, shard_batch(batch, mesh)))
                totals = {k: totals[k] + float(sums[k]) for k in totals}
            summary = {"eval_loss": totals["loss"] / totals["count"], "eval_accuracy": totals["correct"] / totals["count"],
                       "strategy": config.strategy, "devices": mesh.size, "processes": n_processes}
            if checkpointer:
                checkpointer.save(state)  # the final state (a no-op if the last step was just saved)
            summary = writer.done(config.steps, summary)
    finally:
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
        print(f"eval_accuracy={summary['eval_accuracy']:.4f} eval_loss={summary['eval_loss']:.4f} "
              f"steps={config.steps} strategy={config.strategy} devices={mesh.size} "
              f"time={summary['elapsed_s']:.1f}s")
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
    """A library's InputError in flag terms: prefixed with the flag that fed its argument."""
    flag = FLAG_OF_ARGUMENT.get(err.argument or "")
    return f"{flag}: {err}" if flag and not isinstance(err, ConfigError) else str(err)


def cli() -> None:
    """The `jaxdp-train` script and `python -m jaxdp.train`: tune malloc first, then run."""
    from jaxdp import malloc_env

    malloc_env.reexec_if_needed()  # before JAX is imported: see jaxdp/malloc_env.py
    sys.exit(main())


if __name__ == "__main__":
    cli()
