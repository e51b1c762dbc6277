"""What a resumed run must share with the run that wrote its checkpoint, and what it may change.

    fields = resume_fields(config)              # {name: value} a checkpoint's recorded config must match
    config, said = with_recorded_defaults(config, recorded)   # an older jaxdp's checkpoint: its defaults
    same_dataset(meta, config)                  # the same --dataset file, however it is spelt
    dataset_path(config)                        # --dataset as an absolute path (None: built in)
    data_change(meta, fingerprint)              # how the data changed since the checkpoint (None: it did not)

jaxdp/checkpoint/checkpointer.py refuses a resume (exit 2, one line naming the first field) when one differs,
and when the data itself changed under the same --dataset (`data_change`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxdp.config import Config, is_corpus

# Config groups whose fields decide what a checkpoint contains or which batches come next: a resumed
# run must use the same values. Every other field may change on resume: --steps (the total to train
# to), --strategy (psum, ring and host compute the same mean; only bit-identity is lost), the
# learning rate and its schedule and clipping (to recover from a divergence; the optimizer state's
# shapes are checked separately), the device and process count (the state is replicated),
# checkpointing and logging, and --shard-optimizer (checkpoints hold the optimizer state whole);
# --sync-every between values above 1 (the state is the same; the next sync comes at the next
# multiple of the new value; between 1 and more, the states differ: `_check_compatible` says so) and
# --outer-lr. `--sync-every auto` resumes with the H its checkpoint recorded (`recorded_meta`).
# Neither do --prefetch (when batches are made, never which) and --attention (the same attention by
# another kernel, like --strategy), nor --model-path (where MODULE is found, not what it is).
# Options of a choice the run did not take cannot matter either
# (`_unused`): --momentum unless --optimizer momentum, --weight-decay unless adamw, the GPT's sizes
# and token options for the other models, the outer optimizer's with synchronous training.
# --dataset compares the file, not the spelling: the same file by another relative path (a rerun
# from another directory with `--config DIR/config.toml`, which stores absolute paths) may resume.
_RESUME_GROUPS = ("data", "model", "optimisation")
_MAY_CHANGE_ON_RESUME = ("steps", "schedule_steps", "strategy", "shard_optimizer", "comm_target", "compression_every", "lr", "schedule",
                         "shard_params", "warmup_steps", "final_lr_fraction", "clip_norm", "sync_every", "outer_lr", "prefetch",
                         "attention", "model_path", "metrics_at_sync", "muon_lr")


def resume_fields(config: Config) -> dict[str, Any]:
    """The Config fields a resumed run must share with the run that wrote the checkpoint."""
    unused = _unused(config)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.metadata["group"] in _RESUME_GROUPS and f.name not in _MAY_CHANGE_ON_RESUME and f.name not in unused}


def with_recorded_defaults(config: Config, recorded: dict[str, Any] | None) -> tuple[Config, list[str]]:
    """`config` for resuming a checkpoint whose recorded config is `recorded` (None: no checkpoint):
    a field the recording lacks (an older jaxdp wrote it) takes the value that jaxdp had
    (`config.RECORDED_BEFORE`), where this run would read it; returns the config and the flags so set."""
    from jaxdp.config import RECORDED_BEFORE, _flag

    if not recorded or recorded.get("model") != config.model:
        return config, []
    changes = {name: value for name, value in RECORDED_BEFORE.items()
               if name not in recorded and name not in _unused(config) and getattr(config, name) != value
               and not (name == "head_bias" and (config.model != "gpt" or config.init_from))}
    said = [f"--{_flag(name)}" + ("" if value is True else f" {value}") for name, value in changes.items()]
    return (config.replace(**changes) if changes else config), said


def _unused(config: Config) -> set[str]:
    """Fields that `config`'s other choices leave unread (jaxdp/step/state.py, jaxdp/models/builtin.py)."""
    unused = set()
    if config.optimizer != "momentum":
        unused.add("momentum")
    if config.optimizer != "adamw":
        unused |= {"weight_decay", "weight_decay_on"}
    if config.optimizer != "muon":
        unused |= {"muon_lr", "muon_on"}
    if config.model in ("mlp", "cnn"):  # their sizes are fixed (a --model MODULE:ATTR factory may read them)
        unused |= {"layers", "d_model", "heads", "seq_len", "vocab_size", "head_bias"}
    if config.sync_every == 1:
        unused |= {"outer_optimizer", "outer_momentum", "sync_fragments"}
    if not is_corpus(config.dataset):  # --text-column names a column of documents only
        unused.add("text_column")
    return unused


# The meta key of the data a run trained on: the dataset's fingerprint (jaxdp/data/datasets.py and tokens.py:
# its size and a digest of evenly spaced blocks, jaxdp/data/digest.py), recorded by the command line.
DATA_DIGEST = "data_digest"


def data_change(meta: dict, fingerprint: dict | None) -> str | None:
    """How the data a run reads now (`fingerprint`) differs from the data the checkpoint with `meta` was
    trained on, in words; None when they agree, or when either is unknown (a checkpoint of an older jaxdp
    or of a notebook records none: it resumes as before).

    Documents appended to a corpus, or text edited in place, move the held-out split (the stream's tail)
    over text already trained on and shift every later batch. The digest samples a large dataset: an edit
    that keeps its size and falls between the sampled blocks goes unseen."""
    recorded = meta.get(DATA_DIGEST)
    if not isinstance(recorded, dict) or not isinstance(fingerprint, dict) or recorded == fingerprint:
        return None
    if recorded.get("what") != fingerprint.get("what"):
        return f"it was trained on {recorded.get('what')}, this run reads {fingerprint.get('what')}"
    return f"the same {fingerprint.get('what')}, with other contents (edited in place)"


def dataset_path(config: Config) -> str | None:
    """The absolute path of `config.dataset`, None for a built-in dataset."""
    from jaxdp.registry import DATASETS

    return None if config.dataset in DATASETS else os.path.abspath(config.dataset)


def same_dataset(meta: dict, config: Config) -> bool:
    """Whether checkpoint `meta` was made from the file `config.dataset` names, however spelt: by the
    absolute path it records, or (checkpoints without one) the recorded path read from here."""
    path = dataset_path(config)
    if path is None:
        return False
    recorded = meta.get("dataset_path") or (meta.get("config") or {}).get("dataset")
    return isinstance(recorded, str) and os.path.abspath(recorded) == path
