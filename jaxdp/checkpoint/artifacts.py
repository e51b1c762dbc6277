"""What a run leaves behind, read back without a template: parameters, and the model they belong to.

    params = jaxdp.load_params("/tmp/run")            # numpy pytree; the latest checkpoint
    params = jaxdp.load_params("/tmp/run", step=200)
    module, params = jaxdp.load_model("/tmp/run")     # a CLI run: built-in model or --model MODULE:ATTR
    logits = module.apply({"params": params}, x)

`Checkpointer.restore(state)` needs a TrainState of exactly the run's structure (its optimizer chain
included), which is right for resuming and wrong for using the result. These read only the
parameters, as numpy arrays on the host, whatever the run's mode: with local steps they are the
global (outer) parameters, with ZeRO-1 the whole parameters (only the optimizer state is sharded),
for a notebook checkpoint exactly `jax.device_get(state.params)`. Every array read is checked
against the checksums recorded when it was saved (jaxdp/checkpoint/checkpointer.py, "Integrity").

`load_model` rebuilds the module from the configuration recorded in the checkpoint: a built-in
model from its flags and the parameters' shapes (the number of classes, the vocabulary), a
`--model MODULE:ATTR` by importing it again (MODULE must be importable, as it was for training).
Errors are `jaxdp.errors.InputError` with one sentence naming the directory.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from jaxdp.errors import InputError

STATE_ITEM, META_ITEM = "state", "meta"   # jaxdp.checkpoint.checkpointer's two items per step
CHECKSUMS_FILE = "jaxdp_checksums.json"  # = jaxdp.checkpoint.checkpointer.CHECKSUMS_FILE (not imported: that pulls orbax's manager in)


def checkpoint_steps(checkpoint_dir: str) -> list[int]:
    """The steps of the complete checkpoints in `checkpoint_dir`, oldest first (unfinished saves,
    `<step>.orbax-checkpoint-tmp`, and damaged ones moved aside, `<step>.unreadable`, do not count)."""
    if not os.path.isdir(checkpoint_dir):
        raise InputError(f"checkpoint directory {checkpoint_dir!r} does not exist", argument="directory")
    steps = []
    for name in os.listdir(checkpoint_dir):
        path = os.path.join(checkpoint_dir, name)
        if name.isdigit() and os.path.isdir(os.path.join(path, STATE_ITEM)) and _committed(path):
            steps.append(int(name))
    return sorted(steps)


def _committed(step_dir: str) -> bool:
    # orbax writes commit_success.txt (or, on newer versions, _CHECKPOINT_METADATA) once a save committed
    return any(os.path.exists(os.path.join(step_dir, f)) for f in ("commit_success.txt", "_CHECKPOINT_METADATA"))


def _step_dir(checkpoint_dir: str, step: int | None) -> tuple[str, int]:
    steps = checkpoint_steps(checkpoint_dir)
    if not steps:
        raise InputError(f"checkpoint directory {checkpoint_dir!r} holds no complete checkpoint", argument="directory")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise InputError(f"checkpoint directory {checkpoint_dir!r} has no checkpoint of step {step}; it has steps "
                         f"{', '.join(map(str, steps))}", argument="directory")
    return os.path.join(checkpoint_dir, str(step)), step


def load_params(checkpoint_dir: str, step: int | None = None) -> Any:
    """The parameters of checkpoint `step` (default: the latest) as a pytree of numpy arrays.

    No template is needed, and the optimizer state is not read. The arrays are verified against the
    checksums saved with them when the checkpoint has them (InputError if one differs)."""
    return _read_params(*_step_dir(os.path.abspath(checkpoint_dir), step))


def _read_params(step_dir: str, step: int) -> Any:
    import orbax.checkpoint as ocp

    from jaxdp.checkpoint import portable
    from jaxdp.cluster import quiet

    path = os.path.join(step_dir, STATE_ITEM)
    try:
        with quiet.quiet(), ocp.PyTreeCheckpointer() as reader:
            metadata = reader.metadata(path)
            tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", None)
            tree = tree if tree is not None else getattr(metadata, "tree", metadata)
            wanted = {"params": tree["params"]}
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
            restored = reader.restore(path, args=ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args,
                                                                        partial_restore=True))
    except Exception as err:  # noqa: BLE001 - a damaged or foreign directory: one line
        raise InputError(f"checkpoint {step_dir!r} could not be read ({quiet.first_line(err)})",
                         argument="directory") from None
    params = _with_zero_size(jax.tree.map(np.asarray, restored["params"]), "params", step_dir)
    checksums_path = os.path.join(step_dir, CHECKSUMS_FILE)
    if os.path.exists(checksums_path):
        with open(checksums_path) as f:
            expected = json.load(f)
        for name, digest in portable.checksums({"params": params}).items():
            if name in expected and expected[name] != digest:
                raise InputError(f"checkpoint {step_dir!r} is damaged: array {name} does not match the checksum "
                                 f"recorded when it was saved; load an earlier step", argument="directory")
    return params


def read_meta(checkpoint_dir: str, step: int | None = None) -> dict:
    """The JSON a checkpoint records beside its state: step, data position, the run's config, ..."""
    step_dir, _ = _step_dir(os.path.abspath(checkpoint_dir), step)
    meta = _meta_of(step_dir)
    if meta is not None:
        return meta
    raise InputError(f"checkpoint {step_dir!r} has no readable {META_ITEM}/ record", argument="directory")


def _meta_of(step_dir: str) -> dict | None:
    """The meta JSON of a step directory; None if it has none."""
    for name in ("metadata", "meta"):  # orbax's JSON handler writes META_ITEM/metadata
        path = os.path.join(step_dir, META_ITEM, name)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    return None


def load_model(checkpoint_dir: str, step: int | None = None) -> tuple[Any, Any]:
    """(module, params) of a `python -m jaxdp.train` checkpoint, so that
    `module.apply({"params": params}, x)` gives the trained model's logits.

    A model with state (BatchNorm's statistics) needs it too: `load_variables` returns them all."""
    module, variables = load_variables(checkpoint_dir, step)
    return module, variables["params"]


def load_variables(checkpoint_dir: str, step: int | None = None) -> tuple[Any, dict]:
    """(module, {"params": ..., **model_state}) of a CLI checkpoint (`load_model` with BatchNorm's
    statistics and any other model state)."""
    from jaxdp.config import RECORDED_BEFORE, Config
    from jaxdp.models import usermodel

    checkpoint_dir = os.path.abspath(checkpoint_dir)
    step_dir, step = _step_dir(checkpoint_dir, step)
    meta = read_meta(checkpoint_dir, step)
    recorded = meta.get("config")
    if not recorded:
        raise InputError(f"checkpoint directory {checkpoint_dir!r} was written by a notebook (no run config is "
                         f"recorded), so the model is unknown; use jaxdp.load_params and your own module",
                         argument="directory")
    known = {f for f in Config.__dataclass_fields__}
    config = Config.__new__(Config)  # the recorded values as they were: no validation (the files may have moved)
    for name, field in Config.__dataclass_fields__.items():  # a field it lacks: the value its jaxdp had
        object.__setattr__(config, name, recorded.get(name, RECORDED_BEFORE.get(name, field.default))
                           if name in known else field.default)
    variables = _read_variables(step_dir, step)
    module = usermodel.rebuild(config, variables["params"], meta.get("num_outputs"))
    return module, variables


def _read_variables(step_dir: str, step: int) -> dict:
    """{"params": ..., **model_state} as numpy."""
    import orbax.checkpoint as ocp

    from jaxdp.cluster import quiet

    params = _read_params(step_dir, step)
    path = os.path.join(step_dir, STATE_ITEM)
    with quiet.quiet(), ocp.PyTreeCheckpointer() as reader:
        metadata = reader.metadata(path)
        tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", None)
        tree = tree if tree is not None else getattr(metadata, "tree", metadata)
        model_state = tree.get("model_state") or {}
        if jax.tree.leaves(model_state):
            wanted = {"model_state": model_state}
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
            model_state = reader.restore(path, args=ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args,
                                                                           partial_restore=True))["model_state"]
    return {"params": params, **_with_zero_size(jax.tree.map(np.asarray, dict(model_state)), "model_state", step_dir)}


def _with_zero_size(tree: Any, prefix: str, step_dir: str) -> Any:
    """`tree` (the `prefix` part of a checkpoint's state, as read from orbax's files) with its
    zero-size arrays put back: orbax cannot save them, the step's meta records their shapes
    (jaxdp/checkpoint/portable.py, `zero_size_meta`)."""
    from jaxdp.checkpoint import portable

    meta = _meta_of(step_dir)
    recorded = portable.recorded_zero_size(meta) if meta else {}
    if not recorded:
        return tree

    def put_back(path: Any, leaf: Any) -> Any:
        shape_dtype = recorded.get("/".join([prefix, *(portable.key_name(k) for k in path)]))
        return np.zeros(*shape_dtype) if leaf is None and shape_dtype else leaf
    return jax.tree_util.tree_map_with_path(put_back, tree, is_leaf=lambda x: x is None)
