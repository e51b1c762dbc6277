"""Hugging Face GPT-2 in and out: jaxdp's GPT reads and writes a transformers GPT-2 directory.

    kwargs, params = read_gpt2("gpt2-dir")          # config.json + model.safetensors
    module = GPT(**kwargs)                           # module.apply({"params": params}, ids) = GPT-2's logits
    write_gpt2(module, params, "out")                # transformers.GPT2LMHeadModel.from_pretrained("out")

    python -m jaxdp.train --model gpt --init-from gpt2-dir --dataset book.txt   # fine-tune (init_from)

jaxdp's GPT has GPT-2's layout (models.GPT): with `ln_epsilon`, `tie_embeddings`, `head_bias`,
`max_positions` and `gelu_approximate` set as GPT-2's config.json says, every weight maps one to one
(`_LAYOUT`): GPT-2's Conv1D weights are stored [in, out], as Flax's kernels are, so the fused
`c_attn` [d, 3d] is `qkv_i` [d, 3, heads, head_dim] reshaped, and `c_proj` [d, d] is `proj_i`
[heads, head_dim, d]. No torch and no transformers here: the files are read and written with the
`safetensors` package's numpy API. What GPT-2 variants jaxdp's GPT cannot express (another
model_type, another activation, the attention options that scale or reorder it, an MLP width other
than 4 * n_embd, cross-attention) is refused with one sentence (`jaxdp.errors.InputError`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from typing import Any, Iterator

import numpy as np

from jaxdp.config import ConfigError
from jaxdp.errors import InputError
from jaxdp.models import builtin as models
from jaxdp.models.builtin import GPT, compute_dtype

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
GELU = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}  # activation_function -> gelu_approximate
GPT2_EOS = 50256  # <|endoftext|>, the last id of GPT-2's 50257-token vocabulary (its bos and eos)


# ---- the one table: GPT-2's tensor names and jaxdp's parameter paths -----------------------------


def _layout(layers: int, tied: bool) -> Iterator[tuple[str, tuple[str, str], Any]]:
    """(GPT-2 name without "transformer.", jaxdp path, how the shapes relate): None the same shape,
    (a, b) GPT-2 merges jaxdp's axes a..b-1 into one, "T" transposed."""
    yield "wte.weight", ("embed", "embedding"), None
    yield "wpe.weight", ("pos", "embedding"), None
    for i in range(layers):
        h = f"h.{i}."
        yield h + "ln_1.weight", (f"ln_attn_{i}", "scale"), None
        yield h + "ln_1.bias", (f"ln_attn_{i}", "bias"), None
        yield h + "attn.c_attn.weight", (f"qkv_{i}", "kernel"), (1, 4)  # [d, 3d] = [d, 3, heads, head_dim]
        yield h + "attn.c_attn.bias", (f"qkv_{i}", "bias"), (0, 3)
        yield h + "attn.c_proj.weight", (f"proj_{i}", "kernel"), (0, 2)  # [d, d] = [heads, head_dim, d]
        yield h + "attn.c_proj.bias", (f"proj_{i}", "bias"), None
        yield h + "ln_2.weight", (f"ln_mlp_{i}", "scale"), None
        yield h + "ln_2.bias", (f"ln_mlp_{i}", "bias"), None
        yield h + "mlp.c_fc.weight", (f"fc_{i}", "kernel"), None
        yield h + "mlp.c_fc.bias", (f"fc_{i}", "bias"), None
        yield h + "mlp.c_proj.weight", (f"fc_out_{i}", "kernel"), None
        yield h + "mlp.c_proj.bias", (f"fc_out_{i}", "bias"), None
    yield "ln_f.weight", ("ln_final", "scale"), None
    yield "ln_f.bias", ("ln_final", "bias"), None
    if not tied:
        yield "lm_head.weight", ("head", "kernel"), "T"


def _hf_shape(shape: tuple[int, ...], relation: Any) -> tuple[int, ...]:
    if relation is None:
        return shape
    if relation == "T":
        return shape[::-1]
    a, b = relation
    return shape[:a] + (math.prod(shape[a:b]),) + shape[b:]


def _param_shapes(kwargs: dict[str, Any]) -> dict[tuple[str, str], tuple[int, ...]]:
    """The shape of every parameter `GPT(**kwargs).init` makes, without making them."""
    import jax
    import jax.numpy as jnp

    shapes = jax.eval_shape(lambda: GPT(**kwargs).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    return {(module, name): leaf.shape for module, leaves in shapes["params"].items() for name, leaf in leaves.items()}


# ---- in ------------------------------------------------------------------------------------------


def read_gpt2(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(GPT keyword arguments, params) of a transformers GPT-2 directory: config.json and
    model.safetensors (or its sharded form, model.safetensors.index.json). `GPT(**kwargs)` with
    these params computes GPT-2's logits; the params are float32 numpy arrays. `seq_len` is set to
    n_positions: pass a shorter one for training (`init_from` does)."""
    kwargs = gpt2_kwargs(read_config(directory), os.path.join(directory, CONFIG_FILE))
    tensors = _read_tensors(directory)
    tensors = {name.removeprefix("transformer."): value for name, value in tensors.items()}
    shapes = _param_shapes(kwargs)
    params: dict[str, dict[str, np.ndarray]] = {}
    for name, (module, leaf), relation in _layout(kwargs["layers"], kwargs["tie_embeddings"]):
        if name not in tensors:
            raise InputError(f"{os.path.join(directory, WEIGHTS_FILE)} has no tensor {name!r} (nor "
                             f"'transformer.{name}'): not a complete GPT-2 checkpoint", argument="directory")
        value, want = tensors[name], _hf_shape(shapes[module, leaf], relation)
        if value.shape != want:
            raise InputError(f"{directory}: tensor {name!r} has shape {list(value.shape)}, but config.json's sizes "
                             f"give {list(want)}", argument="directory")
        if np.issubdtype(value.dtype, np.inexact) and not np.all(np.isfinite(value)):
            bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
            raise InputError(f"{directory}: tensor {name!r} holds {bad} NaN or infinite value{'s' * (bad > 1)}: the "
                             f"weights are damaged (or were saved from a diverged model)", argument="directory")
        value = value.T if relation == "T" else value.reshape(shapes[module, leaf])
        params.setdefault(module, {})[leaf] = np.ascontiguousarray(value, dtype=np.float32)
    return kwargs, params


def read_config(directory: str) -> dict[str, Any]:
    """config.json of a Hugging Face model directory, or InputError saying what is missing."""
    if not os.path.isdir(directory):
        raise InputError(f"{directory!r} is not a directory (a Hugging Face GPT-2 directory holds config.json and "
                         f"model.safetensors)", argument="directory")
    path = os.path.join(directory, CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise InputError(f"{directory!r} has no {CONFIG_FILE}: not a Hugging Face model directory",
                         argument="directory") from None
    except (OSError, ValueError) as err:
        raise InputError(f"{path} is not a readable JSON file ({err})", argument="directory") from None
    if not isinstance(config, dict):
        raise InputError(f"{path} is not a JSON object", argument="directory")
    return config


def gpt2_kwargs(config: dict[str, Any], source: str = CONFIG_FILE) -> dict[str, Any]:
    """jaxdp GPT keyword arguments of a GPT-2 config.json (read from `source`, the path its errors
    name), or InputError naming a value of the wrong type or what jaxdp's GPT cannot express."""
    def refuse(what: str) -> InputError:
        return InputError(f"jaxdp's GPT cannot express this model: {what}", argument="directory")

    def value(name: str, default: Any, kind: str) -> Any:
        """config[name] (default if absent), InputError unless it is of `kind`: "count" a positive
        integer, "epsilon" a positive finite number, "flag" true or false, "name" a string."""
        got = config.get(name, default)
        ok = {"count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
              "epsilon": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
              "flag": lambda v: isinstance(v, bool), "name": lambda v: isinstance(v, str)}[kind](got)
        if not ok:
            want = {"count": "a positive integer", "epsilon": "a positive number", "flag": "true or false",
                    "name": "a string"}[kind]
            raise InputError(f"{source}: {name} is {json.dumps(got)}, not {want}", argument="directory")
        return got

    if config.get("model_type") != "gpt2":
        raise refuse(f"model_type is {config.get('model_type')!r}, not 'gpt2'")
    activation = value("activation_function", "gelu_new", "name")
    if activation not in GELU:
        raise refuse(f"activation_function is {activation!r}, not one of {', '.join(GELU)}")
    for name, default in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                          ("add_cross_attention", False), ("scale_attn_weights", True)):
        if config.get(name, default) != default:
            raise refuse(f"{name} is {config.get(name)!r} (jaxdp's GPT has {default})")
    d_model, heads = value("n_embd", 768, "count"), value("n_head", 12, "count")
    if d_model % heads:
        raise refuse(f"n_head={heads} does not divide n_embd={d_model}")
    if config.get("n_inner") not in (None, 4 * d_model):
        raise refuse(f"n_inner is {config.get('n_inner')}, not 4 * n_embd = {4 * d_model}")
    positions = value("n_positions" if "n_positions" in config else "n_ctx", 1024, "count")
    return {"vocab_size": value("vocab_size", 50257, "count"), "seq_len": positions,
            "layers": value("n_layer", 12, "count"), "d_model": d_model, "heads": heads, "max_positions": positions,
            "ln_epsilon": float(value("layer_norm_epsilon", 1e-5, "epsilon")),
            "tie_embeddings": value("tie_word_embeddings", True, "flag"), "head_bias": False,
            "gelu_approximate": GELU[activation]}


def _read_tensors(directory: str) -> dict[str, np.ndarray]:
    single, index = os.path.join(directory, WEIGHTS_FILE), os.path.join(directory, INDEX_FILE)
    if os.path.isfile(single):
        return _read_safetensors(single)
    if os.path.isfile(index):  # sharded: {"weight_map": {tensor name: file}}
        with open(index) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
        return {k: v for name in files for k, v in _read_safetensors(os.path.join(directory, name)).items()}
    raise InputError(f"{directory!r} has no {WEIGHTS_FILE} (nor {INDEX_FILE}); save the model with "
                     f"save_pretrained(directory, safe_serialization=True)", argument="directory")


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file, as numpy (bfloat16 through ml_dtypes, which numpy lacks)."""
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except TypeError:  # "data type 'bfloat16' not understood": read the format directly
        pass
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file: one line
        raise InputError(f"{path} is not a readable safetensors file ({err})", argument="directory") from None
    import ml_dtypes

    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        data = f.read()
    dtypes = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64}
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        out[name] = np.frombuffer(data[start:end], dtypes[entry["dtype"]]).reshape(entry["shape"])
    return out


# ---- training from it (--init-from) --------------------------------------------------------------


def gpt_module(directory: str, config: Any) -> GPT:
    """The GPT of GPT-2 directory `directory` (its config.json only), sized for training by `config`
    (a `jaxdp.config.Config`): its --seq-len, --precision and --attention; the architecture (--layers,
    --d-model, --heads, the vocabulary) is the directory's. ConfigError if --seq-len exceeds its
    n_positions."""
    with _as_init_from():
        kwargs = gpt2_kwargs(read_config(directory), os.path.join(directory, CONFIG_FILE))
    if config.seq_len > kwargs["max_positions"]:
        raise ConfigError(f"--seq-len={config.seq_len} is longer than --init-from={directory!r} can see "
                          f"(n_positions={kwargs['max_positions']}); use --seq-len {kwargs['max_positions']} or less")
    return GPT(**{**kwargs, "seq_len": config.seq_len}, dtype=compute_dtype(config.precision),
               attention=config.attention, kernels=getattr(config, "kernels", "auto"), fp8=config.precision == "fp8")


def init_from(directory: str, config: Any) -> tuple[GPT, dict[str, Any]]:
    """(module, params) to start `--model gpt --init-from DIR` from, in place of
    `models.build_model` and `model.init`: GPT-2's architecture and weights (numpy float32)."""
    return gpt_module(directory, config), init_params(directory)


def init_params(directory: str) -> dict[str, Any]:
    """The params of `--init-from DIR` (`read_gpt2`'s), its errors naming --init-from."""
    with _as_init_from():
        return read_gpt2(directory)[1]


@contextlib.contextmanager
def _as_init_from() -> Iterator[None]:
    """What is wrong with the directory, as the --init-from flag's error (argument "init_from")."""
    try:
        yield
    except InputError as err:
        if err.argument != "directory":
            raise
        raise InputError(str(err), argument="init_from") from None


def build_gpt(config: Any, num_outputs: int, axis_name: str | None = None) -> GPT:
    """`models.build_gpt` that knows --init-from: the directory's GPT-2 (`gpt_module`; InputError if the
    dataset's `num_outputs` token ids do not fit its vocabulary) when `config.init_from` is set, else
    the GPT sized by --layers, --d-model, --heads. The same factory signature as the registry's."""
    directory = getattr(config, "init_from", None)
    if not directory:
        return models.build_gpt(config, num_outputs, axis_name)
    module = gpt_module(directory, config)
    check_vocab(num_outputs, module.vocab_size)
    return module


def check_vocab(dataset_vocab: int, model_vocab: int) -> None:
    """InputError unless every token id of the dataset has a row in the model's embedding."""
    if dataset_vocab > model_vocab:
        raise InputError(f"the dataset's token ids go up to {dataset_vocab - 1}, but the --init-from model's "
                         f"vocabulary has {model_vocab} tokens; tokenize the data with the model's own tokenizer",
                         argument="dataset")


# ---- out -----------------------------------------------------------------------------------------


def write_gpt2(module: Any, params: Any, out_dir: str) -> None:
    """config.json and model.safetensors in `out_dir` (made if missing; those two files replaced)
    that `transformers.GPT2LMHeadModel.from_pretrained(out_dir)` loads as the same model.

    An untied head is written as lm_head.weight (`tie_word_embeddings: false`); GPT-2 has no head
    bias, so a head bias must be all zeros (InputError otherwise). The dropout rates are written
    as 0.0, as jaxdp's GPT trains without dropout."""
    from safetensors.numpy import save_file

    if not isinstance(module, GPT):
        raise InputError(f"only jaxdp's built-in GPT can be written as GPT-2, not {type(module).__name__}",
                         argument="module")
    params = {k: dict(v) for k, v in params.items()}  # a shallow copy we may drop the head bias from
    if not module.tie_embeddings and module.head_bias:
        bias = np.asarray(params["head"].pop("bias"))
        if np.any(bias != 0):
            raise InputError(f"this GPT's output layer has a bias (largest {float(np.max(np.abs(bias))):.3g}), which "
                             f"GPT-2 cannot express; only a model trained with GPT(head_bias=False), or a zero bias, "
                             f"can be written", argument="params")
    tensors = {}
    for name, (scope, leaf), relation in _layout(module.layers, module.tie_embeddings):
        value = np.asarray(params[scope][leaf], dtype=np.float32)
        value = value.T if relation == "T" else value.reshape(_hf_shape(value.shape, relation))
        tensors[name if name.startswith("lm_head") else "transformer." + name] = np.ascontiguousarray(value)
    if module.vocab_size != tensors["transformer.wte.weight"].shape[0]:
        raise InputError(f"params have {tensors['transformer.wte.weight'].shape[0]} token embeddings but the module "
                         f"{module.vocab_size}: they belong to another model", argument="params")
    eos = GPT2_EOS if module.vocab_size == GPT2_EOS + 1 else None  # GPT-2's own vocabulary: its <|endoftext|>
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": module.vocab_size,
        "n_positions": module.context, "n_embd": module.d_model, "n_layer": module.layers, "n_head": module.heads,
        "n_inner": None, "activation_function": "gelu_new" if module.gelu_approximate else "gelu",
        "layer_norm_epsilon": module.ln_epsilon, "tie_word_embeddings": module.tie_embeddings,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "bos_token_id": eos, "eos_token_id": eos, "torch_dtype": "float32", "use_cache": True,
    }
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InputError(f"{out_dir!r} is a file, not a directory", argument="out_dir")
    os.makedirs(out_dir, exist_ok=True)
    weights, config_path = os.path.join(out_dir, WEIGHTS_FILE), os.path.join(out_dir, CONFIG_FILE)
    with contextlib.suppress(FileNotFoundError):
        os.remove(weights + ".tmp")  # a crashed export's: its mode is not this umask's
    with open(weights + ".tmp", "wb"):  # made as open() makes a file: its mode follows the umask ...
        pass
    mode = stat.S_IMODE(os.stat(weights + ".tmp").st_mode)
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})  # transformers requires the "pt" format
    os.chmod(weights + ".tmp", mode)  # ... which safetensors does not keep (it writes 0600: the owner's only)
    os.replace(weights + ".tmp", weights)
    with open(config_path + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.replace(config_path + ".tmp", config_path)
