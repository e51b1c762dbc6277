"""Train a built-in model, or your own (`--model MODULE:ATTR`), data-parallel over every device of every process.

    python -m jaxdp.train                                  # MLP on digits, 8 simulated CPU devices
    python -m jaxdp.train --strategy=ring --steps 500 --metrics-file run.jsonl
    python -m jaxdp.train --model cnn --dataset my_data.npz --batch-size 256
    python -m jaxdp.train --model my_models:Classifier --dataset my_data.npz   # jaxdp/models/usermodel.py
    python -m jaxdp.train --help                           # the common flags, then the others' names
    python -m jaxdp.train --help-all                       # every flag, grouped, with defaults

Exit codes (jaxdp/errors.py): 0 success, 1 an unexpected error, 2 bad input (one line on stderr;
--debug for the traceback), 69 a peer process died, never arrived or stalled, 73 a checkpoint could
not be written (disk full), 75 preempted (with
--checkpoint-dir, SIGTERM or SIGUSR1 make every process finish its step, save and stop; rerun the
same command to resume), 130 interrupted.

The file reads top to bottom in data-flow order: distribution, mesh, data, model and optimizer;
then `jaxdp.fit` (jaxdp/loop/trainer.py) runs the update step, checkpoints, the loop and evaluation.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import traceback
import warnings
from typing import Any, Sequence

STARTED = time.perf_counter()  # this module loads first (before JAX): the run's start-up starts here

from jaxdp.config import Config, ConfigError, parse_args  # noqa: E402
from jaxdp.errors import (EXIT_CANNOT_SAVE, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED,  # noqa: E402
                          CheckpointWriteError, InputError, run_tool)
from jaxdp.loop.trainer import MAX_PENDING_STEPS, Result  # noqa: E402,F401  (their home is jaxdp.loop.trainer; older code imports them here)
from jaxdp.metrics import Diverged  # noqa: E402

# Which flag fed each library argument that an InputError may name.
FLAG_OF_ARGUMENT = {"tokenizer": "--tokenizer", "directory": "--checkpoint-dir", "dataset": "--dataset", "devices": "--devices",
                    "vocab_size": "--vocab-size", "strategy": "--strategy", "tx": "--optimizer",
                    "init_from": "--init-from"}


def _mesh_and_strategy(config: Config, devices: list) -> tuple[Any, Any]:
    """The mesh and the strategy for `--hierarchy`: with several processes of several devices each
    and an in-graph strategy, `auto` makes the mesh ("hosts", "local") and the strategy
    hierarchical (jaxdp.sync.hierarchy.hierarchical), and says so in one line; otherwise one flat axis.
    `--shard-params` in several processes always takes the ("hosts", "local") mesh: cut over "local",
    the strategy, codec and local steps across "hosts" (jaxdp/step/fsdp.py, jaxdp/step/hsdp.py)."""
    import jax

    from jaxdp.mesh import make_mesh
    from jaxdp.sync.hierarchy import hierarchical
    from jaxdp.sync.rules import abilities as abilities_of

    processes = len({d.process_index for d in devices})
    local = len(devices) // processes
    if config.shard_params and processes > 1:  # cut inside each process, data-parallel across (jaxdp/step/fsdp.py)
        if jax.process_index() == 0:
            local_steps = config.sync_every != 1
            what = "pseudo-gradients averaged every " + str(config.sync_every) + " steps" if local_steps else "gradients"
            if local_steps and config.overlap:
                what += ", each round's average while the next round trains (jaxdp/step/overlap.py, `Cut`)"
            how = ("XLA's all-reduce" if config.strategy == "psum" and config.compression == "none" and not local_steps
                   else f"--strategy {config.strategy}" + ("" if config.compression == "none" else
                                                            f" with --compression {config.compression}"))
            print(f"jaxdp: --shard-params: {processes} processes x {local} devices: parameters, gradients and optimizer "
                  f"state cut over each process's {local} devices, a whole copy per process, {what} across processes "
                  f"through {how} (jaxdp/step/hsdp.py)", flush=True)
        return make_mesh(devices, axis_name=("hosts", "local")), config.strategy
    abilities = abilities_of(config.strategy)
    flat = config.hierarchy == "flat" or config.sync_seconds or config.overlap  # rounds: one axis (jaxdp/step/rounds.py)
    if flat or processes == 1 or local == 1 or "sum" not in abilities or "host" in abilities:
        with warnings.catch_warnings():  # one CPU device here is --devices 1, asked for (the default simulates 8);
            warnings.filterwarnings("ignore", "jaxdp.make_mesh: JAX sees one CPU device")  # the hint is a notebook's
            return make_mesh(devices), config.strategy
    if jax.process_index() == 0:
        print(f"jaxdp: --hierarchy auto: {processes} processes x {local} devices: each process sums its devices' "
              f"gradients exactly first, then --strategy {config.strategy} runs across processes on 1/{local} of "
              f"the buffer per device (--hierarchy flat: one all-reduce over all {len(devices)})", flush=True)
    return make_mesh(devices, axis_name=("hosts", "local")), hierarchical(config.strategy)


def train(config: Config) -> Any:
    """Run `config`: build its model, data and optimizer, then `jaxdp.fit` them. Returns fit's Result."""
    # JAX is imported here, after the flags are parsed, because distributed.initialize must run
    # before JAX starts its backend; the sync choices are checked before it (jaxdp/sync/rules.py).
    from jaxdp.sync import rules

    rules.check_config(config)
    from jaxdp.models.usermodel import is_user_model

    if is_user_model(config.model) and config.model_path is None:  # recorded: found again from anywhere
        config = config.replace(model_path=os.getcwd())
    from jaxdp.cluster import runtime

    runtime.add_gpu_xla_flags()  # before JAX starts its backend; CPUs ignore them
    import jax

    from jaxdp import elastic
    from jaxdp.checkpoint.resume import DATA_DIGEST
    from jaxdp.cluster import agreement, distributed, heartbeat
    from jaxdp.data import datasets as data
    from jaxdp.loop.options import CheckpointOptions, EvalOptions, LogOptions, RunOptions, SyncOptions
    from jaxdp.loop.trainer import fit
    from jaxdp.mesh import axis_name
    from jaxdp.models import fp8, usermodel
    from jaxdp.step.optim import make_optimizer, make_outer_optimizer, make_schedule

    # ---- distribution and mesh ---------------------------------------------------------------
    with runtime.two_cpu_workers(config.overlap):  # the backend starts in here (--overlap: see there)
        distributed.initialize(config)
        cache_dir = runtime.enable_compile_cache(config.compile_cache)  # a rerun loads its compiled steps
        # started by `jaxdp.launch --elastic` (the hub, or torchft, whose workers compare their flags' prints)
        member = elastic.from_env(flags=agreement.prints(config))
        if member:  # the hub leaves out a member that sends nothing this long after another's part
            member.stall_timeout = config.stall_timeout
        with warnings.catch_warnings():
            if member:  # one device here is one of several in the run
                warnings.filterwarnings("ignore", message="jaxdp.make_mesh: JAX sees one CPU device")
            mesh, strategy = _mesh_and_strategy(config, distributed.mesh_devices(config.devices))
    if config.precision == "fp8" and (why := fp8.unsupported(mesh.devices.flat[0], config.model)):
        raise ConfigError(why)
    n_processes, process = jax.process_count(), jax.process_index()
    devices = mesh.size * (member.size if member else 1)
    if config.batch_size % devices:
        raise ConfigError(f"--batch-size={config.batch_size} must be divisible by the number of devices "
                          f"({devices}); try {max(devices, config.batch_size // devices * devices)}")

    # Multi-process: stalled peers and stragglers (jaxdp/cluster/heartbeat.py), watched from here to the end.
    beat = heartbeat.for_run(config.stall_timeout)
    try:
        # ---- input pipeline --------------------------------------------------------------------
        # Every process checks its own input, then they agree: bad input or different data on any
        # one process stops every process with exit 2 naming it, before the first collective.
        dataset = agreement.load_dataset(lambda: data.load_dataset(config.dataset, seq_len=config.seq_len,
                                                                   vocab_size=config.vocab_size, tokenizer=config.tokenizer,
                                                                   text_column=config.text_column),
                                       process, n_processes)
        if config.model == "cnn" and dataset.x_train.ndim != 4:
            raise ConfigError(f"--model=cnn needs image data of shape (N, H, W[, C]), got rows of shape "
                              f"{dataset.x_train.shape[1:]}; use --model=mlp")
        rows_per_step = config.batch_size * config.grad_accum  # --grad-accum K: K micro-batches per step

        # ---- model, loss and optimizer ---------------------------------------------------------
        config = _with_recorded_defaults(config, process)  # a checkpoint of an older jaxdp resumes as it was made
        tokens = dataset.kind == "tokens"
        num_outputs = dataset.vocab_size if tokens else dataset.num_classes
        model = usermodel.build(config, num_outputs, axis_name(mesh), dataset.kind)
        if config.init_from:  # a Hugging Face GPT-2's weights (the registry's gpt builder read its architecture)
            from jaxdp.models import hf

            variables = {"params": hf.init_params(config.init_from)}
        else:
            variables = jax.jit(model.init)(usermodel.init_rngs(config.seed), dataset.example())
        if usermodel.is_user_model(config.model):  # the wrong output shape is one line, not a traceback
            usermodel.check_output(model, variables, dataset.example(), dataset.kind, num_outputs, config.model)
        variables = dict(variables)
        params = variables.pop("params")
        model_state = variables  # e.g. {"batch_stats": ...}; {} for the MLP and GPT
        task = _task(dataset.kind, model, config)
        horizon, horizon_note = schedule_horizon(config)
        if config.schedule == "warmup-cosine" and config.warmup_steps >= horizon:  # a resumed run's recorded horizon
            raise ConfigError(f"--warmup-steps={config.warmup_steps} must be smaller than the schedule's horizon, "
                              f"{horizon} steps (recorded by the checkpoint); give --schedule-steps")
        schedule = make_schedule(config.schedule, config.lr, horizon, config.warmup_steps, config.final_lr_fraction)
        muon_lr = make_schedule(config.schedule, config.muon_lr, horizon, config.warmup_steps,
                                config.final_lr_fraction) if config.optimizer == "muon" and config.muon_lr else None
        tx = make_optimizer(config.optimizer, schedule, config.momentum, config.weight_decay, clip_norm=config.clip_norm,
                            decay_matrices_only=config.weight_decay_on == "matrices" and not config.shard_optimizer,
                            muon_lr=muon_lr, muon_on=config.muon_on)
        if config.optimizer == "adamw" and config.weight_decay_on == "matrices" and config.shard_optimizer \
                and jax.process_index() == 0:
            print("jaxdp: --shard-optimizer: adamw decays every parameter (ZeRO-1's flat buffers cannot tell matrices "
                  "from biases)", file=sys.stderr)
        outer_tx = make_outer_optimizer(config.outer_optimizer, config.outer_lr, config.outer_momentum)
        # --byte-budget with the outer flags at their defaults: the budget's own outer step
        # (jaxdp/sync/budget.py, outer_lr), since top-k pseudo-gradients cannot follow momentum
        if config.byte_budget is not None and outer_defaults(config):
            outer_tx = None
    except BaseException:
        beat.stop()
        raise

    def batch_at(step: int) -> Any:  # this process's rows of global batch `step`, a pure function of it
        return dataset.train_batch(rows_per_step, step, config.seed, process, n_processes)

    def shard_at(step: int, shard: int) -> Any:  # elastic: any shard's rows (a lost process's too)
        return dataset.train_batch(rows_per_step, step, config.seed, shard, member.size)

    eval_rows = config.batch_size if tokens else mesh.size * max(1, 256 // mesh.size)
    held_out_size = dataset.held_out_windows if tokens else len(dataset.x_test)
    evaluated = min(held_out_size, config.eval_batches * eval_rows) if config.eval_batches else held_out_size

    def held_out() -> Any:  # at most --eval-batches global batches; padding rows carry mask 0
        return dataset.eval_batches(eval_rows, process, n_processes, config.eval_batches or None)  # (elastic: rank 0, all)

    tokens_per_step = rows_per_step * config.seq_len if tokens else None
    flops = getattr(model, "flops_per_token", None)
    result = fit(
        task.loss_fn, params, tx, shard_at if member else batch_at, steps=config.steps, mesh=mesh, stateful=True,
        model_state=model_state, seed=config.seed,
        sync=SyncOptions(strategy=strategy, compression=config.compression, sync_every=config.sync_every,
                         outer_tx=None if config.sync_every == 1 and not config.sync_seconds else outer_tx,
                         sync_fragments=config.sync_fragments, sync_seconds=config.sync_seconds or None,
                         overlap=config.overlap, shard_optimizer=config.shard_optimizer, shard_params=config.shard_params,
                         metrics_at_sync=config.metrics_at_sync, grad_accum=config.grad_accum,
                         comm_target=config.comm_target, compression_every=config.compression_every,
                         byte_budget=config.byte_budget),
        evaluation=EvalOptions(fn=task.eval_fn, data=held_out, summarize=task.summarize, every=config.eval_every),
        checkpoint=CheckpointOptions(directory=config.checkpoint_dir, save_every=config.save_every, keep=config.keep,
                                     meta={"num_outputs": num_outputs, "schedule_steps": horizon,
                                           DATA_DIGEST: dataset.fingerprint()}),  # a resume checks it
        logging=LogOptions(every=config.log_every, metrics_file=config.metrics_file, log_dir=config.log_dir,
                           wandb_project=config.wandb_project, progress=config.progress, schedule=schedule),
        run=RunOptions(config=config, resume_note=horizon_note, run_info={"compile_cache": cache_dir}, watch=beat,
                       elastic=member, prefetch=config.prefetch, examples_per_step=rows_per_step,
                       tokens_per_step=tokens_per_step, started=STARTED, exits_after=True,
                       flops_per_step=flops(params) * tokens_per_step if tokens and flops else None))
    if (member.lead if member else jax.process_index() == 0) and not result.preempted:
        summary, timings = result.summary, result.timings
        held = " ".join(f"{k}={v:.4f}" for k, v in summary.items() if k.startswith("eval_"))
        decided = timings.get("decided_s")
        what = "windows" if tokens else "examples"
        part = (f"all {held_out_size} {what}" if evaluated == held_out_size else f"{evaluated} of {held_out_size} "
                f"{what}, {100 * evaluated / held_out_size:.1f} %; --eval-batches 0: all")
        print(f"{held} (held-out: {part}) steps={config.steps} strategy={config.strategy} devices={devices} "
              + closing_time(time.perf_counter() - STARTED, timings["startup_s"], timings["compile_s"], decided))
    return result


def closing_time(total_s: float, startup_s: float, first_step_s: float, decided_s: float | None = None) -> str:
    """The closing line's `time=T s (start-up S s, first step with compilation F s)`, in tenths of a
    second as printed, with S + F <= T: consecutive parts. Start-up runs from the process's start to
    the loop's; the first step's clock starts when the metrics writer opens, a moment before start-up
    ends (longer where that compiles, as --shard-params's memory report does), so the first step is
    counted from start-up's end: at most what the total leaves after start-up. The auto controllers'
    measuring (`decided_s`) lies inside those parts (before the loop, inside start-up) or after them,
    so it is said as a share of the total, not added as a third part."""
    total = round(total_s * 10)
    startup = min(round(startup_s * 10), total)
    first = min(round(first_step_s * 10), total - startup)
    text = f"time={total / 10:.1f}s (start-up {startup / 10:.1f}s, first step with compilation {first / 10:.1f}s"
    if decided_s:
        text += f"; of the {total / 10:.1f}s, --compression/--sync-every auto measuring {min(decided_s, total_s):.1f}s"
    return text + ")"


def _task(kind: str, model: Any, config: Config) -> Any:
    """The loss and held-out metrics for the dataset's kind (jaxdp/models/tasks.py)."""
    from jaxdp.models import tasks, usermodel

    if not usermodel.is_user_model(config.model):
        return tasks.for_dataset(kind, model)
    return tasks.for_dataset(kind, model, takes_train=usermodel.takes_train(model))


def schedule_horizon(config: Config) -> tuple[int, str]:
    """(steps the learning-rate schedule spans, what the resume line says of it).

    --schedule-steps when given; otherwise the horizon the run started with, which its checkpoints
    record, so that raising --steps on resume trains further at the schedule's final rate instead of
    re-stretching the schedule under the steps already taken; a new run: --steps."""
    if config.schedule_steps:
        return config.schedule_steps, f"; the lr schedule spans --schedule-steps={config.schedule_steps} steps"
    recorded = _recorded_horizon(config.checkpoint_dir) if config.checkpoint_dir else None
    if recorded is None:
        return config.steps, ""
    if config.schedule == "constant" or recorded == config.steps:
        return recorded, ""
    return recorded, (f"; the lr schedule keeps the {recorded} steps it started with (--steps is now {config.steps}; "
                      f"--schedule-steps N changes it)")


def _with_recorded_defaults(config: Config, process: int) -> Config:
    """`config`, with the values an older jaxdp had for the fields the checkpoint to resume does not
    record (jaxdp.checkpoint.resume.with_recorded_defaults), said in one line on process 0."""
    from jaxdp.checkpoint import artifacts, resume

    if not config.checkpoint_dir:
        return config
    try:
        recorded = artifacts.read_meta(config.checkpoint_dir).get("config")
    except (InputError, OSError, ValueError):
        return config  # no checkpoint (or none readable: the Checkpointer says so, and starts afresh)
    config, said = resume.with_recorded_defaults(config, recorded)
    if said and process == 0:
        print(f"jaxdp: {config.checkpoint_dir} holds a checkpoint of an older jaxdp, made with what is now "
              f"{', '.join(said)}: resuming it so", file=sys.stderr, flush=True)
    return config


def _recorded_horizon(checkpoint_dir: str) -> int | None:
    """The schedule horizon the latest checkpoint in `checkpoint_dir` records (None: no checkpoint)."""
    from jaxdp.checkpoint import artifacts

    try:
        meta = artifacts.read_meta(checkpoint_dir)
    except InputError:
        return None  # no checkpoint (or none readable: the Checkpointer says so, and starts afresh)
    horizon = meta.get("schedule_steps") or (meta.get("config") or {}).get("steps")
    return horizon if isinstance(horizon, int) and horizon > 0 else None


def outer_defaults(config: Config) -> bool:
    """Whether the run's outer optimizer flags are all at their defaults (DiLoCo's Nesterov)."""
    import dataclasses

    default = {f.name: f.default for f in dataclasses.fields(Config)}
    return all(getattr(config, name) == default[name] for name in ("outer_optimizer", "outer_lr", "outer_momentum"))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxdp.train ARGS`, returning the exit code (jaxdp/errors.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s",
                        force=True)  # importing orbax already gave the root logger a handler

    def body() -> int:
        try:
            result = train(parse_args(argv))
            if result.preempted:  # (a first Ctrl-C saves as SIGTERM does, and exits as Ctrl-C does)
                return EXIT_INTERRUPTED if result.summary.get("signal") == "SIGINT" else EXIT_PREEMPTED
            return EXIT_OK
        except Diverged as err:
            last, unverified = getattr(err, "last_checkpoint", None), getattr(err, "restored_unverified", None)
            kept = f"; the last checkpoint (step {last}) is intact" if last and last != unverified else ""
            if unverified:  # a damaged checkpoint that restored is a likelier cause than the learning rate
                kept += (f"; this run resumed from checkpoint step {unverified}, which has no checksum record, so it "
                         f"could not be verified: if it is damaged, that is the likely cause")
            print(f"jaxdp: error: training diverged: {err.name} became {err.value} at step {err.step}; lower --lr or "
                  f"set --clip-norm{kept} (exit code {EXIT_DIVERGED})", file=sys.stderr)
            return EXIT_DIVERGED
        except CheckpointWriteError as err:
            if debug:
                traceback.print_exc()
            print(f"jaxdp: error: {err}", file=sys.stderr)
            return EXIT_CANNOT_SAVE

    def lost_peer_first() -> None:  # a lost peer is reported as such (exit 69), not as its echo here
        from jaxdp.cluster.peer_watch import wait_for_verdict

        wait_for_verdict()

    return run_tool(body, debug=debug, describe=cli_message, before_unexpected=lost_peer_first,
                    memory_advice=MEMORY_ADVICE)


MEMORY_ADVICE = ("; lower --batch-size (--grad-accum N keeps the examples per step), shard the model over a worker's "
                 "devices with --shard-params (or the optimizer state with --shard-optimizer), or train in --precision bf16")


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
    from jaxdp.cluster import malloc_env

    malloc_env.reexec_if_needed()  # before JAX is imported: see jaxdp/cluster/malloc_env.py
    sys.exit(main())


if __name__ == "__main__":
    cli()
