"""`fit`'s keyword arguments, grouped by what they describe: one small frozen dataclass per part.

    jaxdp.fit(loss_fn, params, tx, data, steps=1000,
              sync=jaxdp.SyncOptions(strategy="ring", compression="int8"),
              evaluation=jaxdp.EvalOptions(fn=eval_fn, data=held_out, every=200),
              checkpoint=jaxdp.CheckpointOptions(directory="/tmp/run", save_every=100),
              logging=jaxdp.LogOptions(metrics_file="run.jsonl", every=10))

The flat keywords of before (`fit(..., strategy="ring", checkpoint_dir="/tmp/run")`) still work for
one release, with a DeprecationWarning that names the new spelling (`FLAT`: each old name's group
and field).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

from jaxdp.moved import REMOVED_IN


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """How the gradient is averaged: `make_train_step`'s choices, and the rounds of jaxdp/step/rounds.py."""

    strategy: Any = "psum"              # psum, ring, host, hierarchical, or a Collective
    compression: Any = "none"           # none, bf16, int8, int4, powersgd:R, ... or "auto" (the controller)
    sync_every: int | str = 1           # local steps: H inner steps per average, or "auto"
    outer_tx: Any = None                # the outer optimizer of local steps (default: jaxdp/step/local_sgd.py's,
                                        # or under byte_budget jaxdp/sync/budget.py's outer_lr)
    sync_fragments: int = 1             # streaming local steps: fragments averaged in turn
    sync_seconds: Any = None            # rounds of wall-clock seconds (or a schedule (round, process) -> steps)
    overlap: bool = False               # the average runs while the next step (or round) computes
    shard_optimizer: bool = False       # ZeRO-1
    shard_params: bool = False          # ZeRO-3 / FSDP: parameters, gradients, optimizer state sharded (jaxdp/step/fsdp.py)
    metrics_at_sync: bool = False       # local steps: the logged scalars averaged only at syncs (jaxdp/step/local_sgd.py)
    grad_accum: int = 1                 # micro-batches per step
    comm_target: float = 0.25           # compression / sync_every "auto": the communication share to aim for
    compression_every: int = 500        # compression "auto": steps between the controller's re-decisions
    byte_budget: Any = None             # both "auto": bytes per step as a fraction of float32's (0.001, "1000x")


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """Held-out evaluation: `fn(params, model_state, batch) -> per-device sums`, on `data` every `every` steps."""

    fn: Callable | None = None          # eval_fn; padding rows carry batch["mask"] == 0
    data: Any = None                    # an iterable of host batches, or a function returning one
    summarize: Callable | None = None   # totals -> metrics (default: jaxdp.loop.trainer.default_summarize)
    every: int = 0                      # steps between evaluations during training (0: only at the end)


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Orbax checkpoints and exact resume (jaxdp/checkpoint/)."""

    directory: str | None = None        # a run pointed at a directory with a checkpoint resumes from it
    save_every: int | str = 0           # steps, or "auto" (jaxdp/checkpoint/saveplan.py); 0: only at the end
    keep: int = 3                       # checkpoints kept
    meta: dict | None = None            # more JSON for every checkpoint


@dataclasses.dataclass(frozen=True)
class LogOptions:
    """What is logged, where, and how often (process 0)."""

    every: int = 10                     # steps between logged records
    metrics_file: str | None = None     # JSON Lines
    log_dir: str | None = None          # TensorBoard
    wandb_project: str | None = None    # Weights & Biases
    progress: bool = True               # the progress bar
    schedule: Callable[[int], Any] | None = None  # the learning-rate schedule, logged as "lr"


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What the command line passes: the process around the loop, and the per-step counts for throughput."""

    config: Any = None                  # its Config: recorded in checkpoints, checked on resume, DIR/config.toml
    resume_note: str = ""               # said after the resume line
    run_info: dict | None = None        # more fields for the "start" record
    watch: Any = None                   # a running jaxdp.cluster.heartbeat watch to use and stop
    elastic: Any = None                 # this process's member of an elastic run: jaxdp.elastic.from_env()
    stall_timeout: int = 20             # seconds before a silent peer counts as stalled (multi-process)
    prefetch: int = 2                   # batches loaded ahead
    examples_per_step: int | None = None
    tokens_per_step: int | None = None
    flops_per_step: float | None = None
    started: float | None = None        # when the process started (time.perf_counter())
    exits_after: bool = False           # the process ends when fit returns: a preempted run keeps its stop handlers


GROUPS = {"sync": SyncOptions, "evaluation": EvalOptions, "checkpoint": CheckpointOptions, "logging": LogOptions,
          "run": RunOptions}

# The flat keywords of before: old name -> (group, field)
FLAT = {
    **{name: ("sync", name) for name in ("strategy", "compression", "sync_every", "outer_tx", "sync_fragments",
                                         "sync_seconds", "overlap", "shard_optimizer", "shard_params", "metrics_at_sync", "grad_accum",
                                         "comm_target", "compression_every", "byte_budget")},
    "eval_fn": ("evaluation", "fn"), "eval_data": ("evaluation", "data"), "summarize": ("evaluation", "summarize"),
    "eval_every": ("evaluation", "every"),
    "checkpoint_dir": ("checkpoint", "directory"), "save_every": ("checkpoint", "save_every"),
    "keep": ("checkpoint", "keep"), "checkpoint_meta": ("checkpoint", "meta"),
    "log_every": ("logging", "every"), "metrics_file": ("logging", "metrics_file"), "log_dir": ("logging", "log_dir"),
    "wandb_project": ("logging", "wandb_project"), "progress": ("logging", "progress"),
    "schedule": ("logging", "schedule"),
    **{name: ("run", name) for name in ("config", "resume_note", "run_info", "watch", "elastic", "stall_timeout",
                                        "prefetch", "examples_per_step", "tokens_per_step", "flops_per_step",
                                        "started")},
}


def grouped(flat: dict[str, Any], **groups: Any) -> dict[str, Any]:
    """The option groups fit runs with: `groups` as given (None: the defaults), each flat keyword of
    before written into its group, with one DeprecationWarning naming the new spelling. TypeError
    for a keyword fit never took."""
    unknown = sorted(set(flat) - set(FLAT))
    if unknown:
        raise TypeError(f"fit() got an unexpected keyword argument {unknown[0]!r}")
    out = {name: groups.get(name) or kind() for name, kind in GROUPS.items()}
    for name in flat:
        group, field = FLAT[name]
        out[group] = dataclasses.replace(out[group], **{field: flat[name]})
    if flat:
        spelled = ", ".join(f"{group}={GROUPS[group].__name__}({', '.join(f'{FLAT[n][1]}=...' for n in flat if FLAT[n][0] == group)})"
                            for group in GROUPS if any(FLAT[n][0] == group for n in flat))
        warnings.warn(f"fit({', '.join(f'{n}=...' for n in flat)}) is deprecated and removed in jaxdp {REMOVED_IN}: "
                      f"use fit(..., {spelled})", DeprecationWarning, stacklevel=3)
    return out
