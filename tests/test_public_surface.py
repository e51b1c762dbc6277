"""What users' code and scripts depend on keeps working across the wave-4 layout (recorded at f0dd332, before it).

Every name `jaxdp` exports, every `python -m` entry point and console script with every flag it had, every
config.toml key, and the deep import paths the docs named: the names a subpackage held before it was split
(`jaxdp.sync.ring_mean`, `jaxdp.step.make_train_step`) still resolve, with a DeprecationWarning that names the release
that removes them, to the very same objects as their new homes. A name dropped from any list below is a break for
somebody: remove it only with a release note (CHANGELOG.md). The flat module paths of the unreleased 0.1.0 layout
(`jaxdp.state`, `jaxdp.syncspec`, ...) were removed with a note there: importing jaxdp patches no import machinery.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

EXPORTS = [
    "Checkpointer", "Collective", "DATA_AXIS", "Diverged", "EXIT_CODES", "InputError", "MODELS", "MetricsWriter",
    "OPTIMIZERS", "Periodic", "Preemption", "Prefetcher", "Result", "STRATEGIES", "SyncSpec", "TrainState", "TrainStep",
    "__version__", "batch_sharding", "check_finite", "fit", "hierarchical", "host_mean", "init_state", "initialize",
    "is_on_host", "load_model", "load_params", "load_variables", "make_eval_step", "make_mesh", "make_optimizer",
    "make_train_step", "on_host", "pad_batch", "psum_mean", "replicate", "replicated_sharding", "ring_allreduce",
    "ring_mean", "shard_batch",
]

FLAGS = {
    "train": [
        "--attention", "--batch-size", "--checkpoint-dir", "--clip-norm", "--comm-target", "--compile-cache",
        "--compression", "--compression-every", "--config", "--coordinator-address", "--d-model", "--dataset", "--debug",
        "--devices", "--eval-batches", "--eval-every", "--final-lr-fraction", "--gloo-interface", "--grad-accum",
        "--heads", "--hierarchy", "--init-from", "--keep", "--layers", "--log-dir", "--log-every", "--lr",
        "--metrics-file", "--model", "--momentum", "--num-processes", "--optimizer", "--outer-lr", "--outer-momentum",
        "--outer-optimizer", "--overlap", "--peer-timeout", "--precision", "--prefetch", "--process-id", "--progress",
        "--save-every", "--schedule", "--schedule-steps", "--seed", "--seq-len", "--shard-optimizer", "--stall-timeout",
        "--steps", "--strategy", "--sync-every", "--sync-fragments", "--sync-seconds", "--tokenizer", "--vocab-size",
        "--wandb-project", "--warmup-steps", "--weight-decay",
    ],
    "launch": ["--coordinator", "--elastic", "--join-timeout", "--max-restarts", "--nnodes", "--no-bind", "--node-rank",
               "--nproc-per-node"],
    "sample": ["--checkpoint-dir", "--debug", "--max-new-tokens", "--prompt", "--prompt-ids", "--seed", "--step",
               "--temperature", "--tokenizer", "--top-k"],
    "export": ["--checkpoint-dir", "--debug", "--format", "--step"],
    "prepare": ["--input", "--no-progress", "--output", "--tokenizer", "--train-tokenizer"],
    "bench": ["collectives", "gpt", "train", "ddp", "zero", "slowlink", "hierarchy", "variants", "dispatch",
              "compression", "localsgd", "pace", "goodput", "saves", "plan"],  # its subcommands
}

CONFIG_KEYS = [
    "attention", "batch_size", "checkpoint_dir", "clip_norm", "comm_target", "compile_cache", "compression",
    "compression_every", "coordinator_address", "d_model", "dataset", "debug", "devices", "eval_batches", "eval_every",
    "final_lr_fraction", "gloo_interface", "grad_accum", "heads", "hierarchy", "init_from", "keep", "layers", "log_dir",
    "log_every", "lr", "metrics_file", "model", "momentum", "num_processes", "optimizer", "outer_lr", "outer_momentum",
    "outer_optimizer", "overlap", "peer_timeout", "precision", "prefetch", "process_id", "progress", "save_every",
    "schedule", "schedule_steps", "seed", "seq_len", "shard_optimizer", "stall_timeout", "steps", "strategy",
    "sync_every", "sync_fragments", "sync_seconds", "tokenizer", "vocab_size", "wandb_project", "warmup_steps",
    "weight_decay",
]

CONSOLE_SCRIPTS = {"jaxdp-train": "jaxdp.train:cli", "jaxdp-launch": "jaxdp.launch:main",
                   "jaxdp-prepare": "jaxdp.prepare:cli", "jaxdp-sample": "jaxdp.sample:main",
                   "jaxdp-export": "jaxdp.export:main"}

# (old path, name) as the docs named them at f0dd332 -> the module that holds the name now.
OLD_PATHS = [
    ("jaxdp.sync", "ring_mean", "jaxdp.sync.collectives"),
    ("jaxdp.sync", "ring_allreduce", "jaxdp.sync.collectives"),
    ("jaxdp.sync", "ring_reduce_scatter", "jaxdp.sync.collectives"),
    ("jaxdp.sync", "psum_mean", "jaxdp.sync.collectives"),
    ("jaxdp.sync", "hierarchical", "jaxdp.sync.hierarchy"),
    ("jaxdp.sync", "on_host", "jaxdp.sync.collectives"),
    ("jaxdp.sync", "send", "jaxdp.sync.collectives"),
    ("jaxdp.step", "make_train_step", "jaxdp.step.train_step"),
    ("jaxdp.step", "make_eval_step", "jaxdp.step.train_step"),
    ("jaxdp.loop", "fit", "jaxdp.loop.trainer"),
    ("jaxdp.checkpoint", "Checkpointer", "jaxdp.checkpoint.checkpointer"),
    ("jaxdp.models", "attention_implementation", "jaxdp.models.builtin"),
    ("jaxdp.models", "GPT", "jaxdp.models.builtin"),
]


def test_every_public_name_is_still_exported():
    import jaxdp

    assert set(EXPORTS) <= set(jaxdp.__all__)
    for name in EXPORTS:
        assert getattr(jaxdp, name) is not None, name


@pytest.mark.parametrize("old, name, home", OLD_PATHS, ids=[f"{o}.{n}" for o, n, _ in OLD_PATHS])
def test_old_deep_paths_resolve_to_the_same_objects(old, name, home):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = getattr(importlib.import_module(old), name)
    assert got is getattr(importlib.import_module(home), name)


def test_an_old_path_warns_and_names_the_release_that_removes_it():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import jaxdp.sync\n"
            "try:\n    jaxdp.sync.ring_mean\nexcept DeprecationWarning as w:\n    print(w)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    from jaxdp.moved import REMOVED_IN

    assert f"jaxdp.sync.ring_mean moved to jaxdp.sync.collectives.ring_mean; the old path is removed in jaxdp {REMOVED_IN}" in out


def test_importing_jaxdp_patches_no_import_machinery():
    code = ("import sys; before = list(sys.meta_path), list(sys.path_hooks)\n"
            "import jaxdp, jaxdp.sync, jaxdp.step\n"
            "assert (list(sys.meta_path), list(sys.path_hooks)) == before, sys.meta_path\n"
            "import importlib.util; assert importlib.util.find_spec('jaxdp.syncspec') is None")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)


def test_config_toml_keys_are_config_fields():
    from jaxdp.config import Config

    assert set(CONFIG_KEYS) <= {f.name for f in dataclasses.fields(Config)}


@pytest.mark.parametrize("module", sorted(FLAGS))
def test_entry_points_keep_every_flag(module):
    out = subprocess.run([sys.executable, "-m", f"jaxdp.{module}", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    words = set(re.findall(r"[\w-]+", out.stdout))
    missing = [flag for flag in FLAGS[module] if flag.lstrip("-") not in {w.lstrip("-") for w in words}]
    assert not missing, f"python -m jaxdp.{module} lost {missing}"


def test_console_scripts_point_at_callables():
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
             if ep.name.startswith("jaxdp-")}
    assert found == CONSOLE_SCRIPTS
    for target in CONSOLE_SCRIPTS.values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target
