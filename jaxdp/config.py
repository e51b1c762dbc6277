"""One frozen `Config` for a training run, and the command line generated from it.

Every field carries its flag group and help text, so `--help`, the README's flag table and the
validation below cannot drift apart. Choices come from `jaxdp.registry`, which names them without
importing them: parsing flags imports no JAX. Validation raises `ConfigError` with one sentence that
says what to change; `jaxdp.train` turns it into exit code 2 without a traceback. The checks here are
per field; which sync choices combine (--strategy, --compression, --sync-every, --sync-seconds,
--shard-optimizer, --overlap) is the one table of jaxdp/sync/rules.py, which `jaxdp.train` asks
in flag terms before JAX starts (`rules.check_config`): config imports no sync code.

Why argparse and not tyro or simple_parsing: `build_parser` below is about thirty lines, keeps `--help`
free of imports, and gives every error as one line; those libraries would add a dependency for the
same dataclass-to-flags mapping.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import math
import os
import sys
import textwrap
import tomllib
from typing import Any, Sequence

from jaxdp import registry
from jaxdp.errors import ConfigError  # noqa: F401 (importable from here, where it was first)
from jaxdp.inputs import (  # noqa: F401 (importable from here too)
    CORPUS_SUFFIXES, MODEL_SPEC, SEED_RANGE, TOKEN_SUFFIXES, check_inputs, is_corpus,
)

SYNC_AUTO = SAVE_AUTO = registry.AUTO  # --sync-every auto, --save-every auto (the controllers decide)

# Fields added after checkpoints recorded their run's Config: the value a recorded Config without the
# field had (jaxdp.checkpoint.resume.with_recorded_defaults on resume, jaxdp.checkpoint.artifacts.load_variables to load).
RECORDED_BEFORE = {
    "head_bias": True,  # jaxdp's GPT had an output bias until --head-bias came (False now)
    "weight_decay_on": "all",  # adamw decayed every parameter until --weight-decay-on came (matrices now)
    "muon_on": "all",  # --optimizer muon updated every 2-D leaf with Muon until --muon-on came (hidden now)
    "muon_lr": 0.0,  # ... at --lr, with its Adam fallback, until --muon-lr came (0.02 now)
}

GROUPS = ("data", "model", "optimisation", "distribution", "checkpointing", "logging")

# What `--help` lists first, one line each: the flags a new run sets (the others: `--help` names
# them by group, `--help-all` and docs/cli.md give each its meaning and default). A flag with
# choices has them added ("optax optimizer: adam, adamw, ...").
COMMON = {
    "model": f"{', '.join(registry.MODELS)}, or your own as MODULE:ATTR",
    "dataset": "digits, synthetic, an .npz file, or gpt's tokens",
    "steps": "training steps (a resumed run continues up to this one)",
    "batch_size": "global batch size, split over every device",
    "lr": "peak learning rate",
    "optimizer": "optax optimizer",
    "schedule": "lr schedule",
    "precision": "compute dtype",
    "strategy": "gradient sync",
    "devices": "devices per process (a CPU-only host simulates one per core, 2 to 8)",
    "compression": "bf16, int8, int4, powersgd:RANK, topk:DENSITY, auto",
    "sync_every": "average the replicas every N steps; auto: measure",
    "checkpoint_dir": "save here; a run pointed at a checkpoint resumes it",
    "metrics_file": "one JSON object per logged step, then the run's summary",
    "seed": "parameters, data order and dropout",
}


def _field(default: Any, group: str, help: str, **kwargs: Any) -> Any:
    return dataclasses.field(default=default, metadata={"group": group, "help": help, **kwargs})


@dataclasses.dataclass(frozen=True)
class Config:
    # -- data -----------------------------------------------------------------------------------
    dataset: str = _field("digits", "data", "built-in dataset (digits, synthetic), an .npz file with arrays x and y, or for --model gpt a token stream: .txt (bytes), .bin or .npy (token ids), or documents: a folder or glob of .parquet, .arrow, .feather or .jsonl files, or a Hugging Face dataset saved with save_to_disk (tokenized once into the token cache)")
    batch_size: int = _field(128, "data", "global batch size (in sequences for gpt), split evenly over every device of every process; with --grad-accum K each step takes K such batches")
    vocab_size: int | None = _field(None, "data", "vocabulary size of a .bin or .npy token file (a .txt file is bytes: 256, or its --tokenizer's)")
    seq_len: int = _field(128, "data", "tokens per training sequence (gpt)")
    tokenizer: str | None = _field(None, "data", "a Hugging Face tokenizers JSON file that encodes a .txt --dataset (else read as bytes); its vocabulary size is the model's (or a larger --vocab-size); the text is encoded once into a cache ($JAXDP_TOKEN_CACHE, else ~/.cache/jaxdp/tokens); needs pip install 'jaxdp-trainer[tokenizers]'", metavar="PATH")
    text_column: str = _field("text", "data", "the column (Parquet, Arrow, a saved Hugging Face dataset) or key (JSON lines) of a documents --dataset that holds the text", metavar="NAME")
    prefetch: int = _field(2, "data", "batches prepared and copied to the devices ahead of the step that needs them, on a background thread (0: none)")

    # -- model ----------------------------------------------------------------------------------
    model: str = _field("mlp", "model", f"a built-in model ({', '.join(registry.MODELS)}) or your own as MODULE:ATTR: a flax Module class or a factory f(config) in MODULE.py, importable from the current directory (docs/models.md)", builtin=registry.MODELS, metavar="MODEL")
    model_path: str | None = _field(None, "model", "the directory a --model MODULE:ATTR is imported from first (default: the current directory, which config.toml and checkpoints record, so a rerun or an export from elsewhere finds the same module)", metavar="DIR")
    layers: int = _field(4, "model", "transformer blocks (gpt)")
    d_model: int = _field(256, "model", "model width (gpt)")
    heads: int = _field(4, "model", "attention heads (gpt); must divide --d-model")
    precision: str = _field("fp32", "model", "compute dtype; parameters and optimizer state stay fp32 (fp8: bf16 with the gpt blocks' dense layers on fp8, on NVIDIA GPUs of compute capability 8.9+)", choices_fixed=("fp32", "bf16", "fp8"))
    attention: str = _field("auto", "model", "gpt attention: cuDNN flash attention on NVIDIA GPUs with bf16 (auto), or force xla / cudnn", choices_fixed=("auto", "xla", "cudnn"))
    kernels: str = _field("auto", "model", "gpt LayerNorms and loss in bf16: XLA's fusions (auto, xla) or Pallas kernels (pallas)", choices_fixed=("auto", "xla", "pallas"))
    head_bias: bool = _field(False, "model", "give the gpt's output layer a bias, as jaxdp's GPT had before this flag existed (its checkpoints resume with it by themselves); GPT-2 has none, so python -m jaxdp.export refuses a trained one")
    init_from: str | None = _field(None, "model", "a Hugging Face GPT-2 directory (config.json + model.safetensors) whose architecture and weights --model gpt starts from (its sizes replace --layers, --d-model and --heads)", metavar="DIR")

    # -- optimisation ---------------------------------------------------------------------------
    strategy: str = _field("psum", "optimisation", "gradient synchronisation across devices", registry=registry.STRATEGIES)
    steps: int = _field(300, "optimisation", "total number of training steps (a resumed run continues up to this step)")
    optimizer: str = _field("adam", "optimisation", "optax optimizer", registry=registry.OPTIMIZERS)
    lr: float = _field(1e-3, "optimisation", "peak learning rate")
    schedule: str = _field("constant", "optimisation", "learning-rate schedule over --steps", registry=registry.SCHEDULES)
    schedule_steps: int = _field(0, "optimisation", "the schedule's horizon in steps (0: the --steps the run started with; a resumed run keeps it even when --steps grows, unless this is given)")
    warmup_steps: int = _field(0, "optimisation", "linear warm-up steps from 0 to --lr (warmup-cosine)")
    final_lr_fraction: float = _field(0.1, "optimisation", "the cosine schedules end at this fraction of --lr")
    clip_norm: float = _field(0.0, "optimisation", "clip the global gradient norm to this value (0: no clipping)")
    shard_optimizer: bool = _field(False, "optimisation", "ZeRO-1: each device keeps and updates 1/N of the optimizer state (psum, ring); the same numbers, 1/N of the optimizer memory")
    shard_params: bool = _field(False, "optimisation", "ZeRO-3 / FSDP: parameters, gradients and optimizer state cut over the process's devices and gathered for the forward and backward passes: the same numbers in about 1/N of the model's memory per device; across processes each is a replica for --strategy, --compression (bf16, int8, int4, powersgd), --sync-every and --overlap rounds")
    sync_every: int | str = _field(1, "optimisation", "local steps (DiLoCo): every device trains its own replica, and the replicas are averaged every N steps through --outer-optimizer (psum, ring); 1: synchronous; auto: every step if the measured link keeps up, else the smallest power of two up to 16 that does (a resumed run keeps the H its checkpoint recorded)", metavar="{N,auto}")
    outer_optimizer: str = _field("nesterov", "optimisation", "with --sync-every > 1: the optimizer that applies the averaged pseudo-gradient (params before - after the local steps) to the global params; sgd with --outer-lr 1 --outer-momentum 0 is plain averaging", registry=registry.OUTER_OPTIMIZERS)
    metrics_at_sync: bool = _field(False, "optimisation", "with --sync-every N: average the logged scalars over the devices only on sync steps, in the sync's own collective, so that nothing crosses a slow link between syncs; between them each process logs its first device's replica, and the NaN check waits for the next sync")
    sync_fragments: int = _field(1, "optimisation", "with --sync-every > 1: Streaming DiLoCo, the parameter arrays cut into N fragments of about equal bytes, one synchronised every --sync-every / N steps in turn (N must divide --sync-every)")
    sync_seconds: float = _field(0.0, "optimisation", "workers at their own pace: local steps in rounds of S seconds of wall clock; every process takes as many steps as it manages in S seconds, then the pseudo-gradients are averaged weighted by the examples each process trained on, through --outer-optimizer (psum, ring; instead of --sync-every; 0: off)", metavar="S")
    overlap: bool = _field(False, "optimisation", "hide the all-reduce behind compute: every step, each step's gradient mean is applied one step late; with --sync-every H, a round's average travels while the next round trains and lands one round late (auto then sizes H to hide it). psum or ring, any fixed --compression; with --shard-params, rounds only")
    outer_lr: float = _field(0.7, "optimisation", "learning rate of --outer-optimizer (DiLoCo: 0.7)")
    outer_momentum: float = _field(0.9, "optimisation", "momentum of --outer-optimizer (DiLoCo: 0.9; 0: none, sgd only)")
    compression: str = _field("none", "optimisation", "none, bf16, int8 or int4 (blockwise, requantized at each hop of --strategy ring, error feedback), powersgd:RANK[:start=STEP] (low rank, error feedback), topk:DENSITY, then optionally :BITS, :sum or :gather, :decay=B, :chunk=C (that fraction of each C values, error feedback; without BITS or a form, DENSITY float32 values' bytes go to the form and precision that carry the most values), or auto: compress only as much as the measured link needs (PowerSGD and top-k under a quality guard)")
    byte_budget: str | None = _field(None, "optimisation", "with --sync-every auto --compression auto: bytes per step as a fraction of the every-step float32 ring's (0.001, or 1000x); H and the codec are chosen to fit, by quality; outer step: SGD at lr 2 with top-k, else 1, unless --outer-optimizer is set", metavar="{FRACTION,NNNx}")
    comm_target: float = _field(0.25, "optimisation", "--compression auto: the all-reduce time it aims for, as a fraction of the step's compute time")
    compression_every: int = _field(500, "optimisation", "--compression auto: measure and decide again every N steps (0: once, at the start)")
    grad_accum: int = _field(1, "optimisation", "micro-batches per step: gradients accumulate on each device and are synchronised once per step")
    momentum: float = _field(0.9, "optimisation", "momentum for --optimizer=momentum")
    weight_decay: float = _field(1e-4, "optimisation", "weight decay for --optimizer=adamw")
    weight_decay_on: str = _field("matrices", "optimisation", "which parameters --optimizer=adamw decays: matrices (and embeddings: every parameter of two or more dimensions, as nanoGPT; not biases or LayerNorm scales) or all (as jaxdp did before; checkpoints that record no --weight-decay-on resume with it)", choices_fixed=("matrices", "all"))
    muon_lr: float = _field(0.02, "optimisation", "with --optimizer muon: the learning rate of Muon's matrices (--schedule's shape, at this peak); --lr is then the Adam fallback's (embeddings, head, biases, norms); 0: --lr for both (as jaxdp did before; checkpoints that record no --muon-lr resume with it)")
    muon_on: str = _field("hidden", "optimisation", "with --optimizer muon: hidden (the hidden layers' weight matrices, attention kernels too; embeddings and the head take the Adam fallback, as Muon's authors do) or all (every 2-D parameter, optax's default; checkpoints that record no --muon-on resume with it)", choices_fixed=("hidden", "all"))
    seed: int = _field(0, "optimisation", "seed for parameters, data order and dropout")

    # -- distribution ---------------------------------------------------------------------------
    devices: int | None = _field(None, "distribution", "devices per process; on a CPU-only host this many are simulated (default there: one per core, rounded down to a power of two, 2 to 8; all local accelerators otherwise)")
    coordinator_address: str | None = _field(None, "distribution", "HOST:PORT of process 0 for a multi-process run (default: from the environment or SLURM, else single-process)")
    num_processes: int | None = _field(None, "distribution", "number of processes in a multi-process run")
    process_id: int | None = _field(None, "distribution", "this process's index, 0 .. num-processes - 1")
    peer_timeout: int = _field(60, "distribution", "seconds a running multi-process run waits for a silent process before giving up (a process that dies is noticed at once)")
    startup_timeout: int = _field(300, "distribution", "seconds a multi-process run waits at start for every process to arrive (a cold start on a cluster: scheduling, image pulls, imports) before giving up; compilation never counts as a stall")
    gloo_interface: str | None = _field(None, "distribution", "network interface for CPU collectives between processes (gloo), e.g. eth0; hostname: JAX's own choice, the address the host name resolves to (default: $JAXDP_GLOO_INTERFACE, else $GLOO_SOCKET_IFNAME, else the interface that reaches the coordinator)", metavar="NAME")
    hierarchy: str = _field("auto", "distribution", "with several processes of several devices each: auto sums exactly inside each process first (XLA's collective), then runs --strategy (and --compression) across processes on 1/G of the buffer per device, then gathers inside the process; flat: one all-reduce over every device (the same sum, in another order)", choices_fixed=("auto", "flat"))
    stall_timeout: int = _field(20, "distribution", "seconds a multi-process run waits for a process that is alive but makes no progress (stopped, stuck) once another process finished the same step; checked from step 2 on, so compilation never counts")

    # -- checkpointing --------------------------------------------------------------------------
    checkpoint_dir: str | None = _field(None, "checkpointing", "orbax checkpoint directory; a run pointed at one that holds a checkpoint resumes from it")
    save_every: int | str = _field(0, "checkpointing", "save a checkpoint every N steps (0: only at the end, when --checkpoint-dir is set); auto: time the first save (20 steps in) and choose N from its cost: at most 1 percent of the training time, or, under jaxdp.launch after a restart, Young's interval from the failures seen so far", metavar="{N,auto}")
    keep: int = _field(3, "checkpointing", "number of most recent checkpoints to keep")

    # -- logging --------------------------------------------------------------------------------
    log_every: int = _field(10, "logging", "log metrics every N steps")
    eval_every: int = _field(0, "logging", "evaluate on the held-out split every N steps (0: only at the end)")
    eval_batches: int = _field(50, "logging", "at most this many global batches per evaluation, the first ones of the held-out split (0: all of it)")
    metrics_file: str | None = _field(None, "logging", "JSON Lines file: one object per logged step, then one with \"event\": \"done\"")
    log_dir: str | None = _field(None, "logging", "TensorBoard event directory")
    wandb_project: str | None = _field(None, "logging", "Weights & Biases project: process 0 logs the same records as --metrics-file there (WANDB_ENTITY, WANDB_NAME, WANDB_MODE=offline as wandb reads them); a run resumed from --checkpoint-dir continues the same W&B run; needs pip install 'jaxdp-trainer[wandb]'", metavar="NAME")
    progress: bool = _field(True, "logging", "show a progress bar on process 0")
    compile_cache: str = _field("auto", "logging", "JAX's persistent compilation cache: a directory, auto ($JAXDP_COMPILE_CACHE, else ~/.cache/jaxdp/xla), or off")
    debug: bool = _field(False, "logging", "show full tracebacks on errors")

    def __post_init__(self) -> None:
        if self.tokenizer:  # absolute from the start: checkpoints record it, resume and sampling read it from anywhere
            object.__setattr__(self, "tokenizer", os.path.abspath(os.path.expanduser(self.tokenizer)))
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first bad value and what to do about it."""
        for f in dataclasses.fields(self):
            allowed = choices(f)
            value = getattr(self, f.name)
            if allowed and value not in allowed:
                raise ConfigError(f"--{_flag(f.name)}={value!r} is not one of: {', '.join(allowed)}")
        if self.batch_size <= 0:
            raise ConfigError(f"--batch-size must be a positive integer, got {self.batch_size}")
        if self.steps < 0:
            raise ConfigError(f"--steps must be 0 or more, got {self.steps}")
        for name in ("lr", "momentum", "weight_decay", "muon_lr"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
                what = "a positive number" if name == "lr" else "a finite number >= 0"
                raise ConfigError(f"--{_flag(name)} must be {what}, got {value}")
        for name in ("seq_len", "layers", "d_model", "heads", "grad_accum"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)} must be a positive integer, got {getattr(self, name)}")
        if self.model not in registry.MODELS:
            if not MODEL_SPEC.match(self.model):
                raise ConfigError(f"--model={self.model!r} is neither a built-in model ({', '.join(registry.MODELS)}) "
                                  f"nor MODULE:ATTR (e.g. my_models:Classifier, with my_models.py in the current "
                                  f"directory)") from None
        if self.model_path is not None and self.model in registry.MODELS:
            raise ConfigError(f"--model-path is where a --model MODULE:ATTR is imported from; --model={self.model} is "
                              f"built in: drop --model-path")
        for name in ("warmup_steps", "eval_every", "eval_batches", "prefetch", "schedule_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{_flag(name)} must be 0 or more, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ConfigError(f"--heads={self.heads} must divide --d-model={self.d_model}")
        if self.vocab_size is not None and self.vocab_size <= 1:
            raise ConfigError(f"--vocab-size must be at least 2, got {self.vocab_size}")
        if not math.isfinite(self.clip_norm) or self.clip_norm < 0:
            raise ConfigError(f"--clip-norm must be a finite number >= 0 (0: no clipping), got {self.clip_norm}")
        if not math.isfinite(self.final_lr_fraction) or not 0 <= self.final_lr_fraction <= 1:
            raise ConfigError(f"--final-lr-fraction must be between 0 and 1, got {self.final_lr_fraction}")
        if self.schedule == "warmup-cosine":  # the warm-up is part of the schedule: of its horizon, not of this run
            horizon, flag = (self.schedule_steps, "--schedule-steps") if self.schedule_steps else (self.steps, "--steps")
            if self.warmup_steps >= max(horizon, 1):
                raise ConfigError(f"--warmup-steps={self.warmup_steps} must be smaller than the schedule's horizon, "
                                  f"{flag}={horizon}")
        if self.devices is not None and self.devices <= 0:
            raise ConfigError(f"--devices must be a positive integer, got {self.devices}")
        for name in ("log_every", "keep"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)} must be a positive integer, got {getattr(self, name)}")
        if self.save_every != SAVE_AUTO and (isinstance(self.save_every, str) or self.save_every < 0):
            raise ConfigError(f"--save-every must be a number of steps (0: only at the end) or auto, "
                              f"got {self.save_every!r}")
        text, token_file = self.dataset.lower().endswith(".txt") or is_corpus(self.dataset), self.dataset.lower().endswith(TOKEN_SUFFIXES)
        if self.model == "gpt" and not (token_file or text):
            raise ConfigError(f"--model=gpt trains on a token stream: give --dataset a .txt, .bin or .npy file, or a folder or "
                              f"glob of .parquet, .arrow, .feather or .jsonl files, not {self.dataset!r}")
        if self.model in ("mlp", "cnn") and (token_file or text):
            raise ConfigError(f"--dataset={self.dataset!r} is a token stream, for --model=gpt; "
                              f"--model={self.model} needs a built-in dataset or an .npz file")
        if self.head_bias and (self.model != "gpt" or self.init_from is not None):
            raise ConfigError("--head-bias adds a bias to the output layer of --model gpt trained from scratch; "
                              + ("GPT-2 (--init-from) has none" if self.model == "gpt" else f"not --model={self.model}"))
        if self.init_from is not None:
            if self.model != "gpt":
                raise ConfigError(f"--init-from starts a --model gpt from Hugging Face GPT-2 weights; it does not "
                                  f"apply to --model={self.model}")
            if not os.path.isfile(os.path.join(self.init_from, "config.json")):
                what = "has no config.json" if os.path.isdir(self.init_from) else "is not a directory"
                raise ConfigError(f"--init-from={self.init_from!r} {what}; give a Hugging Face GPT-2 directory "
                                  f"(config.json + model.safetensors, as save_pretrained writes it)")
        if self.dataset not in registry.DATASETS and not self.dataset.lower().endswith((".npz", *TOKEN_SUFFIXES)) and not text:
            raise ConfigError(f"--dataset={self.dataset!r} is neither a built-in dataset ({', '.join(registry.DATASETS)}) "
                              f"nor a path ending in .npz, .txt, .bin, .npy, {', '.join(CORPUS_SUFFIXES)} or a folder of them")
        if self.tokenizer is not None and not text:
            raise ConfigError(f"--tokenizer encodes text: --dataset={self.dataset!r} is not a .txt file (a .bin or "
                              f".npy holds token ids already: give its --vocab-size; python -m jaxdp.prepare makes one)")
        for name, package, extra in (("tokenizer", "tokenizers", "tokenizers"), ("wandb_project", "wandb", "wandb")):
            if getattr(self, name) is not None and importlib.util.find_spec(package) is None:
                raise ConfigError(f"--{_flag(name)} needs the {package} package: pip install 'jaxdp-trainer[{extra}]'")
        if self.wandb_project is not None and not self.wandb_project.strip():
            raise ConfigError("--wandb-project must name a project, got an empty name")
        if self.checkpoint_dir is not None and os.path.exists(self.checkpoint_dir) and not os.path.isdir(self.checkpoint_dir):
            raise ConfigError(f"--checkpoint-dir={self.checkpoint_dir!r} is a file, not a directory; point it at a directory")
        if self.num_processes is not None and self.num_processes <= 0:
            raise ConfigError(f"--num-processes must be a positive integer, got {self.num_processes}")
        if self.process_id is not None and self.process_id < 0:
            raise ConfigError(f"--process-id must be 0 or more, got {self.process_id}")
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise ConfigError(f"--process-id={self.process_id} must be smaller than --num-processes={self.num_processes}")
        for name in ("peer_timeout", "startup_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)} must be a positive number of seconds, got {getattr(self, name)}")
        check_inputs(self)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    """A field's choices: the names in its registry now (a user may have registered more)."""
    names = f.metadata.get("registry", f.metadata.get("choices_fixed"))
    return None if names is None else tuple(names)


def metavar(f: dataclasses.Field) -> str:
    if "metavar" in f.metadata:
        return f.metadata["metavar"]
    if f.name.endswith(("_dir", "_file")) or f.name == "dataset":
        return "PATH"
    return {"int": "N", "int | None": "N", "float": "X"}.get(f.type, f.name.upper())


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr and exit code 2, without the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def _int_or_auto(text: str) -> int | str:
    """--sync-every, --save-every: an integer, or any other word as given (validation names what is allowed)."""
    if text.strip().lower() == SYNC_AUTO:
        return SYNC_AUTO
    try:
        return int(text)
    except ValueError:
        return text


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class _Help(argparse.Action):
    """-h / --help: the COMMON flags with their meaning, then every other flag's name by group;
    --help-all (`full`): every flag with its meaning and default, grouped (`format_help`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, full: bool = False, help: str | None = None):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)
        self.full = full

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser._print_message(parser.format_help() if self.full else common_help(parser), sys.stdout)
        parser.exit()


def common_help(parser: argparse.ArgumentParser) -> str:
    """What --help prints: the usage, the COMMON flags (then --config and --help-all), one line each
    with its default, and the name of every other flag under its group."""
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, parser._actions, [])
    formatter.add_text(parser.description)
    by_dest = {action.dest: action for action in parser._actions}
    shown = []
    for name, brief in COMMON.items():
        action = copy.copy(by_dest[name])
        if action.choices:
            brief, action.metavar = f"{brief}: {', '.join(action.choices)}", name.upper()
        action.help = brief + ("" if action.default is None else f" (default: {action.default})")
        shown.append(action)
    shown += [a for a in parser._actions if a.option_strings[0] in ("--config", "--help-all")]
    formatter.start_section("common")
    formatter.add_arguments(shown)
    formatter.end_section()
    lines = [formatter.format_help().rstrip("\n"), "",
             "the other flags, by group (--help-all: each with its meaning and default):"]
    for group in GROUPS:
        names = [f"--{_flag(f.name)}" for f in dataclasses.fields(Config)
                 if f.metadata["group"] == group and f.name not in COMMON]
        lines.append(textwrap.fill(" ".join(names), width=100, initial_indent=f"  {group + ':':<16}",
                                   subsequent_indent=" " * 18, break_on_hyphens=False))
    return "\n".join(lines) + "\n"


def build_parser(prog: str = "python -m jaxdp.train") -> argparse.ArgumentParser:
    """The CLI, generated from Config's fields: one flag per field, grouped, with defaults shown
    (`format_help`, --help-all); --help shows the COMMON ones first (`common_help`)."""
    parser = _Parser(
        prog=prog, allow_abbrev=False,  # --step is not --steps
        usage="%(prog)s [--FLAG VALUE ...]", add_help=False,
        description="Data-parallel training of a Flax model over every device of every process.",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=32, width=100),
    )
    parser.add_argument("-h", "--help", action=_Help, help="the common flags, then the others' names")
    parser.add_argument("--help-all", action=_Help, full=True, help="every flag with its meaning and default, by group")
    groups = {g: parser.add_argument_group(g) for g in GROUPS}
    types = {"int": int, "float": float, "str": str, "int | None": int, "str | None": str, "int | str": _int_or_auto}
    for f in dataclasses.fields(Config):
        group = groups[f.metadata["group"]]
        flag = f"--{_flag(f.name)}"
        help = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if f.type == "bool":
            group.add_argument(flag, dest=f.name, nargs="?", const=True, default=f.default,
                               type=_parse_bool, metavar="BOOL", help=help)
            group.add_argument(f"--no-{_flag(f.name)}", dest=f.name, action="store_false", help=argparse.SUPPRESS)
        else:
            group.add_argument(flag, dest=f.name, type=types[f.type], default=f.default,
                               choices=choices(f), help=help, metavar=None if choices(f) else metavar(f))
    parser.add_argument("--config", metavar="PATH", help="a TOML file of flag values (keys: the flag names, for "
                        "example batch-size = 64); flags on the command line override it")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse command-line flags into a validated Config (ConfigError on bad input).

    `--config run.toml` supplies defaults whose keys are the flag names (`batch-size = 64`);
    flags given on the command line override them.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = _Parser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    parser = build_parser()
    if known.config:
        parser.set_defaults(**read_config_file(known.config))
    namespace = vars(parser.parse_args(argv))
    namespace.pop("config")
    return Config(**namespace)


def read_config_file(path: str) -> dict[str, Any]:
    """A TOML file of flag-name keys -> {field name: value}, type-checked; ConfigError otherwise."""
    where = f"--config={path!r}"
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{where} is not a readable TOML file ({err})") from None
    fields = {f.name: f for f in dataclasses.fields(Config)}
    values = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{where}: unknown key {key!r}; the keys are the flag names without dashes in "
                              f"front, for example batch-size = 64")
        expected = {"int": (int,), "int | None": (int,), "float": (int, float), "str": (str,), "str | None": (str,),
                    "int | str": (int, str), "bool": (bool,)}[fields[name].type]
        if isinstance(value, bool) and bool not in expected or not isinstance(value, expected):
            raise ConfigError(f"{where}: {key} = {value!r} should be {' or '.join(t.__name__ for t in expected)}")
        values[name] = float(value) if fields[name].type == "float" else value
    return values


def absolute_paths(config: Config) -> Config:
    """`config` with its file and directory paths made absolute, as read from the working directory
    now: --dataset (unless a built-in name), --tokenizer, --checkpoint-dir, --metrics-file, --log-dir,
    --init-from, a --compile-cache directory, and --model-path (the current directory, for a --model
    MODULE:ATTR). A relative path in a file read from elsewhere would
    name another file, and a rerun would quietly start a fresh run in a new directory."""
    changes = {name: os.path.abspath(getattr(config, name)) for name in ("checkpoint_dir", "metrics_file", "log_dir",
                                                                         "tokenizer", "init_from")
               if getattr(config, name) is not None}
    if config.dataset not in registry.DATASETS:
        changes["dataset"] = os.path.abspath(config.dataset)
    if config.model not in registry.MODELS:  # MODULE:ATTR: where `python -m` found it, the current directory
        changes["model_path"] = os.path.abspath(os.path.expanduser(config.model_path or "."))
    if config.compile_cache not in ("auto", "off"):
        changes["compile_cache"] = os.path.abspath(os.path.expanduser(config.compile_cache))
    return config.replace(**changes)


def config_toml(config: Config, comment: str | None = None) -> str:
    """The effective config as a TOML file that `--config` reads back (fields that are None are left
    out); `comment`, if given, as a second comment line. Paths are written absolute (`absolute_paths`),
    so the file reruns the same run from any working directory."""
    lines = ["# the effective configuration of a jaxdp run; rerun it with --config this-file (from any directory)"]
    lines += [f"# {comment}"] if comment else []
    config = absolute_paths(config)
    for f in dataclasses.fields(Config):
        value = getattr(config, f.name)
        if value is None:
            continue
        text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
        lines.append(f"{_flag(f.name)} = {text}")
    return "\n".join(lines) + "\n"
