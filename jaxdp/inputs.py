"""The command line's values that are checked before JAX starts, beyond one field's type: numbers
in range, paths that can be written, --model MODULE:ATTR's form, which --dataset paths are corpora.
`jaxdp.config.Config` runs `check_inputs` when it is made; nothing here imports JAX.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

from jaxdp import registry
from jaxdp.errors import ConfigError

TOKEN_SUFFIXES = (".txt", ".bin", ".npy")  # token streams (jaxdp/data/tokens.py), for --model gpt
CORPUS_SUFFIXES = (".parquet", ".arrow", ".feather", ".jsonl", ".ndjson")  # documents (jaxdp/data/corpus.py), for gpt

# --model MODULE:ATTR, checked without importing anything (jaxdp/models/usermodel.py imports it)
MODEL_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

SEED_RANGE = 2**32  # numpy's and JAX's seeds are unsigned 32-bit on every path that takes --seed


def check_inputs(config: Any) -> None:
    """Values that used to fail only after JAX started (or at the first save): fail before it."""
    if config.stall_timeout <= 0:
        raise ConfigError(f"--stall-timeout must be a positive number of seconds, got {config.stall_timeout}")
    if not 0 < config.comm_target:
        raise ConfigError(f"--comm-target must be a positive fraction of compute time, got {config.comm_target}")
    if config.compression_every < 0:
        raise ConfigError(f"--compression-every must be 0 (decide once) or a number of steps, got {config.compression_every}")
    auto_sync = config.sync_every == registry.AUTO
    if isinstance(config.sync_every, str) and not auto_sync:
        raise ConfigError(f"--sync-every must be a positive integer (1: synchronous training) or auto, "
                          f"got {config.sync_every!r}")
    if not auto_sync and config.sync_every < 1:
        raise ConfigError(f"--sync-every must be a positive integer (1: synchronous training), got {config.sync_every}")
    if getattr(config, "byte_budget", None) is not None:
        parse_byte_budget(config.byte_budget)
    if config.sync_fragments < 1:
        raise ConfigError(f"--sync-fragments must be a positive integer, got {config.sync_fragments}")
    paced = config.sync_seconds != 0
    if paced:
        if not math.isfinite(config.sync_seconds) or config.sync_seconds < 0:
            raise ConfigError(f"--sync-seconds must be a positive number of seconds (0: off), got {config.sync_seconds}")
    if auto_sync or config.sync_every > 1 or paced:
        if not math.isfinite(config.outer_lr) or config.outer_lr <= 0:
            raise ConfigError(f"--outer-lr must be a positive number, got {config.outer_lr}")
        if not math.isfinite(config.outer_momentum) or not 0 <= config.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be at least 0 and below 1, got {config.outer_momentum}")
        if config.outer_optimizer == "nesterov" and config.outer_momentum == 0:
            raise ConfigError("--outer-optimizer=nesterov needs --outer-momentum > 0; use --outer-optimizer=sgd for none")
    if not 0 <= config.seed < SEED_RANGE:
        raise ConfigError(f"--seed must be between 0 and {SEED_RANGE - 1}, got {config.seed}")
    for name in ("checkpoint_dir", "metrics_file", "log_dir"):
        path = getattr(config, name)
        if path is None:
            continue
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as surrogate escapes
            raise ConfigError(f"--{name.replace('_', '-')}={path!r} is not valid UTF-8 (checkpoint and log libraries "
                              f"need UTF-8 paths); rename it") from None
        if name == "checkpoint_dir":
            continue  # jaxdp.checkpoint.checkpointer probes it (a file on the way: "not a writable directory")
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
        if parent and not os.path.isdir(parent):
            raise ConfigError(f"--{name.replace('_', '-')}={path!r} is under {parent!r}, which is a file, not a directory; "
                              f"point it at a path in a directory")


def is_corpus(dataset: str) -> bool:
    """Whether --dataset names documents (jaxdp/data/corpus.py): a folder, a glob, or a Parquet / Arrow / JSONL file."""
    return dataset not in registry.DATASETS and not dataset.lower().endswith((".npz", *TOKEN_SUFFIXES)) and (
        os.path.isdir(dataset) or any(c in dataset for c in "*?[") or dataset.lower().endswith(CORPUS_SUFFIXES))


def parse_byte_budget(text: Any) -> float:
    """--byte-budget: the bytes allowed per step as a fraction of what the every-step float32 ring
    sends, written as a fraction in (0, 1] (0.001) or as NNNx, NNN-fold fewer (1000x: 0.001)."""
    raw = str(text).strip().lower()
    try:
        value = 1 / float(raw[:-1]) if raw.endswith("x") else float(raw)
    except (ValueError, ZeroDivisionError):
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ConfigError(f"--byte-budget must be a fraction of the float32 ring's bytes in (0, 1] (0.001) or NNNx "
                          f"for NNN-fold fewer (1000x, NNN >= 1), got {text!r}")
    return value
