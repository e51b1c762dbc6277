"""`--model`: a built-in model's name, or a user's own as MODULE:ATTR.

    python -m jaxdp.train --model my_models:Classifier --dataset data.npz
    python -m jaxdp.train --model my_models:make_lm --dataset book.txt --strategy ring --shard-optimizer

MODULE is imported as `python -m` would import it: from the current directory first (or the
directory --model-path names), then the installed packages. config.toml and the checkpoints record
that directory, so a rerun with --config, a resume or an export from elsewhere imports the same file.
ATTR (dotted for nested names) is one of:

* a `flax.linen.Module` class. It is constructed with the keyword arguments among its fields that
  the run knows: `num_classes` (classification) or `vocab_size` (language modelling), the
  number of outputs either way as `num_outputs`, `seq_len`, and `axis_name` (the mesh's axis: for
  synchronised BatchNorm, as jaxdp's CNN does). Other fields keep their defaults.
* a `flax.nnx.Module` class: the same keyword arguments among its `__init__`'s parameters, plus
  `rngs`; it trains through `flax.nnx.bridge.ToLinen`, its BatchNorm statistics are model state
  like linen's `batch_stats`.
* a factory: `f(config)`, `f(config, num_outputs)` or `f(config, num_outputs, axis_name)` (by how
  many positional parameters it takes; the built-in models' builders are such factories) returning
  a linen Module. `config` is the run's `jaxdp.config.Config`: its --layers, --d-model, ... are the
  factory's to read.

The task follows from the dataset, as for the built-in models: an .npz of x, y (or a built-in
dataset) trains `module(x) -> logits [B, classes]` with cross-entropy; a token stream trains
`module(tokens int32 [B, T]) -> logits [B, T, V]` on the next token. A `__call__` with a `train`
parameter gets `train=True` while training and `train=False` in evaluation. A "dropout" rng is
there when the model is initialised (`init_rngs`: an nnx module's `nnx.Dropout(rate, rngs=rngs)`
takes its stream then) and in every training step, different per device and step.

Everything that is not a model, or gives the wrong shape, is one InputError naming what to fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from typing import Any

from jaxdp.config import MODEL_SPEC
from jaxdp.errors import InputError

SPEC = MODEL_SPEC  # MODULE:ATTR (jaxdp.config checks --model with it before JAX starts)


def is_user_model(name: str) -> bool:
    """Whether --model names a user's MODULE:ATTR (not a built-in model)."""
    return ":" in name


def check_spec(name: str) -> None:
    """Without importing anything: is `name` shaped like MODULE:ATTR? (config validation)"""
    if not SPEC.match(name):
        raise InputError(f"--model={name!r} is neither a built-in model nor MODULE:ATTR (e.g. my_models:Classifier, "
                         f"with my_models.py in the current directory)", setting="model")


def resolve(name: str, path: str | None = None) -> Any:
    """The object `MODULE:ATTR` names, imported from `path` first (--model-path), then as `python -m`
    would (the current directory first, then the installed packages)."""
    check_spec(name)
    module_name, attribute = name.split(":")
    where = os.path.abspath(os.path.expanduser(path)) if path else os.getcwd()
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if path and where not in sys.path:  # before the current directory (a recorded path may be gone: then it)
        sys.path.insert(0, where)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            searched = f"--model-path ({where}), " if path else ""
            raise InputError(f"--model={name!r}: no module named {module_name!r} in {searched}the current directory "
                             f"({os.getcwd()}) or the installed packages; give the directory that holds "
                             f"{module_name.replace('.', '/')}.py as --model-path, or run from it",
                             setting="model") from None
        raise InputError(f"--model={name!r}: importing {module_name} failed: {err}", setting="model") from None
    except Exception as err:  # noqa: BLE001 - the user's module raised while importing: name it, in one line
        raise InputError(f"--model={name!r}: importing {module_name} raised {type(err).__name__}: {err}",
                         setting="model") from None
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise InputError(f"--model={name!r}: module {module_name} ({getattr(module, '__file__', '?')}) has no "
                             f"attribute {attribute!r}", setting="model")
        obj = getattr(obj, part)
    return obj


def build(config: Any, num_outputs: int, axis_name: Any, task: str) -> Any:
    """The linen Module --model names, sized for the dataset (`task`: "classification" or "tokens")."""
    from jaxdp.models import builtin as models

    if not is_user_model(config.model):
        return models.build_model(config.model, config, num_outputs, axis_name)
    import flax.linen as nn
    from flax import nnx

    obj = resolve(config.model, getattr(config, "model_path", None))
    known = {"num_outputs": num_outputs, "seq_len": config.seq_len, "axis_name": axis_name,
             ("num_classes" if task == "classification" else "vocab_size"): num_outputs}
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        fields = {f.name for f in dataclasses.fields(obj)}
        return obj(**{k: v for k, v in known.items() if k in fields})
    if isinstance(obj, type) and issubclass(obj, nnx.Module):
        parameters = inspect.signature(obj.__init__).parameters
        if "rngs" not in parameters:
            raise InputError(f"--model={config.model!r}: an nnx Module needs an `rngs` parameter in __init__ "
                             f"(flax.nnx.Rngs), to create its parameters", setting="model")
        return nnx.bridge.ToLinen(obj, kwargs={k: v for k, v in known.items() if k in parameters})
    if isinstance(obj, nn.Module):
        return obj  # an instance: used as is
    if not callable(obj):
        raise InputError(f"--model={config.model!r} is a {type(obj).__name__}, not a flax Module class or a factory "
                         f"f(config) -> Module", setting="model")
    positional = [p for p in inspect.signature(obj).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    module = obj(*(config, num_outputs, axis_name)[:max(1, min(3, len(positional)))])
    if not isinstance(module, nn.Module):
        raise InputError(f"--model={config.model!r}: the factory returned a {type(module).__name__}, not a "
                         f"flax.linen Module (for an nnx Module, give its class as ATTR)", setting="model")
    return module


def init_rngs(seed: int) -> dict[str, Any]:
    """The rngs a model is initialised with: "params", and a "dropout" stream, which an nnx module's
    `nnx.Dropout(rate, rngs=rngs)` takes at construction (and a linen module whose `train` defaults
    to True uses). The "params" key is `PRNGKey(seed)`, as it always was: the same parameters."""
    import jax

    key = jax.random.PRNGKey(seed)
    return {"params": key, "dropout": jax.random.fold_in(key, 1)}


def takes_train(module: Any) -> bool:
    """Whether the module's `__call__` has a `train` parameter (then it is passed True / False)."""
    from flax import nnx

    target = module.nnx_class if isinstance(module, nnx.bridge.ToLinen) else type(module)
    try:
        return "train" in inspect.signature(target.__call__).parameters
    except (TypeError, ValueError):
        return False


def check_output(module: Any, variables: Any, example: Any, task: str, num_outputs: int, name: str) -> None:
    """InputError, in one line, when the module's output is not the task's logits shape."""
    import jax

    kwargs = {"train": False} if takes_train(module) else {}
    try:
        out = jax.eval_shape(lambda v, x: module.apply(v, x, **kwargs), variables, example)
    except Exception as err:  # noqa: BLE001 - the user's __call__ failed on the dataset's input
        raise InputError(f"--model={name!r} failed on an input of shape {tuple(example.shape)} "
                         f"({example.dtype}): {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                         setting="model") from None
    rows = example.shape[0]
    want = (rows, num_outputs) if task == "classification" else (rows, example.shape[1], num_outputs)
    what = ("logits [batch, classes]" if task == "classification" else "logits [batch, tokens, vocabulary]")
    shape = getattr(out, "shape", None)
    if shape is None or tuple(shape) != want:
        got = tuple(shape) if shape is not None else type(out).__name__
        raise InputError(f"--model={name!r} returned {got} for an input of shape {tuple(example.shape)}; "
                         f"the dataset needs {what} = {want}", setting="model")


def rebuild(config: Any, params: Any, num_outputs: int | None = None) -> Any:
    """The module of a finished run, from its recorded config and its parameters' shapes
    (jaxdp.checkpoint.artifacts.load_model)."""
    from jaxdp.registry import DATASETS

    # classification: a built-in dataset or an .npz; anything else is a token stream (a .txt, .bin, .npy, documents)
    task = "classification" if config.dataset in DATASETS or config.dataset.lower().endswith(".npz") else "tokens"
    if num_outputs is None:
        num_outputs = _outputs_from_params(config.model, params)
    return build(config, num_outputs, None, task)  # no mesh axis: BatchNorm outside a mapped step


def _outputs_from_params(model: str, params: Any) -> int:
    if model == "gpt":
        return int(params["embed"]["embedding"].shape[0])
    if model in ("mlp", "cnn"):
        dense = sorted((k for k in params if k.startswith("Dense_")), key=lambda k: int(k.split("_")[1]))
        return int(params[dense[-1]]["kernel"].shape[-1])
    raise InputError(f"the checkpoint does not record its model's number of outputs (--model={model!r}); it was "
                     f"written by an older jaxdp", argument="directory")
